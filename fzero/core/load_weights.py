"""Loading a model's weights from a safetensors checkpoint (a `model.safetensors`
directory, Transformers' sharded one, or a file), each rank reading only the bytes it
keeps: a parameter partitioned at construction (`fzero.init_context`) gets its partition's
byte range, a whole tensor (a buffer, a parameter built outside the context) the whole
tensor. The same reader serves Transformers' `from_pretrained` under ZeRO-3
(`fzero.core.partitioned`'s [Note: loading by byte range])."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from fzero.core.partitioned import is_partitioned, read_partition_from_file, shape_of
from fzero.core.tensor_files import SafetensorsIndex

__all__ = ["LoadedKeys", "load_safetensors"]


class LoadedKeys(NamedTuple):
    """What a load found (torch's `load_state_dict` report): the model's keys the files
    lack, and the files' keys the model lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_safetensors(
    model: torch.nn.Module, path: str | os.PathLike[str], *, strict: bool = True
) -> LoadedKeys:
    """Load `model`'s parameters and persistent buffers from the safetensors checkpoint
    at `path`, converted to each tensor's dtype; every rank reads only its partitions'
    bytes (not collective). A tied tensor loads under any of its names. With `strict`,
    missing or unexpected keys raise, naming them all; a shape that differs always
    does. Parameters an engine holds already are refused: load before building it."""
    index = SafetensorsIndex(path)
    own = model.state_dict(keep_vars=True)
    loaded: set[int] = set()
    missing: list[str] = []
    for key, tensor in own.items():
        if "_fzero_engine" in tensor.__dict__:
            raise ValueError(
                f"load_safetensors: {key!r} is held by an fzero engine; load the weights "
                "into the model before fzero.shard / fzero.initialize builds it"
            )
        if key not in index:
            missing.append(key)
            continue
        entry = index[key]
        if shape_of(tensor) != entry.shape:
            raise ValueError(
                f"load_safetensors: {key!r} is {entry.shape} in {entry.path} but "
                f"{shape_of(tensor)} in the model"
            )
        with torch.no_grad():
            if is_partitioned(tensor):  # straight into the partition, converted there
                read_partition_from_file(tensor, entry.path, entry.offset, entry.dtype)
            elif tensor.data.is_contiguous():
                index.read_range(key, 0, entry.numel, tensor.data.view(-1))
            else:
                values = torch.empty(entry.numel, dtype=tensor.dtype)
                index.read_range(key, 0, entry.numel, values)
                tensor.data.copy_(values.view(entry.shape))
        loaded.add(id(tensor))
    missing = [key for key in missing if id(own[key]) not in loaded]  # tied: loaded once
    unexpected = [key for key in index if key not in own]
    if strict and (missing or unexpected):
        raise KeyError(
            f"load_safetensors({os.fspath(path)!r}): missing keys {missing}, unexpected "
            f"keys {unexpected}"
        )
    return LoadedKeys(missing, unexpected)
