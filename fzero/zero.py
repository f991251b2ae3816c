"""`import fzero.zero`: DeepSpeed's name (`deepspeed.zero`) for
`fzero.compat.zero`; the same module object, handed over as this one is imported."""

import sys

from fzero.compat import zero

sys.modules[__name__] = zero
