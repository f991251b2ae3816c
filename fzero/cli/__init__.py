"""The `fzero` command's subcommands: `fzero run` (launch on torchrun), `fzero estimate`
(memory), `fzero checkpoint consolidate|inspect` and `fzero plot` (a PNG of runs).

The command line itself is parsed by `fzero_cli` (standard library only, so `--help` and
`--version` never import torch); it calls `COMMANDS[name](args)` here. Each subcommand
turns bad input into one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

from fzero_cli import main

__all__ = ["COMMANDS", "main"]


def _load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {spec!r}: expected 'module:factory'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--model {spec!r}: {error}") from None


_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _links(text: str) -> dict[str, str]:
    """`--links node=25Gbps,local=400GBps` as {axis: bandwidth}."""
    links = {}
    for item in text.split(","):
        axis, sep, bandwidth = item.partition("=")
        if not sep or not axis.strip() or not bandwidth.strip():
            raise ValueError(
                f"--links item {item!r} is not axis=bandwidth (e.g. node=25Gbps,local=400GBps)"
            )
        links[axis.strip()] = bandwidth.strip()
    return links


def _estimate(args: argparse.Namespace) -> int:
    try:
        print(_estimate_table(args))
    except ValueError as error:  # PlanError is one; so are bad names and sizes
        print(f"fzero estimate: {error}", file=sys.stderr)
        return 1
    return 0


def _estimate_table(args: argparse.Namespace) -> str:
    import torch

    from fzero.cli.estimate import (
        estimate,
        estimate_mesh,
        format_estimate,
        format_mesh_estimate,
        manifest_of_size,
    )
    from fzero.partition import PRESETS, Mesh, describe, preset_from_name, strategy_from_name

    if (args.model is None) == (args.params is None):
        raise ValueError("give exactly one of --model module:factory or --params N")
    if args.preset is not None and args.mesh is None:
        raise ValueError("--preset needs --mesh (e.g. --mesh node=2,local=8)")
    if args.mesh is not None and args.world_sizes is not None:
        raise ValueError("give --mesh or --world-sizes, not both")
    if args.model is not None:
        with torch.device("meta"):
            model = _load_factory(args.model)()
        manifest = describe(model)
    else:
        manifest = manifest_of_size(args.params)
    settings = {
        "param_dtype": _DTYPE_NAMES[args.precision],
        "grad_dtype": _DTYPE_NAMES[args.grad_dtype or args.precision],
        "optimizer": args.optimizer,
        "master_dtype": _DTYPE_NAMES[args.master_dtype],
        "state_dtype": _DTYPE_NAMES[args.state_dtype],
        "persistence_threshold": args.persistence_threshold,
        "eval_live_parameters": args.eval_live_parameters,
        "links": _links(args.links) if args.links is not None else None,
    }
    strategy = strategy_from_name(args.strategy, where="--strategy")
    if args.mesh is not None:
        mesh = Mesh.parse(args.mesh)
        presets = args.preset.split(",") if args.preset else list(PRESETS)
        for name in presets:  # built-in names, or module:name (errors name the flag)
            preset_from_name(name, where="--preset")
        rows = estimate_mesh(manifest, mesh, presets, strategy=strategy, **settings)
        return format_mesh_estimate(rows, manifest.numel, mesh)
    world_sizes = args.world_sizes if args.world_sizes is not None else [1, 8, 64]
    rows = estimate(manifest, world_sizes, strategy=strategy, **settings)
    return format_estimate(rows, manifest.numel)


def _consolidate(args: argparse.Namespace) -> int:
    from fzero.checkpoint import CheckpointError, consolidate

    try:
        files = consolidate(args.save_dir, args.out_dir, args.tag, args.dtype, args.max_shard_size)
    except (CheckpointError, ValueError, OSError) as error:
        print(f"fzero checkpoint consolidate: {error}", file=sys.stderr)
        return 1
    for path in files:
        print(path)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from fzero.checkpoint import CheckpointError, inspect

    try:
        report, intact = inspect(args.save_dir)
    except (CheckpointError, OSError) as error:
        print(f"fzero checkpoint inspect: {error}", file=sys.stderr)
        return 1
    print(report)
    return 0 if intact else 1


def _run(args: argparse.Namespace) -> int:
    from fzero.cli.launcher import run

    if args.launcher == "torchrun" and not args.dry_run and not os.path.isfile(args.script):
        # torchrun would start every process only for each to fail on the missing file
        # (a slurm job may run a path that exists only on the nodes it lands on)
        print(f"fzero run: script {args.script!r} is not a file", file=sys.stderr)
        return 2
    if args.hostfile is not None and not os.path.isfile(args.hostfile):
        print(f"fzero run: --hostfile {args.hostfile!r} is not a file", file=sys.stderr)
        return 2
    try:
        return run(args, args.script_args)
    except (ValueError, OSError) as error:
        print(f"fzero run: {error}", file=sys.stderr)
        return 2


def _plot(args: argparse.Namespace) -> int:
    from fzero.cli import plot

    return plot.main(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plot": _plot,
    "consolidate": _consolidate,
    "estimate": _estimate,
    "inspect": _inspect,
    "run": _run,
}
