"""`deepspeed.moe`: Mixture of Experts is not supported by fzero (an error on import)."""

raise ImportError(
    "deepspeed.moe (Mixture of Experts, expert parallelism) is not supported by fzero; "
    "fzero shards data-parallel training only (ZeRO stages 0-3)"
)
