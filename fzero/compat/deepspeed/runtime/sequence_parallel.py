"""`deepspeed.runtime.sequence_parallel`: sequence parallelism (Ulysses, ALST) is not
supported by fzero (an error on import)."""

raise ImportError(
    "deepspeed.runtime.sequence_parallel (Ulysses/ALST sequence parallelism) is not "
    "supported by fzero; fzero shards data-parallel training only (ZeRO stages 0-3)"
)
