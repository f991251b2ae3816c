"""What each process `fzero run` starts runs first, before the training script.

`fzero run` hands these over in the environment (torchrun gives every process the same
command line): `FZERO_AS_DEEPSPEED=1` makes `import deepspeed` resolve to fzero
(`fzero.compat.install`); `FZERO_LOCAL_RANK_ARG=1` appends `--local_rank=N` to the
script's arguments, as DeepSpeed's launcher does; `FZERO_CORE_LISTS="0,1;2,3"` pins local
rank i to the i-th list of cores and sets OMP_NUM_THREADS to its length (DeepSpeed's
`--bind_cores_to_rank`). Then the script runs as `python script.py args` would run it.

    python -m fzero.cli.launch_entry script.py [args...]
"""

from __future__ import annotations

import os
import runpy
import sys

__all__ = ["main"]


def _bind_cores(local_rank: int) -> None:
    lists = os.environ.get("FZERO_CORE_LISTS")
    if not lists:
        return
    cores = [int(c) for c in lists.split(";")[local_rank].split(",")]
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    print(f"fzero run: local rank {local_rank} bound to cores {cores}", file=sys.stderr)


def main(argv: list[str]) -> None:
    """Prepare this process as the environment says, then run `argv[0]` as __main__."""
    if not argv:
        raise SystemExit("usage: python -m fzero.cli.launch_entry script.py [args...]")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    _bind_cores(local_rank)
    if os.environ.get("FZERO_AS_DEEPSPEED") == "1":
        from fzero import compat

        compat.install()
    script, *args = argv
    if os.environ.get("FZERO_LOCAL_RANK_ARG") == "1":
        args.append(f"--local_rank={local_rank}")
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
