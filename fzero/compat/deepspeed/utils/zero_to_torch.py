"""`deepspeed.utils.zero_to_torch`: DeepSpeed's command line converting a ZeRO checkpoint to
float32, float16 or bfloat16 weights (`--dtype`), over fzero checkpoints
(`zero_to_fp32.convert_zero_checkpoint_to_state_dict`): `python -m
fzero.compat.deepspeed.utils.zero_to_torch checkpoint_dir output_dir --dtype bf16`."""

from __future__ import annotations

from fzero.compat.deepspeed.utils import zero_to_fp32

__all__ = ["main", "zero_to_fp32"]


def main(args: list[str] | None = None) -> None:
    """DeepSpeed's `zero_to_torch.py` command line."""
    zero_to_fp32.main(args, with_dtype=True)


if __name__ == "__main__":
    main()
