/* bf16 matrix products on the CPU: y = x W^T (+ bias).
 *
 * Built by layers/cpu_gemv.py with the system C compiler (as attention/backends/cpu_native's
 * decode kernel) and called through ctypes. Two uses: a decode step of a small batch, whose
 * time is the weight read (torch's bf16 linear at a few rows is slower than that), and, on
 * CPUs without native bf16 matmuls, bf16 linears of a few rows (torch's emulated bf16 matmul
 * runs at a fraction of its fp32 rate there; larger ones run in fp32 on widened weights).
 *
 * Layouts (row strides in elements, the last axis contiguous):
 *   x    [m, k]  bf16, row stride x_stride
 *   w    [n, k]  bf16, contiguous (a linear layer's weight)
 *   bias [n]     bf16 or NULL
 *   y    [m, n]  bf16, row stride y_stride
 * Products are exact and sums fp32 (bf16 widened to fp32 by a shift, AVX2 fused multiply-adds
 * where the CPU has them, else plain C); y is rounded to nearest
 * even once. `num_threads` OpenMP threads share the output columns, COLS at a time (as many
 * independent accumulator chains: one chain waits on the dot-product instruction's latency).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "decode_gemv.h"
#include "panel_gemm.h"

#define MAX_ROWS 4 /* rows of x per pass over a group of weight rows (registers) */
#define ROW_CHUNK 64 /* rows of x whose widened copy one sweep over the weights reuses */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define COLS 4 /* output columns per pass: independent accumulator chains */

static inline __m256 widen8(const uint16_t *p) { /* 8 bf16 -> fp32 */
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Output columns col..col+cols-1 (cols <= COLS) for every row of x, x widened to fp32 once
 * (xf [m, k] contiguous): sums[r * COLS + j] = x[r] . w[col + j]. The bf16 weights are
 * widened by a shift; 8 lanes of fused multiply-adds. */
static inline __attribute__((always_inline)) void columns_m(
    const float *xf, const uint16_t *w, int64_t cols, const int64_t m, int64_t k, float *sums) {
    __m256 acc[MAX_ROWS][COLS];
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < COLS; j++) acc[r][j] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        for (int j = 0; j < cols; j++) {
            __m256 wv = widen8(w + j * k + i);
            for (int64_t r = 0; r < m; r++)
                acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + r * k + i), wv, acc[r][j]);
        }
    }
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < cols; j++) {
            float sum = hsum8(acc[r][j]);
            for (int64_t t = i; t < k; t++) sum += xf[r * k + t] * bf16_to_float(w[j * k + t]);
            sums[r * COLS + j] = sum;
        }
}

/* One copy per row count: with m a constant the accumulators stay in registers. */
static void columns(const float *xf, const uint16_t *w, int64_t cols, int64_t m, int64_t k,
                    float *sums) {
    switch (m) {
    case 1: columns_m(xf, w, cols, 1, k, sums); break;
    case 2: columns_m(xf, w, cols, 2, k, sums); break;
    case 3: columns_m(xf, w, cols, 3, k, sums); break;
    default: columns_m(xf, w, cols, 4, k, sums); break;
    }
}
#define WIDENS_X 1
#else
#define COLS 4

static void columns(const uint16_t *x, const uint16_t *w, int64_t cols, int64_t m, int64_t k,
                    int64_t x_stride, float *sums) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < cols; j++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++)
                acc += bf16_to_float(x[r * x_stride + i]) * bf16_to_float(w[j * k + i]);
            sums[r * COLS + j] = acc;
        }
}
#endif

int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
              int64_t m, int64_t n, int64_t k, int64_t x_stride, int64_t y_stride,
              int num_threads) {
    if (m < 1) return 1;
    int64_t passes = (n + COLS - 1) / COLS;
#ifdef WIDENS_X
    float *xf = malloc((size_t)(m * k) * sizeof(float)); /* x widened once: [m, k] */
    if (xf == NULL) return 2;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_to_float(x[r * x_stride + i]);
#endif
    /* Rows in chunks whose widened x stays in L2 (64 x k floats); within a chunk each pass
     * reads COLS weight rows once (they stay in L1) for every block of MAX_ROWS rows. */
    for (int64_t c0 = 0; c0 < m; c0 += ROW_CHUNK) {
        int64_t c1 = m - c0 < ROW_CHUNK ? m : c0 + ROW_CHUNK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < passes; p++) {
            int64_t col = p * COLS, cols = n - col < COLS ? n - col : COLS;
            float sums[MAX_ROWS * COLS];
            for (int64_t r0 = c0; r0 < c1; r0 += MAX_ROWS) {
                int64_t rows = c1 - r0 < MAX_ROWS ? c1 - r0 : MAX_ROWS;
#ifdef WIDENS_X
                columns(xf + r0 * k, w + col * k, cols, rows, k, sums);
#else
                columns(x + r0 * x_stride, w + col * k, cols, rows, k, x_stride, sums);
#endif
                for (int64_t j = 0; j < cols; j++) {
                    float b = bias ? bf16_to_float(bias[col + j]) : 0.0f;
                    for (int64_t r = 0; r < rows; r++)
                        y[(r0 + r) * y_stride + col + j] = float_to_bf16(sums[r * COLS + j] + b);
                }
            }
        }
    }
#ifdef WIDENS_X
    free(xf);
#endif
    return 0;
}

/* 1 where decode_gemv.h's kernel is vectorized here (AVX512F): gemv_rows is the one to call
 * for a few rows; elsewhere gemv_bf16 (AVX2) or torch serve them. */
int gemv_rows_vectorized(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* y = x W^T (+ bias) for a few rows (a decode step's linears and LM head) with decode_gemv.h's
 * kernel, bf16 or fp32: x [m, k] (row stride x_stride), w [n, k], bias [n] or NULL, y [m, n]
 * (row stride y_stride), all in one dtype; fp32 sums, one rounding. With `packed`, w is
 * panel_gemm.h's layout of the weight instead. Returns 2 where the fp32 copies cannot be
 * allocated, 1 where panel_gemm has no kernel for the dtype here. */
static int rows_product(const void *x, const void *w, const void *bias, void *y, int64_t m,
                        int64_t n, int64_t k, int64_t x_stride, int64_t y_stride, int is_bf16,
                        int packed, int num_threads) {
    float *xf = malloc((size_t)(m * (k + n)) * sizeof(float)); /* x [m, k], then y [m, n] */
    uint16_t *xb = malloc((size_t)(m * k) * sizeof(uint16_t) + 64); /* x as bf16 [m, k] */
    if (xf == NULL || xb == NULL) {
        free(xf), free(xb);
        return 2;
    }
    float *yf = xf + m * k;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) {
            if (is_bf16) {
                xb[r * k + i] = ((const uint16_t *)x)[r * x_stride + i];
                xf[r * k + i] = bf16_to_float(xb[r * k + i]);
            } else {
                xf[r * k + i] = ((const float *)x)[r * x_stride + i];
            }
        }
    int status = 0;
    if (packed) status = panel_gemm(xf, xb, w, bias, yf, m, n, k, is_bf16, num_threads);
    else decode_gemv(xf, xb, w, bias, yf, m, n, k, is_bf16, num_threads);
    for (int64_t r = 0; r < m && status == 0; r++)
        for (int64_t j = 0; j < n; j++) {
            if (is_bf16) ((uint16_t *)y)[r * y_stride + j] = float_to_bf16(yf[r * n + j]);
            else ((float *)y)[r * y_stride + j] = yf[r * n + j];
        }
    free(xf), free(xb);
    return status;
}

int gemv_rows(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n,
              int64_t k, int64_t x_stride, int64_t y_stride, int is_bf16, int num_threads) {
    return rows_product(x, w, bias, y, m, n, k, x_stride, y_stride, is_bf16, 0, num_threads);
}

/* 1 where panel_gemm.h has a kernel for the dtype in this build (bf16: its own, or the fp32
 * one on widened panels). */
int gemm_panels_kernel(int is_bf16) {
    return is_bf16 ? PANEL_BF16 || PANEL_WIDENS_BF16 : PANEL_F32;
}

/* 1 where bf16 weights' panels are packed widened to fp32 (panel_gemm.h). */
int gemm_panels_widens_bf16(void) { return PANEL_WIDENS_BF16; }

/* gemv_rows on a weight packed for panel_gemm.h. */
int gemm_panels(const void *x, const void *wp, const void *bias, void *y, int64_t m, int64_t n,
                int64_t k, int64_t x_stride, int64_t y_stride, int is_bf16, int num_threads) {
    return rows_product(x, wp, bias, y, m, n, k, x_stride, y_stride, is_bf16, 1, num_threads);
}
