"""cffi (API mode) build of fzero's native kernels: `fzero.native._kernels`.

setup.py compiles it during `pip install`; by hand: `python native_src/build.py`.
"""

from __future__ import annotations

import os
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

AIO_PROTOTYPES = """
typedef struct fz_aio fz_aio;
fz_aio *fz_aio_new(int threads);
int64_t fz_aio_submit(fz_aio *q, int fd, void *buf, int64_t nbytes, int64_t offset, int write,
                      int64_t block);
int fz_aio_wait(fz_aio *q, int64_t ticket);
void fz_aio_free(fz_aio *q);
"""

CDEF = """
void fz_adam(float *p, const float *g, float *m, float *v, int64_t n, float grad_scale,
             int decoupled, float decay, float l2, float one_minus_beta1, float beta2,
             float one_minus_beta2, float c2sqrt, float eps, float neg_step, void *out,
             int out_kind, int threads);
void fz_lamb_direction(const float *p, const float *g, float *m, float *v, float *u, int64_t n,
                       float grad_scale, float beta1, float one_minus_beta1, float beta2,
                       float one_minus_beta2, float c1, float c2, float eps, float wd,
                       int threads);
void fz_lamb_apply(float *p, const float *u, const int64_t *starts, const int64_t *stops,
                   const float *scales, int64_t segments, void *out, int out_kind,
                   int threads);
void fz_sgd(float *p, const float *g, float *buf, int64_t n, float grad_scale, float wd,
            float momentum, float one_minus_dampening, int first, int nesterov, float neg_lr,
            void *out, int out_kind, int threads);
void fz_adagrad(float *p, const float *g, float *s, int64_t n, float grad_scale, float wd,
                float neg_lr, float eps, void *out, int out_kind, int threads);
void fz_lion(float *p, const float *g, float *m, int64_t n, float grad_scale, float beta1,
             float one_minus_beta1, float beta2, float one_minus_beta2, int decayed,
             float decay, float neg_lr, void *out, int out_kind, int threads);
void fz_sq_sum(const float *g, int64_t n, double *sum, int *nonfinite, int threads);
void fz_segment_sq_sums(const float *x, const int64_t *starts, const int64_t *stops,
                        int64_t segments, double *out, int threads);
void fz_stream_floor(float *p, const float *g, float *m, float *v, int64_t n, int threads);
void fz_bf16_stochastic(const float *x, uint16_t *out, int64_t n, uint64_t seed, int threads);
void fz_quantize_int8(const float *x, int64_t n, int8_t *codes, float *scales, int threads);
void fz_dequantize_int8(const int8_t *codes, const float *scales, int64_t n, int64_t parts,
                        int64_t stride, void *out, int out_kind, int threads);
void fz_dequantize_mean_int8(const int8_t *codes, const float *scales, int64_t n,
                             int64_t parts, int64_t stride, float *out, int threads);
void fz_quantize_int4(const float *x, int64_t n, uint8_t *codes, float *scales, int threads);
void fz_dequantize_mean_int4(const uint8_t *codes, const float *scales, int64_t n,
                             int64_t parts, int64_t stride, float *out, int threads);
"""
CDEF += AIO_PROTOTYPES


def _compile_args() -> list[str]:
    if sys.platform == "win32":
        return ["/O2", "/openmp", "/fp:precise"]
    return ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=c11"]


ffibuilder = FFI()
ffibuilder.cdef(CDEF)
with open(os.path.join(HERE, "fzero_kernels.c")) as source:
    ffibuilder.set_source(
        "fzero.native._kernels",
        source.read() + AIO_PROTOTYPES,
        sources=[os.path.relpath(os.path.join(HERE, "fzero_aio.c"))],
        include_dirs=[HERE],  # fzero_common.h, shared with the CUDA kernels
        extra_compile_args=_compile_args(),
        extra_link_args=[] if sys.platform == "win32" else ["-fopenmp", "-pthread"],
    )

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=os.path.join(HERE, "..", "build", "cffi"), verbose=True)
