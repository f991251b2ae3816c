"""A plan's fingerprint: what ranks compare to know they run the same plan.

A plan is a value, so every rank of a run must hold an equal one: a strategy that
decides from something rank-local (a timing, a profile, a random draw, an environment
variable) can return different plans on different ranks, whose collectives may still
have equal sizes and pair silently with the wrong data. `plan_digest` is one short
string per plan; `plan_parts` splits a plan into named parts (its header, its manifest,
each unit) with a digest each, so the first part that differs can be named, and
`part_fields` gives that part's fields as text, so the field that differs can be shown
with each rank's value. Pure: no process group (`fzero.core.groups.check_same_plan`
compares them across ranks).
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import msgpack

from fzero.partition._mesh import KINDS
from fzero.partition._plan import Plan
from fzero.partition._wire import encode_manifest, encode_memory, encode_unit
from fzero.partition._wire import to_bytes as _to_bytes

__all__ = ["PlanPart", "part_fields", "plan_digest", "plan_parts"]


class PlanPart(NamedTuple):
    """One named part of a plan and the digest of its encoding."""

    name: str
    digest: str


def _hex(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def plan_digest(plan: Plan) -> str:
    """A 32-character digest of `plan`'s msgpack encoding: equal plans, equal digests."""
    return _hex(_to_bytes(plan))


def _encoded_parts(plan: Plan) -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan is a {type(plan).__name__}; expected a partition.Plan")
    mesh = plan.mesh
    header = {
        "world_size": plan.world_size,
        "stage": plan.stage,
        "alignment": plan.alignment,
        "strategy": plan.strategy,
        "preset": None if mesh is None else mesh.preset,
        "units": len(plan.units),
        "mesh": None if mesh is None else [[list(a) for a in mesh.axes], list(mesh.shard)],
        "secondary": None if mesh is None else list(mesh.secondary),
        "hierarchical": None if mesh is None else mesh.hierarchical,
        "optimizer_extra": None if mesh is None else list(mesh.optimizer_extra),
        "memory": list(encode_memory(plan.memory).get("memory", ())),
    }
    parts = [("the plan's header", header), ("the manifest", encode_manifest(plan.manifest))]
    for index, unit in enumerate(plan.units):
        fields = encode_unit(unit)
        sharding = plan.sharding_of(unit)  # each kind's axes, as the message names them
        for kind in KINDS:
            of = sharding.of(kind)
            fields[f"{kind} split over"] = None if of is None else list(of.shard)
        parts.append((f"unit {index} ({unit.name!r}, module {unit.module!r})", fields))
    return parts


def plan_parts(plan: Plan) -> tuple[PlanPart, ...]:
    """`plan` as named parts in a fixed order — its header (world size, stage, mesh,
    strategy, unit count, memory), its manifest, then each unit — each with a digest."""
    return tuple(
        PlanPart(name, _hex(msgpack.packb(fields))) for name, fields in _encoded_parts(plan)
    )


def part_fields(plan: Plan, index: int) -> dict[str, str]:
    """Part `index` of `plan_parts(plan)` as field name -> its value as text (long values
    shortened to their first and last 60 characters)."""
    parts = _encoded_parts(plan)
    if not 0 <= index < len(parts):
        return {"(part)": f"absent: the plan has {len(parts)} parts"}
    return {key: _short(repr(value)) for key, value in parts[index][1].items()}


def _short(text: str, keep: int = 60) -> str:
    return text if len(text) <= 2 * keep + 5 else f"{text[:keep]} ... {text[-keep:]}"
