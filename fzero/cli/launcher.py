"""`fzero run`: start a training script on local (or several) nodes with PyTorch's torchrun.

fzero has no transport of its own: this builds a `torch.distributed.run` command line
(DeepSpeed's launcher flags mapped onto torchrun's) and runs it, passing its exit code on.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Host",
    "core_lists",
    "filter_hosts",
    "parse_core_list",
    "parse_hostfile",
    "script_environment",
    "slurm_command",
    "torchrun_command",
]


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile(path: str | Path) -> list[Host]:
    """DeepSpeed's hostfile: one `hostname slots=N` per line, `#` comments."""
    hosts = []
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.split("#")[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = [p for p in parts[1:] if p.startswith("slots=")]
        if len(parts) != 2 or not slots or not slots[0][6:].isdigit() or int(slots[0][6:]) < 1:
            raise ValueError(
                f"hostfile {str(path)!r} line {number}: {raw!r}; expected 'hostname slots=N'"
            )
        hosts.append(Host(parts[0], int(slots[0][6:])))
    if not hosts:
        raise ValueError(f"hostfile {str(path)!r} names no hosts")
    return hosts


def _selection(spec: str, flag: str) -> dict[str, list[int] | None]:
    """DeepSpeed's `host[:slot,slot][@host...]` into {host: slots or None (all)}."""
    chosen: dict[str, list[int] | None] = {}
    for part in filter(None, spec.split("@")):
        name, _, slots = part.partition(":")
        if slots and not all(s.isdigit() for s in slots.split(",")):
            raise ValueError(f"{flag} {spec!r}: {part!r}; expected host or host:slot[,slot]")
        chosen[name] = [int(s) for s in slots.split(",")] if slots else None
    return chosen


def filter_hosts(hosts: Sequence[Host], include: str = "", exclude: str = "") -> list[Host]:
    """Apply DeepSpeed's `--include` / `--exclude` (`worker-0:0,1@worker-1`) to a hostfile:
    a bare host keeps or drops it whole, `host:slots` keeps or drops those slots."""
    if include and exclude:
        raise ValueError("--include and --exclude cannot be used together")
    known = {h.name: h for h in hosts}
    selection = _selection(include or exclude, "--include" if include else "--exclude")
    unknown = sorted(set(selection) - set(known))
    if unknown:
        raise ValueError(f"hosts {unknown} are not in the hostfile; it has {sorted(known)}")
    for name, slots in selection.items():
        bad = [s for s in slots or [] if not 0 <= s < known[name].slots]
        if bad:
            raise ValueError(f"{name} has slots 0..{known[name].slots - 1}; asked for {bad}")
    result = []
    for host in hosts:
        if include:
            if host.name in selection:
                slots = selection[host.name]
                result.append(Host(host.name, len(slots) if slots else host.slots))
        elif host.name not in selection:
            result.append(host)
        elif selection[host.name]:
            left = host.slots - len(set(selection[host.name]))
            if left:
                result.append(Host(host.name, left))
    if not result:
        raise ValueError(f"--include/--exclude {include or exclude!r} leaves no hosts")
    return result


def parse_core_list(spec: str) -> list[int]:
    """DeepSpeed's `--bind_core_list`: `1,3-5,7` -> [1, 3, 4, 5, 7]."""
    cores: list[int] = []
    for part in filter(None, spec.split(",")):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise ValueError(f"--bind_core_list {spec!r}: {part!r}; expected N or N-M (M >= N)")
        cores += range(int(low), int(high or low) + 1)
    if not cores or len(set(cores)) != len(cores):
        raise ValueError(f"--bind_core_list {spec!r}: expected distinct cores, e.g. 0-3,8")
    return cores


def core_lists(cores: Sequence[int], ranks: int) -> list[list[int]]:
    """`cores` split into `ranks` contiguous, equal lists (DeepSpeed's rank binding)."""
    per_rank = len(cores) // ranks
    if per_rank < 1:
        raise ValueError(f"{len(cores)} cores cannot be bound to {ranks} ranks per node")
    return [list(cores[i * per_rank : (i + 1) * per_rank]) for i in range(ranks)]


def script_environment(args, nproc_per_node: int) -> dict[str, str]:
    """What `fzero.cli.launch_entry` reads: the DeepSpeed stand-in, `--local_rank`, cores;
    and what fzero's logging reads: `FZERO_LOG_ALL_RANKS` (`fzero._logs`)."""
    env: dict[str, str] = {}
    if getattr(args, "as_deepspeed", False):
        env["FZERO_AS_DEEPSPEED"] = "1"
        if not getattr(args, "no_local_rank", False):
            env["FZERO_LOCAL_RANK_ARG"] = "1"  # DeepSpeed's launcher passes it
    if getattr(args, "log_all_ranks", False):
        env["FZERO_LOG_ALL_RANKS"] = "1"
    if getattr(args, "bind_cores_to_rank", False):
        spec = getattr(args, "bind_core_list", None)
        cores = parse_core_list(spec) if spec else sorted(os.sched_getaffinity(0))
        lists = core_lists(cores, nproc_per_node)
        env["FZERO_CORE_LISTS"] = ";".join(",".join(map(str, c)) for c in lists)
    elif getattr(args, "bind_core_list", None):
        raise ValueError("--bind_core_list needs --bind_cores_to_rank (as DeepSpeed's launcher)")
    return env


def slurm_command(
    script: str,
    script_args: Sequence[str],
    *,
    nproc_per_node: int,
    num_nodes: int,
    master_addr: str,
    master_port: int = 29500,
    entry: bool = False,
) -> list[str]:
    """`srun` starting one torchrun per node; torchrun's c10d rendezvous numbers them."""
    inner = torchrun_command(
        script,
        script_args,
        nproc_per_node=nproc_per_node,
        num_nodes=num_nodes,
        master_addr=master_addr,
        master_port=master_port,
        entry=entry,
    )
    inner = [arg for arg in inner if not arg.startswith("--node-rank=")]
    return ["srun", f"--nodes={num_nodes}", "--ntasks-per-node=1", *inner]


def torchrun_command(
    script: str,
    script_args: Sequence[str],
    *,
    nproc_per_node: int = 1,
    num_nodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int = 29500,
    hosts: Sequence[Host] | None = None,
    entry: bool = False,
) -> list[str]:
    """The `python -m torch.distributed.run ...` argv for these launcher settings; with
    `entry`, each process starts in `fzero.cli.launch_entry`, which then runs the script."""
    if hosts:
        slots = {h.slots for h in hosts}
        if len(slots) != 1:
            raise ValueError(
                f"hosts have different slot counts {sorted(slots)}; torchrun needs one"
            )
        nproc_per_node, num_nodes = slots.pop(), len(hosts)
        master_addr = master_addr or hosts[0].name
    if nproc_per_node < 1 or num_nodes < 1:
        raise ValueError(f"nproc_per_node {nproc_per_node} and num_nodes {num_nodes} must be >= 1")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if num_nodes == 1 and master_addr is None:
        command.append("--standalone")
    else:
        command += [
            f"--nnodes={num_nodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master_addr or '127.0.0.1'}:{master_port}",
            "--rdzv-id=fzero",
        ]
    if entry:
        return [*command, "-m", "fzero.cli.launch_entry", script, *script_args]
    return [*command, script, *script_args]


def default_nproc_per_node() -> int:
    """As DeepSpeed's launcher: one process per visible GPU; one on a machine without."""
    import torch

    return torch.cuda.device_count() or 1


def run(args, script_args: Sequence[str]) -> int:
    """Run the command for parsed `fzero run` arguments; return its exit code."""
    if args.nproc_per_node is None:
        args.nproc_per_node = default_nproc_per_node()
    hosts = parse_hostfile(args.hostfile) if args.hostfile else None
    local = hosts[0].slots if hosts else args.nproc_per_node
    env = script_environment(args, local)
    if hosts and (args.include or args.exclude):
        hosts = filter_hosts(hosts, args.include, args.exclude)
    elif args.include or args.exclude:
        raise ValueError("--include/--exclude select hosts of a --hostfile")
    if args.launcher == "slurm":
        slots = {h.slots for h in hosts} if hosts else {args.nproc_per_node}
        master = args.master_addr or (hosts[0].name if hosts else None)
        if master is None or len(slots) != 1:
            raise ValueError("--launcher slurm needs --master_addr or a --hostfile of equal slots")
        command = slurm_command(
            args.script,
            script_args,
            nproc_per_node=slots.pop(),
            num_nodes=len(hosts) if hosts else args.num_nodes,
            master_addr=master,
            master_port=args.master_port,
            entry=bool(env),
        )
        return _call(command, env, args.dry_run)
    command = torchrun_command(
        args.script,
        script_args,
        nproc_per_node=args.nproc_per_node,
        num_nodes=args.num_nodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        hosts=hosts,
        entry=bool(env),
    )
    return _call(command, env, args.dry_run)


def _call(command: list[str], env: dict[str, str], dry_run: bool) -> int:
    if dry_run:
        print(shlex.join([*(f"{k}={v}" for k, v in sorted(env.items())), *command]))
        return 0
    return subprocess.call(command, env={**os.environ, **env})
