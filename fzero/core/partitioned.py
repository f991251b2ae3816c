"""Parameters partitioned at construction: DeepSpeed's `zero.Init` contract, which
`fzero.init_context` (`fzero.core.construction`) and `deepspeed.zero.Init` produce, and
the engine and `fzero.init` adopt unit by unit (`fzero.core.build`).

A partitioned parameter keeps this rank's part of its flattened values and nothing
else: `param.data` is an empty tensor of its dtype, `ds_shape` / `ds_numel` say the whole
tensor, `ds_status` is `NOT_AVAILABLE`, and `ds_tensor` is the partition (an empty tensor
when the partition lives in a file). Every tensor is cut as DeepSpeed cuts it
(`partition_range`): `ceil(numel / world)` elements per rank in rank order, the last
parts short and padded with zeros, so a parameter's partition does not depend on the
rest of the model (the units the engine later groups it into are not known yet).

[Note: rank 0's values] DeepSpeed broadcasts each parameter from rank 0 when it
partitions it, so every rank keeps rank 0's construction. Here the ranks first compare
an XXH3 digest of each parameter (one small all-reduce per module) and broadcast only
where they differ: built from the same seed, no weight moves.

`gathered_partitions` is `GatheredParameters` on such parameters: whole on every rank
inside the block; with `modifier_rank`, that rank's values become the partitions on exit.
[Note: loading by byte range] On the modifier rank a `TorchFunctionMode` watches the
block: a `param.copy_(source)` of a whole parameter is recorded instead of run, and if
`source` turns out to be a view of a memory-mapped file (safetensors' `safe_open`, which
Transformers loads from), every rank reads its own partition's bytes of that file on
exit; the modifier rank never reads the rest. Any other use of the parameter or of the
source first runs the recorded copy, so what the block sees is always what it wrote.
The bytes go straight into the partition (converted piece by piece where the dtypes
differ) after the block's whole copy is released, so a load holds the share, one
parameter whole and nothing else model-sized (gathered without gloo's staging copy:
`comm.all_gather_into`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgpack
import torch
import xxhash
from torch import Tensor
from torch.overrides import TorchFunctionMode

from fzero import comm
from fzero.core import nvme as _nvme
from fzero.core.layout import ZeroParamStatus
from fzero.core.tensor_files import (
    file_digest,
    mapped_bytes,
    read_bytes_into,
    read_chunks,
    read_elements_into,
)
from fzero.core.zero3_params import describe_zero3_param
from fzero.partition import dtype_name, dtype_of

__all__ = [
    "PartitionStore",
    "gather_whole",
    "gathered_partitions",
    "is_partitioned",
    "materialise",
    "partition_parameters",
    "partition_range",
    "read_partition",
    "read_partition_from_file",
    "release_partition",
    "shape_of",
    "write_partition",
]


def partition_range(numel: int, world: int, rank: int) -> tuple[int, int, int]:
    """`(start, stop, size)`: `rank`'s elements `[start, stop)` of a flattened tensor of
    `numel` elements cut in `world` parts of `size = ceil(numel / world)` elements
    (DeepSpeed's `partition_numel`); the last parts are short or empty, padded to `size`."""
    size = -(-numel // world) if numel else 0
    start = min(rank * size, numel)
    return start, min(start + size, numel), size


def is_partitioned(p: Tensor) -> bool:
    """Whether `p` is a parameter partitioned at construction (not yet adopted)."""
    return "_fzero_partitions" in p.__dict__


def shape_of(p: Tensor) -> tuple[int, ...]:
    """The whole shape of `p`: `ds_shape` where it is partitioned, else its own."""
    return tuple(p.ds_shape) if "ds_shape" in p.__dict__ else tuple(p.shape)


class PartitionStore:
    """Where this rank keeps the partitions a construction made: `where` is "device"
    (the compute device), "cpu" (host memory, pinned with `pin_memory`) or "nvme" (one
    file under `nvme_path`, removed when its last partition is dropped or the store is
    collected). The parts are cut over every process of the default group."""

    def __init__(
        self,
        where: str,
        *,
        device: torch.device,
        pin_memory: bool = False,
        nvme_path: str | None = None,
    ) -> None:
        if where not in ("device", "cpu", "nvme"):
            raise ValueError(f"partition store is {where!r}; allowed: 'device', 'cpu', 'nvme'")
        if where == "nvme" and not nvme_path:
            raise ValueError(
                "partitions on 'nvme' need a directory: give nvme_path (DeepSpeed's "
                "zero_optimization.offload_param.nvme_path)"
            )
        self.where, self.compute_device = where, device
        self.device = device if where == "device" else torch.device("cpu")
        self.pin = pin_memory and where == "cpu" and torch.cuda.is_available()
        self.nvme_path = nvme_path
        self.rank, self.world = comm.get_rank(), comm.get_world_size()
        self._fd: int | None = None
        self._path = ""
        self._end = 0
        self._regions: dict[int, tuple[int, int, torch.dtype]] = {}  # ds_id -> offset, numel, dtype
        self._finalizer: Any = None

    # ---- keeping one partition ----------------------------------------------------------

    def put(self, p: torch.nn.Parameter, part: Tensor) -> None:
        """Keep `part` (this rank's padded partition of `p`) as `p`'s."""
        if self.where != "nvme":
            held = part.to(self.device)
            if self.pin:
                held = held.pin_memory()
            p.ds_tensor = held
        else:
            nbytes = part.numel() * part.element_size()
            offset = self._allocate(nbytes)
            self._regions[p.ds_id] = (offset, part.numel(), part.dtype)
            self._pwrite(offset, part.cpu().contiguous(), p)
            p.ds_tensor = torch.empty(0, dtype=part.dtype)
        p.ds_tensor.ds_numel = part.numel()

    def read(self, p: torch.nn.Parameter) -> Tensor:
        """`p`'s partition in memory (the held tensor itself, or read from the file)."""
        if self.where != "nvme":
            return p.ds_tensor
        offset, numel, dtype = self._regions[p.ds_id]
        out = torch.empty(numel, dtype=dtype)
        read_bytes_into(self._path, offset, out)
        return out

    def write(self, p: torch.nn.Parameter, first: int, values: Tensor) -> None:
        """Set elements `[first, first + values.numel())` of `p`'s partition from
        `values` (flat, converted to the partition's dtype), in place: no partition-sized
        buffer is made for a part of one."""
        if self.where != "nvme":
            p.ds_tensor[first : first + values.numel()].copy_(values)
            return
        offset, _, dtype = self._regions[p.ds_id]
        values = values.to("cpu", dtype).contiguous()
        self._pwrite(offset + first * dtype.itemsize, values, p)

    def read_from_file(
        self, p: torch.nn.Parameter, path: str, offset: int, dtype: torch.dtype, count: int
    ) -> None:
        """Set the first `count` elements of `p`'s partition from `count` elements of
        `dtype` in the file `path` from byte `offset`, converted: straight into the
        partition where it is in memory, else through a bounded buffer (`read_chunks`)."""
        if self.where != "nvme":
            read_elements_into(path, offset, dtype, p.ds_tensor[:count])
            return
        for first, piece in read_chunks(path, offset, dtype, count):
            self.write(p, first, piece)

    def drop(self, p: torch.nn.Parameter) -> None:
        """Forget `p`'s partition; the file goes with the last one."""
        self._regions.pop(p.ds_id, None)
        if self.where == "nvme" and not self._regions and self._finalizer is not None:
            self._finalizer()
            self._fd, self._end, self._finalizer = None, 0, None

    # ---- the file ---------------------------------------------------------------------

    def _allocate(self, nbytes: int) -> int:
        if self._fd is None:
            assert self.nvme_path is not None
            os.makedirs(self.nvme_path, exist_ok=True)
            self._path = os.path.join(
                self.nvme_path, f"fzero-init-rank{self.rank}-{os.getpid()}-{id(self):x}.swap"
            )
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self._finalizer = weakref.finalize(self, _remove_file, self._fd, self._path)
        offset = self._end
        self._end += -(-nbytes // 4096) * 4096  # page-aligned regions
        return offset

    def _pwrite(self, offset: int, part: Tensor, p: torch.nn.Parameter) -> None:
        assert self._fd is not None
        view = memoryview(part.view(torch.uint8).numpy()) if part.numel() else memoryview(b"")
        done = 0
        try:
            while done < len(view):
                done += os.pwritev(self._fd, [view[done:]], offset + done)
        except OSError as error:
            raise OSError(
                error.errno,
                f"writing the partition of parameter ds_id {p.ds_id} (shape "
                f"{tuple(p.ds_shape)}, {len(view)} bytes) to {self._path}: {error.strerror}",
            ) from error


def _remove_file(fd: int, path: str) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _store(p: Tensor) -> PartitionStore:
    return p.__dict__["_fzero_partitions"]


# ---- partitioning whole parameters ------------------------------------------------------


def partition_parameters(
    params: Sequence[torch.nn.Parameter],
    store: PartitionStore,
    *,
    dtype: torch.dtype | None = None,
    persistence_threshold: int = 0,
    what: str = "",
) -> None:
    """Reduce each of `params` (whole, the same list on every rank) to this rank's
    partition in `store`, floating ones cast to `dtype` first; collective. Every rank
    keeps rank 0's values (see [Note: rank 0's values]). `what` names them in errors."""
    params = [p for p in params if not is_partitioned(p)]
    if not params:
        return
    wholes = []
    for p in params:
        value = p.data.detach()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        wholes.append(value.contiguous())
    agreed = _same_on_every_rank(wholes, what)
    for p, whole, same in zip(params, wholes, agreed):
        if not same:  # built differently on some rank: rank 0's, as DeepSpeed keeps
            whole = whole.to(comm.backend_device())
            comm.broadcast_from(whole, src=0, what=f"rank 0's construction of {what}")
        start, stop, size = partition_range(whole.numel(), store.world, store.rank)
        part = torch.zeros(size, dtype=whole.dtype, device=whole.device)
        part[: stop - start].copy_(whole.reshape(-1)[start:stop])
        describe_zero3_param(
            p, tuple(p.shape), persistent=whole.numel() <= persistence_threshold, available=False
        )
        p._fzero_partitions = store
        store.put(p, part)
        p.data = torch.empty(0, dtype=whole.dtype, device=p.device)


def _digest(tensor: Tensor) -> int:
    host = tensor.detach().cpu().contiguous()
    data = memoryview(host.view(torch.uint8).numpy()) if host.numel() else b""
    return xxhash.xxh3_64_intdigest(data)


def _same_on_every_rank(tensors: Sequence[Tensor], what: str) -> list[bool]:
    """Whether every rank holds the same bytes of each tensor (one all-reduce of their
    digests: the max of each 32-bit half and of its negation)."""
    if comm.get_world_size() == 1:
        return [True] * len(tensors)
    halves = []
    for tensor in tensors:
        value = _digest(tensor)
        halves += [value >> 32, value & 0xFFFFFFFF]
    both = torch.tensor(halves + [-h for h in halves], dtype=torch.int64)
    both = both.to(comm.backend_device())
    comm.all_reduce(both, op="max", what=f"comparing each rank's construction of {what}")
    top, bottom = both[: len(halves)], -both[len(halves) :]
    same = (top == bottom).view(-1, 2).all(dim=1)
    return [bool(s) for s in same.cpu()]


# ---- reading, writing, gathering ----------------------------------------------------------


def read_partition(p: torch.nn.Parameter) -> Tensor:
    """This rank's padded partition of `p`, in memory."""
    return _store(p).read(p)


def write_partition(p: torch.nn.Parameter, values: Tensor) -> None:
    """Set this rank's partition of `p` from `values`: its `[start, stop)` elements of
    the flattened tensor (`partition_range`), written in place (the padding stays the
    zeros `partition_parameters` put there)."""
    store = _store(p)
    start, stop, _ = partition_range(p.ds_numel, store.world, store.rank)
    if values.numel() != stop - start:
        raise ValueError(
            f"partition of parameter ds_id {p.ds_id} (shape {tuple(p.ds_shape)}) is "
            f"{stop - start} elements on rank {store.rank}; got {values.numel()}"
        )
    store.write(p, 0, values.reshape(-1))


def read_partition_from_file(
    p: torch.nn.Parameter, path: str, offset: int, dtype: torch.dtype
) -> None:
    """Set this rank's partition of `p` from the file `path` that holds the whole
    tensor row-major in `dtype` from byte `offset`: only the partition's bytes are read,
    converted to `p`'s dtype as they go into the partition (see [Note: loading by byte
    range])."""
    store = _store(p)
    start, stop, _ = partition_range(p.ds_numel, store.world, store.rank)
    store.read_from_file(p, path, offset + start * dtype.itemsize, dtype, stop - start)


def gather_whole(p: torch.nn.Parameter, *, what: str = "") -> Tensor:
    """`p`'s whole values on the compute device (every rank's partition); collective."""
    store = _store(p)
    device = store.compute_device
    part = store.read(p).to(device)
    if store.world == 1:
        whole = part[: p.ds_numel].clone()
    else:
        padded = torch.empty(part.numel() * store.world, dtype=part.dtype, device=device)
        name = what or f"parameter ds_id {p.ds_id} {tuple(p.ds_shape)}"
        comm.all_gather_into(padded, part, what=f"gathering partitioned {name}")
        whole = padded[: p.ds_numel]
    return whole.view(p.ds_shape)


def _release(p: torch.nn.Parameter) -> None:
    p.data = torch.empty(0, dtype=p.dtype, device=p.data.device)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def release_partition(p: torch.nn.Parameter) -> None:
    """Forget `p`'s partition (adopted by an engine or made whole): the store drops it
    and `p` no longer counts as partitioned."""
    _store(p).drop(p)
    del p.__dict__["_fzero_partitions"]
    p.__dict__.pop("ds_tensor", None)


def materialise(p: torch.nn.Parameter) -> None:
    """Make `p` whole again on every rank (collective) and forget its partition."""
    whole = gather_whole(p)
    release_partition(p)
    p.data = whole
    p.ds_status = ZeroParamStatus.AVAILABLE


# ---- GatheredParameters -------------------------------------------------------------------


@contextlib.contextmanager
def gathered_partitions(
    params: Iterable[torch.nn.Parameter], modifier_rank: int | None = None
) -> Iterator[None]:
    """DeepSpeed's `GatheredParameters` on partitioned `params`: whole on every rank
    inside the block (collective); on exit, with `modifier_rank`, that rank's values
    become the partitions (see [Note: loading by byte range]), else edits are dropped
    as DeepSpeed drops them. Blocks nest: an inner block leaves whole what an outer one
    gathered."""
    params = sorted({id(p): p for p in params if is_partitioned(p)}.values(), key=_ds_id)
    world = comm.get_world_size()
    if modifier_rank is not None and not 0 <= modifier_rank < world:
        raise ValueError(f"modifier_rank is {modifier_rank}; allowed: None or 0..{world - 1}")
    fresh = [p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
    for p in fresh:
        p.data = gather_whole(p)
        p.ds_status = ZeroParamStatus.AVAILABLE
    modifies = modifier_rank is not None and modifier_rank == comm.get_rank()
    edits = _Edits(params) if modifies else None
    try:
        with edits if edits is not None else contextlib.nullcontext():
            yield
    except BaseException:
        for p in fresh:
            _release(p)
        raise
    if modifier_rank is not None and params:
        read = _take_edits(params, modifier_rank, edits, fresh)
        for p in read:  # whole for an enclosing block: its new values, every rank's part
            if not any(p is f for f in fresh):
                p.data = gather_whole(p)
    for p in fresh:
        _release(p)
    if modifier_rank is not None and fresh:
        # [Note: loading by byte range] A load is one such block per module; what each
        # leaves freed between live blocks of glibc's heap (under the 1 MiB mapping
        # threshold) added up to ~10 MB over a 125M-parameter model: to the OS (~3 ms)
        _nvme.return_free_memory()


def _ds_id(p: torch.nn.Parameter) -> int:
    return p.ds_id


_METADATA_PROPERTIES = {
    torch._C.TensorBase.__dict__[name]
    for name in (
        "shape",
        "dtype",
        "device",
        "ndim",
        "requires_grad",
        "is_leaf",
        "grad",
        "grad_fn",
        "data",
        "layout",
        "is_meta",
        "is_cuda",
        "names",
    )
    if name in torch._C.TensorBase.__dict__
}
_METADATA_METHODS = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.stride,
    torch.Tensor.is_contiguous,
    torch.Tensor.data_ptr,
    torch.Tensor.storage_offset,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.__len__,
    torch.Tensor.untyped_storage,
}


def _is_metadata(func: Any) -> bool:
    return func in _METADATA_METHODS or getattr(func, "__self__", None) in _METADATA_PROPERTIES


def _storage(value: Any) -> int:
    try:
        return value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return 0


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class _Edits(TorchFunctionMode):
    """What the modifier rank does to gathered `params` inside the block: which it
    touched, and whole-tensor copies into them recorded for later (see [Note: loading
    by byte range])."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__()
        self.params = list(params)
        self.wholes = {_storage(p.data): i for i, p in enumerate(self.params)}
        self.touched: set[int] = set()
        self.deferred: dict[int, Tensor] = {}  # parameter index -> source of a copy

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _is_metadata(func):
            return func(*args, **kwargs)
        storages = {_storage(t) for t in _tensors((args, kwargs))} - {0}
        hits = {self.wholes[s] for s in storages if s in self.wholes}
        hits |= {i for i, src in self.deferred.items() if _storage(src) in storages}
        if not hits:
            return func(*args, **kwargs)
        target = self._whole_copy(func, args)
        if target is not None:
            self.deferred[target] = args[1]
            self.touched.discard(target)
            return args[0]
        for i in hits:
            self.run_deferred(i)
        self.touched |= hits
        return func(*args, **kwargs)

    def _whole_copy(self, func: Any, args: tuple[Any, ...]) -> int | None:
        """The parameter `func(*args)` overwrites whole from another tensor, if it does."""
        if func is not torch.Tensor.copy_ or len(args) < 2:
            return None
        dest, source = args[0], args[1]
        if not isinstance(source, Tensor) or _storage(source) in self.wholes:
            return None
        index = self.wholes.get(_storage(dest))
        if index is None:
            return None
        whole = self.params[index].data
        if (
            dest.data_ptr() != whole.data_ptr()
            or dest.shape != whole.shape
            or not dest.is_contiguous()
            or source.shape != dest.shape
        ):
            return None
        return index

    def run_deferred(self, index: int) -> None:
        """Run the recorded copy into parameter `index`, if any."""
        source = self.deferred.pop(index, None)
        if source is not None:
            with torch.no_grad():
                self.params[index].data.copy_(source)
            self.touched.add(index)

    def decisions(self) -> list[list[Any]]:
        """Per parameter: `["same"]`, `["memory"]` (this rank's values travel), or
        `["file", path, offset, dtype, digest]` (every rank reads its partition's bytes
        of a file)."""
        indices = sorted(self.deferred)
        sources = [self.deferred[i] for i in indices]
        where = dict(zip(indices, mapped_bytes(sources)))
        out: list[list[Any]] = []
        for i in range(len(self.params)):
            mapped = where.get(i)
            if mapped is not None:
                dtype = dtype_name(self.deferred[i].dtype)
                out.append(["file", mapped.path, mapped.offset, dtype, mapped.digest])
                continue
            self.run_deferred(i)  # not from a file: copied now, and sent
            out.append(["memory"] if i in self.touched else ["same"])
        return out


def _take_edits(
    params: Sequence[torch.nn.Parameter],
    modifier_rank: int,
    edits: _Edits | None,
    fresh: Sequence[torch.nn.Parameter],
) -> list[torch.nn.Parameter]:
    """The modifier rank's values of `params` into every rank's partitions; collective.
    Returns those read from a file (their whole values here are not the new ones: those
    whole for this block only, `fresh`, are released before their partitions are read,
    so the two never coexist)."""
    world, rank = comm.get_world_size(), comm.get_rank()
    mine = msgpack.packb(edits.decisions() if edits is not None else [], use_bin_type=True)
    told = comm.all_gather_bytes(mine)[modifier_rank] if world > 1 else mine
    decisions = msgpack.unpackb(told, raw=False)
    readable = []  # whether this rank reads the same file the modifier mapped
    for decision in decisions:
        if decision[0] == "file":
            _, path, offset, _, digest = decision
            try:
                readable.append(file_digest(path, offset) == digest)
            except OSError:
                readable.append(False)
    if world > 1 and readable:
        agreed = torch.tensor(readable, dtype=torch.int32, device=comm.backend_device())
        comm.all_reduce(agreed, op="min", what="agreeing on the files the ranks read")
        readable = [bool(x) for x in agreed.cpu()]
    files, read, whole_here = iter(readable), [], {id(p) for p in fresh}
    for index, (p, decision) in enumerate(zip(params, decisions)):
        kind = decision[0]
        if kind == "same":
            continue
        if kind == "file" and next(files):
            _, path, offset, dtype, _ = decision
            if id(p) in whole_here:
                _release(p)
            read_partition_from_file(p, path, offset, dtype_of(dtype))
            read.append(p)
            continue
        if edits is not None:
            edits.run_deferred(index)
        if world > 1:
            whole = p.data.contiguous()
            comm.broadcast_from(whole, src=modifier_rank, what=f"rank {modifier_rank}'s edits")
        else:
            whole = p.data
        start, stop, _ = partition_range(p.ds_numel, world, rank)
        write_partition(p, whole.reshape(-1)[start:stop])
    return read
