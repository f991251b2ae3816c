"""NVMe offload (ZeRO-Infinity, Rajbhandari et al. 2021): optimizer state in a file.

Each rank keeps its fp32 masters and optimizer state tensors in one swap file under
`nvme_path`, a region per (unit, kind), each region padded to 4 KiB so it can be read
and written with O_DIRECT into 4 KiB-aligned host buffers. Transfers go through
fzero's native thread pool of pread/pwrite (`native_src/fzero_aio.c`; a Python thread
pool when the kernels are not built), so the engine reads unit i+1 while it updates
unit i and writes unit i-1. The file has a unique name per rank and run, is
allocated in full up front (a full disk is an error naming the path and the bytes),
and is removed when the engine goes away or the process exits.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import errno
import os
import shutil
import uuid
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from fzero import native

__all__ = [
    "AsyncIO",
    "BufferPool",
    "SwapFile",
    "aligned_empty",
    "map_large_buffers",
    "return_free_memory",
]

ALIGN = 4096


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """A tensor of `numel` elements whose data starts on a 4 KiB boundary and whose
    storage extends to a multiple of 4 KiB (what O_DIRECT needs)."""
    size = dtype.itemsize
    padded = -(-max(numel, 1) * size // ALIGN) * ALIGN // size
    raw = torch.empty(padded + ALIGN // size, dtype=dtype)
    skip = (-raw.data_ptr() % ALIGN) // size
    return raw[skip : skip + padded][:numel]


class BufferPool:
    """Aligned host buffers of one size, reused from step to step.

    With `map_large_buffers` each fresh unit-sized buffer is a new mapping whose pages
    fault in on first touch; allocating the step's swap buffers, gradient copies and
    gradient writes afresh cost 0.4 s a step for a 100.7M-parameter model
    (`benchmarks/offload.py`). The pool keeps as many as were in use at once, unless
    trimmed.
    """

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32) -> None:
        self.numel, self.dtype = numel, dtype
        self._free: list[Tensor] = []

    def take(self) -> Tensor:
        return self._free.pop() if self._free else aligned_empty(self.numel, self.dtype)

    def give(self, buffer: Tensor) -> None:
        if buffer.numel() != self.numel:
            raise ValueError(f"buffer of {buffer.numel()} elements; the pool's are {self.numel}")
        self._free.append(buffer)

    def trim(self, keep: int) -> None:
        """Free all but `keep` idle buffers."""
        del self._free[keep:]

    @property
    def idle(self) -> int:
        """Buffers kept for the next `take`."""
        return len(self._free)


def available_memory() -> int | None:
    """Bytes of memory the kernel says a new allocation can have without swapping
    (`MemAvailable`), or None where it does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def return_free_memory() -> None:
    """Give freed heap memory back to the OS (glibc's malloc_trim).

    Unit-sized buffers come and go during an offloaded step; glibc keeps such freed
    blocks in its heap, so without this the process's resident memory grows towards
    the sizes NVMe offload exists to avoid (measured: 1.64 GB -> 0.91 GB after a step
    of a 100M-parameter model). A no-op where glibc is not the allocator.
    """
    if _libc is not None:
        _libc.malloc_trim(0)


def map_large_buffers(threshold: int = 2**20) -> None:
    """Serve every allocation of `threshold` bytes or more with its own mapping, which
    goes back to the OS when freed (glibc's `M_MMAP_THRESHOLD`; process-wide).

    glibc starts with a 128 KiB threshold but raises it, up to 32 MiB, each time a
    mapped block is freed; from then on unit-sized buffers come from the heap, and the
    heap keeps what it frees. Offloading allocates and frees such buffers all the time,
    so resident memory grew to the size offload exists to avoid: a 100.7M-parameter
    model with NVMe offload peaked at 1.82 GB with the moving threshold and 0.79 GB
    with it fixed at 1 MiB (`benchmarks/offload.py`). A no-op without glibc, and where
    the user set the threshold (`MALLOC_MMAP_THRESHOLD_`, or `glibc.malloc.mmap_threshold`
    in `GLIBC_TUNABLES`): theirs stays.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or "glibc.malloc.mmap_threshold" in tunables:
        return
    if _libc is not None and hasattr(_libc, "mallopt"):
        _libc.mallopt(_M_MMAP_THRESHOLD, threshold)


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _glibc():
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_libc = _glibc()


class AsyncIO:
    """Asynchronous pread/pwrite of tensor bytes; `submit` returns a ticket, `wait` it."""

    def __init__(self, threads: int, block_size: int) -> None:
        self.block_size = block_size
        if native.available():
            self._lib, self._ffi = native._lib, native._ffi
            self._queue = self._lib.fz_aio_new(threads)
            self._pool = None
        else:
            self._lib = None
            self._pool = concurrent.futures.ThreadPoolExecutor(threads, "fzero-aio")

    def submit(self, fd: int, tensor: Tensor, nbytes: int, offset: int, write: bool) -> object:
        if self._lib is not None:
            pointer = self._ffi.cast("void *", tensor.data_ptr())
            return self._lib.fz_aio_submit(
                self._queue, fd, pointer, nbytes, offset, int(write), self.block_size
            )
        view = memoryview((_c_char_array(nbytes)).from_address(tensor.data_ptr())).cast("B")
        return self._pool.submit(_transfer, fd, view, offset, write)

    def wait(self, ticket: object) -> int:
        """0, or the errno of the first failure."""
        if self._lib is not None:
            return int(self._lib.fz_aio_wait(self._queue, ticket))
        return ticket.result()

    def close(self) -> None:
        if self._lib is not None and self._queue is not None:
            self._lib.fz_aio_free(self._queue)
            self._queue = None
        if self._pool is not None:
            self._pool.shutdown()


def _c_char_array(nbytes: int):
    import ctypes

    return ctypes.c_char * nbytes


def _transfer(fd: int, view: memoryview, offset: int, write: bool) -> int:
    moved = 0
    try:
        while moved < len(view):
            n = (os.pwrite if write else _pread_into)(fd, view[moved:], offset + moved)
            if n == 0:
                return errno.EIO if write else errno.ENODATA
            moved += n
    except OSError as error:
        return error.errno or errno.EIO
    return 0


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


class SwapFile:
    """One rank's swap file: fixed regions of `sizes` bytes, read and written async."""

    def __init__(
        self,
        directory: str,
        rank: int,
        sizes: Sequence[int],
        threads: int,
        block_size: int,
        *,
        what: str = "optimizer",
        key: str = "zero_optimization.offload_optimizer.nvme_path",
    ) -> None:
        if not directory:
            raise ValueError(f"{key} is required for device 'nvme'")
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"{key} {directory!r} is not a directory")
        name = f"fzero-{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{rank}.swap"
        self.path = os.path.join(directory, name)
        self.offsets = []
        total = 0
        for nbytes in sizes:
            self.offsets.append(total)
            total += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = total
        # Every local rank puts its file in the same directory: say so before training
        # starts, not when a step runs out of room halfway.
        free = shutil.disk_usage(directory).free
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if total * ranks > free:
            raise OSError(
                errno.ENOSPC,
                f"{key} {directory!r} cannot hold the {what} swap files: {ranks} local "
                f"rank(s) x {total:,} bytes needed, {free:,} bytes free",
            )
        self.direct = True
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            self.fd = os.open(self.path, flags | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:  # a filesystem without O_DIRECT (tmpfs): buffered I/O
            self.fd, self.direct = os.open(self.path, flags, 0o600), False
        self._finalizer = weakref.finalize(self, _remove, self.fd, self.path)
        atexit.register(self._finalizer)
        try:
            os.posix_fallocate(self.fd, 0, max(total, 1))
        except OSError as error:
            self.close()
            raise OSError(
                error.errno,
                f"cannot allocate the {what} swap file {self.path}: {total:,} bytes needed, "
                f"{shutil.disk_usage(directory).free:,} free "
                f"({os.strerror(error.errno or errno.EIO)})",
            ) from None
        if os.fstat(self.fd).st_size < total:
            self.close()
            raise OSError(
                errno.ENOSPC, f"swap file {self.path} is shorter than the {total:,} bytes needed"
            )
        self.io = AsyncIO(threads, block_size)
        self.bytes_read = self.bytes_written = 0  # submitted so far (the step report's rates)

    def submit(self, region: int, tensor: Tensor, write: bool, offset: int = 0) -> object:
        """Start moving `tensor`'s bytes (rounded up to whole 4 KiB pages) to or from
        region `region`, from byte `offset` of it (a multiple of 4 KiB: O_DIRECT)."""
        if offset % ALIGN:
            raise ValueError(f"swap file offset {offset} is not a multiple of {ALIGN} bytes")
        nbytes = -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        if write:
            self.bytes_written += nbytes
        else:
            self.bytes_read += nbytes
        return self.io.submit(self.fd, tensor, nbytes, self.offsets[region] + offset, write)

    def wait(self, ticket: object, what: str) -> None:
        error = self.io.wait(ticket)
        if error:
            raise OSError(error, f"{what} {self.path} failed: {os.strerror(error)}")

    def close(self) -> None:
        if getattr(self, "io", None) is not None:
            self.io.close()
            self.io = None
        self._finalizer()


def _remove(fd: int, path: str) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
