/* Row operations of a decoder layer, shared by the decode step (model/cpu_decode.c) and the
 * many-row kernels of prompts (layers/cpu_rows.c): RMSNorm, neox rotary embedding,
 * SiLU-and-mul. Each rounds as the torch layers do (layers/layernorm.py, rotary.py,
 * activation.py): fp32 arithmetic, the result of every torch op rounded to the model's dtype
 * (bf16 or fp32: `is_bf16`).
 *
 * Everything here is static: each library that includes it gets its own copy.
 */
#ifndef PAGEDSERVE_ROW_OPS_H
#define PAGEDSERVE_ROW_OPS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

/* The bits of x rounded to the nearest bf16 (ties to even), in the top half: float_to_bf16
 * without its NaN branch, so that loops of it vectorize (every NaN of the model's tensors
 * keeps a top-half payload, which the rounding leaves a NaN). */
ALWAYS_INLINE uint32_t bf16_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
}

ALWAYS_INLINE float rnd(float x, int is_bf16) {
    if (!is_bf16) return x;
    const uint32_t b = bf16_bits(x);
    float r;
    memcpy(&r, &b, sizeof r);
    return r;
}

ALWAYS_INLINE float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

ALWAYS_INLINE void store(void *p, int64_t i, float x, int is_bf16) {
    if (is_bf16) ((uint16_t *)p)[i] = (uint16_t)(bf16_bits(x) >> 16);
    else ((float *)p)[i] = x;
}

/* out[0:n] = w * (x / rms(x)), as RMSNorm's torch code rounds it: the normalized row in the
 * dtype, then the product with the weight. x: the fp32 row (a sum not yet rounded). */
static inline void rms_norm(const float *x, const void *w, float eps, int64_t n, float *out,
                            int is_bf16) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        out[i] = rnd(load(w, i, is_bf16) * rnd(x[i] * inv, is_bf16), is_bf16);
}

/* Neox rotary embedding of `heads` heads of x [heads, D] in place, as rotate_neox rounds;
 * cos_sin [max_position, D] (cos half | sin half) in the dtype. */
static inline void rotate(float *x, int64_t heads, int64_t dim, const void *cos_sin,
                          int64_t pos, int is_bf16) {
    const int64_t half = dim / 2;
    for (int64_t hd = 0; hd < heads; hd++) {
        float *v = x + hd * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float c = load(cos_sin, pos * dim + i, is_bf16);
            const float sn = load(cos_sin, pos * dim + half + i, is_bf16);
            const float x1 = v[i], x2 = v[half + i];
            v[i] = rnd(rnd(x1 * c, is_bf16) - rnd(x2 * sn, is_bf16), is_bf16);
            v[half + i] = rnd(rnd(x2 * c, is_bf16) + rnd(x1 * sn, is_bf16), is_bf16);
        }
    }
}

#if defined(__AVX512F__)
/* rotate's arithmetic on 16 lanes: (x1, x2), columns i and D/2 + i of a head, rotated in
 * place, each product, difference and sum rounded to the dtype (so the results are values of
 * the dtype: store16_exact narrows them). */
ALWAYS_INLINE void rotate16(__m512 *x1, __m512 *x2, __m512 c, __m512 sn, const int is_bf16) {
    const __m512 a = *x1, b = *x2;
    *x1 = rnd16(_mm512_sub_ps(rnd16(_mm512_mul_ps(a, c), is_bf16),
                              rnd16(_mm512_mul_ps(b, sn), is_bf16)), is_bf16);
    *x2 = rnd16(_mm512_add_ps(rnd16(_mm512_mul_ps(b, c), is_bf16),
                              rnd16(_mm512_mul_ps(a, sn), is_bf16)), is_bf16);
}

/* rotate of `heads` heads [heads, D] read from x[x_at:] (bf16 where x_is_bf16, else fp32)
 * and stored in the dtype at out[out_at:], in one pass of 16 lanes: no widened copy of the
 * row, each cos/sin vector loaded once for every head. cos_sin[cs_at:]: one position's cos
 * half | sin half, in the dtype. D/2 a multiple of 16. */
ALWAYS_INLINE void rotate_into16(const void *x, int64_t x_at, const int x_is_bf16, void *out,
                                 int64_t out_at, int64_t heads, int64_t dim,
                                 const void *cos_sin, int64_t cs_at, const int is_bf16) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __m512 c = load16(cos_sin, cs_at + i, is_bf16);
        const __m512 sn = load16(cos_sin, cs_at + half + i, is_bf16);
        for (int64_t hd = 0; hd < heads; hd++) {
            const int64_t at = hd * dim + i;
            __m512 x1 = load16(x, x_at + at, x_is_bf16), x2 = load16(x, x_at + at + half, x_is_bf16);
            rotate16(&x1, &x2, c, sn, is_bf16);
            store16_exact(out, out_at + at, x1, is_bf16);
            store16_exact(out, out_at + at + half, x2, is_bf16);
        }
    }
}
#endif

/* act[0:n] = silu(gate) * up, each op's result rounded to the dtype; gate, up fp32 [n].
 * Below a gate of -88 the result is 0 (torch's quotient is x / inf = -0 from about -88.7 on,
 * and under 1e-36 in between): the kernels are built with -ffast-math, whose vector expf
 * does not return infinity, so the exponent is clamped and the quotient not taken there. */
static inline void silu_mul_tail(const float *gate, const float *up, float *act, int64_t n,
                                 int is_bf16) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float e = expf(fminf(-gate[i], 88.0f));
        const float silu = -gate[i] > 88.0f ? 0.0f : rnd(gate[i] / (1.0f + e), is_bf16);
        act[i] = rnd(silu * up[i], is_bf16);
    }
}

#if defined(__AVX512F__)
/* e^x for x <= 88, 16 lanes, within an ulp or two of expf: x = n ln 2 + r with |r| <= ln 2 / 2
 * (ln 2 in two parts, so r is exact to fp32 while |n| stays small), e^r by its Taylor series to
 * degree 7 (the remainder under 6e-9), times 2^n by vscalefps. x below -100 counts as -100
 * (e^-100 is under fp32's smallest normal; further down the reduction would lose r). Inline:
 * the library's vector expf is a call per 16 lanes. */
ALWAYS_INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x); /* ln 2, high bits */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);      /* ln 2, the rest */
    static const float c[8] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720,
                               1.0f / 5040};
    __m512 p = _mm512_set1_ps(c[7]);
#pragma GCC unroll 7
    for (int k = 6; k >= 0; k--) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[k]));
    return _mm512_scalef_ps(p, n);
}

/* silu_mul_tail's arithmetic on 16 lanes (its comment says why the clamp at 88). */
ALWAYS_INLINE __m512 silu_mul16(__m512 gate, __m512 up, const int is_bf16) {
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gate);
    const __m512 e = exp16(_mm512_min_ps(neg, _mm512_set1_ps(88.0f)));
    __m512 silu = rnd16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), is_bf16);
    silu = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(neg, _mm512_set1_ps(88.0f), _CMP_NGT_UQ), silu);
    return rnd16(_mm512_mul_ps(silu, up), is_bf16);
}
#endif

/* act[0:n] (fp32) from gate, up fp32 [n]: 16 lanes at a time where the build has AVX512. */
static inline void silu_mul(const float *gate, const float *up, float *act, int64_t n,
                            int is_bf16) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(act + i, silu_mul16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i),
                                             is_bf16));
#endif
    silu_mul_tail(gate + i, up + i, act + i, n - i, is_bf16);
}

#endif
