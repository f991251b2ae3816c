"""fzero's ZeRO-3, MiCS, hpZ and a whole-layer plan against FSDP2's HSDP on a 2 x 2 mesh.

    python benchmarks/mesh.py [--steps 10] [--warmup 2] [--rounds 1] [--rows A,B] [--results F]

4 CPU ranks (gloo) as a mesh ("node": 2, "local": 2), rank = 2 * node + local. A GPT-shaped
LM built here (4 pre-norm blocks, width 256, vocab 1024, 64-token sequences, micro-batch 8
per rank, fixed seeds) on generated tokens (a permutation chain: the loss falls), fp32,
AdamW. Rows, each in its own processes: ZeRO-3 over the 4 ranks, MiCS (`mics_shard_size:
2`), hpZ (`zero_hpz_partition_size: 2`), a whole-layer plan (`"strategy":
"mesh:whole_blocks"`), whole tensors (`"strategy": "whole_tensors"`: uneven shards), MiCS
with the optimizer state over every rank in either order (`"mesh:optimizer_local_first"`,
`"mesh:optimizer_node_first"`: the second exchanges the boundary's blocks), MiCS for
the blocks beside ZeRO-3 over every rank for the rest (`"mesh:mics_blocks"`: units on
their own axes), and the baseline, FSDP2's HSDP (`fully_shard` on a 2-D `DeviceMesh`,
replicated over "node", sharded over "local"). A row in `REFUSABLE` that fzero refuses
prints as refused, with the error's first line.

Per row: seconds per step (median; a barrier before and after each step) and its ratio to
HSDP, the largest peak RSS of the ranks, rank 0's collective calls and bytes per step by
the mesh axes their group spans (whole buffers, as `fzero.comm.traffic()` counts them;
fzero's from `fzero.comm.traffic_by_group()`, FSDP2's by wrapping the torch.distributed
collectives it calls), a modelled communication time (the table's notes say how), and the
final loss. Exits non-zero when the fzero rows' loss curves differ by more than 1e-4.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

import fzero
from fzero import partition
from fzero.partition import Manifest, Plan, flat_even

WIDTH, DEPTH, HEADS, VOCAB, SEQ, MICRO = 256, 4, 4, 1024, 64, 8
LR, DECAY = 1e-3, 0.01
NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
LOSS_LIMIT = 1e-4  # fzero rows run the same arithmetic up to the order of a 4-way sum
GBPS = (25, 100)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(batch, length, 3, HEADS, WIDTH // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, length, dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, WIDTH))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch at `step`: sequences that follow one fixed permutation of
    the vocabulary from a random start (the same in every row)."""
    chain = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1234))
    seed = torch.Generator().manual_seed(step * WORLD + rank)
    tokens = [torch.randint(VOCAB, (MICRO,), generator=seed)]
    for _ in range(SEQ):
        tokens.append(chain[tokens[-1]])
    return torch.stack(tokens[:-1], dim=1), torch.stack(tokens[1:], dim=1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def whole_blocks(manifest: Manifest, *, world_size: int, stage: int, **options: object) -> Plan:
    """One unit per transformer block (`blocks.0` ... and the embeddings, norm and head
    each their own), every tensor of it sharded: the engine's `persistence_threshold`
    (DeepSpeed's 100,000 elements: LayerNorms, biases, `proj` stay whole) is not applied."""
    return flat_even(manifest, world_size=world_size, stage=stage)


def _finer(order: tuple[str, str]) -> Callable[..., Plan]:
    """MiCS's ZeRO-3 within the node (parameters and gradients over "local") with the
    optimizer state over every rank, along `order`: a quarter per rank; in the order
    ("node", "local") each rank's quarter lies in another rank's gradient half, and the
    boundary's blocks are exchanged (one all-to-all there, one before the publish)."""

    def rule(mesh: partition.Mesh, unit: partition.Unit) -> partition.UnitSharding:
        local = mesh.sharding("local")
        params = mesh.replicated if unit.persistent else local
        return partition.UnitSharding(params, local, mesh.sharding(*order))

    mesh = partition.Mesh({"node": NODES, "local": LOCAL})
    return partition.on_mesh(mesh, partition.Custom(f"optimizer over {order}", rule, stage=3))


optimizer_local_first = _finer(("local", "node"))  # "strategy": "mesh:optimizer_local_first"
optimizer_node_first = _finer(("node", "local"))


def _mics_blocks(mesh: partition.Mesh, unit: partition.Unit) -> partition.UnitSharding:
    """MiCS for the transformer blocks (every kind within "local", replicas across
    "node"), ZeRO-3 over every rank for the rest (embeddings, norm, head): units on
    their own axes (`Unit.shard_axes`). Persistent units keep whole parameters."""
    axes = ("local",) if unit.module.startswith("blocks") else ("node", "local")
    split = mesh.sharding(*axes)
    params = mesh.replicated if unit.persistent else split
    return partition.UnitSharding(params, split, split)


mics_blocks = partition.on_mesh(  # "strategy": "mesh:mics_blocks"
    partition.Mesh({"node": NODES, "local": LOCAL}),
    partition.Custom("MiCS blocks, ZeRO-3 rest", _mics_blocks, stage=3),
)


Trainer = Callable[[torch.Tensor, torch.Tensor], float]  # one step on a batch: its loss
Traffic = Callable[[], dict[str, dict[str, tuple[int, int]]]]  # axes -> op -> (calls, bytes)


def fzero_traffic() -> dict[str, dict[str, tuple[int, int]]]:
    """fzero's collectives by the axes their group spans; before `traffic_by_group`
    exists, all of them under "all" (counted as world: the engine runs one group today)."""
    by_group = getattr(fzero.comm, "traffic_by_group", None)
    return by_group() if by_group else {"all": fzero.comm.traffic()}


def fzero_row(strategy: str = "", **zero: int) -> Callable[[nn.Module], tuple[Trainer, Traffic]]:
    def build(model: nn.Module) -> tuple[Trainer, Traffic]:
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}},
            "zero_optimization": {"stage": 3, **zero},
            **({"strategy": strategy} if strategy else {}),
        }
        engine, *_ = fzero.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> float:
            loss = lm_loss(engine(tokens), targets)
            engine.backward(loss)
            engine.step()
            return loss.item()

        return step, fzero_traffic

    return build


_torch_traffic: dict[str, dict[str, list[int]]] = {}  # axes -> op -> [calls, bytes]
_AXES_OF_RANKS = {  # rank = LOCAL * node + local
    **{frozenset(range(n * LOCAL, (n + 1) * LOCAL)): "local" for n in range(NODES)},
    **{frozenset(range(r, WORLD, LOCAL)): "node" for r in range(LOCAL)},
}
# torch 2.13's FSDP2 calls all_gather_single and reduce_scatter_single, and all_reduce over
# HSDP's replicate axis; the older spellings are counted too, should another version call them.
_COUNTED = {  # function -> (operation, the argument whose whole buffer is counted)
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
}


def count_torch_collectives() -> None:
    """Wrap `torch.distributed`'s collectives (FSDP2 looks them up there at each call) to
    count each one's buffer under the mesh axes its group's ranks span."""
    for name, (operation, argument) in _COUNTED.items():
        if hasattr(dist, name):
            setattr(dist, name, _counting(getattr(dist, name), operation, argument))


def _counting(original: Callable[..., Any], operation: str, argument: str) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def counted(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        ranks = frozenset(dist.get_process_group_ranks(bound.get("group") or dist.group.WORLD))
        entry = _torch_traffic.setdefault(_AXES_OF_RANKS.get(ranks, "world"), {})
        calls, size = entry.get(operation, (0, 0))
        tensor = bound[argument]
        entry[operation] = [calls + 1, size + tensor.numel() * tensor.element_size()]
        return original(*args, **kwargs)

    return counted


def hsdp(model: nn.Module) -> tuple[Trainer, Traffic]:
    """FSDP2's HSDP: each block and the root `fully_shard`ed on the 2-D mesh, replicated
    over its first axis ("node") and sharded over the second ("local")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (NODES, LOCAL), mesh_dim_names=("node", "local"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    count_torch_collectives()

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step, lambda: copy.deepcopy(_torch_traffic)


BASELINE = "FSDP2 HSDP"
ROWS: dict[str, Callable[[nn.Module], tuple[Trainer, Traffic]]] = {
    "fzero ZeRO-3": fzero_row(),
    "fzero MiCS": fzero_row(mics_shard_size=LOCAL),
    "fzero hpZ": fzero_row(zero_hpz_partition_size=LOCAL),
    # units released after forward (DeepSpeed's default keeps them within 1e9 elements):
    # backward gathers again, across nodes under ZeRO-3 and inside the node under hpZ
    "fzero ZeRO-3, reuse 0": fzero_row(stage3_max_reuse_distance=0),
    "fzero hpZ, reuse 0": fzero_row(zero_hpz_partition_size=LOCAL, stage3_max_reuse_distance=0),
    "fzero ZeRO++ (hpZ+qwZ+int4 qgZ), reuse 0": fzero_row(
        zero_hpz_partition_size=LOCAL,
        stage3_max_reuse_distance=0,
        zero_quantized_weights=True,
        zero_quantized_gradients=True,
        zero_quantized_gradients_bits=4,
    ),
    "fzero whole-layer plan": fzero_row("mesh:whole_blocks"),  # this file, imported as `mesh`
    # MiCS within the node, the optimizer over every rank in either order of its axes
    "fzero MiCS + optimizer over local then node": fzero_row("mesh:optimizer_local_first"),
    "fzero MiCS + optimizer over node then local": fzero_row("mesh:optimizer_node_first"),
    "fzero whole tensors": fzero_row("whole_tensors"),  # uneven: each tensor on one rank
    "fzero MiCS blocks + ZeRO-3 rest": fzero_row("mesh:mics_blocks"),
    BASELINE: hsdp,
}
REFUSABLE: tuple[str, ...] = ()  # rows fzero may refuse (printed, not failed)


def train(trainer: Trainer, traffic: Traffic, rank: int, args: argparse.Namespace) -> dict:
    """Every step's loss, the timed steps' median seconds, and [calls, bytes] per timed
    step by axes."""
    losses: list[float] = []
    times: list[float] = []
    before = traffic()
    for index in range(args.warmup + args.steps):
        before = traffic() if index == args.warmup else before
        tokens, targets = batch(rank, index)
        dist.barrier()  # timed from when all ranks start to when all finish
        start = time.perf_counter()
        losses.append(trainer(tokens, targets))
        dist.barrier()
        times.append(time.perf_counter() - start)
    moved: dict[str, list[float]] = {}
    for axes, ops in traffic().items():
        for op, (calls, size) in ops.items():
            earlier = before.get(axes, {}).get(op, (0, 0))
            total = moved.setdefault(axes, [0.0, 0.0])
            total[0] += (calls - earlier[0]) / args.steps
            total[1] += (size - earlier[1]) / args.steps
    return {"seconds": statistics.median(times[args.warmup :]), "losses": losses, "moved": moved}


def run_row(args: argparse.Namespace) -> None:
    """One row on this launch's 4 ranks; rank 0 writes its measurements to `--json`."""
    fzero.comm.init_distributed()
    rank = dist.get_rank()
    try:
        trainer, traffic = ROWS[args.row](make_model())
    except (ValueError, NotImplementedError) as error:
        if args.row not in REFUSABLE:
            raise
        measured: dict[str, Any] = {"refused": str(error).splitlines()[0]}
    else:
        measured = train(trainer, traffic, rank, args)
        del trainer  # the model and its hooks go before the process group they hold work of
        gc.collect()
        peaks: list[float] = [0.0] * dist.get_world_size()
        dist.all_gather_object(peaks, _harness.peak_rss_mb())
        measured["peak_rss_mb"] = max(peaks)
    if rank == 0:
        _harness.write_row(args.json, measured)
    dist.barrier()
    dist.destroy_process_group()


# Columns by the axes a group spans. fzero's presets name MiCS's axes "replica" (across
# shard groups: here across nodes) and "shard" (within one); anything else is both: world.
_COLUMN_OF_AXES = {"local": "local", "shard": "local", "node": "node", "replica": "node"}
COLUMNS = (
    ("s/step", ".3f"), ("x HSDP", ".2f"), ("peak RSS MB", ".0f"), ("calls", ".0f"),
    ("local MB", ".2f"), ("node MB", ".2f"), ("world MB", ".2f"),
    *[(f"ms @{gbps}G", ".1f") for gbps in GBPS], ("final loss", ".5f"),
)  # fmt: skip


def row_cells(rounds: list[dict], base: list[float] | None) -> tuple[_harness.Cell, ...]:
    times = [r["seconds"] for r in rounds]
    megabytes = {"local": 0.0, "node": 0.0, "world": 0.0}
    for axes, (_, size) in rounds[0]["moved"].items():
        megabytes[_COLUMN_OF_AXES.get(axes, "world")] += size / 1e6
    crossing_bits = (megabytes["node"] + megabytes["world"]) * 8e6  # per step, between nodes
    ratio = _harness.paired_ratio(times, base) if base else None
    calls = sum(calls for calls, _ in rounds[0]["moved"].values())
    peak = max(r["peak_rss_mb"] for r in rounds)
    modelled_ms = [crossing_bits / (gbps * 1e6) for gbps in GBPS]
    last = rounds[0]["losses"][-1]
    return statistics.median(times), ratio, peak, calls, *megabytes.values(), *modelled_ms, last


def max_gap(curves: list[list[float]], reference: list[float]) -> float:
    return max((abs(a - b) for curve in curves for a, b in zip(curve, reference)), default=0.0)


def table(args: argparse.Namespace, results: dict[str, list[dict]]) -> tuple[_harness.Table, float]:
    """The table, and the largest gap between the fzero rows' loss curves."""
    ran = {name: rounds for name, rounds in results.items() if "refused" not in rounds[0]}
    base = [r["seconds"] for r in ran[BASELINE]] if BASELINE in ran else None
    rows = tuple(
        (
            name,
            row_cells(rounds, base) if name in ran else ("refused", *[None] * (len(COLUMNS) - 1)),
        )
        for name, rounds in results.items()
    )
    notes = [
        f"{name}: refused: {r[0]['refused']}" for name, r in results.items() if name not in ran
    ]
    zero = [
        rounds[0]["losses"]
        for name, rounds in ran.items()
        if name.startswith("fzero") and "ZeRO++" not in name  # exact rows only
    ]
    gap = max_gap(zero, zero[0]) if zero else 0.0
    if zero:
        to_hsdp = f", with HSDP to {max_gap(zero, ran[BASELINE][0]['losses']):.1e}" if base else ""
        notes.append(
            f"loss curves ({len(zero[0])} steps): fzero rows agree to {gap:.1e} (limit "
            f"{LOSS_LIMIT:.0e}){to_hsdp}"
        )
        for name, rounds in ran.items():
            if "ZeRO++" in name:
                quantized = rounds[0]["losses"]
                worst = max(abs(a - b) / b for a, b in zip(quantized, zero[0]))
                notes.append(f"{name}: loss within {100 * worst:.2f}% of the exact rows'")
    notes.append(
        "calls, MB: rank 0's collectives per step (MB: whole buffers) by the axes their group "
        "spans; world: both. ms @G: modelled comm per step = MB on groups crossing nodes "
        "(node + world) / G Gbit/s per rank; local free; no latency, overlap or ring factor."
    )
    if any("all" in rounds[0]["moved"] for rounds in ran.values()):
        notes.append(
            "note: fzero.comm.traffic_by_group() is absent: fzero rows count every collective "
            "as world (exact while the engine runs one group, the world)."
        )
    params = sum(p.numel() for p in make_model().parameters())
    title = (
        f"mesh: GPT {params / 1e6:.2f}M params (width {WIDTH}, {DEPTH} blocks, vocab {VOCAB}, "
        f"seq {SEQ}, micro {MICRO}), fp32 AdamW, {WORLD} gloo ranks as node {NODES} x local "
        f"{LOCAL}, median of {args.steps} steps after {args.warmup}, {args.rounds} round(s)"
    )
    return _harness.Table(title, "row", COLUMNS, rows, tuple(notes)), gap


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all rows")
    parser.add_argument("--rows", default="", help=f"comma-separated subset of: {', '.join(ROWS)}")
    parser.add_argument("--results", default=None, help="also append the table to this file")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        run_row(args)
        return
    names = [name.strip() for name in args.rows.split(",") if name.strip()] or list(ROWS)
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; expected some of {list(ROWS)}")
    shape = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    results = _harness.run_rows(
        names,
        lambda name, out: _harness.torchrun(WORLD, __file__, *shape, "--row", name, "--json", out),
        args.rounds,
    )
    printed, gap = table(args, results)
    _harness.report("mesh", printed, args.results)
    if gap > LOSS_LIMIT:
        raise SystemExit(f"fzero rows' loss curves differ by {gap:.2e} > {LOSS_LIMIT:.0e}")


if __name__ == "__main__":
    main()
