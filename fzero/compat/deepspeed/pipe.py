"""`deepspeed.pipe`: pipeline parallelism is not supported by fzero (an error on import)."""

raise ImportError(
    "deepspeed.pipe (pipeline parallelism, PipelineModule) is not supported by fzero; "
    "fzero shards data-parallel training only (ZeRO stages 0-3)"
)
