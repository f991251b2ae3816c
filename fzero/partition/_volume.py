"""Communication volume of a plan: which collectives one optimizer step issues, how many,
and how many bytes they move — a pure function of the plan and the run's settings, for
comparing plans before running them (and checked against what a run sends:
`fzero.comm.traffic`, `tests/test_comm_volume.py`).

A collective's `bytes` is its whole buffer (an all-gather's output, a reduce-scatter's
input, an all-reduce's tensor). What one rank puts on the wire with ring algorithms is
`wire_bytes`: (W-1)/W of that for an all-gather or reduce-scatter, twice it for an
all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fzero.partition._manifest import dtype_of
from fzero.partition._plan import Plan, PlanError
from fzero.partition._queries import reduction_buckets

__all__ = ["Collective", "comm_volume", "format_comm_volume"]

_GRAD_BYTES = 4  # gradients are reduced in fp32 at every precision


@dataclass(frozen=True)
class Collective:
    """One kind of collective a step issues over all ranks of the plan: `operation`
    (`all_reduce`, `reduce_scatter`, `all_gather`), `what` it moves, its `calls` and
    `bytes` per optimizer step."""

    operation: str
    what: str
    calls: int
    bytes: int
    world_size: int

    @property
    def wire_bytes(self) -> int:
        """Bytes one rank sends per step with ring algorithms."""
        share = self.bytes * (self.world_size - 1) // self.world_size
        return 2 * share if self.operation == "all_reduce" else share


_QUANT_BLOCK = 256  # elements per fp32 scale of a quantized collective (fzero.core.quantize)


def comm_volume(
    plan: Plan,
    *,
    accumulation_steps: int = 1,
    param_dtype: str = "float32",
    bucket_numel: int = 500_000_000,
    scatter_as_all_reduce: bool = False,
    regathered: Iterable[int] = (),
    loss_scaling: bool = False,
    optimizer: str = "adam",
    quantized_weights: bool = False,
    quantized_gradients: bool = False,
) -> list[Collective]:
    """The collectives one optimizer step of the engine issues under `plan`.

    - gradients: stages 0-1 all-reduce each bucket (`bucket_numel`, the config's
      `reduce_bucket_size`) once per step; stages 2-3 every micro-step, each unit
      reduce-scattered, or each bucket all-reduced with `scatter_as_all_reduce` (what
      fzero does on gloo, where it measured faster);
    - parameters: stages 1-2 (and stage 3's persistent units) all-gather each unit
      after the update; stage 3 gathers each other unit once per micro-step in forward,
      and again in backward for the units in `regathered` (those released between, by
      `stage3_max_reuse_distance` or `stage3_max_live_parameters`; the engine's
      `comm_volume()` fills it from its recorded use order);
    - control: the global gradient norm (8 bytes), the fp16 overflow flag with dynamic
      `loss_scaling`, LAMB's per-tensor norms (`optimizer="lamb"`), and the engine's check
      for gradients left by other passes (4 bytes, per micro-step at stages 2-3, per step
      at 0-1).

    `quantized_weights` (qwZ, `zero_quantized_weights`): stage 3's forward and backward
    gathers travel as int8 codes in blocks of 256 plus one fp32 scale per block: two
    all-gathers per unit, 1.016 bytes per element. `quantized_gradients` (qgZ,
    stages 2-3): each bucket's reduction is two all-to-alls (codes and scales) of the
    bucket's int8 blocks, every micro-step.

    A world of 1 issues nothing. A step an fp16 overflow skips sends neither the norm
    nor new parameters.
    """
    if accumulation_steps < 1:
        raise PlanError(f"accumulation_steps is {accumulation_steps}; it must be >= 1")
    world, stage, steps = plan.world_size, plan.stage, accumulation_steps
    if world == 1:
        return []
    param_bytes = dtype_of(param_dtype).itemsize
    units = plan.units
    total = sum(u.numel for u in units)
    rows: list[Collective] = []

    def add(operation: str, what: str, calls: int, size: int) -> None:
        if calls:
            rows.append(Collective(operation, what, calls, size, world))

    buckets = reduction_buckets(plan, bucket_numel)
    if stage < 2:
        add("all_reduce", "gradients", len(buckets), total * _GRAD_BYTES)
    elif quantized_gradients:
        # one row of blocks per rank: every unit's shard of that rank, concatenated
        per_rank = [sum(units[i].shard_numel for i in bucket) for bucket in buckets]
        size = sum(-(-n // _QUANT_BLOCK) * world * (_QUANT_BLOCK + 4) for n in per_rank)
        add("all_to_all", "gradients (int8)", 2 * len(buckets) * steps, size * steps)
    elif scatter_as_all_reduce:
        add("all_reduce", "gradients", len(buckets) * steps, total * _GRAD_BYTES * steps)
    else:
        add("reduce_scatter", "gradients", len(units) * steps, total * _GRAD_BYTES * steps)
    sharded = [u for u in units if stage == 3 and not u.persistent]
    whole = [u for u in units if stage in (1, 2) or (stage == 3 and u.persistent)]
    add(
        "all_gather",
        "parameters after the update",
        len(whole),
        sum(u.numel for u in whole) * param_bytes,
    )
    again = [units[i] for i in sorted(set(regathered))]
    if any(stage != 3 or u.persistent for u in again):
        raise PlanError("regathered names units stage 3 does not gather (persistent, or stage < 3)")
    for what, gathered in (("parameters for forward", sharded), ("parameters for backward", again)):
        if quantized_weights:
            blocks = [-(-u.shard_numel // _QUANT_BLOCK) * world for u in gathered]
            size = sum(b * (_QUANT_BLOCK + 4) for b in blocks) * steps
            add("all_gather", what + " (int8)", 2 * len(gathered) * steps, size)
        else:
            size = sum(u.numel for u in gathered) * param_bytes * steps
            add("all_gather", what, len(gathered) * steps, size)
    add("all_reduce", "gradient norm", 1, 8)
    if loss_scaling:
        add("all_reduce", "fp16 overflow flag", 1, 4)
    if optimizer == "lamb":
        add("all_reduce", "LAMB tensor norms", 1, 2 * len(plan.manifest.tensors) * 8)
    checks = steps if stage >= 2 else 1
    add("all_reduce", "left-over gradients check", checks, 4 * checks)
    return rows


def format_comm_volume(rows: list[Collective]) -> str:
    """A table of `comm_volume`'s rows, with totals by operation."""
    lines = [f"{'operation':<15}{'what':<32}{'calls':>7}{'bytes':>15}{'wire bytes':>15}"]
    for r in rows:
        lines.append(f"{r.operation:<15}{r.what:<32}{r.calls:>7}{r.bytes:>15,}{r.wire_bytes:>15,}")
    total = sum(r.bytes for r in rows)
    wire = sum(r.wire_bytes for r in rows)
    lines.append(f"{'total':<47}{sum(r.calls for r in rows):>7}{total:>15,}{wire:>15,}")
    return "\n".join(lines)
