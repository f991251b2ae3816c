/* fzero native optimizer kernels for CUDA devices, over contiguous fp32 buffers (one
 * optimizer shard): the same contract and arithmetic as fzero_kernels.c, element for
 * element, so each matches the same pure-torch twin in fzero/optim.
 *
 * Compiled at first use by NVRTC (fzero/native/_cuda.py) with --fmad=false: nothing is
 * fused but the fmaf calls, which stand where ATen's kernels fuse (lerp, add with alpha),
 * exactly as in the C kernels; division and sqrt are IEEE round-to-nearest (NVRTC's
 * default -prec-div/-prec-sqrt). Elementwise kernels are grid-stride loops launched on
 * PyTorch's current stream; the sum of squares reduces per block into `partials` and
 * then in one block in a fixed order, so it is deterministic (no atomics).
 *
 * Entry points are extern "C" so their names are the ones `_cuda.KERNELS` lists.
 */

typedef unsigned short fz_u16;
typedef unsigned int fz_u32;
typedef unsigned long long fz_u64;
typedef long long fz_i64;
typedef signed char fz_i8;
typedef unsigned char fz_u8;

#define FZ_OUT_NONE 0
#define FZ_OUT_BF16 1
#define FZ_OUT_FP16 2

__device__ __forceinline__ fz_u32 fz_bits(float f) { return __float_as_uint(f); }

__device__ __forceinline__ float fz_float(fz_u32 u) { return __uint_as_float(u); }

#define FZ_FN __device__ __forceinline__
#include "fzero_common.h" /* fz_bf16, fz_fp16, fz_bf16_stochastic_at: shared with the C kernels */

__device__ __forceinline__ void fz_copy_out(void *out, int out_kind, fz_i64 i, float value) {
    if (out_kind == FZ_OUT_BF16) ((fz_u16 *)out)[i] = fz_bf16(value);
    else if (out_kind == FZ_OUT_FP16) ((fz_u16 *)out)[i] = fz_fp16(value);
}

#define FZ_GRID_STRIDE(i, n)                                                                \
    for (fz_i64 i = (fz_i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                 \
         i += (fz_i64)gridDim.x * blockDim.x)

/* Adam / AdamW in place, as fz_adam: with `decoupled`, p *= decay (1 - lr*wd); with
 * `use_l2`, g += l2 * p. Then m = lerp(m, g, w) (w = 1-beta1); v = v*beta2 +
 * (1-beta2)*g*g; p += (neg_step * m) / (sqrt(v) / c2sqrt + eps). Gradients are first
 * multiplied by `grad_scale` unless it is 1. */
extern "C" __global__ void fz_adam(float *__restrict__ p, const float *__restrict__ g,
                                   float *__restrict__ m, float *__restrict__ v, fz_i64 n,
                                   float grad_scale, int decoupled, float decay, float l2,
                                   float w, float beta2, float one_minus_beta2, float c2sqrt,
                                   float eps, float neg_step, void *out, int out_kind) {
    const int scaled = grad_scale != 1.0f;
    const int use_l2 = !decoupled && l2 != 0.0f;
    const int small_w = fabsf(w) < 0.5f;
    FZ_GRID_STRIDE(i, n) {
        float gi = scaled ? g[i] * grad_scale : g[i];
        float pi = p[i];
        if (decoupled) pi = pi * decay;
        if (use_l2) gi = fmaf(l2, pi, gi);
        const float diff = gi - m[i];
        const float mi = small_w ? fmaf(w, diff, m[i]) : fmaf(w - 1.0f, diff, gi);
        float vi = v[i] * beta2;
        vi = vi + one_minus_beta2 * gi * gi;
        const float denom = sqrtf(vi) / c2sqrt + eps;
        pi = pi + neg_step * mi / denom;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        fz_copy_out(out, out_kind, i, pi);
    }
}

/* LAMB, first pass, as fz_lamb_direction (fz_lamb_direction_at). */
extern "C" __global__ void fz_lamb_direction(const float *__restrict__ p,
                                             const float *__restrict__ g, float *__restrict__ m,
                                             float *__restrict__ v, float *__restrict__ u,
                                             fz_i64 n, float grad_scale, float beta1,
                                             float one_minus_beta1, float beta2,
                                             float one_minus_beta2, float c1, float c2,
                                             float eps, float wd) {
    FZ_GRID_STRIDE(i, n) {
        fz_lamb_direction_at(p, g, m, v, u, i, grad_scale, beta1, one_minus_beta1, beta2,
                             one_minus_beta2, c1, c2, eps, wd);
    }
}

/* LAMB, second pass, as fz_lamb_apply: p += scales[s] * u over segment s =
 * [starts[s], stops[s]) (scale = -lr x trust ratio); blockIdx.y is the segment. */
extern "C" __global__ void fz_lamb_apply(float *__restrict__ p, const float *__restrict__ u,
                                         const fz_i64 *__restrict__ starts,
                                         const fz_i64 *__restrict__ stops,
                                         const float *__restrict__ scales, void *out,
                                         int out_kind) {
    const fz_i64 start = starts[blockIdx.y];
    const float scale = scales[blockIdx.y];
    FZ_GRID_STRIDE(j, stops[blockIdx.y] - start) {
        const fz_i64 i = start + j;
        const float pi = fmaf(scale, u[i], p[i]);
        p[i] = pi;
        fz_copy_out(out, out_kind, i, pi);
    }
}

/* SGD, as fz_sgd (fz_sgd_at), with the 16-bit copy of the new parameters. */
extern "C" __global__ void fz_sgd(float *__restrict__ p, const float *__restrict__ g,
                                  float *__restrict__ buf, fz_i64 n, float grad_scale, float wd,
                                  float momentum, float one_minus_dampening, int first,
                                  int nesterov, float neg_lr, void *out, int out_kind) {
    FZ_GRID_STRIDE(i, n) {
        const float pi = fz_sgd_at(p, g, buf, i, grad_scale, wd, momentum, one_minus_dampening,
                                   first, nesterov, neg_lr);
        fz_copy_out(out, out_kind, i, pi);
    }
}

/* Adagrad, as fz_adagrad (fz_adagrad_at), with the 16-bit copy of the new parameters. */
extern "C" __global__ void fz_adagrad(float *__restrict__ p, const float *__restrict__ g,
                                      float *__restrict__ s, fz_i64 n, float grad_scale,
                                      float wd, float neg_lr, float eps, void *out,
                                      int out_kind) {
    FZ_GRID_STRIDE(i, n) {
        const float pi = fz_adagrad_at(p, g, s, i, grad_scale, wd, neg_lr, eps);
        fz_copy_out(out, out_kind, i, pi);
    }
}

/* Lion, as fz_lion (fz_lion_at), with the 16-bit copy of the new parameters. */
extern "C" __global__ void fz_lion(float *__restrict__ p, const float *__restrict__ g,
                                   float *__restrict__ m, fz_i64 n, float grad_scale,
                                   float beta1, float one_minus_beta1, float beta2,
                                   float one_minus_beta2, int decayed, float decay,
                                   float neg_lr, void *out, int out_kind) {
    FZ_GRID_STRIDE(i, n) {
        const float pi = fz_lion_at(p, g, m, i, grad_scale, beta1, one_minus_beta1, beta2,
                                    one_minus_beta2, decayed, decay, neg_lr);
        fz_copy_out(out, out_kind, i, pi);
    }
}

#define FZ_REDUCE_THREADS 256 /* the launch's block size for both reduction kernels */

/* Block-wide sums (double) and ors (int) into thread 0, in a fixed tree order. */
__device__ __forceinline__ void fz_block_reduce(double *sums, int *flags) {
    for (int stride = FZ_REDUCE_THREADS / 2; stride > 0; stride /= 2) {
        __syncthreads();
        if (threadIdx.x < stride) {
            sums[threadIdx.x] += sums[threadIdx.x + stride];
            flags[threadIdx.x] |= flags[threadIdx.x + stride];
        }
    }
}

/* Sum of squares (in double) and any inf/NaN of g, first pass: one partial per block
 * into partials[blockIdx.x] and flags[blockIdx.x]. */
extern "C" __global__ void fz_sq_sum_partial(const float *__restrict__ g, fz_i64 n,
                                             double *__restrict__ partials,
                                             int *__restrict__ flags) {
    __shared__ double sums[FZ_REDUCE_THREADS];
    __shared__ int bad[FZ_REDUCE_THREADS];
    double total = 0.0;
    int nonfinite = 0;
    FZ_GRID_STRIDE(i, n) {
        const double x = (double)g[i];
        total += x * x;
        nonfinite |= !isfinite(g[i]);
    }
    sums[threadIdx.x] = total;
    bad[threadIdx.x] = nonfinite;
    fz_block_reduce(sums, bad);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = sums[0];
        flags[blockIdx.x] = bad[0];
    }
}

/* Second pass, one block: the `count` partials summed into partials[0], flags[0]. */
extern "C" __global__ void fz_sq_sum_final(double *__restrict__ partials,
                                           int *__restrict__ flags, int count) {
    __shared__ double sums[FZ_REDUCE_THREADS];
    __shared__ int bad[FZ_REDUCE_THREADS];
    double total = 0.0;
    int nonfinite = 0;
    for (int i = threadIdx.x; i < count; i += FZ_REDUCE_THREADS) {
        total += partials[i];
        nonfinite |= flags[i];
    }
    sums[threadIdx.x] = total;
    bad[threadIdx.x] = nonfinite;
    fz_block_reduce(sums, bad);
    if (threadIdx.x == 0) {
        partials[0] = sums[0];
        flags[0] = bad[0];
    }
}

/* Sums of squares (in double) of x over each segment s = [starts[s], stops[s]) (LAMB's
 * per-tensor norms), first pass: blockIdx.y is the segment; one partial per block into
 * partials[s * gridDim.x + blockIdx.x]. */
extern "C" __global__ void fz_segment_sq_partial(const float *__restrict__ x,
                                                 const fz_i64 *__restrict__ starts,
                                                 const fz_i64 *__restrict__ stops,
                                                 double *__restrict__ partials) {
    __shared__ double sums[FZ_REDUCE_THREADS];
    __shared__ int unused[FZ_REDUCE_THREADS];
    const fz_i64 start = starts[blockIdx.y];
    double total = 0.0;
    FZ_GRID_STRIDE(j, stops[blockIdx.y] - start) {
        const double v = (double)x[start + j];
        total += v * v;
    }
    sums[threadIdx.x] = total;
    unused[threadIdx.x] = 0;
    fz_block_reduce(sums, unused);
    if (threadIdx.x == 0) partials[(fz_i64)blockIdx.y * gridDim.x + blockIdx.x] = sums[0];
}

/* Second pass, one block per segment (blockIdx.y): its `count` partials into out[s]. */
extern "C" __global__ void fz_segment_sq_final(const double *__restrict__ partials, int count,
                                               double *__restrict__ out) {
    __shared__ double sums[FZ_REDUCE_THREADS];
    __shared__ int unused[FZ_REDUCE_THREADS];
    double total = 0.0;
    for (int i = threadIdx.x; i < count; i += FZ_REDUCE_THREADS)
        total += partials[(fz_i64)blockIdx.y * count + i];
    sums[threadIdx.x] = total;
    unused[threadIdx.x] = 0;
    fz_block_reduce(sums, unused);
    if (threadIdx.x == 0) out[blockIdx.y] = sums[0];
}

/* float -> bfloat16 stochastically, as fz_bf16_stochastic (fz_bf16_stochastic_at). */
extern "C" __global__ void fz_bf16_stochastic(const float *__restrict__ x,
                                              fz_u16 *__restrict__ out, fz_i64 n,
                                              fz_u64 seed) {
    FZ_GRID_STRIDE(i, n) { out[i] = fz_bf16_stochastic_at(x[i], seed, i); }
}

/* Blockwise int8, as fz_quantize_int8: one thread block (FZ_QBLOCK threads) per quant
 * block, grid-stride over blocks; the block's max|x| reduced in shared memory (an exact
 * max: any order gives the same value; NaN propagates as in fz_absmax). */
extern "C" __global__ void fz_quantize_int8(const float *__restrict__ x, fz_i64 n,
                                            fz_i8 *__restrict__ codes,
                                            float *__restrict__ scales) {
    __shared__ float amax[FZ_QBLOCK];
    const fz_i64 blocks = (n + FZ_QBLOCK - 1) / FZ_QBLOCK;
    for (fz_i64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        const fz_i64 i = b * FZ_QBLOCK + threadIdx.x;
        const float xi = i < n ? x[i] : 0.0f;
        amax[threadIdx.x] = fz_absmax(0.0f, xi);
        __syncthreads();
        for (int half = FZ_QBLOCK / 2; half > 0; half /= 2) {
            if (threadIdx.x < half)
                amax[threadIdx.x] = fz_absmax(amax[threadIdx.x], amax[threadIdx.x + half]);
            __syncthreads();
        }
        const float scale = amax[0] / 127.0f;
        const float divisor = scale > 0.0f ? scale : 1.0f;
        codes[i] = i < n ? fz_int8_code(xi, divisor) : 0;
        if (threadIdx.x == 0) scales[b] = scale;
        __syncthreads();
    }
}

__device__ __forceinline__ float fz_dequantized(const fz_i8 *codes, const float *scales,
                                                fz_i64 stride, fz_i64 r, fz_i64 i) {
    return (float)codes[r * stride + i] * scales[r * (stride / FZ_QBLOCK) + i / FZ_QBLOCK];
}

/* As fz_dequantize_int8: out[r * n + i] = code * scale, fp32 (0), bf16 (1) or fp16 (2). */
extern "C" __global__ void fz_dequantize_int8(const fz_i8 *__restrict__ codes,
                                              const float *__restrict__ scales, fz_i64 n,
                                              fz_i64 parts, fz_i64 stride, void *out,
                                              int out_kind) {
    FZ_GRID_STRIDE(k, parts * n) {
        const float value = fz_dequantized(codes, scales, stride, k / n, k % n);
        if (out_kind == 1) ((fz_u16 *)out)[k] = fz_bf16(value);
        else if (out_kind == 2) ((fz_u16 *)out)[k] = fz_fp16(value);
        else ((float *)out)[k] = value;
    }
}

/* As fz_dequantize_mean_int8: the rows summed in order in fp32, divided by `parts`. */
extern "C" __global__ void fz_dequantize_mean_int8(const fz_i8 *__restrict__ codes,
                                                   const float *__restrict__ scales, fz_i64 n,
                                                   fz_i64 parts, fz_i64 stride,
                                                   float *__restrict__ out) {
    FZ_GRID_STRIDE(i, n) {
        float total = fz_dequantized(codes, scales, stride, 0, i);
        for (fz_i64 r = 1; r < parts; r++) total = total + fz_dequantized(codes, scales, stride, r, i);
        out[i] = total / (float)parts;
    }
}

/* Blockwise int4, as fz_quantize_int4: the block's max|x| as in fz_quantize_int8, each
 * thread's code into shared memory, then the first half of the threads packs pairs. */
extern "C" __global__ void fz_quantize_int4(const float *__restrict__ x, fz_i64 n,
                                            fz_u8 *__restrict__ codes,
                                            float *__restrict__ scales) {
    __shared__ float amax[FZ_QBLOCK];
    __shared__ signed char code[FZ_QBLOCK];
    const fz_i64 blocks = (n + FZ_QBLOCK - 1) / FZ_QBLOCK;
    for (fz_i64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        const fz_i64 i = b * FZ_QBLOCK + threadIdx.x;
        const float xi = i < n ? x[i] : 0.0f;
        amax[threadIdx.x] = fz_absmax(0.0f, xi);
        __syncthreads();
        for (int half = FZ_QBLOCK / 2; half > 0; half /= 2) {
            if (threadIdx.x < half)
                amax[threadIdx.x] = fz_absmax(amax[threadIdx.x], amax[threadIdx.x + half]);
            __syncthreads();
        }
        const float scale = amax[0] / 7.0f;
        const float divisor = scale > 0.0f ? scale : 1.0f;
        code[threadIdx.x] = i < n ? fz_int4_code(xi, divisor) : 0;
        if (threadIdx.x == 0) scales[b] = scale;
        __syncthreads();
        if (threadIdx.x < FZ_QBLOCK / 2)
            codes[b * (FZ_QBLOCK / 2) + threadIdx.x] =
                fz_int4_pack(code[2 * threadIdx.x], code[2 * threadIdx.x + 1]);
        __syncthreads();
    }
}

__device__ __forceinline__ float fz_dequantized_int4(const fz_u8 *codes, const float *scales,
                                                     fz_i64 stride, fz_i64 r, fz_i64 i) {
    return (float)fz_int4_at(codes, r * stride + i) * scales[r * (stride / FZ_QBLOCK) + i / FZ_QBLOCK];
}

/* As fz_dequantize_mean_int4: packed int4 rows summed in order in fp32, divided by `parts`. */
extern "C" __global__ void fz_dequantize_mean_int4(const fz_u8 *__restrict__ codes,
                                                   const float *__restrict__ scales, fz_i64 n,
                                                   fz_i64 parts, fz_i64 stride,
                                                   float *__restrict__ out) {
    FZ_GRID_STRIDE(i, n) {
        float total = fz_dequantized_int4(codes, scales, stride, 0, i);
        for (fz_i64 r = 1; r < parts; r++)
            total = total + fz_dequantized_int4(codes, scales, stride, r, i);
        out[i] = total / (float)parts;
    }
}

/* The memory floor of an Adam step, as fz_stream_floor: read p, g, m, v and write p, m, v
 * (28 bytes per element) with the least arithmetic. */
extern "C" __global__ void fz_stream_floor(float *__restrict__ p, const float *__restrict__ g,
                                           float *__restrict__ m, float *__restrict__ v,
                                           fz_i64 n) {
    FZ_GRID_STRIDE(i, n) {
        const float gi = g[i];
        m[i] = m[i] + gi;
        v[i] = v[i] + gi;
        p[i] = p[i] + gi;
    }
}
