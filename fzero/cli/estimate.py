"""Model-state memory per rank for every stage, from the exact plan, and the modelled
communication time of a step over given links (pure). Memory is the worst rank's: with
uneven plans (`whole_tensors`, a strategy of your own) ranks hold different amounts."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fzero.partition import (
    DEFAULT_PERSISTENCE_THRESHOLD,
    Manifest,
    MemoryEstimate,
    Mesh,
    Plan,
    TensorSpec,
    comm_time,
    comm_volume,
    flat_even,
    memory_per_rank,
    mesh_plan,
    plan,
)

__all__ = [
    "EstimateRow",
    "MeshEstimate",
    "estimate",
    "estimate_mesh",
    "format_estimate",
    "format_mesh_estimate",
    "manifest_of_size",
    "worst_rank",
]


@dataclass(frozen=True)
class EstimateRow:
    """One plan's model-state bytes on its worst rank (`rank`: the one holding the most
    on the device, the lowest such), and its modelled communication seconds per step
    (None without links)."""

    stage: int
    world_size: int
    offload_optimizer: bool
    device_bytes: int
    host_bytes: int
    rank: int = 0
    comm_seconds: float | None = None


def worst_rank(plan: Plan, **settings: object) -> tuple[int, MemoryEstimate]:
    """The rank (a process: on a mesh, of its `processes`) holding the most model-state
    bytes on the device (then on the host; the lowest such rank) under `plan`, with its
    `memory_per_rank(plan, rank, **settings)`."""
    ranks = range(plan.processes)
    estimates = [(memory_per_rank(plan, r, **settings), r) for r in ranks]  # type: ignore[arg-type]
    memory, rank = max(estimates, key=lambda e: (e[0].device, e[0].host, -e[1]))
    return rank, memory


def manifest_of_size(num_params: int, *, dtype: str = "float32") -> Manifest:
    """A stand-in manifest of `num_params` elements when no model is given."""
    return Manifest((TensorSpec("params", (num_params,), dtype),))


def estimate(
    manifest: Manifest,
    world_sizes: Sequence[int],
    *,
    param_dtype: str = "float16",
    grad_dtype: str = "float32",
    optimizer: str = "adam",
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    strategy: Callable[..., Plan] = flat_even,
    master_dtype: str = "float32",
    state_dtype: str = "float32",
    eval_live_parameters: int = 0,
    links: Mapping[str, str | float] | None = None,
) -> list[EstimateRow]:
    """The worst rank's bytes for stages 0-3 x `world_sizes`, without and with optimizer
    offload. The defaults are the engine's: fp32 gradient accumulators, fp32 masters and
    optimizer states, and stage 3 keeps tensors under `stage3_param_persistence_threshold`
    (DeepSpeed's 100,000) whole; `strategy` is the partitioning function (its plan's
    padding counts). With `links` ({"world": "25Gbps"}), each row also has the modelled
    communication time of a step (`partition.comm_time`, ring algorithms, stage 3's
    backward gathering every sharded unit again)."""
    rows = []
    for world_size in world_sizes:
        for stage in (0, 1, 2, 3):
            p = plan(
                manifest,
                world_size=world_size,
                stage=stage,
                persistence_threshold=persistence_threshold,
                strategy=strategy,
            )
            seconds = None
            if links is not None:
                regathered = [i for i, u in enumerate(p.units) if stage == 3 and not u.persistent]
                timed = comm_time(p, links=links, param_dtype=param_dtype, regathered=regathered)
                seconds = sum(row.seconds for row in timed)
            for offload in (False, True) if stage else (False,):
                rank, mem = worst_rank(
                    p,
                    param_dtype=param_dtype,
                    grad_dtype=grad_dtype,
                    optimizer=optimizer,
                    offload_optimizer=offload,
                    master_dtype=master_dtype,
                    state_dtype=state_dtype,
                    eval_live_parameters=eval_live_parameters,
                )
                rows.append(
                    EstimateRow(stage, world_size, offload, mem.device, mem.host, rank, seconds)
                )
    return rows


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e7 else f"{num_bytes / 1e6:.2f} MB"


def format_estimate(rows: Sequence[EstimateRow], num_params: int) -> str:
    """The table `fzero estimate` prints."""
    exponent = int(math.log10(num_params)) if num_params else 0
    timed = any(row.comm_seconds is not None for row in rows)
    lines = [
        f"model states per rank for {num_params:,} params (~{num_params / 10**exponent:.1f}e"
        f"{exponent}); the worst rank's; activations not included",
        f"{'stage':>5} {'ranks':>6} {'offload_optimizer':>17} "
        f"{'device/rank':>14} {'host/rank':>12} {'worst rank':>10}"
        + (f" {'comm ms/step':>13}" if timed else ""),
    ]
    for row in rows:
        line = (
            f"{row.stage:>5} {row.world_size:>6} {('cpu' if row.offload_optimizer else '-'):>17} "
            f"{_gb(row.device_bytes):>14} {_gb(row.host_bytes):>12} {row.rank:>10}"
        )
        if row.comm_seconds is not None:
            line += f" {1e3 * row.comm_seconds:>13.1f}"
        lines.append(line)
    if timed:
        lines.append(
            "comm: modelled seconds of one step's collectives on the given links (ring "
            "algorithms; one micro-step; not overlapped with compute)"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class MeshEstimate:
    """One preset on a mesh: the worst rank's model-state bytes (hpZ's secondary copy
    counted on the device), the ring wire bytes one rank sends per step by axes and
    operation, and with links the modelled seconds per step by axes."""

    preset: str
    offload_optimizer: bool
    device_bytes: int
    host_bytes: int
    wire_bytes: dict[tuple[tuple[str, ...], str], int]
    rank: int = 0
    seconds: dict[tuple[str, ...], float] | None = None


def estimate_mesh(
    manifest: Manifest,
    mesh: Mesh,
    presets: Sequence[str],
    *,
    param_dtype: str = "float16",
    grad_dtype: str = "float32",
    optimizer: str = "adam",
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    strategy: Callable[..., Plan] = flat_even,
    master_dtype: str = "float32",
    state_dtype: str = "float32",
    eval_live_parameters: int = 0,
    links: Mapping[str, str | float] | None = None,
) -> list[MeshEstimate]:
    """The worst rank's bytes and each step's wire bytes per axes for every preset (a
    name in `partition.PRESETS`) on `mesh`, with the engine's defaults as `estimate` has
    them; with `links` (one per mesh axis) the modelled seconds per step by axes.
    Communication counts one micro-step per step and backward re-gathering every unit
    whose parameters are split (ZeRO's 3Ψ: what hpZ's secondary copy serves). As in
    `estimate`, optimizer offload is shown only where the optimizer state is split."""
    rows = []
    for name in presets:
        p = mesh_plan(
            manifest, mesh, name, strategy=strategy, persistence_threshold=persistence_threshold
        )
        regathered = [i for i, s in enumerate(p.shardings) if s.params.shard]
        wire: dict[tuple[tuple[str, ...], str], int] = {}
        volume = comm_volume(p, param_dtype=param_dtype, regathered=regathered)
        for row in volume:
            key = (row.axes, row.operation)
            wire[key] = wire.get(key, 0) + row.wire_bytes
        seconds = None
        if links is not None:
            seconds = {}
            for timed in comm_time(volume, links=links):
                seconds[timed.axes] = seconds.get(timed.axes, 0.0) + timed.seconds
        splits_optimizer = any(s.optimizer.shard for s in p.shardings)
        for offload in (False, True) if splits_optimizer else (False,):
            rank, mem = worst_rank(
                p,
                param_dtype=param_dtype,
                grad_dtype=grad_dtype,
                optimizer=optimizer,
                offload_optimizer=offload,
                master_dtype=master_dtype,
                state_dtype=state_dtype,
                eval_live_parameters=eval_live_parameters,
            )
            rows.append(MeshEstimate(name, offload, mem.device, mem.host, wire, rank, seconds))
    return rows


def _bytes(num_bytes: int) -> str:
    return f"{num_bytes:,} B" if num_bytes < 10_000 else _gb(num_bytes)


def format_mesh_estimate(rows: Sequence[MeshEstimate], num_params: int, mesh: Mesh) -> str:
    """The tables `fzero estimate --mesh` prints: memory per preset, then wire bytes."""
    w = max([6, *(len(row.preset) for row in rows)])  # a preset's column: its longest name
    lines = [
        f"model states per rank for {num_params:,} params on mesh {mesh} ({mesh.size} ranks); "
        "the worst rank's; activations not included",
        f"{'preset':>{w}} {'offload_optimizer':>17} {'device/rank':>14} {'host/rank':>12} "
        f"{'worst rank':>10}",
    ]
    for row in rows:
        lines.append(
            f"{row.preset:>{w}} {('cpu' if row.offload_optimizer else '-'):>17} "
            f"{_gb(row.device_bytes):>14} {_gb(row.host_bytes):>12} {row.rank:>10}"
        )
    operations = ("all_gather", "reduce_scatter", "all_reduce")
    lines += [
        "wire bytes one rank sends per step, by the axes of each collective (ring "
        "algorithms; backward re-gathers every split unit):",
        f"{'preset':>{w}} {'axes':<20}" + "".join(f"{op:>15}" for op in operations),
    ]
    for row in rows:
        if row.offload_optimizer:
            continue
        for axes in dict.fromkeys(axes for axes, _ in row.wire_bytes):
            sent = [row.wire_bytes.get((axes, op), 0) for op in operations]
            lines.append(
                f"{row.preset:>{w}} {'+'.join(axes):<20}"
                + "".join(f"{_bytes(b):>15}" for b in sent)
            )
    timed = [row for row in rows if row.seconds is not None and not row.offload_optimizer]
    if timed:
        lines += [
            "modelled communication per step (ring algorithms, the slowest link of each "
            "collective's axes; one micro-step; not overlapped with compute):",
            f"{'preset':>{w}} {'axes':<20}{'ms':>12}",
        ]
        for row in timed:
            assert row.seconds is not None
            for axes, seconds in row.seconds.items():
                lines.append(f"{row.preset:>{w}} {'+'.join(axes):<20}{1e3 * seconds:>12.1f}")
            lines.append(f"{row.preset:>{w}} {'total':<20}{1e3 * sum(row.seconds.values()):>12.1f}")
    return "\n".join(lines)
