"""Sharding plans as plain data: pure functions, no process group, no I/O.

manifest = describe(model)                       # works on the meta device
p = plan(manifest, world_size=4, stage=3)        # or strategy=per_tensor_dim0 / your own
local_slices(p, rank=1); memory_per_rank(p, 1, param_dtype="bfloat16")
m = mesh_plan(manifest, Mesh({"node": 2, "local": 2}), "mics")  # or "hpz", "zero3", Custom
print(format_plan(m)); comm_volume(m)                # per kind: the axes; per axis: bytes
comm_time(m, links={"node": "25Gbps", "local": "400GBps"})  # modelled seconds per step
"""

from fzero.partition._digest import PlanPart, part_fields, plan_digest, plan_parts
from fzero.partition._manifest import (
    Manifest,
    TensorSpec,
    describe,
    dtype_name,
    dtype_of,
    leaf_modules,
)
from fzero.partition._mesh import KINDS, Mesh, MeshError, Sharding, UnitSharding
from fzero.partition._mesh_plan import (
    MeshPlan,
    executable,
    from_plan,
    mesh_plan_from_bytes,
    process_groups,
    stage_shardings,
    to_bytes,
    to_plan,
    validate,
)
from fzero.partition._plan import OnMesh, Piece, Placement, Plan, PlanError, Unit, from_bytes
from fzero.partition._plot import plot_plan
from fzero.partition._presets import (
    PRESETS,
    Custom,
    HpZ,
    MiCS,
    Preset,
    Zero,
    from_zero_config,
    mesh_plan,
    preset_from_name,
)
from fzero.partition._queries import (
    LocalSlice,
    MemoryEstimate,
    Read,
    format_plan,
    kind_slices,
    local_slices,
    memory_per_rank,
    optimizer_state_slots,
    owned_numel,
    owner_of,
    reduction_buckets,
    reshard_reads,
)
from fzero.partition._strategies import (
    BUILT_IN,
    DEFAULT_ALIGNMENT,
    Strategy,
    UnitGroup,
    flat_even,
    group_units,
    module_key,
    per_tensor_dim0,
    plan,
    strategy_from_name,
    whole_tensors,
)
from fzero.partition._time import AxisTime, Link, comm_time, format_comm_time, parse_link
from fzero.partition._volume import Collective, comm_volume, format_comm_volume, volume_by_axes

__all__ = [
    "BUILT_IN",
    "DEFAULT_ALIGNMENT",
    "KINDS",
    "PRESETS",
    "AxisTime",
    "Collective",
    "Custom",
    "HpZ",
    "Link",
    "LocalSlice",
    "Manifest",
    "MemoryEstimate",
    "Mesh",
    "MeshError",
    "MeshPlan",
    "MiCS",
    "OnMesh",
    "Piece",
    "Placement",
    "Plan",
    "PlanError",
    "PlanPart",
    "Preset",
    "Read",
    "Sharding",
    "Strategy",
    "TensorSpec",
    "Unit",
    "UnitGroup",
    "UnitSharding",
    "Zero",
    "comm_time",
    "comm_volume",
    "describe",
    "dtype_name",
    "dtype_of",
    "executable",
    "flat_even",
    "format_comm_time",
    "format_comm_volume",
    "format_plan",
    "from_bytes",
    "from_plan",
    "from_zero_config",
    "group_units",
    "kind_slices",
    "leaf_modules",
    "local_slices",
    "memory_per_rank",
    "mesh_plan",
    "mesh_plan_from_bytes",
    "module_key",
    "optimizer_state_slots",
    "owned_numel",
    "owner_of",
    "parse_link",
    "part_fields",
    "per_tensor_dim0",
    "plan",
    "plan_digest",
    "plan_parts",
    "plot_plan",
    "preset_from_name",
    "process_groups",
    "reduction_buckets",
    "reshard_reads",
    "stage_shardings",
    "strategy_from_name",
    "to_bytes",
    "to_plan",
    "validate",
    "volume_by_axes",
    "whole_tensors",
]
