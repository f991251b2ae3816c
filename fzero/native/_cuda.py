"""fzero's CUDA kernels (`native_src/fzero_kernels.cu`): compiled at first use by NVRTC,
loaded and launched through the CUDA driver API, both reached through cffi's ABI mode
(`ffi.dlopen` of `libnvrtc` and `libcuda`), so installing fzero needs no CUDA toolchain.

Each device architecture compiles once per process (and once per machine: the cubin is
cached under `$FZERO_CACHE_DIR`, default `~/.cache/fzero`, named by a hash of the source,
the options and NVRTC's version). Kernels run on PyTorch's current stream of the tensors'
device, in the primary context PyTorch uses. `compile_source` needs NVRTC only, not a
GPU: CI compiles every kernel to PTX for sm_80 and sm_90 on a CPU machine.

Launch arguments are packed from `(C type, value)` pairs (`launch`), so the argument
lists in `fzero.native` read like the C prototypes.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

__all__ = [
    "KERNELS",
    "OPTIONS",
    "CudaError",
    "available",
    "compile_source",
    "launch",
    "nvrtc",
    "source",
    "why",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
# an installed wheel ships the source beside this module; a source checkout has it in
# native_src/
SOURCE_PATH = next(
    (
        path
        for path in (
            os.path.join(_HERE, "fzero_kernels.cu"),
            os.path.join(os.path.dirname(os.path.dirname(_HERE)), "native_src", "fzero_kernels.cu"),
        )
        if os.path.isfile(path)
    ),
    os.path.join(_HERE, "fzero_kernels.cu"),
)
KERNELS = (
    "fz_adam",
    "fz_lamb_direction",
    "fz_lamb_apply",
    "fz_sgd",
    "fz_adagrad",
    "fz_lion",
    "fz_sq_sum_partial",
    "fz_sq_sum_final",
    "fz_segment_sq_partial",
    "fz_segment_sq_final",
    "fz_bf16_stochastic",
    "fz_stream_floor",
    "fz_quantize_int8",
    "fz_dequantize_int8",
    "fz_dequantize_mean_int8",
    "fz_quantize_int4",
    "fz_dequantize_mean_int4",
)
# No contraction but the source's fmaf calls; IEEE division and square root (the default).
OPTIONS = ("--fmad=false", "--std=c++17")
THREADS = 256  # per block; FZ_REDUCE_THREADS in the source
REDUCE_BLOCKS = 1024  # blocks of the first reduction pass (partials the second one sums)
SEGMENT_BLOCKS = 128  # at most, per segment, in the first pass of segment sums
MAX_BLOCKS = 65_535  # of a grid-stride launch (x); any larger grid only adds blocks
MAX_BLOCKS_Y = 65_535  # CUDA's limit on gridDim.y (LAMB's segments)

_NVRTC_CDEF = """
typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;
const char *nvrtcGetErrorString(nvrtcResult result);
nvrtcResult nvrtcVersion(int *major, int *minor);
nvrtcResult nvrtcCreateProgram(nvrtcProgram *prog, const char *src, const char *name,
                               int numHeaders, const char *const *headers,
                               const char *const *includeNames);
nvrtcResult nvrtcDestroyProgram(nvrtcProgram *prog);
nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int numOptions, const char *const *options);
nvrtcResult nvrtcGetPTXSize(nvrtcProgram prog, size_t *ptxSizeRet);
nvrtcResult nvrtcGetPTX(nvrtcProgram prog, char *ptx);
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t *cubinSizeRet);
nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char *cubin);
nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, size_t *logSizeRet);
nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char *log);
"""

_DRIVER_CDEF = """
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
CUresult cuInit(unsigned int flags);
CUresult cuGetErrorString(CUresult error, const char **pStr);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra);
"""
_MAJOR, _MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}


class CudaError(RuntimeError):
    """NVRTC or the CUDA driver failed; the message names the call and its error."""


HEADER = "fzero_common.h"  # beside the source: the bit formulas it shares with the C kernels


def source() -> str:
    """The CUDA C source of the kernels."""
    with open(SOURCE_PATH) as f:
        return f.read()


def header() -> str:
    """The header the source includes (NVRTC is given it by name)."""
    with open(os.path.join(os.path.dirname(SOURCE_PATH), HEADER)) as f:
        return f.read()


def _library(names: Sequence[str], wheel_dirs: Sequence[str]) -> str | None:
    """The first of `names` found in an NVIDIA wheel's lib directory on sys.path (as
    `nvidia-cuda-nvrtc` and torch's CUDA builds install them), else by the loader."""
    for entry in sys.path:
        for sub in wheel_dirs:
            for name in names:
                found = sorted(glob.glob(os.path.join(entry, "nvidia", sub, "lib", name)))
                if found:
                    return found[-1]
    return None


class _Api:
    """One dlopened C library and its cffi; `call` raises `CudaError` on a nonzero
    result."""

    def __init__(self, cdef: str, candidates: Sequence[str], what: str) -> None:
        from cffi import FFI

        self.ffi = FFI()
        self.ffi.cdef(cdef)
        errors = []
        for candidate in candidates:
            try:
                self.lib = self.ffi.dlopen(candidate)
                self.path = candidate
                return
            except OSError as error:
                errors.append(f"{candidate}: {error}")
        raise OSError(f"{what} not found ({'; '.join(errors) or 'no candidates'})")


class _Nvrtc(_Api):
    def __init__(self) -> None:
        wheel = _library(["libnvrtc.so*"], ["cu13", "cu12", "cuda_nvrtc"])
        names = [wheel] if wheel else []
        names += ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"]
        super().__init__(_NVRTC_CDEF, names, "NVRTC (pip install nvidia-cuda-nvrtc)")
        major, minor = self.ffi.new("int *"), self.ffi.new("int *")
        self.check(self.lib.nvrtcVersion(major, minor), "nvrtcVersion")
        self.version = (major[0], minor[0])

    def check(self, result: int, call: str) -> None:
        if result != 0:
            message = self.ffi.string(self.lib.nvrtcGetErrorString(result)).decode()
            raise CudaError(f"{call} failed: {message} ({result})")

    def compile(self, text: str, arch: str, output: str) -> bytes:
        """`text` compiled for `arch` ("sm_90"): PTX (`output="ptx"`, for the virtual
        architecture compute_90) or a cubin (`output="cubin"`)."""
        ffi, lib = self.ffi, self.lib
        virtual = arch.replace("sm_", "compute_")
        target = virtual if output == "ptx" else arch
        program = ffi.new("nvrtcProgram *")
        headers = [ffi.new("char[]", header().encode())]
        names = [ffi.new("char[]", HEADER.encode())]
        self.check(
            lib.nvrtcCreateProgram(program, text.encode(), b"fzero_kernels.cu", 1, headers, names),
            "nvrtcCreateProgram",
        )
        try:
            options = [ffi.new("char[]", o.encode()) for o in (f"--gpu-architecture={target}",)]
            options += [ffi.new("char[]", o.encode()) for o in OPTIONS]
            result = lib.nvrtcCompileProgram(program[0], len(options), options)
            if result != 0:
                size = ffi.new("size_t *")
                lib.nvrtcGetProgramLogSize(program[0], size)
                log = ffi.new("char[]", size[0])
                lib.nvrtcGetProgramLog(program[0], log)
                raise CudaError(
                    f"NVRTC could not compile {SOURCE_PATH} for {target}:\n"
                    + ffi.string(log).decode(errors="replace")
                )
            size = ffi.new("size_t *")
            getsize, get = (
                (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
                if output == "ptx"
                else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            )
            self.check(getsize(program[0], size), f"nvrtcGet{output.upper()}Size")
            image = ffi.new("char[]", size[0])
            self.check(get(program[0], image), f"nvrtcGet{output.upper()}")
            return bytes(ffi.buffer(image, size[0]))
        finally:
            lib.nvrtcDestroyProgram(program)


class _Driver(_Api):
    def __init__(self) -> None:
        super().__init__(_DRIVER_CDEF, ["libcuda.so.1", "libcuda.so"], "the CUDA driver")
        self.check(self.lib.cuInit(0), "cuInit")

    def check(self, result: int, call: str) -> None:
        if result != 0:
            text = self.ffi.new("const char **")
            self.lib.cuGetErrorString(result, text)
            message = self.ffi.string(text[0]).decode() if text[0] != self.ffi.NULL else "?"
            raise CudaError(f"{call} failed: {message} ({result})")


_lock = threading.Lock()
_state: dict[str, Any] = {}  # "nvrtc", "driver", ("why",), modules by device index


def nvrtc() -> _Nvrtc:
    """NVRTC, loaded once (raises `OSError` naming what was tried)."""
    with _lock:
        if "nvrtc" not in _state:
            _state["nvrtc"] = _Nvrtc()
        return _state["nvrtc"]


def compile_source(arch: str, output: str = "ptx", text: str | None = None) -> bytes:
    """The kernels (or `text`) compiled by NVRTC for `arch` ("sm_80", "sm_90", ...) with
    `OPTIONS`; needs no GPU."""
    if output not in ("ptx", "cubin"):
        raise ValueError(f"output {output!r} is not allowed; use 'ptx' or 'cubin'")
    return nvrtc().compile(source() if text is None else text, arch, output)


def _cache_path(arch: str, text: str) -> str:
    version = "{}.{}".format(*nvrtc().version)
    key = hashlib.sha256("\0".join([text, header(), *OPTIONS, version, arch]).encode())
    key = key.hexdigest()
    root = os.environ.get("FZERO_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "fzero"
    )
    return os.path.join(root, "cuda", f"fzero_kernels-{arch}-{key[:16]}.cubin")


def _cubin(arch: str) -> bytes:
    """The kernels for `arch`, from the cache or compiled and cached (atomic write)."""
    text = source()
    path = _cache_path(arch, text)
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return f.read()
    image = compile_source(arch, "cubin", text)
    with contextlib.suppress(OSError):  # a read-only home only costs the next compile
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        os.replace(partial, path)
    return image


def _module(device: int) -> dict[str, Any]:
    """The kernels loaded into `device`'s primary context: name -> CUfunction."""
    import torch

    with _lock:
        if device in _state:
            return _state[device]
    driver = _driver()
    torch.cuda.init()
    with torch.cuda.device(device):
        ffi, lib = driver.ffi, driver.lib
        context = ffi.new("CUcontext *")
        driver.check(lib.cuCtxGetCurrent(context), "cuCtxGetCurrent")
        if context[0] == ffi.NULL:  # PyTorch has not made it current on this thread yet
            handle = ffi.new("CUdevice *")
            driver.check(lib.cuDeviceGet(handle, device), "cuDeviceGet")
            driver.check(lib.cuDevicePrimaryCtxRetain(context, handle[0]), "cuDevicePrimaryCtx")
            driver.check(lib.cuCtxSetCurrent(context[0]), "cuCtxSetCurrent")
        major, minor = torch.cuda.get_device_capability(device)
        image = _cubin(f"sm_{major}{minor}")
        module = ffi.new("CUmodule *")
        driver.check(lib.cuModuleLoadData(module, image), "cuModuleLoadData")
        functions = {"_keep": (image, module), "_context": context[0]}
        for name in KERNELS:
            function = ffi.new("CUfunction *")
            driver.check(
                lib.cuModuleGetFunction(function, module[0], name.encode()),
                f"cuModuleGetFunction({name})",
            )
            functions[name] = function[0]
    with _lock:
        _state[device] = functions
    return functions


def _driver() -> _Driver:
    with _lock:
        if "driver" not in _state:
            _state["driver"] = _Driver()
        return _state["driver"]


def available() -> bool:
    """Whether the CUDA kernels can run here: a CUDA device, the driver and NVRTC found,
    and the kernels compiled for device 0 (checked once, at first call)."""
    return why() == "loaded"


def why() -> str:
    """'loaded', or why CUDA tensors take the torch path."""
    with _lock:
        known = _state.get("why")
    if known is not None:
        return known
    reason = _probe()
    with _lock:
        _state["why"] = reason
    return reason


def _probe() -> str:
    import torch

    if os.environ.get("FZERO_NATIVE", "1") == "0":
        return "FZERO_NATIVE=0"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _module(torch.cuda.current_device())
    except (OSError, CudaError, ImportError) as error:
        return f"CUDA kernels unavailable ({error}); using the torch path"
    return "loaded"


def launch(
    name: str, device: int, stream: int, grid: tuple[int, int], args: Sequence[tuple[str, Any]]
) -> None:
    """Kernel `name` on `device`, `grid` = (blocks x, blocks y) of `THREADS` threads, on
    `stream` (a CUstream handle; 0 is the legacy default stream), with `args` as
    (C type, value) pairs in the kernel's order (pointers as integers)."""
    module = _module(device)
    function = module[name]
    driver = _driver()
    ffi = driver.ffi
    current = ffi.new("CUcontext *")
    driver.check(driver.lib.cuCtxGetCurrent(current), "cuCtxGetCurrent")
    if current[0] != module["_context"]:  # a thread where PyTorch has not made it current
        driver.check(driver.lib.cuCtxSetCurrent(module["_context"]), "cuCtxSetCurrent")
    holders = [ffi.new(f"{kind} *", ffi.cast(kind, value)) for kind, value in args]
    params = ffi.new("void *[]", [ffi.cast("void *", h) for h in holders])
    driver.check(
        driver.lib.cuLaunchKernel(
            function, grid[0], grid[1], 1, THREADS, 1, 1, 0,
            ffi.cast("CUstream", stream), params, ffi.NULL,
        ),
        f"cuLaunchKernel({name})",
    )  # fmt: skip
