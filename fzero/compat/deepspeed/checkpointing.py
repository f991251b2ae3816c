"""`deepspeed.checkpointing`: activation checkpointing, `fzero.compat.checkpointing`
itself, handed over as this module is imported; as in DeepSpeed, where it is one module
with `deepspeed.runtime.activation_checkpointing.checkpointing`, the three names (and
the `deepspeed.checkpointing` attribute) are one module object."""

import sys

from fzero.compat import checkpointing

sys.modules[__name__] = checkpointing
