/* The prefill kernel's softmax over a block's score rows (paged_prefill.c), 16 lanes at a
 * time with an inline exponential. */
#ifndef PREFILL_SOFTMAX_H
#define PREFILL_SOFTMAX_H

#include "prefill.h"

#if defined(__AVX512F__)
/* 2^t for t <= 0, 16 lanes: 2^n 2^f with n = round(t), |f| <= 1/2 (f = t - n exact), 2^n by
 * vscalefps (lanes below -150 give 0). 2^f by a polynomial fitted to it on [-1/2, 1/2] for
 * least relative error: degree 6 (error under 1e-7, fp32's rounding) where the probabilities
 * stay fp32; degree 4 (under 3e-6) where they are rounded to bf16 (2^-9) next. */
ALWAYS_INLINE __m512 exp2_16(__m512 t, const int pairs) {
    static const float fp32[7] = {1.0f, 0.6931471825f, 0.2402264625f, 0.05550328642f,
                                  0.009618489072f, 0.001339993090f, 0.0001534580661f};
    static const float bf16[5] = {0.9999992847f, 0.6931217909f, 0.2402474433f, 0.05591785908f,
                                  0.009570096619f};
    const float *c = pairs ? bf16 : fp32;
    const int degree = pairs ? 4 : 6;
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(c[degree]);
#pragma GCC unroll 6
    for (int k = degree - 1; k >= 0; k--) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[k]));
    return _mm512_scalef_ps(p, n);
}

/* Lanes of tile i that hold keys a row of `seen` keys sees. */
ALWAYS_INLINE __mmask16 seen_lanes(int64_t seen, int64_t i) {
    const int64_t n = seen - i * TILE;
    return (__mmask16)_bzhi_u32(0xffffu, n < 0 ? 0 : n > TILE ? TILE : (uint32_t)n);
}

/* The block's score rows -> e = exp(scale (s - max)), computed as 2^(s c - max c) with
 * c = scale log2 e (the rounding of max c is common to the row: the normalization cancels
 * it), for the keys each vector sees, 0 for the others up to `end` (rounded up to a tile);
 * with `pairs` e is rounded to bf16 into probs, else kept in scores. inv[m] = 1 / the sum of
 * the e that the weighted values multiply by. The MB rows go through each pass together:
 * their chains of exponentials and sums overlap. */
ALWAYS_INLINE void block_softmax(const Block *blk, const Scratch *b, int64_t end, float scale,
                                 float *inv, const int pairs) {
    const int64_t tiles = (blk->seen_max + TILE - 1) / TILE;
    __m512 max[MB], sum[MB];
#pragma GCC unroll 6
    for (int m = 0; m < MB; m++) max[m] = _mm512_set1_ps(-FLT_MAX), sum[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < tiles; i++)
#pragma GCC unroll 6
        for (int m = 0; m < MB; m++)
            max[m] = _mm512_mask_max_ps(max[m], seen_lanes(blk->seen[m], i), max[m],
                                        _mm512_loadu_ps(b->scores + m * b->padded + i * TILE));
    const __m512 c = _mm512_set1_ps(scale * 1.442695041f); /* log2 e */
#pragma GCC unroll 6
    for (int m = 0; m < MB; m++) /* max[m]: now max c, every lane */
        max[m] = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(max[m])), c);
    float *scores = b->scores;
    uint16_t *probs = b->probs;
    for (int64_t i = 0; i * TILE < end; i++) {
#pragma GCC unroll 6
        for (int m = 0; m < MB; m++) {
            float *s = scores + m * b->padded + i * TILE;
            const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s), c, max[m]); /* <= ~0 */
            const __m512 e = _mm512_maskz_mov_ps(seen_lanes(blk->seen[m], i), exp2_16(x, pairs));
#if HAVE_DPBF16
            if (pairs) { /* rounded to nearest even (e >= 0, no NaN) */
                const __m256i r = (__m256i)_mm512_cvtneps_pbh(e);
                _mm256_storeu_si256((__m256i *)(probs + m * b->padded + i * TILE), r);
                const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16);
                sum[m] = _mm512_add_ps(sum[m], _mm512_castsi512_ps(widened));
                continue;
            }
#else
            (void)probs;
#endif
            _mm512_storeu_ps(s, e);
            sum[m] = _mm512_add_ps(sum[m], e);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MB; m++) inv[m] = 1.0f / _mm512_reduce_add_ps(sum[m]);
}

#endif

#endif
