"""What `import deepspeed` gives under `fzero.compat.install()` / `fzero run --as-deepspeed`.

The names DeepSpeed training scripts use, served by fzero: `initialize`,
`init_distributed`, `add_config_arguments`, `DeepSpeedEngine`, `zero`, `comm`,
`accelerator`, `checkpointing`, `utils.logger`, `ops.adam`, `runtime.engine`,
`runtime.lr_schedules`. `deepspeed.moe` and
`deepspeed.pipe` are not supported and say so when imported.
"""

from __future__ import annotations

from fzero import checkpointing, zero
from fzero._arguments import add_config_arguments
from fzero._version import __version__ as _fzero_version
from fzero.api import initialize
from fzero.compat.deepspeed import accelerator, comm, runtime, utils
from fzero.compat.deepspeed.comm import init_distributed
from fzero.engine import Engine as DeepSpeedEngine

# The DeepSpeed API level fzero follows, and what it really is.
__version__ = f"0.16.0+fzero.{_fzero_version}"
__version_major__, __version_minor__, __version_patch__ = 0, 16, 0

__all__ = [
    "DeepSpeedEngine",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "runtime",
    "utils",
    "zero",
]
