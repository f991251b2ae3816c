"""`deepspeed.utils`: the names clients import from it, served by fzero or refused.

Served: `logger`, `log_dist` (and the `logging` submodule Lightning sets the level
through), `OnDevice` (`init_on_device`), `zero_to_fp32`, the `safe_get_full_*` /
`safe_set_full_*` tensor accessors, the ZeRO-3 leaf-module flags, `groups` (data
parallel), `is_initialized`, `timer` (DeepSpeed's timers). Refused by name when called:
the local-shard and gradient-setting accessors, and every group that is not data
parallel.
"""

from __future__ import annotations

from fzero.comm import is_initialized
from fzero.compat.deepspeed.utils import (
    groups,
    init_on_device,
    logging,
    tensor_fragment,
    timer,
    zero_to_fp32,
)
from fzero.compat.deepspeed.utils.init_on_device import OnDevice
from fzero.compat.deepspeed.utils.logging import log_dist, logger
from fzero.compat.deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from fzero.compat.deepspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "OnDevice",
    "get_z3_leaf_modules",
    "groups",
    "init_on_device",
    "is_initialized",
    "log_dist",
    "logger",
    "logging",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "tensor_fragment",
    "timer",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_to_fp32",
]
