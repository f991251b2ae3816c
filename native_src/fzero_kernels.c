/* fzero native optimizer kernels over contiguous fp32 buffers (one optimizer shard).
 *
 * References they implement (each has a pure-torch twin in fzero/optim, and a test
 * comparing the two):
 *   Adam / AdamW: Kingma & Ba 2015; Loshchilov & Hutter 2019 (decoupled decay),
 *     operation for operation as torch.optim's single-tensor path (fzero/optim/_adam.py);
 *   LAMB: You et al. 2020, direction and per-tensor trust-ratio apply
 *     (fzero/optim/_lamb.py);
 *   SGD with momentum / Nesterov (fzero/optim/_sgd.py);
 *   Adagrad: Duchi, Hazan & Singer 2011, as torch.optim.Adagrad (fzero/optim/_adagrad.py);
 *   Lion: Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"
 *     (fzero/optim/_lion.py);
 *   sum of squares + non-finite flag of a gradient (fzero/optim/_clip.py);
 *   per-segment sums of squares (fzero/optim/_lamb.py, segment_sq_sums).
 *
 * Every loop is plain C the compiler vectorises; `FZ_CLONES` builds it for AVX-512,
 * AVX2 and baseline x86-64 and picks one at load time (GCC/Clang target_clones), so one
 * binary runs on any x86-64; other architectures get the portable build. Compiled with
 * -ffp-contract=off: the compiler fuses nothing; the fmaf calls below are where ATen's
 * vectorised kernels fuse (lerp, add with alpha), so each element rounds as torch's
 * vector body does. (torch's scalar tail, under one vector per chunk, rounds those two
 * without FMA: there results may differ by 1 ulp.) Threads: OpenMP, `threads` per call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(FZ_NO_CLONES)
#define FZ_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FZ_CLONES
#endif

#define FZ_OUT_NONE 0
#define FZ_OUT_BF16 1
#define FZ_OUT_FP16 2

/* The 16-bit copy of updated parameters is write-only: plain stores first read each
 * destination line (read-for-ownership), 2 more bytes per element on top of the 30 an
 * update with copy-out must move. Non-temporal stores (SSE2, so every x86-64 clone)
 * skip that read; elsewhere the copy is a plain memcpy. */
#if defined(__SSE2__)
#include <emmintrin.h>
#define FZ_STREAM_STORES 1
#else
#define FZ_STREAM_STORES 0
#endif
#define FZ_OUT_BLOCK 64 /* elements staged on the stack before they are streamed out */

static inline void fz_stream_out(uint16_t *restrict out, const uint16_t *restrict staged,
                                 int64_t n) {
#if FZ_STREAM_STORES
    for (int64_t j = 0; j < n; j += 8) /* out 16-byte aligned, n a multiple of 8 */
        _mm_stream_si128((__m128i *)(out + j), _mm_load_si128((const __m128i *)(staged + j)));
#else
    memcpy(out, staged, (size_t)n * sizeof(uint16_t));
#endif
}

static inline void fz_stream_fence(void) {
#if FZ_STREAM_STORES
    _mm_sfence(); /* streamed stores are weakly ordered: drain before others read them */
#endif
}

static inline uint32_t fz_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float fz_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

typedef uint16_t fz_u16;
typedef uint32_t fz_u32;
typedef uint64_t fz_u64;
typedef int64_t fz_i64;
#define FZ_FN static inline
#include "fzero_common.h" /* fz_bf16, fz_fp16, fz_bf16_stochastic_at: shared with CUDA */

static inline void fz_copy_out(void *out, int out_kind, int64_t i, float value) {
    if (out_kind == FZ_OUT_BF16) ((uint16_t *)out)[i] = fz_bf16(value);
    else if (out_kind == FZ_OUT_FP16) ((uint16_t *)out)[i] = fz_fp16(value);
}

/* torch.lerp(start, end, weight) for one element, as ATen's vectorised kernel computes
 * it: one fused multiply-add from the nearer end. */
static inline float fz_lerp(float start, float end, float weight) {
    return fabsf(weight) < 0.5f ? fmaf(weight, end - start, start)
                                : fmaf(weight - 1.0f, end - start, end);
}

/* Adam / AdamW in place. With `decoupled`, p *= decay (decay = 1 - lr*wd);
 * otherwise g += l2 * p. Then m = lerp(m, g, 1-beta1); v = v*beta2 + (1-beta2)*g*g;
 * p += (neg_step * m) / (sqrt(v) / c2sqrt + eps). Gradients are first multiplied by
 * `grad_scale` (loss-scale inverse x clip coefficient) unless it is 1.
 *
 * The body is instantiated per combination of the loop-invariant switches (constant
 * arguments to an always-inline function), so each inner loop is branch-free and
 * vectorises. */
typedef struct {
    float grad_scale, decay, l2, w, beta2, one_minus_beta2, c2sqrt, eps, neg_step;
} fz_adam_args;

static inline __attribute__((always_inline)) void fz_adam_range(
    float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
    uint16_t *restrict out, int64_t lo, int64_t hi, const fz_adam_args a, const int decoupled,
    const int l2, const int scaled, const int small_w, const int out_kind) {
    for (int64_t i = lo; i < hi; i++) {
        float gi = scaled ? g[i] * a.grad_scale : g[i];
        float pi = p[i];
        if (decoupled) pi = pi * a.decay;
        if (l2) gi = fmaf(a.l2, pi, gi); /* torch's add(alpha=): one FMA */
        const float diff = gi - m[i];
        const float mi = small_w ? fmaf(a.w, diff, m[i]) : fmaf(a.w - 1.0f, diff, gi);
        float vi = v[i] * a.beta2;
        vi = vi + a.one_minus_beta2 * gi * gi;
        const float denom = sqrtf(vi) / a.c2sqrt + a.eps;
        pi = pi + a.neg_step * mi / denom;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        if (out_kind == FZ_OUT_BF16) out[i] = fz_bf16(pi);
        if (out_kind == FZ_OUT_FP16) out[i] = fz_fp16(pi);
    }
}

/* fz_adam_range with the 16-bit copy staged on the stack and streamed out in aligned
 * blocks; the unaligned head and the tail are stored directly. */
static inline __attribute__((always_inline)) void fz_adam_range_out(
    float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
    uint16_t *restrict out, int64_t lo, int64_t hi, const fz_adam_args a, const int decoupled,
    const int l2, const int scaled, const int small_w, const int out_kind) {
    int64_t i = lo;
    const int64_t misaligned = (int64_t)(((uintptr_t)(out + lo) & 15u) / sizeof(uint16_t));
    const int64_t head = misaligned ? lo + 8 - misaligned : lo;
    if (head >= hi || ((uintptr_t)out & 1u)) {
        fz_adam_range(p, g, m, v, out, lo, hi, a, decoupled, l2, scaled, small_w, out_kind);
        return;
    }
    fz_adam_range(p, g, m, v, out, lo, head, a, decoupled, l2, scaled, small_w, out_kind);
    _Alignas(16) uint16_t staged[FZ_OUT_BLOCK];
    for (i = head; i + FZ_OUT_BLOCK <= hi; i += FZ_OUT_BLOCK) {
        fz_adam_range(p + i, g + i, m + i, v + i, staged, 0, FZ_OUT_BLOCK, a, decoupled, l2,
                      scaled, small_w, out_kind);
        fz_stream_out(out + i, staged, FZ_OUT_BLOCK);
    }
    fz_adam_range(p, g, m, v, out, i, hi, a, decoupled, l2, scaled, small_w, out_kind);
    fz_stream_fence();
}

#define FZ_ADAM_CASE(D, L, S, W, O)                                                         \
    if (decoupled == D && use_l2 == L && scaled == S && small_w == W && out_kind == O) {     \
        if (O) fz_adam_range_out(p, g, m, v, out16, lo, hi, a, D, L, S, W, O);              \
        else fz_adam_range(p, g, m, v, out16, lo, hi, a, D, L, S, W, O);                    \
        continue;                                                                          \
    }
#define FZ_ADAM_OUT(D, L, S, W) FZ_ADAM_CASE(D, L, S, W, 0) FZ_ADAM_CASE(D, L, S, W, 1) FZ_ADAM_CASE(D, L, S, W, 2)
#define FZ_ADAM_W(D, L, S) FZ_ADAM_OUT(D, L, S, 0) FZ_ADAM_OUT(D, L, S, 1)
#define FZ_ADAM_S(D, L) FZ_ADAM_W(D, L, 0) FZ_ADAM_W(D, L, 1)

FZ_CLONES
void fz_adam(float *p, const float *g, float *m, float *v, int64_t n, float grad_scale,
             int decoupled, float decay, float l2, float one_minus_beta1, float beta2,
             float one_minus_beta2, float c2sqrt, float eps, float neg_step, void *out,
             int out_kind, int threads) {
    const fz_adam_args a = {grad_scale, decay, l2, one_minus_beta1, beta2, one_minus_beta2,
                            c2sqrt, eps, neg_step};
    const int scaled = grad_scale != 1.0f;
    const int use_l2 = !decoupled && l2 != 0.0f;
    const int small_w = fabsf(one_minus_beta1) < 0.5f;
    uint16_t *out16 = (uint16_t *)out;
    const int64_t chunk = 16384; /* whole vectors per chunk; chunks spread over threads */
    const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t lo = c * chunk;
        const int64_t hi = lo + chunk < n ? lo + chunk : n;
        FZ_ADAM_S(0, 0) FZ_ADAM_S(0, 1) FZ_ADAM_S(1, 0)
    }
}

/* In what follows fmaf(a, b, c) stands wherever torch calls add(c, b, alpha=a): ATen
 * computes that as one fused multiply-add. */

/* LAMB, first pass: advance the moments and write the direction (fz_lamb_direction_at). */
FZ_CLONES
void fz_lamb_direction(const float *p, const float *g, float *m, float *v, float *u, int64_t n,
                       float grad_scale, float beta1, float one_minus_beta1, float beta2,
                       float one_minus_beta2, float c1, float c2, float eps, float wd,
                       int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++)
        fz_lamb_direction_at(p, g, m, v, u, i, grad_scale, beta1, one_minus_beta1, beta2,
                             one_minus_beta2, c1, c2, eps, wd);
}

/* LAMB, second pass: p += scale[s] * u over each segment s = [starts[s], stops[s]),
 * scale[s] = -lr * trust_ratio(s). */
FZ_CLONES
void fz_lamb_apply(float *p, const float *u, const int64_t *starts, const int64_t *stops,
                   const float *scales, int64_t segments, void *out, int out_kind,
                   int threads) {
    for (int64_t s = 0; s < segments; s++) {
        const float scale = scales[s];
        const int64_t stop = stops[s];
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = starts[s]; i < stop; i++) {
            const float pi = fmaf(scale, u[i], p[i]);
            p[i] = pi;
            if (out_kind) fz_copy_out(out, out_kind, i, pi);
        }
    }
}

/* SGD (fz_sgd_at), with the 16-bit copy of the new parameters. */
FZ_CLONES
void fz_sgd(float *p, const float *g, float *buf, int64_t n, float grad_scale, float wd,
            float momentum, float one_minus_dampening, int first, int nesterov, float neg_lr,
            void *out, int out_kind, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float pi = fz_sgd_at(p, g, buf, i, grad_scale, wd, momentum, one_minus_dampening,
                                   first, nesterov, neg_lr);
        if (out_kind) fz_copy_out(out, out_kind, i, pi);
    }
}

/* Adagrad (fz_adagrad_at), with the 16-bit copy of the new parameters. */
FZ_CLONES
void fz_adagrad(float *p, const float *g, float *s, int64_t n, float grad_scale, float wd,
                float neg_lr, float eps, void *out, int out_kind, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float pi = fz_adagrad_at(p, g, s, i, grad_scale, wd, neg_lr, eps);
        if (out_kind) fz_copy_out(out, out_kind, i, pi);
    }
}

/* Lion (fz_lion_at), with the 16-bit copy of the new parameters. */
FZ_CLONES
void fz_lion(float *p, const float *g, float *m, int64_t n, float grad_scale, float beta1,
             float one_minus_beta1, float beta2, float one_minus_beta2, int decayed,
             float decay, float neg_lr, void *out, int out_kind, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float pi = fz_lion_at(p, g, m, i, grad_scale, beta1, one_minus_beta1, beta2,
                                    one_minus_beta2, decayed, decay, neg_lr);
        if (out_kind) fz_copy_out(out, out_kind, i, pi);
    }
}

/* Sum of squares in double and whether any element is inf or NaN, in one pass. */
FZ_CLONES
void fz_sq_sum(const float *g, int64_t n, double *sum, int *nonfinite, int threads) {
    double total = 0.0;
    int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total) reduction(| : bad)
    for (int64_t i = 0; i < n; i++) {
        const double x = (double)g[i];
        total += x * x;
        bad |= !isfinite(g[i]);
    }
    *sum = total;
    *nonfinite = bad;
}

/* Sum of squares (in double) of x[starts[s]:stops[s]] into out[s], for each segment s
 * (LAMB's per-tensor norms of a shard). */
FZ_CLONES
void fz_segment_sq_sums(const float *x, const int64_t *starts, const int64_t *stops,
                        int64_t segments, double *out, int threads) {
    for (int64_t s = 0; s < segments; s++) {
        double total = 0.0;
        const int64_t stop = stops[s];
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
        for (int64_t i = starts[s]; i < stop; i++) {
            const double v = (double)x[i];
            total += v * v;
        }
        out[s] = total;
    }
}

/* float -> bfloat16, stochastically (fz_bf16_stochastic_at, in fzero_common.h). */
void fz_bf16_stochastic(const float *x, uint16_t *out, int64_t n, uint64_t seed, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = fz_bf16_stochastic_at(x[i], seed, i);
}

/* Blockwise int8 codes and scales of x (n elements; codes for whole blocks, the padding
 * 0): fz_absmax and fz_int8_code in fzero_common.h, as fzero.core.quantize.quantize. */
void fz_quantize_int8(const float *x, int64_t n, int8_t *codes, float *scales, int threads) {
    const int64_t blocks = (n + FZ_QBLOCK - 1) / FZ_QBLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * FZ_QBLOCK;
        const int64_t stop = start + FZ_QBLOCK < n ? start + FZ_QBLOCK : n;
        float amax = 0.0f;
        for (int64_t i = start; i < stop; i++) amax = fz_absmax(amax, x[i]);
        const float scale = amax / 127.0f;
        const float divisor = scale > 0.0f ? scale : 1.0f;
        scales[b] = scale;
        for (int64_t i = start; i < start + FZ_QBLOCK; i++)
            codes[i] = i < stop ? fz_int8_code(x[i], divisor) : 0;
    }
}

static float fz_dequantized(const int8_t *codes, const float *scales, int64_t stride,
                            int64_t r, int64_t i) {
    return (float)codes[r * stride + i] * scales[r * (stride / FZ_QBLOCK) + i / FZ_QBLOCK];
}

/* `parts` rows of codes (`stride` each, whole blocks) back to values: out[r * n + i] =
 * code * its block's scale, as fp32 (out_kind 0), bf16 (1) or fp16 (2), rounded to
 * nearest (qwZ's gathered parameters). */
void fz_dequantize_int8(const int8_t *codes, const float *scales, int64_t n, int64_t parts,
                        int64_t stride, void *out, int out_kind, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < parts * n; k++) {
        const float value = fz_dequantized(codes, scales, stride, k / n, k % n);
        if (out_kind == 1) ((uint16_t *)out)[k] = fz_bf16(value);
        else if (out_kind == 2) ((uint16_t *)out)[k] = fz_fp16(value);
        else ((float *)out)[k] = value;
    }
}

/* The mean of `parts` dequantized rows, summed in row order in fp32, then divided by
 * `parts` (qgZ: what the owner of a gradient shard keeps). */
void fz_dequantize_mean_int8(const int8_t *codes, const float *scales, int64_t n,
                             int64_t parts, int64_t stride, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float total = fz_dequantized(codes, scales, stride, 0, i);
        for (int64_t r = 1; r < parts; r++) total = total + fz_dequantized(codes, scales, stride, r, i);
        out[i] = total / (float)parts;
    }
}

/* Blockwise int4 codes (two to a byte, whole blocks, the padding 0) and scales of x:
 * fz_absmax, fz_int4_code and fz_int4_pack in fzero_common.h, as
 * fzero.core.quantize.quantize with bits=4. */
void fz_quantize_int4(const float *x, int64_t n, uint8_t *codes, float *scales, int threads) {
    const int64_t blocks = (n + FZ_QBLOCK - 1) / FZ_QBLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * FZ_QBLOCK;
        const int64_t stop = start + FZ_QBLOCK < n ? start + FZ_QBLOCK : n;
        float amax = 0.0f;
        for (int64_t i = start; i < stop; i++) amax = fz_absmax(amax, x[i]);
        const float scale = amax / 7.0f;
        const float divisor = scale > 0.0f ? scale : 1.0f;
        scales[b] = scale;
        for (int64_t i = start; i < start + FZ_QBLOCK; i += 2) {
            const signed char low = i < stop ? fz_int4_code(x[i], divisor) : 0;
            const signed char high = i + 1 < stop ? fz_int4_code(x[i + 1], divisor) : 0;
            codes[i / 2] = fz_int4_pack(low, high);
        }
    }
}

static float fz_dequantized_int4(const uint8_t *codes, const float *scales, int64_t stride,
                                 int64_t r, int64_t i) {
    return (float)fz_int4_at(codes, r * stride + i) * scales[r * (stride / FZ_QBLOCK) + i / FZ_QBLOCK];
}

/* As fz_dequantize_mean_int8 over packed int4 codes (`stride` elements a row, stride / 2
 * bytes): the mean of `parts` rows, summed in row order in fp32 (qgZ with 4 bits). */
void fz_dequantize_mean_int4(const uint8_t *codes, const float *scales, int64_t n,
                             int64_t parts, int64_t stride, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float total = fz_dequantized_int4(codes, scales, stride, 0, i);
        for (int64_t r = 1; r < parts; r++)
            total = total + fz_dequantized_int4(codes, scales, stride, r, i);
        out[i] = total / (float)parts;
    }
}

/* The memory floor of an Adam step: read p, g, m, v and write p, m, v (28 bytes per
 * element) with the least arithmetic, for benchmarks/cpu_adam.py. */
FZ_CLONES
void fz_stream_floor(float *p, const float *g, float *m, float *v, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i];
        m[i] = m[i] + gi;
        v[i] = v[i] + gi;
        p[i] = p[i] + gi;
    }
}
