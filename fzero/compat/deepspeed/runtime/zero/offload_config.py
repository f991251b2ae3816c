"""`deepspeed.runtime.zero.offload_config`: `OffloadDeviceEnum`, the offload devices
DeepSpeed's memory estimators name in their tables (`stage3`, `stage_1_and_2`)."""

from __future__ import annotations

import enum

__all__ = ["OffloadDeviceEnum"]


class OffloadDeviceEnum(str, enum.Enum):
    """Where `offload_param` / `offload_optimizer` put states: DeepSpeed's values.

    A `str` mixin, as DeepSpeed's: formatted (`f"{OffloadDeviceEnum.cpu:4}"`, as the
    estimators do) it reads `cpu ` before Python 3.11 and `OffloadDeviceEnum.cpu` from
    3.11 on; being this same kind of enum, fzero's tables print what DeepSpeed's do on
    either."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"
