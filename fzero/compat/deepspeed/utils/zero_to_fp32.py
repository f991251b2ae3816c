"""`deepspeed.utils.zero_to_fp32` over fzero checkpoints: the whole model from a sharded
checkpoint, in fp32 or (`convert_zero_checkpoint_to_state_dict`) fp16 or bf16, with
DeepSpeed's function names, arguments and returns. `save_checkpoint` writes scripts that
run this command line into the save directory, as DeepSpeed copies its own there
(`fzero.engine.recovery_scripts`).

Differences, each said where it applies: the files written are safetensors
(`model.safetensors`, HF-style shards past `max_shard_size`), never `pytorch_model.bin`,
since fzero writes no pickle; `get_model_state_file` and `get_optim_files` (paths of
DeepSpeed's pickled `*_states.pt`, which Lightning's converter `torch.load`s) raise,
naming what to use instead. Non-floating buffers keep their dtype (DeepSpeed casts every
buffer to float). Runs without a process group: `python -m
fzero.compat.deepspeed.utils.zero_to_fp32 checkpoint_dir output_dir`.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
from torch import Tensor

from fzero.checkpoint import consolidate, consolidated_state_dict
from fzero.checkpoint._format import read_latest

__all__ = [
    "OUTPUT_DTYPE_NAMES",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
]

log = logging.getLogger("fzero")

# DeepSpeed's names for the dtypes a converted checkpoint may be written in
OUTPUT_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _output_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`dtype` as a torch dtype: one of `OUTPUT_DTYPE_NAMES` (any case, "torch." allowed)
    or their torch dtypes; anything else is an error naming it and the choices."""
    found = dtype
    if isinstance(dtype, str):
        found = OUTPUT_DTYPE_NAMES.get(dtype.removeprefix("torch.").lower())
    if found not in set(OUTPUT_DTYPE_NAMES.values()):
        raise ValueError(
            f"output dtype {dtype!r} is not supported; allowed: {sorted(OUTPUT_DTYPE_NAMES)}"
        )
    assert isinstance(found, torch.dtype)
    return found


def _tag(checkpoint_dir: str, tag: str | None) -> str:
    """DeepSpeed's lookup: `tag`, else the one `checkpoint_dir/latest` names."""
    if tag is None:
        tag = read_latest(checkpoint_dir)
        if tag is None:
            latest = os.path.join(checkpoint_dir, "latest")
            raise ValueError(f"Unable to find 'latest' file at {latest}")
    directory = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Directory '{directory}' doesn't exist")
    return str(tag)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Tensor]:
    """The model's state dict from the checkpoint `checkpoint_dir/tag` (default: the tag
    in `latest`), whatever world size and stage saved it: parameters and floating buffers
    in fp32 on the CPU, tied weights under each name; without frozen parameters when
    `exclude_frozen_parameters`. `lazy_mode` is accepted: the tensors are loaded
    already (`.contiguous()` on each, as DeepSpeed asks of lazy ones, is a no-op)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    tag = _tag(checkpoint_dir, tag)
    return consolidated_state_dict(
        checkpoint_dir, tag, torch.float32, exclude_frozen=exclude_frozen_parameters
    )


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: str | torch.dtype = torch.float32,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the model, its floating tensors in `dtype` (float32, float16 or bfloat16, by
    name or torch dtype; other tensors keep theirs), to `output_dir/model.safetensors`
    (or HF-style shards with `model.safetensors.index.json` past `max_shard_size`; None:
    one file). DeepSpeed writes `pytorch_model.bin` unless `safe_serialization`; fzero
    writes no pickle, so the file is safetensors either way, and the log says so."""
    checkpoint_dir, output_dir = os.fspath(checkpoint_dir), os.fspath(output_dir)
    cast = _output_dtype(dtype)
    tag = _tag(checkpoint_dir, tag)
    if not safe_serialization:
        log.warning(
            "fzero: convert_zero_checkpoint_to_state_dict writes model.safetensors in %s, "
            "not pytorch_model.bin (fzero writes no pickle); transformers' from_pretrained "
            "and safetensors.torch.load_file read it",
            output_dir,
        )
    limit = max_shard_size if max_shard_size is not None else 2**62
    consolidate(
        checkpoint_dir,
        output_dir,
        tag,
        dtype=cast,
        max_shard_size=limit,
        exclude_frozen=exclude_frozen_parameters,
    )


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """`convert_zero_checkpoint_to_state_dict` in fp32."""
    convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        torch.float32,
        max_shard_size,
        safe_serialization,
        tag,
        exclude_frozen_parameters,
    )


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into `model`, moved to the CPU (DeepSpeed's
    `strict=False` load); returns the model."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def _pickle_paths(name: str) -> Any:
    raise NotImplementedError(
        f"deepspeed.utils.zero_to_fp32.{name} returns the paths of DeepSpeed's pickled "
        "*_states.pt files, which callers torch.load; fzero checkpoints hold no pickle "
        "(safetensors and msgpack). For the fp32 weights use "
        "get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir) (and write them in the "
        "format you need), or `fzero checkpoint consolidate`; "
        "the client state saved with the checkpoint is what load_checkpoint returns. "
        "Lightning's convert_zero_checkpoint_to_fp32_state_dict calls this to torch.save "
        "a pickle: call deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict"
        "(checkpoint_dir, output_dir) instead, which writes output_dir/model.safetensors"
    )


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """Refused by name: DeepSpeed's pickled model-states file (see `_pickle_paths`)."""
    return _pickle_paths("get_model_state_file")


def get_optim_files(checkpoint_dir: str) -> list[str]:
    """Refused by name: DeepSpeed's pickled optimizer-states files."""
    return _pickle_paths("get_optim_files")


def _parser(description: str) -> argparse.ArgumentParser:
    """The arguments DeepSpeed's `zero_to_fp32.py` and `zero_to_torch.py` share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    return parser


def main(argv: list[str] | None = None, *, with_dtype: bool = False) -> None:
    """DeepSpeed's `zero_to_fp32.py` command line; `with_dtype`: its `zero_to_torch.py`'s,
    which asks for `--dtype` (float32, float16 or bfloat16)."""
    what = "to float32, float16 or bfloat16" if with_dtype else "to float32"
    parser = _parser(f"Convert a ZeRO checkpoint {what} weights (safetensors).")
    if with_dtype:
        parser.add_argument("--dtype", required=True, choices=sorted(OUTPUT_DTYPE_NAMES))
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        dtype=args.dtype if with_dtype else torch.float32,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )


if __name__ == "__main__":
    main()
