"""A plan's wire format: msgpack (no pickle). `to_bytes` writes format 1, a `Plan`
(every checkpoint holds one); `from_bytes` reads it and format 2, the per-kind plans an
earlier fzero wrote for a mesh (`KindPlan`), as the `Plan` they run as. Fields a plan
leaves at their defaults (memory, `OnMesh.optimizer_extra`, ...) are written only when
set, so older plans keep their bytes and digests."""

from __future__ import annotations

from typing import Any

import msgpack

from fzero.partition._manifest import Manifest, TensorSpec
from fzero.partition._mesh import Mesh, MeshError, Sharding, UnitSharding
from fzero.partition._mesh_plan import KindPlan, executable
from fzero.partition._plan import (
    Memory,
    OnMesh,
    Piece,
    Placement,
    Plan,
    PlanError,
    Unit,
)
from fzero.partition._plan import validate as _validate_stage_plan

__all__ = [
    "FORMAT_VERSION",
    "MESH_FORMAT_VERSION",
    "decode_manifest",
    "decode_memory",
    "decode_unit",
    "encode_manifest",
    "encode_memory",
    "encode_unit",
    "from_bytes",
    "to_bytes",
]

FORMAT_VERSION = 1
MESH_FORMAT_VERSION = 2  # an earlier fzero's per-kind plan on a mesh: read, never written


def encode_manifest(manifest: Manifest) -> dict[str, Any]:
    """The manifest as msgpack-ready lists (shared by both plan formats)."""
    return {
        "tensors": [
            [s.fqn, list(s.shape), s.dtype, s.group, list(s.aliases)] for s in manifest.tensors
        ],
        "frozen": list(manifest.frozen),
    }


def encode_unit(unit: Unit) -> dict[str, Any]:
    """One unit as a msgpack-ready dict (shared by both plan formats)."""
    return {
        "name": unit.name,
        "module": unit.module,
        "group": unit.group,
        "dtype": unit.dtype,
        "placements": [
            [p.fqn, [[x.start, x.offset, x.numel] for x in p.pieces]] for p in unit.placements
        ],
        "shard_numel": unit.shard_numel,
        "numel": unit.numel,
        "persistent": unit.persistent,
        **({"bounds": list(unit.bounds)} if unit.bounds else {}),
        **({"stage": unit.stage} if unit.stage is not None else {}),
        **({"optimizer_memory": unit.optimizer_memory} if unit.optimizer_memory else {}),
        **({"params_memory": unit.params_memory} if unit.params_memory else {}),
        **({"states_dtype": unit.states_dtype} if unit.states_dtype else {}),
        **({"grads_dtype": unit.grads_dtype} if unit.grads_dtype else {}),
        **({"master_dtype": unit.master_dtype} if unit.master_dtype else {}),
        **({"shard_axes": list(unit.shard_axes)} if unit.shard_axes is not None else {}),
    }


def decode_manifest(raw: dict[str, Any]) -> Manifest:
    """Inverse of `encode_manifest`."""
    return Manifest(
        tensors=tuple(
            TensorSpec(fqn, tuple(shape), dtype, group, tuple(aliases))
            for fqn, shape, dtype, group, aliases in raw["tensors"]
        ),
        frozen=tuple(raw["frozen"]),
    )


def decode_unit(raw: dict[str, Any]) -> Unit:
    """Inverse of `encode_unit`."""
    return Unit(
        name=raw["name"],
        module=raw["module"],
        group=raw["group"],
        dtype=raw["dtype"],
        placements=tuple(
            Placement(fqn, tuple(Piece(*x) for x in pieces)) for fqn, pieces in raw["placements"]
        ),
        shard_numel=raw["shard_numel"],
        numel=raw["numel"],
        persistent=raw["persistent"],
        bounds=tuple(raw.get("bounds", ())),
        stage=raw.get("stage"),
        optimizer_memory=raw.get("optimizer_memory"),
        params_memory=raw.get("params_memory"),
        states_dtype=raw.get("states_dtype"),
        grads_dtype=raw.get("grads_dtype"),
        master_dtype=raw.get("master_dtype"),
        shard_axes=tuple(raw["shard_axes"]) if "shard_axes" in raw else None,
    )


def _stage_plan_to_bytes(plan: Plan) -> bytes:
    """Serialise a plan with msgpack (no pickle); `from_bytes` inverts it exactly."""
    return msgpack.packb(
        {
            "format": FORMAT_VERSION,
            "manifest": encode_manifest(plan.manifest),
            "world_size": plan.world_size,
            "stage": plan.stage,
            "alignment": plan.alignment,
            "strategy": plan.strategy,
            "units": [encode_unit(u) for u in plan.units],
            **({"mesh": _encode_on_mesh(plan.mesh)} if plan.mesh is not None else {}),
            **encode_memory(plan.memory),
        }
    )


def encode_memory(memory: Memory) -> dict[str, Any]:
    """`{"memory": {...}}` for a plan that says where its states live, else `{}`: a plan
    at the defaults keeps the bytes (and digest) it had before plans said so."""
    if memory == Memory():
        return {}
    said = [memory.params, memory.optimizer, memory.master, memory.states]
    if memory.grads != Memory().grads:  # written only when said: older bytes unchanged
        said.append(memory.grads)
    return {"memory": said}


def decode_memory(raw: dict[str, Any]) -> Memory:
    """Inverse of `encode_memory` (on the plan's whole msgpack dict)."""
    return Memory(*raw["memory"]) if "memory" in raw else Memory()


def _encode_on_mesh(mesh: OnMesh) -> dict[str, Any]:
    return {
        "axes": [list(axis) for axis in mesh.axes],
        "shard": list(mesh.shard),
        "secondary": list(mesh.secondary),
        "preset": mesh.preset,
        **({"hierarchical": True} if mesh.hierarchical else {}),
        **({"optimizer_extra": list(mesh.optimizer_extra)} if mesh.optimizer_extra else {}),
    }


def _decode_on_mesh(raw: dict[str, Any] | None) -> OnMesh | None:
    if raw is None:
        return None
    return OnMesh(
        tuple((name, size) for name, size in raw["axes"]),
        tuple(raw["shard"]),
        tuple(raw["secondary"]),
        raw["preset"],
        bool(raw.get("hierarchical", False)),
        tuple(raw.get("optimizer_extra", ())),
    )


def from_bytes(data: bytes) -> Plan:
    """Read a plan written by `to_bytes` (format 1), or a plan said per kind on a mesh
    that an earlier fzero wrote (format 2) as the `Plan` it runs as; raise `PlanError`
    on any other input."""
    try:
        raw = msgpack.unpackb(data)
        version = raw.get("format")
        if version == MESH_FORMAT_VERSION:
            return _from_kind_bytes(raw)
        if version != FORMAT_VERSION:
            raise PlanError(f"plan format {version!r}; this fzero reads 1 and 2")
        plan = Plan(
            manifest=decode_manifest(raw["manifest"]),
            world_size=raw["world_size"],
            stage=raw["stage"],
            alignment=raw["alignment"],
            units=tuple(decode_unit(u) for u in raw["units"]),
            strategy=raw["strategy"],
            mesh=_decode_on_mesh(raw.get("mesh")),
            memory=decode_memory(raw),
        )
    except (PlanError, MeshError):
        raise
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as error:
        raise PlanError(f"bytes are not an fzero plan: {error!r}") from error
    return _validate_stage_plan(plan)


def _decode_sharding(raw: list[list[str]] | None) -> Sharding | None:
    return None if raw is None else Sharding(tuple(raw[0]), tuple(raw[1]))


def to_bytes(plan: Plan) -> bytes:
    """Serialise a plan with msgpack (no pickle), as format 1 (what `from_bytes` reads)."""
    if not isinstance(plan, Plan):
        raise PlanError(f"plan is a {type(plan).__name__}; expected a partition.Plan")
    return _stage_plan_to_bytes(plan)


def _from_kind_bytes(raw: dict[str, Any]) -> Plan:
    """A format-2 plan (units on every process of a mesh, each kind's split) as the plan
    it runs as (`executable`)."""
    plan = KindPlan(
        manifest=decode_manifest(raw["manifest"]),
        mesh=Mesh((name, size) for name, size in raw["mesh"]),
        alignment=raw["alignment"],
        units=tuple(decode_unit(u) for u in raw["units"]),
        shardings=tuple(
            UnitSharding(
                params=_decode_sharding(s["params"]),
                grads=_decode_sharding(s["grads"]),
                optimizer=_decode_sharding(s["optimizer"]),
                params_secondary=_decode_sharding(s["params_secondary"]),
                hierarchical_params_gather=s["hierarchical_params_gather"],
            )
            for s in raw["shardings"]
        ),
        strategy=raw["strategy"],
        preset=raw["preset"],
        memory=decode_memory(raw),
    )
    return executable(plan)
