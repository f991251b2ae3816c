"""Sharding plans: strategies, invariants, queries and serialisation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fzero import partition
from fzero.partition import (
    Manifest,
    Piece,
    Placement,
    Plan,
    PlanError,
    TensorSpec,
    Unit,
    describe,
    flat_even,
    format_plan,
    from_bytes,
    local_slices,
    memory_per_rank,
    module_key,
    owned_numel,
    owner_of,
    per_tensor_dim0,
    reduction_buckets,
    reshard_reads,
    to_bytes,
    validate,
)


def plan(manifest, **options):
    """`partition.plan`, sharding every tensor of these tiny models at stage 3 unless a
    test says otherwise (DeepSpeed's default persistence threshold keeps them whole)."""
    built_in = (partition.flat_even, partition.per_tensor_dim0, partition.whole_tensors)
    if options.get("strategy", partition.flat_even) in built_in:
        options.setdefault("persistence_threshold", 0)
    return partition.plan(manifest, **options)


STRATEGIES = [flat_even, per_tensor_dim0]


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = torch.nn.Linear(4, 2)
        self.frozen.requires_grad_(False)


def test_describe_lists_tied_once_and_excludes_frozen():
    manifest = describe(Tied())
    assert manifest.fqns == (
        "embed.weight",
        "blocks.0.weight",
        "blocks.0.bias",
        "blocks.1.weight",
        "blocks.1.bias",
    )
    assert manifest["embed.weight"].aliases == ("head.weight",)
    assert manifest.frozen == ("frozen.weight", "frozen.bias")


def test_describe_works_on_meta_and_reads_groups():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.LayerNorm(1000))
    groups = [
        {"params": [model[0].weight], "weight_decay": 0.01},
        {"params": [model[0].bias, model[1].weight, model[1].bias], "weight_decay": 0.0},
    ]
    manifest = describe(model, groups)
    assert [s.group for s in manifest.tensors] == [0, 1, 1, 1]
    units = plan(manifest, world_size=2, stage=2).units
    assert {(u.module, u.group) for u in units} == {("0", 0), ("0", 1), ("1", 1)}


def test_describe_rejects_a_parameter_in_two_groups():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="groups 0 and 1"):
        describe(model, [[model.weight], [model.weight, model.bias]])


def test_module_key():
    assert module_key("blocks.3.attn.weight") == "blocks.3"
    assert module_key("bert.encoder.layer.0.x.bias") == "bert.encoder.layer.0"
    assert module_key("embed.weight") == "embed"
    assert module_key("bias") == ""


def test_tied_tensor_goes_to_the_common_parent():
    p = plan(describe(Tied()), world_size=2, stage=3)
    assert p.units[p.unit_of("embed.weight")].module == ""
    assert p.unit_of("head.weight") == p.unit_of("embed.weight")


def test_flat_even_layout_is_end_to_end():
    manifest = Manifest((TensorSpec("a.w", (3, 5)), TensorSpec("a.b", (5,))))
    p = plan(manifest, world_size=4, stage=1, alignment=2)
    (unit,) = p.units
    assert unit.shard_numel == 6 and unit.numel == 24
    assert unit.placements[1].pieces == (Piece(0, 15, 5),)
    assert [owner_of(p, "a.w", i) for i in (0, 5, 6, 14)] == [0, 0, 1, 2]
    assert owner_of(p, "a.b", 4) == 3


def test_dim0_gives_each_rank_whole_rows():
    manifest = Manifest((TensorSpec("m.w", (5, 3)), TensorSpec("m.s", ())))
    p = plan(manifest, world_size=2, stage=3, strategy=per_tensor_dim0, alignment=1)
    rows = {s.fqn + str(rank): (s.start, s.stop) for rank in (0, 1) for s in local_slices(p, rank)}
    assert rows == {"m.w0": (0, 9), "m.w1": (9, 15), "m.s0": (0, 1)}


def test_persistence_threshold_only_in_stage_3():
    manifest = Manifest((TensorSpec("l.w", (100, 100)), TensorSpec("l.b", (100,))))
    p3 = plan(manifest, world_size=2, stage=3, persistence_threshold=1000)
    assert [u.persistent for u in p3.units] == [False, True]
    p2 = plan(manifest, world_size=2, stage=2, persistence_threshold=1000)
    assert [u.persistent for u in p2.units] == [False]


def test_size_budget_grouping():
    manifest = Manifest(tuple(TensorSpec(f"l.{i}.w", (10,)) for i in range(5)))
    p = plan(manifest, world_size=1, stage=0, unit_numel=25)
    assert [len(u.placements) for u in p.units] == [2, 2, 1]


def test_user_strategy_is_accepted_and_validated():
    manifest = Manifest((TensorSpec("w", (6,)),))

    def everything_on_rank_zero(manifest, *, world_size, stage):
        # A valid plan that puts the whole tensor in rank 0's shard (padding elsewhere).
        unit = Unit(
            "all", "", 0, "float32", (Placement("w", (Piece(0, 0, 6),)),), 6, 6 * world_size
        )
        return Plan(manifest, world_size, stage, 1, (unit,), strategy="rank0")

    p = plan(manifest, world_size=3, stage=1, strategy=everything_on_rank_zero)
    assert owned_numel(p) == [6, 0, 0]

    def broken(manifest, *, world_size, stage):
        unit = Unit(
            "all", "", 0, "float32", (Placement("w", (Piece(0, 0, 4),)),), 2, 2 * world_size
        )
        return Plan(manifest, world_size, stage, 1, (unit,))

    with pytest.raises(PlanError, match="cover 4 of 6"):
        plan(manifest, world_size=3, stage=1, strategy=broken)


def test_a_strategy_returning_a_mesh_plan_of_another_size_is_named():
    """A strategy that builds its mesh without the world size it is given (an example's
    fixed 2x2 run at 64 ranks by `fzero estimate`) names the mesh and the world size."""
    manifest = Manifest((TensorSpec("w", (64,)),))

    def fixed(manifest, *, world_size, stage, **options):
        return partition.mesh_plan(manifest, partition.Mesh({"node": 2, "local": 2}), "mics")

    with pytest.raises(
        PlanError,
        match=r"'fixed' returned a plan on mesh node=2 x local=2 \(4 processes\) "
        r"for world_size=64",
    ):
        plan(manifest, world_size=64, stage=3, strategy=fixed)


def test_a_strategy_given_an_option_it_does_not_take_is_named():
    """The engine gives stage 3 strategies `persistence_threshold`; one that neither
    names it nor takes **options is an error naming the strategy and the option, not a
    TypeError from inside the call."""
    manifest = Manifest((TensorSpec("w", (6,)),))

    def whole(manifest, *, world_size, stage):
        return flat_even(manifest, world_size=world_size, stage=stage)

    with pytest.raises(PlanError, match=r"'whole' does not take option persistence_threshold=7"):
        plan(manifest, world_size=2, stage=3, strategy=whole, persistence_threshold=7)

    def named(manifest, *, world_size, stage, persistence_threshold=0):
        return flat_even(manifest, world_size=world_size, stage=stage)

    def any_options(manifest, *, world_size, stage, **options):
        return flat_even(manifest, world_size=world_size, stage=stage)

    for strategy in (named, any_options):
        assert plan(manifest, world_size=2, stage=3, strategy=strategy, persistence_threshold=7)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda u: {"numel": u.numel + 1}, "numel"),
        (lambda u: {"shard_numel": 7, "numel": 14}, "alignment"),
        (lambda u: {"group": 1}, "never mixes"),
        (lambda u: {"persistent": True}, "only stage 3"),
        (lambda u: {"placements": u.placements[:1]}, "in no unit"),
        (lambda u: {"placements": (u.placements[0], Placement("b", (Piece(0, 0, 3),)))}, "overlap"),
    ],
)
def test_validate_names_the_broken_invariant(mutate, message):
    import dataclasses

    manifest = Manifest((TensorSpec("a", (10,)), TensorSpec("b", (3,))))
    good = plan(manifest, world_size=2, stage=1, alignment=4)
    bad_unit = dataclasses.replace(good.units[0], **mutate(good.units[0]))
    with pytest.raises(PlanError, match=message):
        validate(dataclasses.replace(good, units=(bad_unit,)))


def test_plan_rejects_bad_arguments():
    manifest = Manifest((TensorSpec("a", (10,)),))
    with pytest.raises(PlanError, match="stage is 4"):
        plan(manifest, world_size=2, stage=4)
    with pytest.raises(PlanError, match="world_size is 0"):
        plan(manifest, world_size=0, stage=1)


def test_from_bytes_rejects_garbage():
    with pytest.raises(PlanError, match="not an fzero plan"):
        from_bytes(b"\x93\x01\x02\x03")


def test_memory_matches_zero_paper_figures():
    # ZeRO paper, figure 1: Ψ = 7.5B, K = 12 (mixed-precision Adam), N = 64.
    manifest = Manifest(tuple(TensorSpec(f"layer.{i}.w", (75_000_000,)) for i in range(100)))
    expected_gb = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected_gb.items():
        p = plan(manifest, world_size=64, stage=stage)
        mem = memory_per_rank(p, 0, param_dtype="float16", grad_dtype=None, optimizer="adam")
        assert round(mem.total / 1e9, 1) == gb


def test_memory_offload_moves_master_and_state_to_host():
    p = plan(Manifest((TensorSpec("w", (1024,)),)), world_size=4, stage=2)
    mem = memory_per_rank(p, 0, param_dtype="bfloat16", optimizer="adamw", offload_optimizer=True)
    assert mem.host == 256 * 4 + 256 * 8
    assert mem.device == 1024 * 2 + 256 * 4  # bf16 params, fp32 gradient shard


def test_format_plan_mentions_every_rank():
    text = format_plan(plan(describe(Tied()), world_size=2, stage=3))
    assert "rank 0:" in text and "rank 1:" in text and "embed.weight[" in text


def test_format_plan_reports_padding_and_imbalance():
    """Two tensors of 10 at world 4, one unit: 16-aligned shards of 16, 44 padding; rank 0
    owns 16, rank 1 the last 4, ranks 2-3 nothing (imbalance 16 / 5 = 3.2x)."""
    manifest = Manifest((TensorSpec("a", (10,)), TensorSpec("b", (10,))))
    text = format_plan(plan(manifest, world_size=4, stage=1))
    assert "numel=64 shard=16 padding=44" in text
    assert "rank 1: b[6:10] (+12 padding)" in text
    assert "rank 3: (padding only)" in text
    assert text.endswith(
        "padding: 44 elements (68.8% of the unit buffers); owned per rank: min 0, max 16 "
        "(imbalance 3.20x)"
    )


def test_reshard_rejects_different_models():
    a = plan(Manifest((TensorSpec("w", (4,)),)), world_size=1, stage=1)
    b = plan(Manifest((TensorSpec("w", (5,)),)), world_size=1, stage=1)
    with pytest.raises(PlanError, match="shape changed"):
        reshard_reads(a, b, 0)


# ---- property tests -------------------------------------------------------------------------

shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
)


@st.composite
def manifests(draw):
    count = draw(st.integers(1, 6))
    tensors = []
    for i in range(count):
        module = draw(st.sampled_from(["a", "b.0", "b.1", ""]))
        name = f"{module}.t{i}" if module else f"t{i}"
        tensors.append(TensorSpec(name, draw(shapes), group=draw(st.integers(0, 1))))
    return Manifest(tuple(tensors))


@settings(max_examples=150, deadline=None)
@given(
    manifest=manifests(),
    world_size=st.integers(1, 8),
    stage=st.integers(0, 3),
    strategy=st.sampled_from(STRATEGIES),
    alignment=st.sampled_from([1, 4, 16]),
)
def test_every_element_owned_exactly_once(manifest, world_size, stage, strategy, alignment):
    p = plan(manifest, world_size=world_size, stage=stage, strategy=strategy, alignment=alignment)
    owners: dict[str, list[int]] = {s.fqn: [0] * s.numel for s in manifest.tensors}
    for rank in range(world_size):
        for piece in local_slices(p, rank):
            for i in range(piece.start, piece.stop):
                owners[piece.fqn][i] += 1
                assert owner_of(p, piece.fqn, i) == rank
    assert all(count == 1 for counts in owners.values() for count in counts)
    for unit in p.units:  # equal shards, each a multiple of the alignment
        assert unit.numel == unit.shard_numel * world_size
        assert unit.shard_numel % alignment == 0
    assert from_bytes(to_bytes(p)) == p
    assert hash(from_bytes(to_bytes(p))) == hash(p)


@settings(max_examples=100, deadline=None)
@given(
    manifest=manifests(),
    old=st.tuples(st.integers(1, 8), st.integers(0, 3), st.sampled_from(STRATEGIES)),
    new=st.tuples(st.integers(1, 8), st.integers(0, 3), st.sampled_from(STRATEGIES)),
)
def test_reshard_reads_cover_each_new_slice_once(manifest, old, new):
    old_plan = plan(manifest, world_size=old[0], stage=old[1], strategy=old[2])
    new_plan = plan(manifest, world_size=new[0], stage=new[1], strategy=new[2])
    old_shards = {
        (rank, index): torch.full((unit.shard_numel,), -1.0)
        for rank in range(old_plan.world_size)
        for index, unit in enumerate(old_plan.units)
    }
    # Fill old shards with each element's global identity (tensor index * 1000 + flat index).
    ident = {spec.fqn: i * 1000 for i, spec in enumerate(manifest.tensors)}
    for rank in range(old_plan.world_size):
        for s in local_slices(old_plan, rank):
            shard = old_shards[(rank, s.unit)]
            shard[s.shard_offset : s.shard_offset + s.numel] = (
                torch.arange(s.start, s.stop) + ident[s.fqn]
            )
    for rank in range(new_plan.world_size):
        new_shards = {i: torch.full((u.shard_numel,), -2.0) for i, u in enumerate(new_plan.units)}
        hits = {i: torch.zeros(u.shard_numel) for i, u in enumerate(new_plan.units)}
        for r in reshard_reads(old_plan, new_plan, rank):
            src = old_shards[(r.old_rank, r.old_unit)][r.old_offset : r.old_offset + r.numel]
            new_shards[r.new_unit][r.new_offset : r.new_offset + r.numel] = src
            hits[r.new_unit][r.new_offset : r.new_offset + r.numel] += 1
        for s in local_slices(new_plan, rank):
            got = new_shards[s.unit][s.shard_offset : s.shard_offset + s.numel]
            assert torch.equal(got, torch.arange(s.start, s.stop, dtype=got.dtype) + ident[s.fqn])
            assert torch.all(hits[s.unit][s.shard_offset : s.shard_offset + s.numel] == 1)
        assert sum(h.sum().item() for h in hits.values()) == sum(
            s.numel for s in local_slices(new_plan, rank)
        )


@settings(max_examples=100, deadline=None)
@given(manifest=manifests(), world_size=st.integers(1, 8), strategy=st.sampled_from(STRATEGIES))
def test_stage3_memory_sums_to_total_plus_padding(manifest, world_size, strategy):
    p = plan(manifest, world_size=world_size, stage=3, strategy=strategy)
    padded = sum(u.numel for u in p.units)
    assert padded - manifest.numel == sum(u.numel for u in p.units) - sum(owned_numel(p))
    totals = [
        memory_per_rank(p, r, param_dtype="bfloat16", grad_dtype="float32", optimizer="adam")
        for r in range(world_size)
    ]
    assert sum(m.params for m in totals) == padded * 2
    assert sum(m.grads for m in totals) == padded * 4
    assert sum(m.master + m.optimizer_state for m in totals) == padded * 12


@settings(max_examples=100, deadline=None)
@given(manifest=manifests(), world_size=st.integers(1, 4), bucket=st.integers(1, 200))
def test_reduction_buckets_cover_units_in_reverse_within_budget(manifest, world_size, bucket):
    p = plan(manifest, world_size=world_size, stage=2)
    buckets = reduction_buckets(p, bucket)
    order = [index for b in buckets for index in b]
    assert order == list(reversed(range(len(p.units))))
    for b in buckets:
        assert len(b) == 1 or sum(p.units[i].numel for i in b) <= bucket


def test_reduction_buckets_reject_a_bad_size():
    p = plan(describe(Tied()), world_size=2, stage=2)
    with pytest.raises(PlanError, match="reduce_bucket_size is 0"):
        reduction_buckets(p, 0)


def test_memory_per_rank_counts_the_units_kept_gathered_for_generation():
    """`eval_live_parameters` (stage3_eval_live_parameters) adds the whole units kept
    gathered between forwards without gradients, up to the bound, at stage 3 only."""
    manifest = Manifest(
        (TensorSpec("a.w", (1000,), "float32"), TensorSpec("b.w", (3000,), "float32"))
    )
    p3 = plan(manifest, world_size=2, stage=3)
    numel = sum(u.numel for u in p3.units)
    assert memory_per_rank(p3, 0, eval_live_parameters=0).params_kept == 0
    assert memory_per_rank(p3, 0, eval_live_parameters=1500).params_kept == 1500 * 4
    whole = memory_per_rank(p3, 0, eval_live_parameters=10**9)
    assert whole.params_kept == numel * 4
    assert whole.total == memory_per_rank(p3, 0).total + numel * 4
    p2 = plan(manifest, world_size=2, stage=2)
    assert memory_per_rank(p2, 0, eval_live_parameters=10**9).params_kept == 0
    with pytest.raises(PlanError, match="eval_live_parameters is -1"):
        memory_per_rank(p3, 0, eval_live_parameters=-1)
