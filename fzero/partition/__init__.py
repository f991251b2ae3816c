"""Sharding plans as plain data: pure functions, no process group, no I/O.

manifest = describe(model)                       # works on the meta device
p = plan(manifest, world_size=4, stage=3)        # or strategy=per_tensor_dim0 / your own
local_slices(p, rank=1); memory_per_rank(p, 1, param_dtype="bfloat16")
"""

from fzero.partition._manifest import Manifest, TensorSpec, describe, dtype_name, dtype_of
from fzero.partition._plan import (
    Piece,
    Placement,
    Plan,
    PlanError,
    Unit,
    from_bytes,
    to_bytes,
    validate,
)
from fzero.partition._plot import plot_plan
from fzero.partition._queries import (
    LocalSlice,
    MemoryEstimate,
    Read,
    format_plan,
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
)
from fzero.partition._volume import Collective, comm_volume, format_comm_volume

__all__ = [
    "BUILT_IN",
    "DEFAULT_ALIGNMENT",
    "Collective",
    "LocalSlice",
    "Manifest",
    "MemoryEstimate",
    "Piece",
    "Placement",
    "Plan",
    "PlanError",
    "Read",
    "Strategy",
    "TensorSpec",
    "Unit",
    "UnitGroup",
    "comm_volume",
    "describe",
    "dtype_name",
    "dtype_of",
    "flat_even",
    "format_comm_volume",
    "format_plan",
    "from_bytes",
    "group_units",
    "local_slices",
    "memory_per_rank",
    "module_key",
    "optimizer_state_slots",
    "owned_numel",
    "owner_of",
    "per_tensor_dim0",
    "plan",
    "plot_plan",
    "reduction_buckets",
    "reshard_reads",
    "strategy_from_name",
    "to_bytes",
    "validate",
]
