"""The scripts DeepSpeed copies into a save directory beside its checkpoints
(`zero_to_fp32.py`, `zero_to_torch.py`: `python zero_to_fp32.py . out_dir` converts the
checkpoint without the training script), as fzero writes them: each runs
`fzero.compat.deepspeed.utils.zero_to_fp32`'s command line, so fzero must be installed
where it runs, and `import zero_to_fp32` from the directory gives that module's functions,
as DeepSpeed's copy does."""

from __future__ import annotations

import os

__all__ = ["RECOVERY_SCRIPTS", "write_recovery_scripts"]

_MODULE = "fzero.compat.deepspeed.utils.zero_to_fp32"

# name: (the dtypes it writes, its code)
RECOVERY_SCRIPTS = {
    "zero_to_fp32.py": (
        "fp32",
        f"from {_MODULE} import *  # noqa: F403\nfrom {_MODULE} import main\n\n"
        'if __name__ == "__main__":\n    main()\n',
    ),
    "zero_to_torch.py": (
        "float32, float16 or bfloat16 (--dtype)",
        f'from {_MODULE} import main\n\nif __name__ == "__main__":\n    main(with_dtype=True)\n',
    ),
}


def _text(name: str) -> str:
    dtypes, code = RECOVERY_SCRIPTS[name]
    return (
        "#!/usr/bin/env python\n"
        f'"""The model of a ZeRO checkpoint in this directory as {dtypes} safetensors, as\n'
        "DeepSpeed's script of this name converts it; written by fzero, which runs it:\n"
        f"python {name} CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--max_shard_size 5GB]\n"
        '[--exclude_frozen_parameters]"""\n\n' + code
    )


def write_recovery_scripts(save_dir: str) -> list[str]:
    """Write `RECOVERY_SCRIPTS` into `save_dir`, executable (DeepSpeed's
    `_copy_recovery_script`, which its engine runs on rank 0 with each ZeRO or bf16
    checkpoint); returns their paths."""
    written = []
    for name in RECOVERY_SCRIPTS:
        path = os.path.join(save_dir, name)
        with open(path, "w") as f:
            f.write(_text(name))
        os.chmod(path, os.stat(path).st_mode | 0o111)
        written.append(path)
    return written
