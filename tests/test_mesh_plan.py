"""Plans on a mesh: the mesh, per-kind shardings, presets, validation, serialisation, and
the study tools (memory, communication, format) over them. Pure and single-process.
A plan on a mesh is a `Plan` like any other: `mesh_plan` lowers a preset's per-kind
splits to it, and `Plan.sharding_of` / `Plan.kind_range` say them again."""

from __future__ import annotations

import dataclasses
import itertools

import msgpack
import pytest
import torch

from fzero import partition
from fzero.partition import (
    KINDS,
    Custom,
    HpZ,
    Manifest,
    Mesh,
    MeshError,
    MiCS,
    PlanError,
    Sharding,
    TensorSpec,
    UnitSharding,
    Zero,
    comm_volume,
    describe,
    format_comm_volume,
    format_plan,
    from_bytes,
    from_zero_config,
    kind_slices,
    local_slices,
    memory_per_rank,
    per_tensor_dim0,
    process_groups,
    to_bytes,
    to_plan,
    validate,
    volume_by_axes,
)
from fzero.partition._mesh_plan import KindPlan, as_kind_plan
from fzero.partition._wire import encode_manifest, encode_memory, encode_unit


def plan(manifest, **options):
    """`partition.plan`, sharding every tensor of these tiny models at stage 3 unless a
    test says otherwise (DeepSpeed's default persistence threshold keeps them whole)."""
    built_in = (partition.flat_even, partition.per_tensor_dim0, partition.whole_tensors)
    if options.get("strategy", partition.flat_even) in built_in:
        options.setdefault("persistence_threshold", 0)
    return partition.plan(manifest, **options)


def mesh_plan(manifest, mesh, preset="zero3", **options):
    """`partition.mesh_plan`, likewise without persistent units unless asked."""
    options.setdefault("persistence_threshold", 0)
    return partition.mesh_plan(manifest, mesh, preset, **options)


MANIFEST = Manifest(
    (
        TensorSpec("embed.weight", (33, 4)),
        TensorSpec("blocks.0.w", (10, 3)),
        TensorSpec("blocks.0.b", (10,)),
        TensorSpec("blocks.1.w", (7, 5)),
        TensorSpec("blocks.1.b", (7,)),
        TensorSpec("head.bias", (3,), "float32", 1),
    )
)
MESH = Mesh({"node": 2, "local": 2})
PRESET_NAMES = ("zero0", "zero1", "zero2", "zero3", "mics", "hpz")


# --- the mesh ---------------------------------------------------------------------------


def test_rank_is_row_major_last_axis_fastest():
    """As torch's DeviceMesh(arange(4).view(2, 2)) and JAX's Mesh lay ranks out."""
    assert [MESH.coordinate(r) for r in range(4)] == [
        {"node": 0, "local": 0},
        {"node": 0, "local": 1},
        {"node": 1, "local": 0},
        {"node": 1, "local": 1},
    ]
    assert all(MESH.rank_at(MESH.coordinate(r)) == r for r in range(4))
    assert MESH.size == 4 and str(MESH) == "node=2 x local=2"


def test_groups_along_axes():
    assert MESH.group(2, ("local",)) == (2, 3)
    assert MESH.group(2, ("node",)) == (0, 2)
    assert MESH.group(2, ()) == (2,)
    assert MESH.groups(("local",)) == ((0, 1), (2, 3))
    assert MESH.groups(("node",)) == ((0, 2), (1, 3))
    assert MESH.groups(("node", "local")) == ((0, 1, 2, 3),)
    # the order of the axes orders a group: local-major visits node fastest
    assert MESH.group(0, ("local", "node")) == (0, 2, 1, 3)
    assert [MESH.index_in_group(r, ("local", "node")) for r in range(4)] == [0, 2, 1, 3]


@pytest.mark.parametrize("axes", [(), ("a",), ("c",), ("a", "c"), ("b", "c"), ("c", "a", "b")])
def test_groups_cut_the_world_into_disjoint_groups(axes):
    mesh = Mesh({"a": 2, "b": 3, "c": 2})
    groups = mesh.groups(axes)
    assert sorted(r for g in groups for r in g) == list(range(12))
    assert all(len(g) == mesh.group_size(axes) for g in groups)
    for group in groups:
        for position, rank in enumerate(group):
            assert mesh.group(rank, axes) == group
            assert mesh.index_in_group(rank, axes) == position


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        ({"node": 0}, "axis 'node' has size 0; it must be an int >= 1"),
        ({"node": 2.0}, "axis 'node' has size 2.0"),
        ({"node": True}, "axis 'node' has size True"),
        ([("node", 2), ("node", 2)], "axis 'node' is named twice"),
        ({"no de": 2}, "'no de' is not allowed; use an identifier"),
        ({}, "at least one axis"),
    ],
)
def test_mesh_errors_name_the_axis_and_value(axes, message):
    with pytest.raises(MeshError, match=message):
        Mesh(axes)


def test_where_a_plan_lies_is_a_mesh():
    """`OnMesh` answers every `Mesh` query for its processes; its constructors split the
    plan's ranks over every axis."""
    on = partition.OnMesh.parse("node=2,local=2")
    assert isinstance(on, Mesh) and on.shard == ("node", "local") and on.size == 4
    assert on.group(2, ("local",)) == MESH.group(2, ("local",)) and str(on) == str(MESH)
    assert partition.OnMesh.single(3) == partition.OnMesh((("dp", 3),), ("dp",))
    with pytest.raises(MeshError, match="axis 'dp' has size 0"):
        partition.OnMesh.single(0)
    assert mesh_plan(MANIFEST, MESH, "zero3").mesh == dataclasses.replace(on, preset="zero3")


def test_mesh_lookups_fail_by_name():
    with pytest.raises(MeshError, match=r"axis 'rack' is not in the mesh \(node=2 x local=2\)"):
        MESH.group(0, ("rack",))
    with pytest.raises(MeshError, match="rank 4 is out of range"):
        MESH.coordinate(4)
    with pytest.raises(MeshError, match="give a tuple of axis names"):
        MESH.group(0, "local")
    with pytest.raises(MeshError, match="has 4 ranks but the world has 8"):
        MESH.check_world(8)
    with pytest.raises(MeshError, match="missing axes \\['local'\\]"):
        MESH.rank_at({"node": 1})
    assert Mesh.parse("node=2, local=2") == MESH
    with pytest.raises(MeshError, match="'local' is not 'axis=size'"):
        Mesh.parse("node=2,local")
    assert isinstance(MeshError("x"), PlanError)  # one exception to catch


# --- presets equal today's plans ---------------------------------------------------------


@pytest.mark.parametrize("strategy_fn", [None, per_tensor_dim0])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_presets_on_one_axis_are_todays_plans(strategy_fn, world, stage):
    options = {"persistence_threshold": 20} if stage == 3 else {}
    if strategy_fn is not None:
        options["strategy"] = strategy_fn
    today = plan(MANIFEST, world_size=world, stage=stage, **options)
    mesh_version = mesh_plan(MANIFEST, Mesh.single(world), f"zero{stage}", **options)
    assert mesh_version.units == today.units and mesh_version.shardings == today.shardings
    assert mesh_version.world_size == mesh_version.processes == world
    assert to_plan(mesh_version) == today and to_plan(today) is today
    split_kinds = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads")}.get(stage, KINDS[:3])
    for index, unit in enumerate(today.units):
        for kind, rank in itertools.product(KINDS[:3], range(world)):
            expected = (
                unit.shard_range(rank)
                if kind in split_kinds and not (kind == "params" and unit.persistent)
                else (0, unit.numel)
            )
            assert mesh_version.kind_range(index, kind, rank) == expected
            assert today.kind_range(index, kind, rank) == expected


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_presets_on_two_axes_are_todays_plans_on_the_world(stage):
    """Split over every axis in mesh order, rank r holds shard r: one group, the world."""
    today = plan(MANIFEST, world_size=4, stage=stage, persistence_threshold=20)
    assert to_plan(mesh_plan(MANIFEST, MESH, Zero(stage), persistence_threshold=20)) == today
    # axes of size 1 change nothing
    trivial = Mesh({"node": 1, "local": 4})
    assert to_plan(mesh_plan(MANIFEST, trivial, MiCS(("local",)))) == plan(
        MANIFEST, world_size=4, stage=3
    )


def test_plans_that_need_subgroups_are_not_stage_plans():
    with pytest.raises(PlanError, match=r"unit 'embed' optimizer: split over \('local',\)"):
        to_plan(mesh_plan(MANIFEST, MESH, "mics"))
    with pytest.raises(PlanError, match="unit 'embed' params: a secondary copy"):
        to_plan(mesh_plan(MANIFEST, MESH, "hpz"))

    def mixed(mesh, unit):
        return Zero(3 if unit.name == "embed" else 1)(mesh, unit)

    # units split as different stages over the world are a stage plan (`Unit.stage`)
    staged = to_plan(mesh_plan(MANIFEST, MESH, Custom("mixed", mixed)))
    assert staged.stage == 3 and staged.stages[0] == 3 and set(staged.stages[1:]) == {1}

    def whole_params(mesh, unit):  # stage 3 but for a unit kept whole: a persistent unit
        return Zero(3 if unit.name == "embed" else 2)(mesh, unit)

    converted = to_plan(mesh_plan(MANIFEST, MESH, Custom("mixed", whole_params)))
    assert converted.stage == 3 and [u.persistent for u in converted.units] == [0, 1, 1, 1]


# --- invariants --------------------------------------------------------------------------


def _plans():
    meshes = [MESH, Mesh({"node": 3, "local": 2}), Mesh({"pod": 2, "node": 2, "local": 2})]
    for mesh, name in itertools.product(meshes, PRESET_NAMES):
        yield mesh_plan(MANIFEST, mesh, name, persistence_threshold=8)
        yield mesh_plan(MANIFEST, mesh, name, strategy=per_tensor_dim0)


@pytest.mark.parametrize("mp", list(_plans()), ids=lambda p: f"{p.preset}-{p.mesh}-{p.strategy}")
def test_every_element_is_held_once_per_replica_of_each_kind(mp):
    """For each kind, the ranks of one group along its shard axes (one replica) hold every
    element of every tensor exactly once; all replicas hold the same blocks; blocks are
    the unit over the group size."""
    mesh = mp.process_mesh
    for index, (unit, sharding) in enumerate(zip(mp.units, mp.shardings)):
        for kind in KINDS:
            split = sharding.of(kind)
            if split is None:
                continue
            block = unit.numel // mesh.group_size(split.shard)
            assert block % mp.alignment == 0
            for group in mesh.groups(split.shard):
                held = {}
                for rank in group:
                    lo, hi = mp.kind_range(index, kind, rank)
                    assert hi - lo == block
                    for s in kind_slices(mp, rank, kind):
                        if s.unit == index:
                            for i in range(s.start, s.stop):
                                key = (s.fqn, i)
                                assert key not in held, f"{key} twice in {kind}"
                                held[key] = rank
                expected = {
                    (p.fqn, i) for p in unit.placements for i in range(mp.manifest[p.fqn].numel)
                }
                assert set(held) == expected
            for rank in range(mesh.size):  # replicas: same position, same block
                twin = mesh.group(rank, split.replicate)
                assert {mp.kind_range(index, kind, r) for r in twin} == {
                    mp.kind_range(index, kind, rank)
                }


@pytest.mark.parametrize("mp", list(_plans()), ids=lambda p: f"{p.preset}-{p.mesh}-{p.strategy}")
def test_each_kind_nests_in_the_one_it_comes_from(mp):
    """What makes a plan executable: a rank's optimizer block lies in its gradient block
    (the update reads only reduced gradients it holds), its gradient block in its
    parameter block. (hpZ's secondary is cut from the gathered whole: it need not nest.)"""
    for index, rank in itertools.product(range(len(mp.units)), range(mp.processes)):
        ranges = {k: mp.kind_range(index, k, rank) for k in KINDS[:3]}
        assert ranges["params"][0] <= ranges["grads"][0] <= ranges["optimizer"][0]
        assert ranges["optimizer"][1] <= ranges["grads"][1] <= ranges["params"][1]


def test_kind_slices_of_a_stage_plan_are_its_local_slices():
    today = plan(MANIFEST, world_size=4, stage=3)
    on_mesh = mesh_plan(MANIFEST, MESH, "zero3")
    for rank, kind in itertools.product(range(4), KINDS[:3]):
        assert kind_slices(today, rank, kind) == local_slices(today, rank)
        assert kind_slices(on_mesh, rank, kind) == local_slices(on_mesh, rank)


# --- validate ----------------------------------------------------------------------------


def _with(mp, index: int | None = 0, **kinds):
    """The plan `mesh_plan` makes of `mp`'s units on `MESH` with unit `index`'s kinds
    replaced (None: every unit's), through a user's preset."""
    shardings = list(mp.shardings)
    for at in range(len(shardings)) if index is None else [index]:
        shardings[at] = dataclasses.replace(shardings[at], **kinds)
    by_name = {unit.name: split for unit, split in zip(mp.units, shardings)}
    return mesh_plan(mp.manifest, MESH, Custom("edited", lambda mesh, unit: by_name[unit.name]))


ZERO3 = mesh_plan(MANIFEST, MESH, "zero3")
EVERY, LOCAL, NODE, WHOLE = (
    MESH.sharding("node", "local"),
    MESH.sharding("local"),
    MESH.sharding("node"),
    MESH.replicated,
)


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        (
            {"grads": Sharding(("local", "rack"), ("node",))},
            "unit 'embed' grads: shard axis 'rack' is not in the mesh",
        ),
        ({"grads": Sharding(("local",), ())}, "unit 'embed' grads: axis 'node' is neither"),
        (
            {"optimizer": Sharding(("local",), ("local", "node"))},
            "unit 'embed' optimizer: axis 'local' is named 2 times",
        ),
        ({"params": Sharding("local", ("node",))}, "unit 'embed' params: shard is 'local'"),
        (
            {"optimizer": LOCAL},
            r"unit 'embed' grads: split over \('node', 'local'\), the optimizer state over "
            r"\('local',\): axis 'node' is missing there",
        ),
        (
            {"params": EVERY, "grads": WHOLE, "optimizer": EVERY},
            r"unit 'embed' params: .* axis 'node' at position 0 is missing there; a parameter "
            "shard is reduced into",
        ),
        (
            {"params": LOCAL, "grads": NODE, "optimizer": EVERY},
            "unit 'embed' params: .* axis 'local' at position 0 is 'node' there",
        ),
        (
            {"params": LOCAL, "grads": LOCAL, "optimizer": LOCAL, "params_secondary": NODE},
            "unit 'embed' params_secondary: split over axis 'node' where the primary params",
        ),
        (
            {
                "hierarchical_params_gather": True,
                "params": LOCAL,
                "grads": LOCAL,
                "optimizer": LOCAL,
            },
            "unit 'embed' params: hierarchical_params_gather needs params split over two or more",
        ),
        ({"optimizer": "everywhere"}, "unit 'embed' optimizer: 'everywhere' is not"),
    ],
)
def test_validate_names_unit_kind_and_axis(kinds, message):
    with pytest.raises(PlanError, match=message):
        validate(_with(ZERO3, **kinds))


def test_validate_accepts_what_zero_and_fsdp_run():
    numel = ZERO3.units[0].numel
    # ZeRO-2 within the node only (grads and states over local, params whole)
    hsdp2 = _with(ZERO3, None, params=WHOLE, grads=LOCAL, optimizer=LOCAL)
    assert validate(hsdp2) is hsdp2
    assert hsdp2.kind_range(0, "params", 3) == (0, numel)
    # ranks 1 and 3 share a local index: the same half on both nodes
    assert hsdp2.kind_range(0, "grads", 1) == hsdp2.kind_range(0, "grads", 3)
    assert hsdp2.kind_range(0, "optimizer", 1) == (numel // 2, numel)
    # states finer than gradients, the gradients' axes first (the optimizer over the
    # world, the gradients within the node): ranges that nest, run by both doors
    # (tests/test_kind_groups.py)
    finer = _with(ZERO3, None, params=WHOLE, grads=LOCAL, optimizer=MESH.sharding("local", "node"))
    start, stop = finer.kind_range(0, "optimizer", 2)  # inside rank 2's gradient half
    grad_start, grad_stop = finer.kind_range(0, "grads", 2)
    assert grad_start <= start < stop <= grad_stop and stop - start == numel // 4
    assert validate(finer) is finer
    # hpZ's secondary may equal the primary (zero_hpz_partition_size = world size): the
    # primary serves backward, so the plan that runs keeps no copy
    same = _with(ZERO3, None, params_secondary=EVERY)
    assert same.mesh.secondary == () and same.shardings == ZERO3.shardings


def test_validate_checks_the_plan_around_the_shardings():
    """The per-kind form `mesh_plan` lowers (and format 2 holds) is checked whole."""
    said = as_kind_plan(ZERO3)
    assert isinstance(said, KindPlan) and said.shardings == ZERO3.shardings
    with pytest.raises(PlanError, match="5 shardings for 4 units"):
        validate(dataclasses.replace(said, shardings=(*said.shardings, said.shardings[0])))
    with pytest.raises(PlanError, match="mesh is a dict"):
        validate(dataclasses.replace(said, mesh={"node": 2, "local": 2}))
    persistent = dataclasses.replace(said.units[0], persistent=True)
    with pytest.raises(PlanError, match=r"unit 'embed' is persistent .* split over"):
        validate(dataclasses.replace(said, units=(persistent, *said.units[1:])))
    short = dataclasses.replace(said.units[0], numel=said.units[0].numel - 16)
    with pytest.raises(PlanError, match="unit 'embed': numel"):
        validate(dataclasses.replace(said, units=(short, *said.units[1:])))
    with pytest.raises(PlanError, match=r"expected a partition\.Plan, found str"):
        validate("plan")


def test_presets_name_a_missing_axis():
    with pytest.raises(MeshError, match="axis 'local' is not in the mesh"):
        mesh_plan(MANIFEST, Mesh({"node": 2, "gpu": 2}), MiCS(("local",)))
    with pytest.raises(PlanError, match="preset is 'zero4'; allowed: zero0, zero1"):
        mesh_plan(MANIFEST, MESH, "zero4")
    with pytest.raises(PlanError, match="ZeRO stage is 4"):
        Zero(4)


def test_a_user_preset_states_any_mix_and_validate_says_what_does_not_run():
    """Embeddings MiCS-style, blocks ZeRO-3 with hpZ, the head ZeRO-2: a plan to price
    (its shard ranges, process groups and bytes are plain queries) that the doors run,
    each unit on its own group (`tests/test_unit_groups.py`); with MiCS's hierarchical
    gather beside it, `validate` and `mesh_plan` refuse it with the reason, so what
    validates is what runs."""

    def rule(mesh: Mesh, unit) -> UnitSharding:
        if unit.module == "embed":
            return MiCS()(mesh, unit)
        if unit.module.startswith("blocks"):
            return HpZ()(mesh, unit)
        return Zero(2)(mesh, unit)

    runs = mesh_plan(MANIFEST, MESH, Custom("mine", rule))
    axes = {u.module: u.shard_axes for u in runs.units}
    assert axes["embed"] == ("local",) and axes["head"] is None and runs.world_size == 4
    assert runs.mesh.secondary == ("local",)  # the blocks' copy; the embeddings need none

    def hierarchical(mesh: Mesh, unit) -> UnitSharding:
        if unit.module == "embed":
            return MiCS()(mesh, unit)
        return MiCS(("node", "local"), True)(mesh, unit)

    refused = r"unit 'blocks.0' params: a hierarchical gather .* different groups of axes"
    with pytest.raises(PlanError, match=refused + r" \(\[\('local',\), \('node', 'local'\)\]\)"):
        mesh_plan(MANIFEST, MESH, Custom("mine", hierarchical))
    mp = runs
    by_module = {u.module: s for u, s in zip(mp.units, mp.shardings)}
    assert by_module["embed"].grads == LOCAL
    assert by_module["blocks.0"].params_secondary == LOCAL
    assert by_module["head"].params == WHOLE and by_module["head"].grads == EVERY
    assert process_groups(mp) == (("local",), ("node",), ("node", "local"))


def test_process_groups_per_preset():
    groups = {name: process_groups(mesh_plan(MANIFEST, MESH, name)) for name in PRESET_NAMES}
    assert groups["zero0"] == (("node", "local"),)  # all-reduce over the world
    assert groups["zero3"] == (("node", "local"),)
    assert groups["mics"] == (("local",), ("node",))  # gather/scatter in, all-reduce across
    assert groups["hpz"] == (("node", "local"), ("local",))  # forward world, backward node
    mesh = Mesh({"replica": 2, "node": 2, "local": 2})
    hierarchical = mesh_plan(MANIFEST, mesh, MiCS(("node", "local"), True))
    assert process_groups(hierarchical) == (
        ("node",),
        ("local",),
        ("node", "local"),
        ("replica",),
    )


# --- serialisation -----------------------------------------------------------------------


def _format2(plan) -> bytes:
    """`plan` as an earlier fzero wrote a plan on a mesh: format 2, said per kind."""
    said = as_kind_plan(plan)
    shardings = [
        {
            **{
                k: None if s.of(k) is None else [list(s.of(k).shard), list(s.of(k).replicate)]
                for k in KINDS
            },
            "hierarchical_params_gather": s.hierarchical_params_gather,
        }
        for s in said.shardings
    ]
    return msgpack.packb(
        {
            "format": 2,
            "manifest": encode_manifest(said.manifest),
            "mesh": [list(axis) for axis in said.mesh.axes],
            "alignment": said.alignment,
            "strategy": said.strategy,
            "preset": said.preset,
            "units": [encode_unit(u) for u in said.units],
            "shardings": shardings,
            **encode_memory(said.memory),
        }
    )


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_plans_on_a_mesh_round_trip_through_msgpack(name):
    """One wire format for every plan (1); format 2, which an earlier fzero wrote for a
    plan on a mesh, loads as the plan it runs as."""
    mp = mesh_plan(MANIFEST, Mesh({"pod": 2, "node": 2, "local": 2}), name)
    data = to_bytes(mp)
    assert msgpack.unpackb(data)["format"] == 1
    assert from_bytes(data) == mp and hash(from_bytes(data)) == hash(mp)
    assert from_bytes(_format2(mp)) == mp


def test_old_plans_load_as_they_were():
    today = plan(describe(torch.nn.Linear(4, 3)), world_size=2, stage=2)
    old = to_bytes(today)
    assert msgpack.unpackb(old)["format"] == 1
    loaded = from_bytes(old)
    assert loaded == today and loaded.process_mesh == Mesh({"dp": 2})
    assert loaded.preset == "zero2"


def test_bytes_that_are_not_a_plan():
    with pytest.raises(PlanError, match="format 3; this fzero reads 1 and 2"):
        from_bytes(msgpack.packb({"format": 3}))
    with pytest.raises(PlanError, match="not an fzero plan"):
        from_bytes(msgpack.packb({"format": 2, "manifest": {}}))
    raw = msgpack.unpackb(_format2(ZERO3))
    raw["mesh"] = [["node", 2], ["local", 0]]
    with pytest.raises(MeshError, match="axis 'local' has size 0"):
        from_bytes(msgpack.packb(raw))
    raw = msgpack.unpackb(_format2(ZERO3))
    raw["shardings"][1]["grads"] = [["local"], ["node"]]
    with pytest.raises(PlanError, match=r"unit 'blocks.0' params: split over"):
        from_bytes(msgpack.packb(raw))
    with pytest.raises(PlanError, match=r"plan is a KindPlan; expected a partition\.Plan"):
        to_bytes(as_kind_plan(ZERO3))


# --- DeepSpeed's keys --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("zero", "world", "mesh", "preset"),
    [
        ({"stage": 3}, 8, {"dp": 8}, Zero(3)),
        ({"stage": 3, "zero_hpz_partition_size": 1}, 8, {"dp": 8}, Zero(3)),
        ({"stage": 3, "zero_hpz_partition_size": 4}, 8, {"node": 2, "local": 4}, HpZ(("local",))),
        ({"stage": 3, "mics_shard_size": 2}, 8, {"replica": 4, "shard": 2}, MiCS(("shard",))),
        ({"stage": 3, "mics_shard_size": -1}, 8, {"dp": 8}, Zero(3)),
        # below stage 3 DeepSpeed ignores hpZ and MiCS: so does the mapping
        ({"stage": 2, "zero_hpz_partition_size": 4}, 8, {"dp": 8}, Zero(2)),
        ({"stage": 1, "mics_shard_size": 4}, 8, {"dp": 8}, Zero(1)),
    ],
)
def test_deepspeed_keys_map_onto_presets(zero, world, mesh, preset):
    assert from_zero_config(zero, world) == (Mesh(mesh), preset)


def test_hierarchical_mics_splits_the_shard_group_into_nodes():
    zero = {"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": True}
    mesh, preset = from_zero_config(zero, 16, ranks_per_node=4)
    assert mesh == Mesh({"replica": 2, "node": 2, "local": 4})
    assert preset == MiCS(("node", "local"), hierarchical_params_gather=True)
    mp = mesh_plan(MANIFEST, mesh, preset)
    assert all(s.hierarchical_params_gather for s in mp.shardings)
    # a shard group within one node: nothing to gather across nodes (DeepSpeed: no effect)
    mesh, preset = from_zero_config({**zero, "mics_shard_size": 4}, 16, ranks_per_node=4)
    assert (mesh, preset) == (Mesh({"replica": 4, "shard": 4}), MiCS(("shard",)))


@pytest.mark.parametrize(
    ("zero", "kwargs", "message"),
    [
        ({"stage": 3, "zero_hpz_partition_size": 3}, {}, r"is 3; it must divide .* \[1, 2, 4, 8\]"),
        ({"stage": 3, "zero_hpz_partition_size": 0}, {}, "zero_hpz_partition_size is 0"),
        ({"stage": 3, "mics_shard_size": 16}, {}, "mics_shard_size is 16; it must divide"),
        ({"stage": 3, "mics_shard_size": "4"}, {}, "mics_shard_size is '4'; it must be an int"),
        (
            {"stage": 3, "mics_shard_size": 4, "zero_hpz_partition_size": 2},
            {},
            "choose one",
        ),
        (
            {"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": True},
            {},
            "give ranks_per_node",
        ),
        (
            {"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": True},
            {"ranks_per_node": 3},
            "ranks_per_node 3 does not divide",
        ),
        ({"stage": 3, "mics_hierarchical_params_gather": 1}, {}, "must be true or false"),
        ({"stage": 5}, {}, "ZeRO stage is 5"),
    ],
)
def test_deepspeed_key_errors_name_key_and_value(zero, kwargs, message):
    with pytest.raises(PlanError, match=message):
        from_zero_config(zero, 8, **kwargs)


# --- study tools: memory and communication -----------------------------------------------

BIG = Manifest(tuple(TensorSpec(f"blocks.{i}.w", (32, 32)) for i in range(3)))  # no padding


def _rows(rows):
    return {(r.operation, r.what, r.axes): (r.calls, r.bytes, r.world_size) for r in rows}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_volume_on_one_axis_is_todays(stage):
    options = {"persistence_threshold": 20} if stage == 3 else {}
    today = plan(MANIFEST, world_size=4, stage=stage, **options)
    mp = mesh_plan(MANIFEST, Mesh.single(4), f"zero{stage}", **options)
    regathered = [i for i, u in enumerate(today.units) if stage == 3 and not u.persistent]
    settings = {
        "accumulation_steps": 3,
        "param_dtype": "bfloat16",
        "bucket_numel": 100,
        "regathered": regathered[:1],
        "loss_scaling": True,
        "optimizer": "lamb",
    }
    expected = [dataclasses.replace(r, axes=("dp",)) for r in comm_volume(today, **settings)]
    assert comm_volume(mp, **settings) == expected
    assert comm_volume(mesh_plan(MANIFEST, Mesh.single(1), f"zero{stage}", **options)) == []


def test_hsdp_reduces_within_the_node_and_all_reduces_across():
    """MiCS/HSDP on 2 x 2, fp32 params, 2 micro-steps: gradients reduce-scattered over
    `local` every micro-step and their shard all-reduced over `node` every micro-step too
    (MiCS's 2-hop gradient synchronisation as FSDP2's HSDP runs it; DeepSpeed waits for
    the accumulation boundary); parameters gathered over `local` only."""
    mp = mesh_plan(BIG, MESH, "mics")
    rows = _rows(comm_volume(mp, accumulation_steps=2, regathered=[0, 1, 2]))
    unit_bytes = 1024 * 4
    assert rows[("reduce_scatter", "gradients", ("local",))] == (6, 3 * unit_bytes * 2, 2)
    across = rows[("all_reduce", "gradients across replicas", ("node",))]
    assert across == (6, 3 * unit_bytes // 2 * 2, 2)
    assert rows[("all_gather", "parameters for forward", ("local",))] == (6, 6 * unit_bytes, 2)
    assert rows[("all_gather", "parameters for backward", ("local",))] == (6, 6 * unit_bytes, 2)
    assert not any("node" in axes and what.startswith("param") for _, what, axes in rows)


def test_hpz_moves_the_backward_gather_into_the_node():
    """ZeRO++ hpZ (Wang et al. 2023, arXiv:2306.10209): ZeRO-3 moves 3M per step across the
    world (forward gather, backward gather, gradient reduce-scatter); hpZ gathers for
    backward from the in-node secondary copy, so 2M of it still crosses nodes: the same
    bytes, one collective moved from node+local to local."""
    regathered = [0, 1, 2]
    zero3 = _rows(comm_volume(mesh_plan(BIG, MESH, "zero3"), regathered=regathered))
    hpz = _rows(comm_volume(mesh_plan(BIG, MESH, "hpz"), regathered=regathered))
    every = ("node", "local")
    backward = zero3.pop(("all_gather", "parameters for backward", every))
    assert hpz.pop(("all_gather", "parameters for backward", ("local",))) == (*backward[:2], 2)
    assert hpz == zero3
    model = 3 * 1024 * 4  # M: fp32 parameters and gradients
    for preset, crossing_models in (("zero3", 3), ("hpz", 2)):
        rows = comm_volume(mesh_plan(BIG, MESH, preset), regathered=regathered)
        data = [r for r in rows if r.what in ("gradients",) or r.what.startswith("param")]
        assert sum(r.bytes for r in data if "node" in r.axes) == crossing_models * model


def test_hierarchical_gather_runs_one_gather_per_axis():
    mesh = Mesh({"replica": 2, "node": 2, "local": 2})
    flat = _rows(comm_volume(mesh_plan(BIG, mesh, MiCS(("node", "local")))))
    hier = _rows(comm_volume(mesh_plan(BIG, mesh, MiCS(("node", "local"), True))))
    model = 3 * 1024 * 4
    assert flat[("all_gather", "parameters for forward", ("node", "local"))] == (3, model, 4)
    # over node: each rank's quarter becomes a half; over local: the half becomes the whole
    assert hier[("all_gather", "parameters for forward", ("node",))] == (3, model // 2, 2)
    assert hier[("all_gather", "parameters for forward", ("local",))] == (3, model, 2)


def test_quantized_collectives_on_a_mesh_and_what_comm_volume_refuses():
    """ZeRO++ whole on 2 x 2: qwZ's int8 gathers over the world for forward, backward
    exact from hpZ's in-node copy, qgZ's all-to-alls one pair per axis, the inner first:
    the outer hop carries the rows the inner one already summed (half as many)."""
    rows = _rows(
        comm_volume(
            mesh_plan(BIG, MESH, "hpz"),
            regathered=[0],
            quantized_weights=True,
            quantized_gradients=True,
        )
    )
    every = ("node", "local")
    assert rows[("all_gather", "parameters for forward (int8)", every)][0] == 2 * 3
    assert ("all_gather", "parameters for backward", ("local",)) in rows
    local = rows[("all_to_all", "gradients (int8)", ("local",))]
    node = rows[("all_to_all", "gradients (int8)", ("node",))]
    assert local[0] == node[0] and node[1] * 2 == local[1]
    assert not any(op == "reduce_scatter" for op, _, _ in rows)
    with pytest.raises(PlanError, match=r"unit 0 \('blocks.0'\), whose parameters are whole"):
        comm_volume(mesh_plan(BIG, MESH, "zero2"), regathered=[0])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_on_one_axis_is_todays(stage):
    today = plan(MANIFEST, world_size=4, stage=stage, persistence_threshold=20)
    for rank, precision in itertools.product(range(4), ("float32", "bfloat16")):
        expected = memory_per_rank(today, rank, param_dtype=precision)
        on_one_axis = mesh_plan(MANIFEST, Mesh.single(4), f"zero{stage}", persistence_threshold=20)
        assert memory_per_rank(on_one_axis, rank, param_dtype=precision) == expected


def test_mics_holds_the_model_over_the_shard_group():
    """MiCS (Zhang et al. 2022, arXiv:2205.00119): per-rank model states are the model over the
    partition group's size, whatever the world: 2 x 2 MiCS holds what ZeRO-3 on 2 ranks
    does (no padding in BIG), twice ZeRO-3 on 4."""
    mics = memory_per_rank(mesh_plan(BIG, MESH, "mics"), 3, param_dtype="bfloat16")
    zero3_on_2 = memory_per_rank(plan(BIG, world_size=2, stage=3), 0, param_dtype="bfloat16")
    zero3_on_4 = memory_per_rank(plan(BIG, world_size=4, stage=3), 0, param_dtype="bfloat16")
    assert mics == zero3_on_2
    assert mics.total == 2 * zero3_on_4.total
    model = 3 * 1024
    assert mics.params == model // 2 * 2 and mics.grads == model // 2 * 4
    assert mics.master == model // 2 * 4 and mics.optimizer_state == model // 2 * 8


def test_hpz_adds_a_secondary_copy_over_the_node():
    """ZeRO++ hpZ trades memory for cross-node volume: ZeRO-3's states plus one copy of
    the parameters split over the ranks of a node (Ψ/2 bf16 elements here)."""
    hpz = memory_per_rank(mesh_plan(BIG, MESH, "hpz"), 0, param_dtype="bfloat16")
    zero3 = memory_per_rank(plan(BIG, world_size=4, stage=3), 0, param_dtype="bfloat16")
    model = 3 * 1024
    assert hpz.params_secondary == model // 2 * 2
    assert dataclasses.replace(hpz, params_secondary=0) == zero3
    assert hpz.total == zero3.total + model


def test_format_plan_shows_each_kind_and_rank():
    text = format_plan(mesh_plan(BIG, MESH, "hpz"))
    lines = text.splitlines()
    assert lines[0] == (
        "plan: strategy=flat_even preset=hpz stage=3 mesh=node=2 x local=2 (4 processes; 4 "
        "shards over node, local) alignment=16 units=3 params=3,072"
    )
    assert "    params_secondary shard(local) replicate(node)" in text
    assert "    grads            shard(node, local)" in text
    assert (
        "    rank 2 (node=1, local=0): params[512:768) grads[512:768) optimizer[512:768) "
        "params_secondary[0:512); updates blocks.0.w[512:768]" in lines
    )
    assert lines[-1].startswith("padding: 0 elements (0.0% of the unit buffers)")
    assert format_plan(mesh_plan(BIG, Mesh.single(2), "zero1")).count("whole") == 6


def test_format_comm_volume_adds_axes_on_a_mesh():
    rows = comm_volume(mesh_plan(BIG, MESH, "mics"))
    text = format_comm_volume(rows)
    assert "axes" in text.splitlines()[0]
    assert volume_by_axes(rows)[("node",)] == 3 * 1024 * 4 // 2  # ring all-reduce: 2(g-1)/g
    assert "  wire bytes over node " in text
    stage_rows = comm_volume(plan(BIG, world_size=4, stage=3))
    assert "axes" not in format_comm_volume(stage_rows)


def test_on_mesh_is_the_strategy_an_engine_takes_and_passes_its_options_on():
    strategy = partition.on_mesh(MESH, "mics")
    got = partition.plan(
        MANIFEST, world_size=4, stage=3, strategy=strategy, persistence_threshold=10**9
    )
    assert got.mesh is not None and got.mesh.preset == "mics"
    assert all(u.persistent for u in got.units)  # the option reached the layout
    assert strategy.__name__ == "on_mesh_mics"
    with pytest.raises(PlanError, match="the run has 2 ranks, the mesh 4"):
        partition.plan(MANIFEST, world_size=2, stage=3, strategy=strategy)
    with pytest.raises(PlanError, match="the run is stage 2, the preset stage 3"):
        partition.plan(MANIFEST, world_size=4, stage=2, strategy=strategy)
    with pytest.raises(PlanError, match=r"mesh_plan got stage, world_size.*partition.on_mesh"):
        mesh_plan(MANIFEST, MESH, "mics", world_size=4, stage=3)
