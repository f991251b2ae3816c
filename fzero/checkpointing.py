"""`import fzero.checkpointing`: DeepSpeed's name (`deepspeed.checkpointing`) for
`fzero.compat.checkpointing`; the same module object, handed over as this one is imported."""

import sys

from fzero.compat import checkpointing

sys.modules[__name__] = checkpointing
