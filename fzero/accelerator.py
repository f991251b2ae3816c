"""`import fzero.accelerator`: DeepSpeed's name (`deepspeed.accelerator`) for
`fzero.compat.accelerator`; the same module object, handed over as this one is imported."""

import sys

from fzero.compat import accelerator

sys.modules[__name__] = accelerator
