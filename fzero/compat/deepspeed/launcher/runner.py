"""`deepspeed.launcher.runner`: the environment file DeepSpeed's launcher exports to
every node (`.deepspeed_env`), which Accelerate writes for multi-node runs; `fzero run`
does not read it (the ranks it starts inherit its environment)."""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
