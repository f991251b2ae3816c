"""What a checkpoint directory is: its names, index, durable writes, asynchronous saves,
the random-number states it keeps, and a reader of the slices its rank files hold.

A checkpoint `save_dir/tag/` holds `rank{r:05d}.safetensors` per rank (tensor slices
named `{kind}/{fqn}/{start}:{stop}`), `index.msgpack` (the plan, counters, per-rank
checksums and random-number states), and optionally `client.safetensors` and
`model.safetensors`; `save_dir/latest` names the newest tag.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from fzero import comm, partition
from fzero.checkpoint._checksum import LEGACY_ALGORITHM
from fzero.checkpoint._files import CheckpointError, SafetensorsFile, tensor_bytes
from fzero.checkpoint._index import decode_client_state, unpack
from fzero.partition import LocalSlice, Plan

__all__ = [
    "CLIENT_FILE",
    "INDEX",
    "MODEL_16BIT",
    "AsyncSave",
    "Reader",
    "check_tag",
    "checksum_algorithm",
    "jsonable",
    "process_rng",
    "rank_file",
    "read_index",
    "read_latest",
    "restore_process_rng",
    "slice_key",
    "write_durably",
]

INDEX = "index.msgpack"
CLIENT_FILE = "client.safetensors"
MODEL_16BIT = "model.safetensors"
_SCRATCH = 2**20  # bytes: a verification pass reads through a buffer this size (L2-sized)
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def slice_key(kind: str, fqn: str, start: int, stop: int) -> str:
    return f"{kind}/{fqn}/{start}:{stop}"


def check_tag(tag: str, where: str) -> str:
    if not isinstance(tag, str) or not _TAG.match(tag):
        raise CheckpointError(
            f"{where}: tag {tag!r} is not allowed: use 1-200 letters, digits, '_', '-', '.', "
            "not starting with '.' or '-'"
        )
    return tag


def process_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": bytes(torch.get_rng_state().tolist()),
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [bytes(s.tolist()) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = numpy.random.get_state()
    state["numpy"] = [
        kind,
        bytes(keys.astype("<u4").tobytes()),
        int(pos),
        int(has_gauss),
        float(cached),
    ]
    return state


def saved_rng(index: Mapping[str, Any], rank: int, processes: int) -> dict[str, Any] | None:
    """The random states this process saved, if the checkpoint has them: by process on a
    mesh with replicas of the same size (`process_rng`), else by plan `rank`."""
    every = index.get("process_rng")
    if every is not None:
        process = comm.get_rank()
        return every[process] if len(every) == processes else None
    return index["ranks"][rank]["rng"] if rank < index["world_size"] else None


def restore_process_rng(state: Mapping[str, Any]) -> None:
    """Set the process's generators to those `state` holds (a functional state's
    checkpoint holds only torch's)."""
    if "torch" in state:
        torch.set_rng_state(torch.tensor(list(state["torch"]), dtype=torch.uint8))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.tensor(list(s), dtype=torch.uint8) for s in state["cuda"]]
        )
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.frombuffer(keys, dtype="<u4"), pos, has_gauss, cached))


def _to_lists(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_to_lists(v) for v in value]
    return value


def jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


class AsyncSave:
    """A save running in a background thread; `wait()` joins it and re-raises its error."""

    def __init__(self, target: Any) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            comm.exempt_thread()  # its collectives are not the main thread's operations
            try:
                target()
            except BaseException as error:  # surfaced by wait()
                self.error = error

        self._thread = threading.Thread(target=run, name="fzero-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"the asynchronous checkpoint save failed: {error}") from error


def write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def checksum_algorithm(index: Mapping[str, Any]) -> str:
    """The algorithm of a checkpoint's tensor checksums (CRC-32 before it was recorded)."""
    return index.get("checksum_algorithm", LEGACY_ALGORITHM)


def read_latest(load_dir: str) -> str | None:
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(256)
    try:
        tag = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        tag = repr(raw[:40])
    return check_tag(tag, f"{path}")


def read_index(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, INDEX)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: {directory} is not a complete checkpoint"
        ) from None
    return unpack(raw, path)


class Reader:
    """Open rank files of one checkpoint on demand; slices looked up by old position."""

    def __init__(self, directory: str, index: Mapping[str, Any], old_plan: Plan) -> None:
        self.directory = directory
        self.index = index
        self.old_plan = old_plan
        self._files: dict[int, SafetensorsFile] = {}
        self._tensor_digests = [
            {r["key"]: r["crc"] for r in rank["slices"]} for rank in index["ranks"]
        ]
        self.algorithm = checksum_algorithm(index)
        self._slices: dict[tuple[int, int], list[LocalSlice]] = {}
        self._cached: tuple[int, str, Tensor] | None = None
        self._verified: set[tuple[int, str]] = set()  # read later without hashing again
        self._scratch: Tensor | None = None

    def _tensor_digest(self, rank: int, key: str) -> int:
        tensor_digest = self._tensor_digests[rank].get(key)
        if tensor_digest is None:
            raise CheckpointError(
                f"tensor {key!r} is not listed for rank {rank} in {self.directory}"
            )
        return tensor_digest

    def verify(self, rank: int, key: str) -> None:
        """Check saved tensor `key` of `rank` against its checksum without keeping it;
        later reads of it skip the check."""
        if (rank, key) in self._verified:
            return
        if self._scratch is None:
            self._scratch = torch.empty(_SCRATCH, dtype=torch.uint8)
        self.file(rank).verify(key, self._tensor_digest(rank, key), tensor_bytes(self._scratch))
        self._verified.add((rank, key))

    def file(self, rank: int) -> SafetensorsFile:
        if rank not in self._files:
            info = self.index["ranks"][rank]
            self._files[rank] = SafetensorsFile(
                os.path.join(self.directory, info["file"]), info["size"], self.algorithm
            )
        return self._files[rank]

    def old_slice(self, rank: int, unit: int, offset: int) -> LocalSlice:
        if (rank, unit) not in self._slices:
            for s in partition.local_slices(self.old_plan, rank):
                self._slices.setdefault((rank, s.unit), []).append(s)
        for s in self._slices[(rank, unit)]:
            if s.shard_offset <= offset < s.shard_offset + s.numel:
                return s
        raise CheckpointError(
            f"{self.directory}: no saved slice at rank {rank} unit {unit} offset {offset}"
        )

    def read_range(self, rank: int, key: str, begin: int, out: Tensor) -> None:
        """Elements `[begin, begin + out.numel())` of saved tensor `key` into `out` (cast
        to `out`'s dtype: bf16 masters and moments load into fp32 ones and back)."""
        tensor_digest: int | None = self._tensor_digest(rank, key)
        if (rank, key) in self._verified:
            tensor_digest = None
        entry = self.file(rank).entry(key)
        whole = begin == 0 and out.numel() == _numel(entry.shape) and out.dtype == entry.dtype
        if whole and out.is_contiguous() and out.device.type == "cpu":
            self.file(rank).read_into(key, out, tensor_digest)
            return
        if self._cached is None or self._cached[:2] != (rank, key):
            self._cached = (rank, key, self.file(rank).read(key, tensor_digest))
        out.copy_(self._cached[2][begin : begin + out.numel()])

    def read_span(self, rank: int, key: str, begin: int, out: Tensor) -> None:
        """`read_range` of a tensor `verify` checked, reading only those elements' bytes
        (a sub-group piece of a swapped unit: [Note: checkpoints in pieces] in
        `fzero.core.swap_pieces`), cast to `out`'s dtype through a buffer of the piece."""
        if (rank, key) not in self._verified:
            raise CheckpointError(f"tensor {key!r} of rank {rank} is read before it is verified")
        file = self.file(rank)
        saved = file.entry(key).dtype
        if out.dtype == saved and out.is_contiguous():
            file.read_span(key, begin, out)
            return
        staged = torch.empty(out.numel(), dtype=saved)
        file.read_span(key, begin, staged)
        out.copy_(staged)

    def read_whole(self, rank: int, key: str, out: Tensor) -> None:
        self.read_range(rank, key, 0, out.view(-1))

    def client_state(self, index: Mapping[str, Any]) -> Any:
        tensors = {}
        info = index["files"].get(CLIENT_FILE)
        if info is not None:
            path = os.path.join(self.directory, CLIENT_FILE)
            with SafetensorsFile(path, info["size"], self.algorithm) as f:
                tensors = {
                    key: f.read(key, tensor_digest) for key, tensor_digest in info["crcs"].items()
                }
        return decode_client_state(index["client_state"], tensors)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *_: object) -> None:
        for f in self._files.values():
            f.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
