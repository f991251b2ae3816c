"""Functional optimizers, schedules, loss scaling and clipping math — all pure.

opt = fzero.optim.adamw(lr=1e-3, weight_decay=0.01)
state = opt.init(params)                     # a tensor, or any pytree of tensors
params, state = opt.update(grads, state, params, lr=schedule(step, 1e-3))
"""

from fzero.optim._adam import (
    AdamHParams,
    AdamState,
    adam,
    adam_init,
    adam_update,
    adam_update_,
    adamw,
)
from fzero.optim._base import Optimizer, with_overrides
from fzero.optim._clip import clip_coefficient, global_norm
from fzero.optim._lamb import (
    LambHParams,
    LambState,
    lamb,
    lamb_apply_,
    lamb_direction_,
    lamb_init,
    lamb_update,
    lamb_update_,
    segment_sq_sums,
    trust_ratio,
)
from fzero.optim._loss_scale import (
    DynamicLossScale,
    LossScaleError,
    LossScaleState,
    StaticLossScale,
)
from fzero.optim._muon import MuonHParams, MuonState, muon
from fzero.optim._registry import (
    OPTIMIZER_PARAMS,
    OPTIMIZERS,
    SCHEDULE_PARAMS,
    SCHEDULES,
    optimizer_from_name,
    schedule_from_name,
)
from fzero.optim._rounding import bf16_stochastic
from fzero.optim._schedules import (
    LRRangeTest,
    OneCycle,
    Schedule,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupExpDecayExp,
    WarmupLR,
    constant,
)
from fzero.optim._sgd import SgdHParams, SgdState, sgd, sgd_init, sgd_update, sgd_update_

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_PARAMS",
    "SCHEDULES",
    "SCHEDULE_PARAMS",
    "AdamHParams",
    "AdamState",
    "DynamicLossScale",
    "LRRangeTest",
    "LambHParams",
    "LambState",
    "LossScaleError",
    "LossScaleState",
    "MuonHParams",
    "MuonState",
    "OneCycle",
    "Optimizer",
    "Schedule",
    "SgdHParams",
    "SgdState",
    "StaticLossScale",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupExpDecayExp",
    "WarmupLR",
    "adam",
    "adam_init",
    "adam_update",
    "adam_update_",
    "adamw",
    "bf16_stochastic",
    "clip_coefficient",
    "constant",
    "global_norm",
    "lamb",
    "lamb_apply_",
    "lamb_direction_",
    "lamb_init",
    "lamb_update",
    "lamb_update_",
    "muon",
    "optimizer_from_name",
    "schedule_from_name",
    "segment_sq_sums",
    "sgd",
    "sgd_init",
    "sgd_update",
    "sgd_update_",
    "trust_ratio",
    "with_overrides",
]
