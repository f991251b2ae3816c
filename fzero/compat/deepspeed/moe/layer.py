"""`deepspeed.moe.layer`: Mixture of Experts layers are not supported by fzero (an error
on import)."""

raise ImportError(
    "deepspeed.moe.layer (Mixture of Experts, expert parallelism) is not supported by "
    "fzero; fzero shards data-parallel training only (ZeRO stages 0-3)"
)
