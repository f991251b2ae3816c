"""The `fzero` command: `fzero run` (launch on torchrun), `fzero estimate` (memory),
`fzero checkpoint consolidate|inspect` and `fzero plot` (a PNG of runs)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"--model {spec!r}: expected 'module:factory'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"--model {spec!r}: {error}") from None


_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _estimate(args: argparse.Namespace) -> int:
    import torch

    from fzero.cli.estimate import (
        estimate,
        estimate_mesh,
        format_estimate,
        format_mesh_estimate,
        manifest_of_size,
    )
    from fzero.partition import PRESETS, Mesh, PlanError, describe, strategy_from_name

    if (args.model is None) == (args.params is None):
        raise SystemExit("fzero estimate: give exactly one of --model module:factory or --params N")
    if args.model is not None:
        with torch.device("meta"):
            model = _load_factory(args.model)()
        manifest = describe(model)
    else:
        manifest = manifest_of_size(int(float(args.params)))
    if args.preset is not None and args.mesh is None:
        raise SystemExit("fzero estimate: --preset needs --mesh (e.g. --mesh node=2,local=8)")
    if args.mesh is not None and args.world_sizes is not None:
        raise SystemExit("fzero estimate: give --mesh or --world-sizes, not both")
    settings = {
        "param_dtype": _DTYPE_NAMES[args.precision],
        "grad_dtype": _DTYPE_NAMES[args.grad_dtype or args.precision],
        "optimizer": args.optimizer,
        "master_dtype": _DTYPE_NAMES[args.master_dtype],
        "state_dtype": _DTYPE_NAMES[args.state_dtype],
        "persistence_threshold": args.persistence_threshold,
        "eval_live_parameters": int(float(args.eval_live_parameters)),
    }
    try:
        strategy = strategy_from_name(args.strategy, where="--strategy")
        if args.mesh is not None:
            mesh = Mesh.parse(args.mesh)
            presets = args.preset.split(",") if args.preset else list(PRESETS)
            unknown = [p for p in presets if p not in PRESETS]
            if unknown:
                raise PlanError(
                    f"--preset {unknown[0]!r} is unknown; allowed: {', '.join(PRESETS)}"
                )
            rows = estimate_mesh(manifest, mesh, presets, strategy=strategy, **settings)
            print(format_mesh_estimate(rows, manifest.numel, mesh))
            return 0
    except PlanError as error:
        raise SystemExit(f"fzero estimate: {error}") from None
    world_sizes = args.world_sizes if args.world_sizes is not None else [1, 8, 64]
    rows = estimate(manifest, world_sizes, strategy=strategy, **settings)
    print(format_estimate(rows, manifest.numel))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fzero", description="ZeRO training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    est = sub.add_parser("estimate", help="model-state memory per rank for ZeRO stages 0-3")
    est.add_argument("--model", help="module:factory building the model (built on meta)")
    est.add_argument("--params", help="number of parameters instead of a model, e.g. 7.5e9")
    est.add_argument(
        "--world-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated data-parallel sizes (default 1,8,64)",
    )
    est.add_argument(
        "--mesh",
        help="a mesh of named axes instead of world sizes, e.g. node=2,local=8 (rank-major, "
        "the last axis fastest): memory and wire bytes per axis for each --preset",
    )
    est.add_argument(
        "--preset",
        help="with --mesh: comma-separated presets among zero0..zero3, mics (split within the "
        "last axis, replicated across the others), hpz (zero3 + a secondary copy split within "
        "the last axis); default all",
    )
    est.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="fp16")
    est.add_argument(
        "--eval-live-parameters",
        default="0",
        help="stage3_eval_live_parameters: elements of whole stage-3 units kept gathered "
        "across forwards without gradients (fast generation), counted on the device",
    )
    est.add_argument("--optimizer", default="adam", help="adam, adamw, lamb or sgd")
    est.add_argument(
        "--grad-dtype",
        choices=["fp16", "bf16", "fp32"],
        default="fp32",
        help="gradient accumulators' dtype (default fp32, what fzero keeps; the ZeRO paper's "
        "figures have them in --precision)",
    )
    est.add_argument(
        "--master-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="master weights' dtype (bf16: bf16.bf16_master_weights_and_grads; with "
        "--precision bf16 the parameters are the masters)",
    )
    est.add_argument(
        "--state-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="optimizer moments' dtype (bf16: bf16.bf16_optimizer_states)",
    )
    est.add_argument(
        "--strategy",
        default="flat_even",
        help="partitioning strategy: flat_even (default), per_tensor_dim0 or module:function",
    )
    est.add_argument(
        "--persistence-threshold",
        type=int,
        default=100_000,
        help="stage 3 keeps tensors under this many elements whole (default 100000, the "
        "engine's stage3_param_persistence_threshold)",
    )
    est.set_defaults(func=_estimate)

    ckpt = sub.add_parser("checkpoint", help="consolidate or inspect a sharded checkpoint")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    cons = ckpt_sub.add_parser(
        "consolidate", help="write model.safetensors (or HF-style shards) from a checkpoint"
    )
    cons.add_argument("save_dir")
    cons.add_argument("out_dir")
    cons.add_argument("--tag", default=None, help="default: the tag in SAVE_DIR/latest")
    cons.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    cons.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    cons.set_defaults(func=_consolidate)
    insp = ckpt_sub.add_parser("inspect", help="tags, sizes, and every checksum verified")
    insp.add_argument("save_dir")
    insp.set_defaults(func=_inspect)

    run = sub.add_parser("run", help="run a training script on N local processes via torchrun")
    run.add_argument(
        "-n",
        "--nproc_per_node",
        "--num_gpus",
        type=int,
        default=None,
        help="processes per node (default: one per visible GPU, else 1)",
    )
    run.add_argument("--num_nodes", type=int, default=1)
    run.add_argument("--node_rank", type=int, default=0)
    run.add_argument("--master_addr", default=None)
    run.add_argument("--master_port", type=int, default=29500)
    run.add_argument("--hostfile", default=None, help="DeepSpeed hostfile: 'host slots=N' lines")
    run.add_argument("--include", default="", help="hosts/slots to use, e.g. worker-0:0,1@worker-1")
    run.add_argument("--exclude", default="", help="hosts/slots to leave out, same format")
    run.add_argument("--launcher", choices=["torchrun", "slurm"], default="torchrun")
    run.add_argument(
        "--as-deepspeed",
        action="store_true",
        help="`import deepspeed` in the script resolves to fzero (passes --local_rank=N)",
    )
    run.add_argument(
        "--no_local_rank", action="store_true", help="with --as-deepspeed: no --local_rank"
    )
    run.add_argument(
        "--bind_cores_to_rank",
        action="store_true",
        help="pin each local rank to its share of the cores; OMP_NUM_THREADS to match",
    )
    run.add_argument("--bind_core_list", default=None, help="cores to share, e.g. 0-7,16-23")
    run.add_argument(
        "--log-all-ranks",
        action="store_true",
        help="fzero's INFO lines from every rank (default: rank 0's only)",
    )
    run.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_run)

    from fzero.cli import plot  # argparse only: the plot's own imports wait until it runs

    plot.add_parser(sub)
    return parser


def _consolidate(args: argparse.Namespace) -> int:
    from fzero.checkpoint import CheckpointError, consolidate

    try:
        files = consolidate(args.save_dir, args.out_dir, args.tag, args.dtype, args.max_shard_size)
    except (CheckpointError, ValueError) as error:
        print(f"fzero checkpoint consolidate: {error}", file=sys.stderr)
        return 1
    for path in files:
        print(path)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from fzero.checkpoint import inspect

    report, intact = inspect(args.save_dir)
    print(report)
    return 0 if intact else 1


def _run(args: argparse.Namespace) -> int:
    from fzero.cli.launcher import run

    try:
        return run(args, args.script_args)
    except (ValueError, OSError) as error:
        print(f"fzero run: {error}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fzero` console script."""
    args = _parser().parse_args(argv)
    return args.func(args)
