/* What the C and CUDA kernels share (fzero_kernels.c, fzero_kernels.cu): the bit formulas
 * of the 16-bit copies and of stochastic rounding, and the per-element bodies of SGD,
 * Adagrad, Lion and LAMB's direction, so both devices compute them in the same operations.
 *
 * The includer defines first: FZ_FN (the functions' qualifiers), the types fz_u16,
 * fz_u32, fz_u64 and fz_i64, and fz_bits / fz_float (a float's bits and back).
 */
#ifndef FZERO_BITS_H
#define FZERO_BITS_H

/* float -> bfloat16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays
 * NaN. Branch-free so the loops that call it vectorise. */
FZ_FN fz_u16 fz_bf16(float f) {
    const fz_u32 u = fz_bits(f);
    const fz_u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const fz_u32 quiet_nan = (u >> 16) | 0x0040u;
    const fz_u32 is_nan = 0u - (fz_u32)((u & 0x7fffffffu) > 0x7f800000u); /* all ones */
    return (fz_u16)((quiet_nan & is_nan) | (rounded & ~is_nan));
}

/* float -> IEEE half, round to nearest even, overflow to inf (Maratyszcza's FP16). */
FZ_FN fz_u16 fz_fp16(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    const fz_u32 w = fz_bits(f);
    const fz_u32 shl1_w = w + w;
    const fz_u32 sign = w & 0x80000000u;
    const fz_u32 raw_bias = shl1_w & 0xff000000u;
    const fz_u32 small = 0u - (fz_u32)(raw_bias < 0x71000000u);
    const fz_u32 bias = (0x71000000u & small) | (raw_bias & ~small);
    base = fz_float((bias >> 1) + 0x07800000u) + base;
    const fz_u32 bits = fz_bits(base);
    const fz_u32 exp_bits = (bits >> 13) & 0x00007c00u;
    const fz_u32 mantissa_bits = bits & 0x00000fffu;
    const fz_u32 nonsign = exp_bits + mantissa_bits;
    const fz_u32 is_nan = 0u - (fz_u32)(shl1_w > 0xff000000u);
    return (fz_u16)((sign >> 16) | (0x7e00u & is_nan) | (nonsign & ~is_nan));
}

/* float -> bfloat16, stochastically: the 16 dropped bits plus 16 random bits carry into
 * the kept ones with probability (dropped bits) / 2^16, so the rounding error averages to
 * zero. The random bits are the top 16 of splitmix64(seed + (i + 1) * golden): they
 * depend on (seed, i) only, as in fzero.optim.bf16_stochastic. Non-finite values round
 * to nearest. */
FZ_FN fz_u64 fz_mix64(fz_u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

FZ_FN fz_u16 fz_bf16_stochastic_at(float x, fz_u64 seed, fz_i64 i) {
    const fz_u32 u = fz_bits(x);
    const fz_u64 z = fz_mix64(seed + (fz_u64)(i + 1) * 0x9e3779b97f4a7c15ull);
    const fz_u32 noise = (fz_u32)(z >> 48);
    const int finite = (u & 0x7f800000u) != 0x7f800000u;
    return finite ? (fz_u16)((u + noise) >> 16) : fz_bf16(x);
}

/* SGD for element i: g += wd * p; buf = first ? g : buf * momentum + (1 - dampening) * g;
 * d = nesterov ? g + momentum * buf : buf (or g without momentum); p += neg_lr * d. The
 * new p[i] is stored and returned. fmaf stands where torch's add(alpha=) fuses. */
FZ_FN float fz_sgd_at(float *p, const float *g, float *buf, fz_i64 i, float grad_scale,
                      float wd, float momentum, float one_minus_dampening, int first,
                      int nesterov, float neg_lr) {
    float gi = grad_scale != 1.0f ? g[i] * grad_scale : g[i];
    if (wd != 0.0f) gi = fmaf(wd, p[i], gi);
    float d = gi;
    if (momentum != 0.0f) {
        const float bi = first ? gi : fmaf(one_minus_dampening, gi, buf[i] * momentum);
        buf[i] = bi;
        d = nesterov ? fmaf(momentum, bi, gi) : bi;
    }
    const float pi = fmaf(neg_lr, d, p[i]);
    p[i] = pi;
    return pi;
}

/* Adagrad for element i (Duchi, Hazan & Singer 2011, as torch.optim.Adagrad's
 * single-tensor path): g += wd * p; s = s + g * g; p = p + (neg_lr * g) / (sqrt(s) + eps),
 * neg_lr = -lr / (1 + (step - 1) * lr_decay). The new p[i] is stored and returned. */
FZ_FN float fz_adagrad_at(float *p, const float *g, float *s, fz_i64 i, float grad_scale,
                          float wd, float neg_lr, float eps) {
    float gi = grad_scale != 1.0f ? g[i] * grad_scale : g[i];
    if (wd != 0.0f) gi = fmaf(wd, p[i], gi);
    const float si = s[i] + gi * gi;
    const float pi = p[i] + neg_lr * gi / (sqrtf(si) + eps);
    s[i] = si;
    p[i] = pi;
    return pi;
}

/* Lion for element i (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
 * c = m * beta1 + (1 - beta1) * g; p = p * decay + neg_lr * sign(c) (decay = 1 - lr * wd,
 * applied when `decayed`); m = m * beta2 + (1 - beta2) * g. sign(+-0) = 0, sign(NaN) =
 * NaN (fzero/optim/_lion.py, lion_sign). The new p[i] is stored and returned. */
FZ_FN float fz_lion_at(float *p, const float *g, float *m, fz_i64 i, float grad_scale,
                       float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                       int decayed, float decay, float neg_lr) {
    const float gi = grad_scale != 1.0f ? g[i] * grad_scale : g[i];
    const float mi = m[i];
    const float c = fmaf(one_minus_beta1, gi, mi * beta1);
    const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : (c == 0.0f ? 0.0f : c));
    float pi = decayed ? p[i] * decay : p[i];
    pi = fmaf(neg_lr, sign, pi);
    m[i] = fmaf(one_minus_beta2, gi, mi * beta2);
    p[i] = pi;
    return pi;
}

/* LAMB's first pass for element i: advance m[i], v[i] and write the direction
 * u[i] = (m / c1) / (sqrt(v / c2) + eps) + wd * p. */
FZ_FN void fz_lamb_direction_at(const float *p, const float *g, float *m, float *v, float *u,
                                fz_i64 i, float grad_scale, float beta1,
                                float one_minus_beta1, float beta2, float one_minus_beta2,
                                float c1, float c2, float eps, float wd) {
    const float gi = grad_scale != 1.0f ? g[i] * grad_scale : g[i];
    const float mi = fmaf(one_minus_beta1, gi, m[i] * beta1);
    float vi = v[i] * beta2;
    vi = vi + one_minus_beta2 * gi * gi;
    float ui = (mi / c1) / (sqrtf(vi / c2) + eps);
    if (wd != 0.0f) ui = fmaf(wd, p[i], ui);
    m[i] = mi;
    v[i] = vi;
    u[i] = ui;
}

/* Blockwise int8 (fzero.core.quantize): FZ_QBLOCK elements per fp32 scale. A block's
 * scale is max|x| / 127 (NaN if any element is NaN: non-finite values reach the
 * dequantized result); an element's code is rint(x / divisor) (the scale, or 1 for an
 * all-zero block; half to even), NaN as 0, clamped to [-127, 127]. */
#define FZ_QBLOCK 256

FZ_FN float fz_absmax(float amax, float x) {
    const float a = fabsf(x);
    return (a > amax || a != a) ? a : amax;
}

FZ_FN signed char fz_int8_code(float x, float divisor) {
    float q = rintf(x / divisor);
    if (q != q) q = 0.0f;
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
    return (signed char)q;
}

/* Blockwise int4, as int8 with the scale max|x| / 7 and codes in [-7, 7], two to a byte:
 * element 2k of a block in the low nibble of byte k, element 2k + 1 in the high one, each
 * in two's complement (fzero.core.quantize.quantize with bits=4). */
FZ_FN signed char fz_int4_code(float x, float divisor) {
    float q = rintf(x / divisor);
    if (q != q) q = 0.0f;
    q = q > 7.0f ? 7.0f : (q < -7.0f ? -7.0f : q);
    return (signed char)q;
}

FZ_FN unsigned char fz_int4_pack(signed char low, signed char high) {
    return (unsigned char)((low & 0xF) | ((high & 0xF) << 4));
}

/* Code of element i of packed int4 codes: its nibble, sign-extended. */
FZ_FN int fz_int4_at(const unsigned char *codes, fz_i64 i) {
    const int nibble = (codes[i >> 1] >> ((i & 1) * 4)) & 0xF;
    return (nibble ^ 8) - 8;
}

#endif
