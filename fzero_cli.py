"""The `fzero` command's entry point: its arguments, parsed with the standard library only.

`fzero --help`, `fzero --version`, every subcommand's `--help` and every error in the
arguments answer without importing torch or fzero; it sits beside the `fzero` package
so that nothing of the package runs for them. The subcommands' work lives in
`fzero.cli` and is imported only when a subcommand runs; `fzero/__init__` imports its
public names on first use, so `fzero run` (the launcher) does not import torch either.
`python -m fzero.cli` and `fzero.cli.main` are this same `main`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
import typing
from collections.abc import Sequence

__all__ = ["main", "parser", "version"]


def version() -> str:
    """fzero's version, read from `fzero/_version.py` without importing fzero."""
    spec = importlib.util.find_spec("fzero")
    locations = list(spec.submodule_search_locations or ()) if spec else []
    for location in locations:
        path = os.path.join(location, "_version.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", f.read(), re.M)
            if found:
                return found.group(1)
    raise SystemExit(f"fzero: no fzero/_version.py with a __version__ under {locations}")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line: what is wrong, and where the usage
    is (argparse prints the whole usage first, which buries the error)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """`--version`: reads the version only when asked (argparse's own action formats it
    when the parser is built)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print fzero's version and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"fzero {version()}")
        parser.exit()


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers, e.g. 1,8,64"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be >= 1")
    return values


def _count(text: str) -> int:
    """A number of elements or parameters: `7.5e9`, `124000000`, `0`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number, e.g. 7.5e9") from None
    if not value >= 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number >= 0")
    return int(value)


def _estimate_parser(sub: argparse._SubParsersAction) -> None:
    est = sub.add_parser("estimate", help="model-state memory per rank for ZeRO stages 0-3")
    est.add_argument("--model", help="module:factory building the model (built on meta)")
    est.add_argument(
        "--params", type=_count, help="number of parameters instead of a model, e.g. 7.5e9"
    )
    est.add_argument(
        "--world-sizes",
        type=_int_list,
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
        "the last axis), or module:name naming your own (a partition.Custom, or a rule "
        "(mesh, unit) -> UnitSharding); default all built-in ones",
    )
    est.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="fp16")
    est.add_argument(
        "--eval-live-parameters",
        type=_count,
        default=0,
        help="stage3_eval_live_parameters: elements of whole stage-3 units kept gathered "
        "across forwards without gradients (fast generation), counted on the device",
    )
    est.add_argument(
        "--optimizer",
        default="adam",
        help="adam, adamw, lamb, muon, sgd, adagrad or lion (default adam)",
    )
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
        help="partitioning strategy: flat_even (default), per_tensor_dim0, whole_tensors or "
        "module:function",
    )
    est.add_argument(
        "--persistence-threshold",
        type=_count,
        default=100_000,
        help="stage 3 keeps tensors under this many elements whole (default 100000, the "
        "engine's stage3_param_persistence_threshold)",
    )
    est.add_argument(
        "--links",
        default=None,
        help="bandwidth of each mesh axis, e.g. node=25Gbps,local=400GBps (optionally "
        "@latency: node=25Gbps@5us); without --mesh the axis is 'world'. Adds the "
        "modelled communication time per step",
    )
    est.set_defaults(command="estimate")


def _checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    ckpt = sub.add_parser("checkpoint", help="consolidate or inspect a sharded checkpoint")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    cons = ckpt_sub.add_parser(
        "consolidate", help="write model.safetensors (or HF-style shards) from a checkpoint"
    )
    cons.add_argument("save_dir", help="the directory save_checkpoint wrote (holds `latest`)")
    cons.add_argument("out_dir", help="where model.safetensors goes (created if missing)")
    cons.add_argument("--tag", default=None, help="default: the tag in SAVE_DIR/latest")
    cons.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    cons.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    cons.set_defaults(command="consolidate")
    insp = ckpt_sub.add_parser("inspect", help="tags, sizes, and every checksum verified")
    insp.add_argument("save_dir", help="the directory save_checkpoint wrote (holds `latest`)")
    insp.set_defaults(command="inspect")


def _run_parser(sub: argparse._SubParsersAction) -> None:
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
    run.set_defaults(command="run")


def _plot_parser(sub: argparse._SubParsersAction) -> None:
    plot = sub.add_parser("plot", help="a PNG of one or more runs (metrics, TensorBoard, CSV)")
    plot.add_argument(
        "runs", nargs="+", metavar="RUN", help="metrics file or monitor directory; NAME=RUN"
    )
    plot.add_argument("-o", "--output", default="fzero-run.png", help="default fzero-run.png")
    plot.set_defaults(command="plot")


def parser() -> argparse.ArgumentParser:
    """The `fzero` command line: `run`, `estimate`, `checkpoint consolidate|inspect`,
    `plot`."""
    root = _Parser(
        prog="fzero",
        description="ZeRO sharded data-parallel training for PyTorch, with sharding plans "
        "as plain data.",
    )
    root.add_argument("--version", action=_Version)
    sub = root.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    _run_parser(sub)
    _estimate_parser(sub)
    _checkpoint_parser(sub)
    _plot_parser(sub)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fzero` console script: parse, then run the subcommand (which
    imports what it needs). Bad input is one line on stderr and a non-zero exit."""
    args = parser().parse_args(argv)
    commands = importlib.import_module("fzero.cli")
    return commands.COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
