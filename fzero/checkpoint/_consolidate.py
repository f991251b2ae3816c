"""One model from a sharded checkpoint, streamed; and verifying a checkpoint directory.

Consolidation needs no process group and no model: the index lists the
model's `state_dict` keys in order with shapes and dtypes, and where each
trainable tensor's slices lie. Tensors are built and written one at a time, so
peak memory is about the largest tensor (in fp32) and its cast, not the model.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from fzero import partition
from fzero.checkpoint._checksum import digest, digest_bytes, new_hasher
from fzero.checkpoint._files import (
    CheckpointError,
    SafetensorsFile,
    Spec,
    tensor_bytes,
    write_safetensors_stream,
)
from fzero.checkpoint._format import (
    CLIENT_FILE,
    INDEX,
    MODEL_16BIT,
    checksum_algorithm,
    read_index,
    read_latest,
)

__all__ = [
    "consolidate",
    "consolidated_state_dict",
    "inspect",
    "iter_consolidated",
    "parse_size",
    "write_model_files",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tags(save_dir: str) -> list[str]:
    """The tag directories under a save directory, sorted; a `save_dir` that is missing or
    not a directory is an error naming it."""
    if not os.path.isdir(save_dir):
        what = "is not a directory" if os.path.exists(save_dir) else "does not exist"
        raise CheckpointError(f"checkpoint directory {save_dir} {what}")
    return sorted(
        name
        for name in os.listdir(save_dir)
        if not name.startswith(".") and os.path.isdir(os.path.join(save_dir, name))
    )


def _tags_there(tags: list[str]) -> str:
    return f"tags there: {', '.join(tags)}" if tags else "it holds no checkpoint"


def _resolve(save_dir: str, tag: str | None) -> tuple[str, dict[str, Any]]:
    tags = _tags(save_dir)
    if tag is None:
        tag = read_latest(save_dir)
        if tag is None:
            raise CheckpointError(
                f"{save_dir} has no 'latest' file naming its newest tag, so pass a tag "
                f"({_tags_there(tags)})"
            )
    directory = os.path.join(save_dir, tag)
    if not os.path.isdir(directory):
        raise CheckpointError(f"tag {tag!r} is not in {save_dir} ({_tags_there(tags)})")
    return directory, read_index(directory)


def _dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype is {name!r}; allowed: {sorted(_DTYPES)}")
    return _DTYPES[name]


def _out_dtype(entry: dict[str, Any], dtype: torch.dtype | None) -> torch.dtype:
    """Trainable tensors come from fp32 masters; `dtype` casts every floating tensor."""
    saved = torch.float32 if entry["fqn"] is not None else partition.dtype_of(entry["dtype"])
    return dtype if dtype is not None and saved.is_floating_point else saved


def _entries(index: dict[str, Any], directory: str, exclude_frozen: bool) -> list[dict[str, Any]]:
    """The index's state_dict entries, without the frozen parameters if asked."""
    entries = index["tensors"]
    if not exclude_frozen:
        return entries
    unknown = [e["key"] for e in entries if e["fqn"] is None and "frozen" not in e]
    if unknown:
        raise CheckpointError(
            f"{directory} does not record which of its module tensors are frozen parameters "
            f"(e.g. {unknown[0]!r}; written by an older fzero): exclude_frozen_parameters "
            "needs a checkpoint saved by this version"
        )
    return [e for e in entries if not e.get("frozen", False)]


def iter_consolidated(
    save_dir: str,
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    exclude_frozen: bool = False,
) -> Iterator[tuple[str, Tensor]]:
    """The model's `state_dict` entries, whole, one at a time, in the model's order
    (without frozen parameters when `exclude_frozen`; buffers stay)."""
    directory, index = _resolve(save_dir, tag)
    entries = _entries(index, directory, exclude_frozen)
    cast = _dtype(dtype)
    pieces: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for rank, info in enumerate(index["ranks"]):
        for record in info["slices"]:
            if record["kind"] == "master":
                pieces.setdefault(record["fqn"], []).append((rank, record))
    files: dict[int, SafetensorsFile] = {}

    def file(rank: int) -> SafetensorsFile:
        if rank not in files:
            info = index["ranks"][rank]
            path = os.path.join(directory, info["file"])
            files[rank] = SafetensorsFile(path, info["size"], checksum_algorithm(index))
        return files[rank]

    try:
        for entry in entries:
            shape = tuple(entry["shape"])
            if entry["fqn"] is None:
                module_digests = {r["key"]: r["crc"] for r in index["ranks"][0]["slices"]}
                key = f"module/{entry['key']}"
                tensor = file(0).read(key, module_digests[key])
            else:
                tensor = torch.empty(math.prod(shape), dtype=torch.float32)
                covered = 0
                for rank, record in pieces.get(entry["fqn"], []):
                    part = tensor[record["start"] : record["stop"]]
                    stored = file(rank).entry(record["key"]).dtype  # bf16 masters: widened
                    into = part if stored == part.dtype else torch.empty_like(part, dtype=stored)
                    file(rank).read_into(record["key"], into, record["crc"])
                    if into is not part:
                        part.copy_(into)
                    covered += record["stop"] - record["start"]
                if covered != tensor.numel():
                    raise CheckpointError(
                        f"{directory}: slices of {entry['fqn']!r} cover {covered} of "
                        f"{tensor.numel()} elements"
                    )
            yield entry["key"], tensor.view(shape).to(_out_dtype(entry, cast))
    finally:
        for f in files.values():
            f.close()


def consolidated_state_dict(
    save_dir: str,
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    exclude_frozen: bool = False,
) -> dict[str, Tensor]:
    """The whole model's `state_dict` from a checkpoint (in memory; `consolidate`
    streams to files instead). Trainable tensors are fp32 unless `dtype` says."""
    return dict(iter_consolidated(save_dir, tag, dtype, exclude_frozen=exclude_frozen))


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '10KiB' or a number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"size {text!r} is not understood; examples: 5GB, 500MB, 1048576")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit.upper() or " "))


def consolidate(
    save_dir: str,
    out_dir: str,
    tag: str | None = None,
    dtype: str = "fp32",
    max_shard_size: str | int = "5GB",
    *,
    exclude_frozen: bool = False,
) -> list[str]:
    """Write the model to `out_dir/model.safetensors`, or to HF-style shards with
    `model.safetensors.index.json` when it exceeds `max_shard_size`; keys are the
    model's own `state_dict` keys (tied weights under each name), without frozen
    parameters when `exclude_frozen`. Returns the files."""
    directory, index = _resolve(save_dir, tag)
    cast = _dtype(dtype)
    entries = _entries(index, directory, exclude_frozen)
    specs = [(e["key"], _out_dtype(e, cast), tuple(e["shape"])) for e in entries]
    tag = os.path.basename(directory)
    stream = (
        tensor
        for _, tensor in iter_consolidated(save_dir, tag, cast, exclude_frozen=exclude_frozen)
    )
    return write_model_files(out_dir, specs, stream, max_shard_size)


def write_model_files(
    out_dir: str,
    specs: list[Spec],
    tensors: Iterable[Tensor],
    max_shard_size: str | int | None = "5GB",
    *,
    filename: str = "model.safetensors",
) -> list[str]:
    """Write a model that arrives one tensor at a time (`tensors`, in the order and of
    the dtypes and shapes `specs` says) as Transformers saves one: `out_dir/filename`,
    or, above `max_shard_size` (None: never), shards named after it
    (`model-00001-of-00003.safetensors`) with `model.safetensors.index.json`. Only one
    tensor need be in memory. Returns the files written."""
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    groups: list[list[Spec]] = [[]]
    filled = 0
    for spec in specs:
        size = math.prod(spec[2]) * spec[1].itemsize
        if limit is not None and groups[-1] and filled + size > limit:
            groups.append([])
            filled = 0
        groups[-1].append(spec)
        filled += size
    os.makedirs(out_dir, exist_ok=True)
    stem, suffix = os.path.splitext(filename)
    names = (
        [filename]
        if len(groups) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(groups):05d}{suffix}" for i in range(len(groups))]
    )
    stream = iter(tensors)
    written = []
    for name, group in zip(names, groups):
        path = os.path.join(out_dir, name)
        chunk = (_host(next(stream)) for _ in group)
        write_safetensors_stream(path, group, chunk, metadata={"format": "pt"})
        written.append(path)
    for _ in stream:  # the producer runs to its end (it may gather as it goes)
        raise ValueError(f"{out_dir}: more tensors than the {len(specs)} the specs list")
    if len(groups) > 1:
        weight_map = {key: name for name, group in zip(names, groups) for key, _, _ in group}
        total = sum(math.prod(s) * d.itemsize for _, d, s in specs)
        path = os.path.join(out_dir, f"{stem}{suffix}.index.json")
        with open(path, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(path)
    return written


def _host(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu").contiguous()


def inspect(save_dir: str) -> tuple[str, bool]:
    """A report of every tag under `save_dir`, verifying every checksum; and whether
    all of it is intact. A `save_dir` that is missing, not a directory or holds no
    checkpoint at all is a `CheckpointError` naming it."""
    tags = _tags(save_dir)
    indexed = [t for t in tags if os.path.isfile(os.path.join(save_dir, t, INDEX))]
    if not indexed and not os.path.lexists(os.path.join(save_dir, "latest")):
        within = (
            f"none of its directories ({', '.join(tags)}) holds an {INDEX}"
            if tags
            else ("no tag directory, no 'latest' file")
        )
        raise CheckpointError(f"{save_dir} holds no checkpoint: {within}")
    lines = []
    latest = None
    try:
        latest = read_latest(save_dir)
    except CheckpointError as error:
        lines.append(f"latest: DAMAGED ({error})")
    if latest is not None and latest not in tags:
        lines.append(f"latest: DAMAGED (it names tag {latest!r}, which is not here)")
        latest = None
    elif latest is not None:
        lines.append(f"latest: {latest}")
    intact = not lines or latest is not None
    for tag in tags:
        directory = os.path.join(save_dir, tag)
        try:
            index = read_index(directory)
        except CheckpointError as error:
            lines.append(f"{tag}: DAMAGED ({error})")
            intact = False
            continue
        counters = index["counters"]
        saving = partition.from_bytes(index["plan"])
        persistent = sum(u.persistent for u in saving.units)
        lines.append(
            f"{tag}: world size {index['world_size']}, stage {index['stage']}, "
            f"{index['precision']}, step {counters['global_steps']}, "
            f"optimizer {index['optimizer']['name']}, fzero {index['fzero_version']}; "
            f"plan: strategy {saving.strategy}, {len(saving.units)} units"
            + (f" ({persistent} persistent)" if persistent else "")
            + _unit_stages(saving)
            + _on_mesh(saving)
        )
        sizes: dict[str, int] = {}
        problems = []
        files = [(info["file"], info["size"], info["checksum"]) for info in index["ranks"]]
        files += [(name, i["size"], i["checksum"]) for name, i in index["files"].items()]
        for name, size, checksum in files:
            try:
                path = os.path.join(directory, name)
                for kind, nbytes in _verify(path, size, checksum, checksum_algorithm(index)):
                    sizes[kind] = sizes.get(kind, 0) + nbytes
            except CheckpointError as error:
                problems.append(str(error))
        for kind, nbytes in sorted(sizes.items()):
            lines.append(f"    {kind:<22} {nbytes:>16,} bytes")
        if problems:
            intact = False
            lines.extend(f"    DAMAGED: {p}" for p in problems)
        else:
            lines.append(f"    checksums: {len(files)} files ok")
    return "\n".join(lines), intact


def _unit_stages(plan: partition.Plan) -> str:
    """How many units run at each stage, where they differ ("; units by stage: 1: 2,
    3: 6")."""
    if not plan.mixed:
        return ""
    counts: dict[int, int] = {}
    for stage in plan.stages:
        counts[stage] = counts.get(stage, 0) + 1
    return "; units by stage: " + ", ".join(f"{s}: {n}" for s, n in sorted(counts.items()))


def _on_mesh(plan: partition.Plan) -> str:
    """How a plan on a mesh ran: its preset, mesh, shard axes, replicas, hpZ's axes."""
    on = plan.mesh
    if on is None:
        return ""
    mesh = " x ".join(f"{name}={size}" for name, size in on.axes)
    text = f"; preset {on.preset} on mesh {mesh}, split over {'+'.join(on.shard) or 'none'}"
    if on.optimizer_extra:
        text += f" (gradients and parameters over {'+'.join(on.grads_shard)})"
    if plan.replicas > 1:
        text += f", {plan.replicas} replicas over {'+'.join(on.replicate)}"
    return text + (f", hpZ secondary over {'+'.join(on.secondary)}" if on.secondary else "")


def _verify(path: str, size: int, checksum: int, algorithm: str) -> list[tuple[str, int]]:
    """Read every tensor of `path`, recompute its checksum; (kind, bytes) per tensor."""
    out = []
    with SafetensorsFile(path, size, algorithm) as f:
        running = new_hasher(algorithm, f.header_bytes)
        for entry in sorted(f.entries.values(), key=lambda e: e.begin):
            tensor = f.read(entry.key, None)  # alive while its bytes are read
            value = digest(tensor_bytes(tensor), algorithm)
            running.update(digest_bytes(value, algorithm))
            out.append((_kind(os.path.basename(path), entry.key), entry.end - entry.begin))
    if running.intdigest() != checksum:
        raise CheckpointError(f"{path} fails its checksum: the file is damaged")
    return out


def _kind(file: str, key: str) -> str:
    if file == CLIENT_FILE:
        return "client_state"
    if file == MODEL_16BIT:
        return "model (16-bit)"
    return key.split("/", 1)[0]
