/* Matrix products of a decode step at larger batches (model/cpu_decode.c): y[m, n] = x[m, k]
 * W^T (+ bias), fp32 sums, fp32 out rounded to the weights' dtype, on weights packed in panels
 * of 16 output columns.
 *
 * decode_gemv.h reads W in its plain [n, k] layout and sums each product along k in one
 * vector, so every (row, column) sum ends in a horizontal add, and each step loads x again.
 * Once a batch has a dozen rows the arithmetic, not the weight read, is the limit: here one
 * vector load of the packed weight holds 16 columns (bf16: 16 columns x 2 consecutive k), and
 * a broadcast of one x value (bf16: a pair) feeds it to 16 sums at once; PANEL_ROWS rows x
 * PANEL_GROUP panels of accumulators stay in registers, no horizontal add.
 *
 * A group of panels is multiplied by every PANEL_ROWS-row block of x in turn: the first block
 * brings the group in from memory, the later ones find it in L2. A single core cannot stream
 * weights as fast as the first block consumes them, so while the last block runs (the only
 * one at a batch of 8 or fewer), the next group is prefetched into L2, and every block reads
 * its weights from cache.
 *
 * Layout (panel_pack in model/cpu_decode.py): n padded to a multiple of 16 with zero columns,
 * panel p holds columns 16p..16p+15: bf16 [k/2][16][2] (k even), fp32 [k][16]. fp32 weights
 * need AVX512F or AVX2 with FMA, bf16 ones AVX512-BF16; PANEL_F32 and PANEL_BF16 say whether
 * this build has the kernel. With AVX2 a panel's 16 columns are two 8-lane vectors, and a block
 * is 6 rows of one panel: 12 accumulators of the 16 vector registers.
 *
 * Without AVX512-BF16 (PANEL_WIDENS_BF16) bf16 weights are packed widened to fp32 (exact) and
 * multiplied by the fp32 kernel with x in fp32; the bias is added and y rounded to bf16 after,
 * the same sums rounded once.
 */
#ifndef PAGEDSERVE_PANEL_GEMM_H
#define PAGEDSERVE_PANEL_GEMM_H

#include <stdint.h>

#include "cpu_kernels.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define PANEL_COLS 16

#if defined(__AVX512F__)
#define PANEL_F32 1
#define PANEL_ROWS 8  /* rows of x per block */
#define PANEL_GROUP 2 /* panels per block: PANEL_ROWS x PANEL_GROUP accumulators */
#elif defined(__AVX2__) && defined(__FMA__)
#define PANEL_F32 1
#define PANEL_AVX2 1
#define PANEL_ROWS 6
#define PANEL_GROUP 1
#else
#define PANEL_F32 0
#define PANEL_ROWS 8 /* blocks of the decode step's rows (cpu_decode.c), no kernel here */
#define PANEL_GROUP 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PANEL_BF16 1
#else
#define PANEL_BF16 0
#endif
#define PANEL_WIDENS_BF16 (PANEL_F32 && !PANEL_BF16) /* bf16 weights on fp32 panels */

#if PANEL_F32 && !defined(PANEL_AVX2)
/* acc[r][g] = x[r] . columns of panel g, for r < R, g < G; xs: x's rows (fp32 [R, k] or bf16
 * pairs), wp: the group's first panel; pf: the next group's first panel, prefetched into L2
 * alongside (NULL: none). */
ALWAYS_INLINE void panel_block(const float *x, const uint16_t *xb, const char *wp, const char *pf,
                               int64_t k, int is_bf16, const int R, const int G,
                               __m512 acc[PANEL_ROWS][PANEL_GROUP]) {
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
#if PANEL_BF16
    if (is_bf16) {
        const int64_t panel = k * PANEL_COLS; /* bf16 elements per panel */
        for (int64_t i = 0; i < k / 2; i++) {
            __m512i w[PANEL_GROUP];
            for (int g = 0; g < G; g++) {
                w[g] = _mm512_loadu_si512((const uint16_t *)wp + g * panel + i * 32);
                if (pf != NULL) _mm_prefetch(pf + 2 * (g * panel + i * 32), _MM_HINT_T1);
            }
            for (int r = 0; r < R; r++) {
                int32_t pair;
                __builtin_memcpy(&pair, xb + r * k + 2 * i, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                for (int g = 0; g < G; g++)
                    acc[r][g] = _mm512_dpbf16_ps(acc[r][g], xv, (__m512bh)w[g]);
            }
        }
        return;
    }
#endif
    (void)xb;
    (void)is_bf16;
    const int64_t panel = k * PANEL_COLS; /* floats per panel */
    for (int64_t i = 0; i < k; i++) {
        __m512 w[PANEL_GROUP];
        for (int g = 0; g < G; g++) {
            w[g] = _mm512_loadu_ps((const float *)wp + g * panel + i * 16);
            if (pf != NULL) _mm_prefetch(pf + 4 * (g * panel + i * 16), _MM_HINT_T1);
        }
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * k + i]);
            for (int g = 0; g < G; g++) acc[r][g] = _mm512_fmadd_ps(xv, w[g], acc[r][g]);
        }
    }
}

/* One block: the products, then y's columns col..col+16G (masked past n) plus the bias,
 * rounded to the dtype. */
ALWAYS_INLINE void panel_store(const __m512 acc[PANEL_ROWS][PANEL_GROUP], const void *bias,
                               float *y, int64_t col, int64_t n, int is_bf16, const int R,
                               const int G) {
    for (int g = 0; g < G; g++) {
        const int64_t c = col + g * PANEL_COLS;
        const __mmask16 mask = lanes_left(n - c);
        __m512 b = _mm512_setzero_ps();
        if (bias != NULL)
            b = is_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + c)), 16))
                        : _mm512_maskz_loadu_ps(mask, (const float *)bias + c);
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_ps(y + r * n + c, mask, rnd16(_mm512_add_ps(acc[r][g], b), is_bf16));
    }
}

/* A block of R rows x G panels; a copy per (R, G) keeps the accumulators in registers. */
static void panel_rows(const float *x, const uint16_t *xb, const char *wp, const char *pf,
                       const void *bias, float *y, int64_t col, int64_t n, int64_t k,
                       int is_bf16, int R, int G) {
    __m512 acc[PANEL_ROWS][PANEL_GROUP];
#define PANEL_RG(RR, GG)                                                   \
    panel_block(x, xb, wp, pf, k, is_bf16, RR, GG, acc);                   \
    panel_store(acc, bias, y, col, n, is_bf16, RR, GG);                    \
    return;
#define PANEL_R(RR)                                                        \
    case RR:                                                               \
        if (G == 2) { PANEL_RG(RR, 2) }                                    \
        PANEL_RG(RR, 1)
    switch (R) {
    PANEL_R(1) PANEL_R(2) PANEL_R(3) PANEL_R(4) PANEL_R(5) PANEL_R(6) PANEL_R(7)
    default: PANEL_R(8)
    }
#undef PANEL_R
#undef PANEL_RG
}
#endif

#if defined(PANEL_AVX2)
/* AVX2, fp32 weights: acc[r][h] = x[r] . columns 8h..8h+7 of the panel, for r < R; pf as
 * above. The sums live in a local array written to acc once: with acc itself GCC kept every
 * sum in memory too, a store per multiply-add. */
ALWAYS_INLINE void panel_block_avx2(const float *x, const float *wp, const char *pf, int64_t k,
                                    const int R, __m256 acc[PANEL_ROWS][2]) {
    /* Without a next group, the prefetches ask for this one's lines (no branch in the loop:
     * 16 registers leave none for the compiler to spare). */
    const char *ahead = pf != NULL ? pf : (const char *)wp;
    __m256 sum[PANEL_ROWS][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const __m256 w0 = _mm256_loadu_ps(wp + i * 16), w1 = _mm256_loadu_ps(wp + i * 16 + 8);
        _mm_prefetch(ahead + 4 * i * 16, _MM_HINT_T1); /* one line per k */
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * k + i);
            sum[r][0] = _mm256_fmadd_ps(xv, w0, sum[r][0]);
            sum[r][1] = _mm256_fmadd_ps(xv, w1, sum[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) acc[r][0] = sum[r][0], acc[r][1] = sum[r][1];
}

/* y's columns col..col+15 of R rows (those past n dropped) plus the bias (fp32). */
ALWAYS_INLINE void panel_store_avx2(__m256 acc[PANEL_ROWS][2], const float *bias, float *y,
                                    int64_t col, int64_t n, const int R) {
    const int64_t cols = n - col < PANEL_COLS ? n - col : PANEL_COLS;
    float b[PANEL_COLS] = {0};
    if (bias != NULL) memcpy(b, bias + col, (size_t)cols * sizeof(float));
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    for (int r = 0; r < R; r++) {
        float *yr = y + r * n + col;
        const __m256 lo = _mm256_add_ps(acc[r][0], b0), hi = _mm256_add_ps(acc[r][1], b1);
        if (cols == PANEL_COLS) {
            _mm256_storeu_ps(yr, lo);
            _mm256_storeu_ps(yr + 8, hi);
        } else {
            float row[PANEL_COLS];
            _mm256_storeu_ps(row, lo);
            _mm256_storeu_ps(row + 8, hi);
            memcpy(yr, row, (size_t)cols * sizeof(float));
        }
    }
}

/* A block of R rows of one panel; a copy per R keeps the accumulators in registers. */
static void panel_rows(const float *x, const uint16_t *xb, const char *wp, const char *pf,
                       const void *bias, float *y, int64_t col, int64_t n, int64_t k,
                       int is_bf16, int R, int G) {
    (void)xb, (void)is_bf16, (void)G; /* fp32 only, one panel a block */
    __m256 acc[PANEL_ROWS][2];
#define PANEL_R(RR)                                                                    \
    case RR:                                                                           \
        panel_block_avx2(x, (const float *)wp, pf, k, RR, acc);                        \
        panel_store_avx2(acc, (const float *)bias, y, col, n, RR);                     \
        return;
    switch (R) {
    PANEL_R(1) PANEL_R(2) PANEL_R(3) PANEL_R(4) PANEL_R(5)
    default: PANEL_R(6)
    }
#undef PANEL_R
}
#endif

/* y[r, j] = round_bf16(y[r, j] + bias[j]) (bias bf16 or NULL): a widened bf16 product's end.
 * Rows go to the region's threads, which meet at the loop's end. */
static inline void round_rows_bf16(const uint16_t *bias, float *y, int64_t m, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++) {
            const float b = bias != NULL ? bf16_to_float(bias[j]) : 0.0f;
            y[r * n + j] = round_bf16(y[r * n + j] + b);
        }
}

/* y[m, n] = x[m, k] W^T + bias[n] (bias NULL: none, else in the weights' dtype), fp32 out
 * rounded to the dtype (bf16 weights: each y a bf16 value). x: fp32 [m, k]; bf16 weights: xb,
 * the same values as bf16 [m, k], and x as well where PANEL_WIDENS_BF16 (else x unread). wp: W
 * packed (above). The groups of panels go to the threads of the enclosing OpenMP region (a team
 * of one outside any), which meet at the loop's end: y is whole for every thread once this
 * returns. The caller checks PANEL_F32 (which every panel product needs). */
static inline void panel_gemm_shared(const float *x, const uint16_t *xb, const void *wp,
                                     const void *bias, float *y, int64_t m, int64_t n, int64_t k,
                                     int is_bf16) {
#if PANEL_F32
    const int widened = is_bf16 && PANEL_WIDENS_BF16;
    if (widened) is_bf16 = 0; /* the fp32 kernel; bias and rounding after it */
    const int64_t panels = (n + PANEL_COLS - 1) / PANEL_COLS;
    const int64_t groups = (panels + PANEL_GROUP - 1) / PANEL_GROUP;
    const int64_t panel_bytes = k * PANEL_COLS * (is_bf16 ? 2 : 4);
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < groups; gi++) {
        const int64_t p = gi * PANEL_GROUP;
        const int G = panels - p < PANEL_GROUP ? (int)(panels - p) : PANEL_GROUP;
        const char *wp_g = (const char *)wp + p * panel_bytes;
        for (int64_t r0 = 0; r0 < m; r0 += PANEL_ROWS) {
            const int R = m - r0 < PANEL_ROWS ? (int)(m - r0) : PANEL_ROWS;
            const char *pf = r0 + R >= m && gi + 1 < groups ? wp_g + PANEL_GROUP * panel_bytes
                                                            : NULL;
            panel_rows(x + r0 * k, xb + r0 * k, wp_g, pf, widened ? NULL : bias, y + r0 * n,
                       p * PANEL_COLS, n, k, is_bf16, R, G);
        }
    }
    if (widened) round_rows_bf16((const uint16_t *)bias, y, m, n);
#else
    (void)x, (void)xb, (void)wp, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)is_bf16;
#endif
}

/* panel_gemm_shared on `num_threads` threads of its own region. Returns 0, or 1 where this
 * build has no panel kernel (nothing written). */
static inline int panel_gemm(const float *x, const uint16_t *xb, const void *wp,
                             const void *bias, float *y, int64_t m, int64_t n, int64_t k,
                             int is_bf16, int num_threads) {
    if (!PANEL_F32) return 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    panel_gemm_shared(x, xb, wp, bias, y, m, n, k, is_bf16);
    return 0;
}

#endif
