/* Few-row matrix products of the CPU's one-token decode step (model/cpu_decode.c):
 * y[m, n] = x[m, k] W^T (+ bias), fp32 sums, fp32 out rounded to the weights' dtype, weights bf16
 * or fp32.
 *
 * A decode step multiplies every weight by a few rows, so its time is the weight read: each
 * pass reads COLS weight rows once (they stay in L1) for every block of up to ROWS rows of x,
 * COLS x ROWS accumulators. Each weight row is read whole before the next: the weights stream
 * from memory in address order, which the hardware prefetcher follows (interleaving the COLS
 * rows chunk by chunk halved the read rate); consecutive rows' sums are independent, so the
 * out-of-order core overlaps them. From GEMV_INTERLEAVE_ROWS rows of x on, the products, not
 * the read, are the limit: then the COLS rows are interleaved 64 bytes at a time, so each load
 * of x serves COLS products. bf16 weights take x as bf16 (`xb`: the caller's
 * activations are bf16 values already, so that copy is exact) and use AVX512-BF16's
 * dot-product instruction where the CPU has it (exact products, fp32 sums), else are widened
 * to fp32 by a shift. fp32 weights use fp32 fused multiply-adds. Without AVX512F, plain C.
 * `num_threads` OpenMP threads share the passes.
 */
#ifndef PAGEDSERVE_DECODE_GEMV_H
#define PAGEDSERVE_DECODE_GEMV_H

#include <stdint.h>

#include "cpu_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GEMV_COLS 8 /* weight rows per pass */
#define GEMV_ROWS 3 /* rows of x per block (registers: ROWS x COLS accumulators of 32) */
#define GEMV_INTERLEAVE_ROWS 12 /* from this many rows of x on, the arithmetic is the limit */

/* The COLS weight rows of a pass; a last, partial pass repeats its first row (its sums are
 * dropped), so every pass runs the same loop. */
ALWAYS_INLINE void pass_rows(const char *w, int64_t col, int64_t cols, int64_t row_bytes,
                             const char *rows[GEMV_COLS]) {
    for (int j = 0; j < GEMV_COLS; j++) rows[j] = w + (col + (j < cols ? j : 0)) * row_bytes;
}

/* sums[r][j] = x[r] . w_j over k, for r < m, fp32 x and weights. */
ALWAYS_INLINE void dots_f32(const float *x, const char *rows[GEMV_COLS], const int64_t m,
                            int64_t k, int interleave, float sums[GEMV_ROWS][GEMV_COLS]) {
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc[GEMV_ROWS][GEMV_COLS];
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < GEMV_COLS; j++) acc[r][j] = _mm512_setzero_ps();
    if (interleave) {
        for (i = 0; i + 16 <= k; i += 16)
            for (int j = 0; j < GEMV_COLS; j++) {
                const __m512 wv = _mm512_loadu_ps((const float *)rows[j] + i);
                for (int64_t r = 0; r < m; r++)
                    acc[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + i), wv, acc[r][j]);
            }
    } else {
        for (int j = 0; j < GEMV_COLS; j++)
            for (i = 0; i + 16 <= k; i += 16) {
                const __m512 wv = _mm512_loadu_ps((const float *)rows[j] + i);
                for (int64_t r = 0; r < m; r++)
                    acc[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + i), wv, acc[r][j]);
            }
    }
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < GEMV_COLS; j++) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
#else
    (void)interleave;
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < GEMV_COLS; j++) sums[r][j] = 0.0f;
#endif
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < GEMV_COLS; j++) {
            const float *wj = (const float *)rows[j];
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t t = i; t < k; t++) s += x[r * k + t] * wj[t];
            sums[r][j] += s;
        }
}

/* sums[r][j] = x[r] . w_j over k, for r < m, bf16 x (xb) and weights. */
ALWAYS_INLINE void dots_bf16(const uint16_t *xb, const char *rows[GEMV_COLS], const int64_t m,
                             int64_t k, int interleave, float sums[GEMV_ROWS][GEMV_COLS]) {
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc[GEMV_ROWS][GEMV_COLS];
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < GEMV_COLS; j++) acc[r][j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (interleave) {
        for (i = 0; i + 32 <= k; i += 32)
            for (int j = 0; j < GEMV_COLS; j++) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512((const uint16_t *)rows[j] + i);
                for (int64_t r = 0; r < m; r++)
                    acc[r][j] = _mm512_dpbf16_ps(
                        acc[r][j], (__m512bh)_mm512_loadu_si512(xb + r * k + i), wv);
            }
    } else {
        for (int j = 0; j < GEMV_COLS; j++)
            for (i = 0; i + 32 <= k; i += 32) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512((const uint16_t *)rows[j] + i);
                for (int64_t r = 0; r < m; r++)
                    acc[r][j] = _mm512_dpbf16_ps(
                        acc[r][j], (__m512bh)_mm512_loadu_si512(xb + r * k + i), wv);
            }
    }
#else
    (void)interleave;
    for (int j = 0; j < GEMV_COLS; j++)
        for (i = 0; i + 16 <= k; i += 16) {
            const __m512 wv = load16(rows[j], i, 1);
            for (int64_t r = 0; r < m; r++)
                acc[r][j] = _mm512_fmadd_ps(load16(xb, r * k + i, 1), wv, acc[r][j]);
        }
#endif
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < GEMV_COLS; j++) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
#else
    (void)interleave;
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < GEMV_COLS; j++) sums[r][j] = 0.0f;
#endif
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < GEMV_COLS; j++) {
            const uint16_t *wj = (const uint16_t *)rows[j];
            float s = 0.0f;
            for (int64_t t = i; t < k; t++) s += bf16_to_float(xb[r * k + t]) * bf16_to_float(wj[t]);
            sums[r][j] += s;
        }
}

/* One block of up to ROWS rows; a copy per row count keeps the accumulators in registers. */
static void dots(const float *x, const uint16_t *xb, const char *rows[GEMV_COLS], int64_t m,
                 int64_t k, int is_bf16, int interleave, float sums[GEMV_ROWS][GEMV_COLS]) {
#define DOTS_M(M)                                                   \
    if (is_bf16) dots_bf16(xb, rows, M, k, interleave, sums);       \
    else dots_f32(x, rows, M, k, interleave, sums);                 \
    break;
    switch (m) {
    case 1: DOTS_M(1)
    case 2: DOTS_M(2)
    default: DOTS_M(3)
    }
#undef DOTS_M
}

/* y[m, n] = x[m, k] w[n, k]^T + bias[n] (bias may be NULL), fp32 out rounded to the dtype
 * (bf16 weights: each y a bf16 value). x: fp32 [m, k]; with bf16 weights, xb: the same values
 * as bf16 [m, k] (x unread; fp32 weights: xb unread). bias in the weights' dtype. The passes go
 * to the threads of the enclosing OpenMP region (a team of one outside any), which meet at the
 * loop's end. */
static void decode_gemv_shared(const float *x, const uint16_t *xb, const void *w,
                               const void *bias, float *y, int64_t m, int64_t n, int64_t k,
                               int is_bf16) {
    const int64_t passes = (n + GEMV_COLS - 1) / GEMV_COLS, elem = is_bf16 ? 2 : 4;
    const int interleave = m >= GEMV_INTERLEAVE_ROWS;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < passes; p++) {
        const int64_t col = p * GEMV_COLS, cols = n - col < GEMV_COLS ? n - col : GEMV_COLS;
        const char *rows[GEMV_COLS];
        float sums[GEMV_ROWS][GEMV_COLS];
        pass_rows((const char *)w, col, cols, k * elem, rows);
        for (int64_t r0 = 0; r0 < m; r0 += GEMV_ROWS) {
            const int64_t block = m - r0 < GEMV_ROWS ? m - r0 : GEMV_ROWS;
            dots(x + r0 * k, xb + r0 * k, rows, block, k, is_bf16, interleave, sums);
            for (int64_t j = 0; j < cols; j++) {
                float b = 0.0f;
                if (bias != NULL)
                    b = is_bf16 ? bf16_to_float(((const uint16_t *)bias)[col + j])
                                : ((const float *)bias)[col + j];
                for (int64_t r = 0; r < block; r++) {
                    const float v = sums[r][j] + b;
                    y[(r0 + r) * n + col + j] = is_bf16 ? round_bf16(v) : v;
                }
            }
        }
    }
}

/* decode_gemv_shared on `num_threads` threads of its own region. */
static void decode_gemv(const float *x, const uint16_t *xb, const void *w, const void *bias,
                        float *y, int64_t m, int64_t n, int64_t k, int is_bf16,
                        int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    decode_gemv_shared(x, xb, w, bias, y, m, n, k, is_bf16);
}

#endif
