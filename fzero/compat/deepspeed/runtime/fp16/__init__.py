"""`deepspeed.runtime.fp16`: `loss_scaler`, DeepSpeed's loss-scaler classes (scripts
name `LossScaler` among torch's safe globals for loading checkpoints)."""

from fzero.compat.deepspeed.runtime.fp16 import loss_scaler

__all__ = ["loss_scaler"]
