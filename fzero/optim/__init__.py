"""Functional optimizers, schedules, loss scaling and clipping math — all pure.

opt = fzero.optim.adamw(lr=1e-3, weight_decay=0.01)
state = opt.init(params)                     # a tensor, or any pytree of tensors
params, state = opt.update(grads, state, params, lr=schedule(step, 1e-3))

An optimizer declares what its update needs across shards (`TensorNorms`,
`WholeTensors`, or nothing) and its native kernels (`NativeKernel`); the core
dispatches on those, so one written outside fzero is treated as a built-in one.
"""

from fzero.optim._adagrad import (
    AdagradHParams,
    AdagradState,
    adagrad,
    adagrad_init,
    adagrad_native,
    adagrad_update,
    adagrad_update_,
)
from fzero.optim._adam import (
    AdamHParams,
    AdamState,
    adam,
    adam_init,
    adam_native,
    adam_update,
    adam_update_,
    adamw,
)
from fzero.optim._base import (
    NativeKernel,
    Needs,
    Optimizer,
    TensorNorms,
    WholeTensors,
    with_overrides,
)
from fzero.optim._clip import clip_coefficient, global_norm
from fzero.optim._lamb import (
    LambHParams,
    LambState,
    lamb,
    lamb_apply_,
    lamb_direction_,
    lamb_init,
    lamb_native,
    lamb_step_hparams,
    lamb_update,
    lamb_update_,
    segment_sq_sums,
    trust_ratio,
)
from fzero.optim._lion import (
    LionHParams,
    LionState,
    lion,
    lion_init,
    lion_native,
    lion_sign,
    lion_update,
    lion_update_,
)
from fzero.optim._loss_scale import (
    DynamicLossScale,
    LossScaleError,
    LossScaleState,
    StaticLossScale,
)
from fzero.optim._muon import MuonHParams, MuonState, muon, muon_needs
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
from fzero.optim._sgd import (
    SgdHParams,
    SgdState,
    sgd,
    sgd_init,
    sgd_native,
    sgd_update,
    sgd_update_,
)

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_PARAMS",
    "SCHEDULES",
    "SCHEDULE_PARAMS",
    "AdagradHParams",
    "AdagradState",
    "AdamHParams",
    "AdamState",
    "DynamicLossScale",
    "LRRangeTest",
    "LambHParams",
    "LambState",
    "LionHParams",
    "LionState",
    "LossScaleError",
    "LossScaleState",
    "MuonHParams",
    "MuonState",
    "NativeKernel",
    "Needs",
    "OneCycle",
    "Optimizer",
    "Schedule",
    "SgdHParams",
    "SgdState",
    "StaticLossScale",
    "TensorNorms",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupExpDecayExp",
    "WarmupLR",
    "WholeTensors",
    "adagrad",
    "adagrad_init",
    "adagrad_native",
    "adagrad_update",
    "adagrad_update_",
    "adam",
    "adam_init",
    "adam_native",
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
    "lamb_native",
    "lamb_step_hparams",
    "lamb_update",
    "lamb_update_",
    "lion",
    "lion_init",
    "lion_native",
    "lion_sign",
    "lion_update",
    "lion_update_",
    "muon",
    "muon_needs",
    "optimizer_from_name",
    "schedule_from_name",
    "segment_sq_sums",
    "sgd",
    "sgd_init",
    "sgd_native",
    "sgd_update",
    "sgd_update_",
    "trust_ratio",
    "with_overrides",
]
