"""Tensors' bytes in files: a safetensors checkpoint read by byte range, and the file
bytes a memory-mapped tensor shows.

A rank that keeps a partition of a tensor reads only that partition's bytes
(`SafetensorsIndex.read_range`): a single `model.safetensors`, Transformers' sharded
`model.safetensors.index.json` directory, or one file. `mapped_bytes` says which file
bytes a tensor is a view of when it comes from a memory map (safetensors' `safe_open`,
which Transformers loads through), so the ranks can read their partitions of it from the
file instead of one rank reading it whole (Linux: `/proc/self/maps`; elsewhere None).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch import Tensor

__all__ = [
    "MappedBytes",
    "SafetensorsIndex",
    "TensorEntry",
    "file_digest",
    "mapped_bytes",
    "read_bytes_into",
    "read_chunks",
    "read_elements_into",
]

# safetensors' dtype names (the format's specification)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

SINGLE = "model.safetensors"
SHARDED_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: `path`, from byte `offset`, row-major."""

    key: str
    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header: (where its data begins, the parsed JSON)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file: {len(raw)} bytes long")
        (length,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if length > size - 8:
            raise ValueError(
                f"{path} is not a safetensors file: its header says {length} bytes, the file "
                f"has {size}"
            )
        header = json.loads(f.read(length))
    return 8 + length, header


class SafetensorsIndex:
    """The tensors of a safetensors checkpoint, by key: `path` is a directory holding
    `model.safetensors` or Transformers' sharded `model.safetensors.index.json`, or one
    `.safetensors` file. Headers only are read here."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, SHARDED_INDEX)
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted({os.path.join(path, name) for name in weight_map.values()})
            elif os.path.exists(os.path.join(path, SINGLE)):
                files = [os.path.join(path, SINGLE)]
            else:
                raise FileNotFoundError(
                    f"{path} holds neither {SINGLE} nor {SHARDED_INDEX}: no safetensors "
                    "checkpoint to read"
                )
        elif os.path.exists(path):
            files = [path]
        else:
            raise FileNotFoundError(f"{path} does not exist")
        self.files = files
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            start, header = read_header(file)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if info["dtype"] not in DTYPES:
                    raise ValueError(
                        f"{file}: tensor {key!r} has dtype {info['dtype']!r}; readable: "
                        f"{sorted(DTYPES)}"
                    )
                self.entries[key] = TensorEntry(
                    key,
                    file,
                    start + int(info["data_offsets"][0]),
                    DTYPES[info["dtype"]],
                    tuple(int(d) for d in info["shape"]),
                )

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __getitem__(self, key: str) -> TensorEntry:
        return self.entries[key]

    def read_range(self, key: str, start: int, stop: int, out: Tensor) -> Tensor:
        """Elements `[start, stop)` of tensor `key` (flattened) into the first
        `stop - start` elements of `out` (contiguous, any device), converted to `out`'s
        dtype; only those bytes are read (`read_elements_into`). Returns the filled part
        of `out`."""
        entry = self.entries[key]
        if not 0 <= start <= stop <= entry.numel:
            raise ValueError(
                f"elements [{start}, {stop}) of {key!r} are outside its {entry.numel} elements"
            )
        target = out[: stop - start]
        offset = entry.offset + start * entry.dtype.itemsize
        read_elements_into(entry.path, offset, entry.dtype, target)
        return target


CHUNK_BYTES = 16 * 2**20  # the most a converting read holds besides its target


def read_chunks(
    path: str, offset: int, dtype: torch.dtype, count: int
) -> Iterator[tuple[int, Tensor]]:
    """`count` elements of `dtype` in the file from byte `offset`, as `(first element,
    values)` pieces of at most `CHUNK_BYTES` each, read one at a time into one buffer
    (each piece is valid until the next is read)."""
    step = max(1, CHUNK_BYTES // dtype.itemsize)
    buffer = torch.empty(min(step, count), dtype=dtype)
    for begin in range(0, count, step):
        piece = buffer[: min(step, count - begin)]
        read_bytes_into(path, offset + begin * dtype.itemsize, piece)
        yield begin, piece


def read_elements_into(path: str, offset: int, dtype: torch.dtype, out: Tensor) -> None:
    """Fill contiguous `out` (any dtype, any device) with its `numel` elements of
    `dtype` from the file's byte `offset`, converted: straight into `out` where it is in
    host memory in `dtype`, else through `read_chunks`, so no `out`-sized copy is made
    (a partition of an embedding read from an fp32 file into bf16 would be one)."""
    if out.device.type == "cpu" and out.dtype == dtype:
        read_bytes_into(path, offset, out)
        return
    flat = out.view(-1)
    for begin, piece in read_chunks(path, offset, dtype, out.numel()):
        flat[begin : begin + piece.numel()].copy_(piece)


def read_bytes_into(path: str, offset: int, out: Tensor) -> None:
    """Fill contiguous host tensor `out` with the file's bytes from `offset`."""
    view = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(
                    f"{path}: {len(view) - done} bytes missing at offset {offset + done} "
                    "(the file is shorter than its header says)"
                )
            done += n
    finally:
        os.close(fd)


def file_digest(path: str, offset: int, length: int = 4096) -> str:
    """What says two ranks read the same file: its size, and XXH3 of its first 64 KiB
    (a safetensors header and more) and of `length` bytes at `offset`."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        hasher = xxhash.xxh3_64(f.read(2**16))
        f.seek(offset)
        hasher.update(f.read(length))
    return f"{size}:{hasher.hexdigest()}"


@dataclass(frozen=True)
class MappedBytes:
    """The file bytes a tensor is a view of: `path` from byte `offset`, a file this
    process mapped and has not written to (`digest`: `file_digest` of it there)."""

    path: str
    offset: int
    digest: str


def mapped_bytes(tensors: list[Tensor]) -> list[MappedBytes | None]:
    """For each tensor (contiguous, host memory), the file bytes it shows through a
    memory map, or None: not mapped from a file, mapped from a file that was replaced
    or deleted since, or written to through the mapping (copy-on-write pages differ
    from the file). Linux only (`/proc/self/smaps`, read once); None elsewhere."""
    mappings = _file_mappings()
    return [_mapped(tensor, mappings) for tensor in tensors]


@dataclass(frozen=True)
class _Mapping:
    low: int
    high: int
    file_offset: int
    major: int
    inode: int
    path: str
    copied_kb: int


def _file_mappings() -> list[_Mapping]:
    """This process's file-backed mappings (`/proc/self/smaps`); [] where unreadable."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[_Mapping] = []
    current: dict[str, Any] | None = None
    for line in lines:
        fields = line.split(None, 5)
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            if current is not None:
                found.append(_Mapping(**current))
            current = None
            if len(fields) == 6 and int(fields[4]) != 0:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                current = dict(
                    low=low,
                    high=high,
                    file_offset=int(fields[2], 16),
                    major=int(fields[3].split(":")[0], 16),
                    inode=int(fields[4]),
                    path=fields[5],
                    copied_kb=0,
                )
        elif current is not None and fields and fields[0] == "Anonymous:":
            # pages written through a private mapping are copies (anonymous); dirty file
            # pages (written by write() and not yet flushed) hold the file's bytes
            current["copied_kb"] += int(fields[1])
    if current is not None:
        found.append(_Mapping(**current))
    return found


def _mapped(tensor: Tensor, mappings: list[_Mapping]) -> MappedBytes | None:
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    for m in mappings:
        if m.low <= begin and end <= m.high:
            if m.copied_kb:
                return None
            try:
                status = os.stat(m.path)
            except OSError:
                return None
            if status.st_ino != m.inode or os.major(status.st_dev) != m.major:
                return None  # the name now points at another file
            offset = m.file_offset + begin - m.low
            return MappedBytes(m.path, offset, file_digest(m.path, offset))
    return None
