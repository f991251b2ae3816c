"""The dtypes a run computes and accumulates in: `fp16` (with its loss scale), `bf16`
(and bf16 masters and optimizer states), `torch_autocast` and `data_types`, with
DeepSpeed's keys and defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fzero.config._base import Section, no_effect

__all__ = ["BF16Config", "DataTypesConfig", "FP16Config", "TorchAutocastConfig"]


@dataclass(frozen=True, kw_only=True)
class FP16Config(Section):
    """fp16 compute over fp32 masters, with a loss scale: a step whose gradients overflow
    is skipped and the dynamic scale lowered (DeepSpeed's `DynamicLossScaler`)."""

    enabled: bool = False
    """Compute in fp16."""
    loss_scale: float = 0.0
    """0 means dynamic loss scaling; any other value is a static scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """The dynamic scale doubles after this many steps without an overflow."""
    hysteresis: int = 2
    """The dynamic scale halves at the hysteresis-th overflow since it last grew (every
    overflowing step is skipped either way)."""
    consecutive_hysteresis: bool = False
    """Restore the hysteresis budget after every step without an overflow (not only when
    the scale grows)."""
    min_loss_scale: float = 1.0
    """The dynamic scale never goes below this; an overflow there, with the hysteresis
    spent, stops training with `LossScaleError`."""


@dataclass(frozen=True, kw_only=True)
class BF16Config(Section):
    """bf16 compute over fp32 masters, or bf16 masters and optimizer states."""

    enabled: bool = False
    """Compute in bf16 (no loss scale needed)."""
    check_grad_overflow: bool = True
    """At ZeRO stages 1-2, a step whose gradients are not finite (inf or NaN) is skipped
    (counted in `skipped_steps`, the weights, optimizer state and lr schedule as they
    were), as DeepSpeed 0.19.8's default; false applies it. At stages 0 and 3 such a step
    is always skipped, as DeepSpeed's (`fzero.core.update.skips_nonfinite`)."""
    bf16_master_weights_and_grads: bool = False
    """Master weights in bf16: in memory they are the bf16 parameters themselves (held
    once, no fp32 copy), in the NVMe swap file 2 bytes per element; each update runs in
    fp32 and rounds the new weights back stochastically (the same bits in memory and in
    the file). Gradients are still reduced and accumulated in fp32 (fzero's accuracy
    choice: 4 B per element of this rank's gradient partition)."""
    bf16_optimizer_states: bool = False
    """The optimizer's moments (Adam's exp_avg and exp_avg_sq, SGD's momentum) kept in
    bf16 where they rest between steps — in memory, or in the NVMe swap file — and
    stochastically rounded after each update, which runs in fp32 (two bytes per moment
    per parameter instead of four). DeepSpeed asks for bf16 masters with it; fzero also
    takes it over fp32 masters."""


@dataclass(frozen=True, kw_only=True)
class TorchAutocastConfig(Section):
    """DeepSpeed's `torch_autocast`: the forward under `torch.autocast` (over fp32
    parameters, or with `bf16` enabled over bf16 ones, as DeepSpeed allows)."""

    enabled: bool = False
    """Run the forward under `torch.autocast`."""
    dtype: Literal[
        "bfloat16", "bf16", "torch.bfloat16", "float16", "fp16", "half", "torch.float16"
    ] = "bfloat16"
    """bfloat16 is supported; float16 would need a gradient scaler (not supported yet)."""
    lower_precision_safe_modules: list[str] | None = no_effect(  # noqa: RUF009 (a field)
        None,
        "DeepSpeed reduces these modules' gradients in the low dtype; fzero reduces all "
        "gradients in fp32 (the same or better accuracy)",
    )


@dataclass(frozen=True, kw_only=True)
class DataTypesConfig(Section):
    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    """The dtype gradients are summed in across micro-steps and held until the update:
    null or "fp32" (fzero's default at every precision), or the compute dtype ("bf16"
    with `bf16.enabled`, "fp16" with `fp16.enabled`): half the accumulators' bytes, each
    micro-step's reduced gradient rounded into the sum, as DeepSpeed's ZeRO accumulates
    in the model's dtype. The plan's `memory.grads` says the same. A half dtype other
    than the compute dtype is refused by name (DeepSpeed's ZeRO ignores it there, and
    refuses it without ZeRO); so is "fp16" with the optimizer on NVMe at stages 2-3 (the
    swap file holds fp32 or bf16 accumulators: "bf16" halves their bytes there too)."""
