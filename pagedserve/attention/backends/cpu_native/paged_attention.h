/* Paged decode attention over the CPU's paged KV cache: the kernel's body, shared by the
 * attention backend's kernel (paged_decode.c) and the one-token decode step
 * (model/cpu_decode.c). See paged_decode.c for the layouts and the numerics.
 *
 * Everything here is static: each library that includes it gets its own copy.
 */
#ifndef PAGEDSERVE_PAGED_ATTENTION_H
#define PAGEDSERVE_PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "row_ops.h"

typedef struct {
    const void *query, *key_cache, *value_cache;
    const int64_t *rows;
    const int32_t *block_table, *seq_lens;
    void *output;
    int64_t num_reqs, num_heads, num_kv_heads, head_dim, block_size, table_stride;
    int64_t query_row_stride, output_row_stride, cache_block_stride;
    float scale;
    int is_bf16;
} Work;

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* dst[0:dim] = the row at base[offset:] as fp32 */
ALWAYS_INLINE void load_row(const void *base, int64_t offset, float *dst, const int64_t dim,
                            const int is_bf16) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) dst[d] = bf16_to_float(src[d]);
    } else {
        const float *src = (const float *)base + offset;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) dst[d] = src[d];
    }
}

ALWAYS_INLINE void store_row(void *base, int64_t offset, const float *src, const int64_t dim,
                             const int is_bf16) {
    if (is_bf16) {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t d = 0; d < dim; d++) dst[d] = float_to_bf16(src[d]);
    } else {
        float *dst = (float *)base + offset;
        for (int64_t d = 0; d < dim; d++) dst[d] = src[d];
    }
}

/* The request's `n` tokens from t0 (one block) of one cache as fp32 rows[t][kv_head][d]: fp32
 * blocks in place, bf16 ones widened into `rows`. */
ALWAYS_INLINE const float *block_rows(const Work *w, const void *cache, const int32_t *table,
                                      int64_t t0, int64_t n, float *rows, const int64_t dim,
                                      const int is_bf16) {
    const int64_t base = table[t0 / w->block_size] * w->cache_block_stride;
    if (!is_bf16) return (const float *)cache + base;
    for (int64_t i = 0; i < n * w->num_kv_heads; i++) /* a block is contiguous: one pass */
        load_row(cache, base + i * dim, rows + i * dim, dim, is_bf16);
    return rows;
}

/* Part `part` of `parts` of the lines of the request's cache block after t0's, asked for into
 * L2 while t0's block is used, a part per step of its use (a token's scores, a head's weighted
 * values): blocks are scattered through the cache, so the hardware prefetcher cannot guess the
 * next, and asked for all at once its lines would fill the core's few miss buffers ahead of
 * the current block's loads. */
ALWAYS_INLINE void prefetch_next_block(const Work *w, const void *cache, const int32_t *table,
                                       int64_t t0, int64_t part, int64_t parts, int64_t seq_len,
                                       const int is_bf16) {
    const int64_t next = t0 + w->block_size;
    if (next >= seq_len) return;
    const int64_t elem = is_bf16 ? 2 : 4;
    const int64_t lines = (w->block_size * w->num_kv_heads * w->head_dim * elem + 63) / 64;
    const char *p = (const char *)cache
                    + table[next / w->block_size] * w->cache_block_stride * elem;
    for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; line++)
        __builtin_prefetch(p + 64 * line, 0, 2);
}

/* a . b over dim, in two chains of 8-lane multiply-adds (one chain waits on the adds). */
ALWAYS_INLINE float dot_rows(const float *a, const float *b, const int64_t dim) {
    v8f s0 = {0}, s1 = {0};
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
        s0 += *(const v8f *)(a + d) * *(const v8f *)(b + d);
        s1 += *(const v8f *)(a + d + 8) * *(const v8f *)(b + d + 8);
    }
    float dot = sum8(s0 + s1);
    for (; d < dim; d++) dot += a[d] * b[d];
    return dot;
}

/* scores[h][t] = q[h] . key[t][h / group], q pre-scaled; a block at a time. */
ALWAYS_INLINE void widened_scores(const Work *w, const int32_t *table, int64_t seq_len,
                                  const float *q, float *scores, float *rows, const int64_t dim,
                                  const int is_bf16) {
    const int64_t group = w->num_heads / w->num_kv_heads;
    for (int64_t t0 = 0; t0 < seq_len; t0 += w->block_size) {
        const int64_t n = t0 + w->block_size < seq_len ? w->block_size : seq_len - t0;
        const float *keys = block_rows(w, w->key_cache, table, t0, n, rows, dim, is_bf16);
        for (int64_t t = 0; t < n; t++) {
            prefetch_next_block(w, w->key_cache, table, t0, t, n, seq_len, is_bf16);
            for (int64_t h = 0; h < w->num_heads; h++) {
                const float *qh = q + h * dim, *k = keys + (t * w->num_kv_heads + h / group) * dim;
                scores[h * seq_len + t0 + t] = dot_rows(qh, k, dim);
            }
        }
    }
}

#if defined(__AVX512F__)
/* One row of n scores -> its softmax, in place, 16 lanes at a time (the last step masked; its
 * idle lanes hold the max, so exp16 sees only arguments <= 0): e^(s - max) by row_ops.h's
 * exp16, inline, where the library's vector expf was a call per 16 lanes plus a scalar tail. */
static void softmax_row(float *s, int64_t n) {
    __m512 vmax = _mm512_set1_ps(s[0]);
    for (int64_t t = 0; t < n; t += 16)
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, lanes_left(n - t), s + t));
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 in = lanes_left(n - t);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(max, in, s + t), max));
        _mm512_mask_storeu_ps(s + t, in, e);
        sum = _mm512_mask_add_ps(sum, in, sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 in = lanes_left(n - t);
        _mm512_mask_storeu_ps(s + t, in, _mm512_mul_ps(_mm512_maskz_loadu_ps(in, s + t), inv));
    }
}
#else
static void softmax_row(float *s, int64_t n) {
    float max = s[0], sum = 0.0f;
    for (int64_t t = 1; t < n; t++) max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = expf(s[t] - max);
        sum += s[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}
#endif

/* Each of the num_heads rows of seq_len scores becomes its softmax, in place. */
static void softmax_rows(float *scores, int64_t num_heads, int64_t seq_len) {
    for (int64_t h = 0; h < num_heads; h++) softmax_row(scores + h * seq_len, seq_len);
}

/* a[0:dim] += sum over t < n of p[t] * v[t * stride : t * stride + dim] */
ALWAYS_INLINE void accumulate_rows(float *a, const float *p, const float *v, int64_t n,
                                   int64_t stride, const int64_t dim) {
#if defined(__AVX512F__)
    if (dim == 64 || dim == 128) { /* the sums in registers across all n rows */
        __m512 sum[8] = {0}; /* dim / 16 of them used */
#pragma GCC unroll 8
        for (int64_t c = 0; c < dim / 16; c++) sum[c] = _mm512_loadu_ps(a + 16 * c);
        for (int64_t t = 0; t < n; t++) {
            const __m512 weight = _mm512_set1_ps(p[t]);
#pragma GCC unroll 8
            for (int64_t c = 0; c < dim / 16; c++)
                sum[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + t * stride + 16 * c), sum[c]);
        }
#pragma GCC unroll 8
        for (int64_t c = 0; c < dim / 16; c++) _mm512_storeu_ps(a + 16 * c, sum[c]);
        return;
    }
#endif
    int64_t c0 = 0;
    for (; c0 + 64 <= dim; c0 += 64) { /* 64 columns' sums in registers across the n rows */
        v8f sum[8];
        memcpy(sum, a + c0, sizeof sum);
        for (int64_t t = 0; t < n; t++)
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                sum[c] += p[t] * *(const v8f *)(v + t * stride + c0 + 8 * c);
        memcpy(a + c0, sum, sizeof sum);
    }
    for (int64_t t = 0; t < n; t++) {
#pragma omp simd
        for (int64_t d = c0; d < dim; d++) a[d] += p[t] * v[t * stride + d];
    }
}

/* acc[h] = sum over t of probs[h][t] * value[t][h / group], a block at a time. */
ALWAYS_INLINE void weighted_values(const Work *w, const int32_t *table, int64_t seq_len,
                                   const float *probs, float *acc, float *rows, const int64_t dim,
                                   const int is_bf16) {
    const int64_t group = w->num_heads / w->num_kv_heads;
    memset(acc, 0, (size_t)(w->num_heads * dim) * sizeof(float));
    for (int64_t t0 = 0; t0 < seq_len; t0 += w->block_size) {
        const int64_t n = t0 + w->block_size < seq_len ? w->block_size : seq_len - t0;
        const float *vals = block_rows(w, w->value_cache, table, t0, n, rows, dim, is_bf16);
        const int64_t token_stride = w->num_kv_heads * dim;
        for (int64_t h = 0; h < w->num_heads; h++) {
            prefetch_next_block(w, w->value_cache, table, t0, h, w->num_heads, seq_len, is_bf16);
            const float *p = probs + h * seq_len + t0, *v = vals + (h / group) * dim;
            accumulate_rows(acc + h * dim, p, v, n, token_stride, dim);
        }
    }
}

#if defined(__AVX512F__)
/* The vector paths below: a block is read as runs of up to SPAN tokens (one lane per token). */
#define SPAN 16
/* Blocks read ahead, into L2: into L1 the requests fill its few miss buffers and stall. */
#define PREFETCH_BLOCKS 2

/* Tokens [t0, t0 + n) of a request: n <= SPAN, all in one block, starting at cache element
 * `at` (their KV head 0). */
typedef struct {
    int64_t t0, n, at;
} Span;

ALWAYS_INLINE Span span_at(const Work *w, const int32_t *table, int64_t t0, int64_t seq_len) {
    const int64_t in_block = t0 % w->block_size, left = w->block_size - in_block;
    Span s = {t0, seq_len - t0 < left ? seq_len - t0 : left, 0};
    s.n = s.n < SPAN ? s.n : SPAN;
    s.at = table[t0 / w->block_size] * w->cache_block_stride
           + in_block * w->num_kv_heads * w->head_dim;
    return s;
}

/* The cache block of token t of a request (NULL past its last token), to be asked for ahead of
 * its use: a request's blocks are scattered through the cache, so the hardware prefetcher
 * cannot guess the next. */
ALWAYS_INLINE const char *block_ahead(const Work *w, const void *cache, const int32_t *table,
                                      int64_t t, int64_t seq_len, const int is_bf16) {
    if (t >= seq_len) return NULL;
    const int64_t elem = is_bf16 ? 2 : 4;
    return (const char *)cache + table[t / w->block_size] * w->cache_block_stride * elem;
}

/* How far token position t lies past the end of a request's last cache block (negative: t is
 * inside its blocks): where the read-ahead moves on from keys to values, or to the next task. */
ALWAYS_INLINE int64_t past_last_block(const Work *w, int64_t t, int64_t seq_len) {
    return t - (seq_len + w->block_size - 1) / w->block_size * w->block_size;
}

/* Part `part` of `parts` of the block at `p` (NULL: nothing) asked for into L2. A block's
 * lines are asked for a part at a time over the span that reads the block before it: all at
 * once, they fill the core's few miss buffers and the span's own loads wait behind them. */
ALWAYS_INLINE void prefetch_part(const Work *w, const char *p, int64_t part, int64_t parts,
                                 const int is_bf16) {
    if (p == NULL) return;
    const int64_t lines = (w->block_size * w->num_kv_heads * w->head_dim * (is_bf16 ? 2 : 4)
                           + 63) / 64;
    for (int64_t line = part * lines / parts; line < (part + 1) * lines / parts; line++)
        _mm_prefetch(p + 64 * line, _MM_HINT_T1);
}

/* Lane t = the sum of the 16 lanes of a[t]: a transpose-add tree (45 operations for the 16
 * sums, where 16 full horizontal reductions would take several times that). */
ALWAYS_INLINE __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) /* per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the four tokens' partial sums */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) /* the four 128-bit lanes of c[i] added in pairs */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Lane t < n = q . key row t (rows `stride` elements apart from key[0]); lanes past n repeat
 * row n - 1, so that every accumulator stays a register whatever n. `q` is the bf16 query
 * head with `dp` (dim a multiple of 32: the bf16 dot-product instruction), else fp32. */
ALWAYS_INLINE __m512 span_dots(const void *q, const void *key, int64_t stride, int64_t n,
                               const int64_t dim, const int is_bf16, const int dp) {
    __m512 acc[SPAN];
    const void *row[SPAN];
#pragma GCC unroll 16
    for (int t = 0; t < SPAN; t++) {
        acc[t] = _mm512_setzero_ps();
        row[t] = (const char *)key + (t < n ? t : n - 1) * stride * (is_bf16 ? 2 : 4);
    }
#if HAVE_DPBF16
    if (dp) {
        for (int64_t d = 0; d < dim; d += 32) {
            const __m512bh qd = (__m512bh)_mm512_loadu_si512((const uint16_t *)q + d);
#pragma GCC unroll 16
            for (int t = 0; t < SPAN; t++) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512((const uint16_t *)row[t] + d);
                acc[t] = _mm512_dpbf16_ps(acc[t], qd, k);
            }
        }
        return sum16(acc);
    }
#else
    (void)dp;
#endif
    for (int64_t d = 0; d < dim; d += 16) {
        const __m512 qd = _mm512_loadu_ps((const float *)q + d);
#pragma GCC unroll 16
        for (int t = 0; t < SPAN; t++)
            acc[t] = _mm512_fmadd_ps(qd, load16(row[t], d, is_bf16), acc[t]);
    }
    return sum16(acc);
}

/* scores[h][t] = scale * q[h] . key[t][h / group] for every token, a span of up to 16 tokens
 * at a time: a KV head's keys of the span stay in L1 while its group's query heads read them.
 * q: the bf16 query with `dp`, else fp32 (bf16 keys widened in registers). */
ALWAYS_INLINE void span_scores(const Work *w, const int32_t *table, int64_t seq_len,
                               const void *q, float scale, float *scores, const int64_t dim,
                               const int is_bf16, const int dp) {
    const int64_t group = w->num_heads / w->num_kv_heads, stride = w->num_kv_heads * dim;
    const int64_t qelem = dp ? 2 : 4, kelem = is_bf16 ? 2 : 4;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < seq_len;) {
        const char *ahead = NULL; /* keys of a block ahead, or past the last, the values' first */
        if (t0 % w->block_size == 0) {
            const int64_t t = t0 + PREFETCH_BLOCKS * w->block_size;
            const int64_t past = past_last_block(w, t, seq_len);
            ahead = past < 0 ? block_ahead(w, w->key_cache, table, t, seq_len, is_bf16)
                             : block_ahead(w, w->value_cache, table, past, seq_len, is_bf16);
        }
        const Span s = span_at(w, table, t0, seq_len);
        const __mmask16 lanes = lanes_left(s.n);
        for (int64_t h = 0; h < w->num_heads; h++) {
            prefetch_part(w, ahead, h, w->num_heads, is_bf16);
            const char *key = (const char *)w->key_cache + (s.at + (h / group) * dim) * kelem;
            const __m512 dots = span_dots((const char *)q + h * dim * qelem, key, stride, s.n,
                                          dim, is_bf16, dp);
            _mm512_mask_storeu_ps(scores + h * seq_len + t0, lanes, _mm512_mul_ps(dots, sc));
        }
        t0 += s.n;
    }
}

/* acc[h][0 : 16 wv] += sum over t < n of p[h][t] v[t][0 : 16 wv] for the heads < ht (acc rows
 * dim apart, p rows seq_len apart, v rows stride apart): the sums stay in registers over the
 * span, and each value vector, widened once, serves all ht heads. */
ALWAYS_INLINE void value_tile(float *acc, const float *p, const void *v, int64_t n,
                              int64_t stride, int64_t seq_len, const int64_t dim, const int ht,
                              const int wv, const int is_bf16) {
    __m512 sum[4][4]; /* [ht][wv] used */
#pragma GCC unroll 4
    for (int h = 0; h < ht; h++)
#pragma GCC unroll 4
        for (int c = 0; c < wv; c++) sum[h][c] = _mm512_loadu_ps(acc + h * dim + 16 * c);
    for (int64_t t = 0; t < n; t++) {
        __m512 x[4];
#pragma GCC unroll 4
        for (int c = 0; c < wv; c++) x[c] = load16(v, t * stride + 16 * c, is_bf16);
#pragma GCC unroll 4
        for (int h = 0; h < ht; h++) {
            const __m512 weight = _mm512_set1_ps(p[h * seq_len + t]);
#pragma GCC unroll 4
            for (int c = 0; c < wv; c++) sum[h][c] = _mm512_fmadd_ps(weight, x[c], sum[h][c]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < ht; h++)
#pragma GCC unroll 4
        for (int c = 0; c < wv; c++) _mm512_storeu_ps(acc + h * dim + 16 * c, sum[h][c]);
}

/* value_tile over all of dim (a multiple of 16): 64 columns at a time, then 16. */
ALWAYS_INLINE void value_heads(float *acc, const float *p, const char *v, int64_t n,
                               int64_t stride, int64_t seq_len, const int64_t dim, const int ht,
                               const int is_bf16) {
    const int64_t elem = is_bf16 ? 2 : 4;
    int64_t c = 0;
    for (; c + 64 <= dim; c += 64)
        value_tile(acc + c, p, v + c * elem, n, stride, seq_len, dim, ht, 4, is_bf16);
    for (; c < dim; c += 16)
        value_tile(acc + c, p, v + c * elem, n, stride, seq_len, dim, ht, 1, is_bf16);
}

/* acc[h] = sum over t of probs[h][t] * value[t][h / group] (dim a multiple of 16), a span at
 * a time, up to four heads of a group per value load. */
ALWAYS_INLINE void span_values(const Work *w, int64_t req, const int32_t *table, int64_t seq_len,
                               const float *probs, float *acc, const int64_t dim,
                               const int is_bf16) {
    const int64_t group = w->num_heads / w->num_kv_heads, stride = w->num_kv_heads * dim;
    const int64_t elem = is_bf16 ? 2 : 4;
    memset(acc, 0, (size_t)(w->num_heads * dim) * sizeof(float));
    for (int64_t t0 = 0; t0 < seq_len;) {
        const char *ahead = NULL; /* values of a block ahead, or past the last, the next task's
                                   * first keys (else they would be read cold) */
        if (t0 % w->block_size == 0) {
            const int64_t t = t0 + PREFETCH_BLOCKS * w->block_size;
            const int64_t past = past_last_block(w, t, seq_len);
            if (past < 0) ahead = block_ahead(w, w->value_cache, table, t, seq_len, is_bf16);
            else if (req + 1 < w->num_reqs)
                ahead = block_ahead(w, w->key_cache, w->block_table + (req + 1) * w->table_stride,
                                    past, w->seq_lens[req + 1], is_bf16);
        }
        const Span s = span_at(w, table, t0, seq_len);
        for (int64_t g = 0; g < w->num_kv_heads; g++) {
            prefetch_part(w, ahead, g, w->num_kv_heads, is_bf16);
            const char *v = (const char *)w->value_cache + (s.at + g * dim) * elem;
            for (int64_t h = g * group; h < (g + 1) * group; h += 4) {
                float *a = acc + h * dim;
                const float *p = probs + h * seq_len + t0;
                switch ((g + 1) * group - h) { /* a copy per tile height: sums in registers */
                case 1: value_heads(a, p, v, s.n, stride, seq_len, dim, 1, is_bf16); break;
                case 2: value_heads(a, p, v, s.n, stride, seq_len, dim, 2, is_bf16); break;
                case 3: value_heads(a, p, v, s.n, stride, seq_len, dim, 3, is_bf16); break;
                default: value_heads(a, p, v, s.n, stride, seq_len, dim, 4, is_bf16);
                }
            }
        }
        t0 += s.n;
    }
}
#endif

/* buf floats: num_heads * dim (q) + num_heads * dim (acc) + block_size * num_kv_heads * dim
 * (rows: the plain path's fp32 copy of a block) + num_heads * seq_len (probs). dim and is_bf16
 * are compile-time constants at every call site (see run_task). */
ALWAYS_INLINE void task_body(const Work *w, int64_t req, float *buf, const int64_t dim,
                             const int is_bf16) {
    const int64_t seq_len = w->seq_lens[req];
    const int32_t *table = w->block_table + req * w->table_stride;
    float *q = buf, *acc = q + w->num_heads * dim, *rows = acc + w->num_heads * dim;
    float *probs = rows + w->block_size * w->num_kv_heads * dim;
    if (seq_len <= 0) return;

#if defined(__AVX512F__)
    if (dim % 16 == 0) {
        const int dp = HAVE_DPBF16 && is_bf16 && dim % 32 == 0;
        const int64_t at = w->rows[req] * w->query_row_stride;
        const void *query = (const char *)w->query + at * (is_bf16 ? 2 : 4);
        if (!dp) { /* fp32 for the fused multiply-adds */
            load_row(w->query, at, q, w->num_heads * dim, is_bf16);
            query = q;
        }
        span_scores(w, table, seq_len, query, w->scale, probs, dim, is_bf16, dp);
        softmax_rows(probs, w->num_heads, seq_len);
        span_values(w, req, table, seq_len, probs, acc, dim, is_bf16);
        store_row(w->output, w->rows[req] * w->output_row_stride, acc, w->num_heads * dim, is_bf16);
        return;
    }
#endif
    load_row(w->query, w->rows[req] * w->query_row_stride, q, w->num_heads * dim, is_bf16);
    for (int64_t i = 0; i < w->num_heads * dim; i++) q[i] *= w->scale;
    widened_scores(w, table, seq_len, q, probs, rows, dim, is_bf16);
    softmax_rows(probs, w->num_heads, seq_len);
    weighted_values(w, table, seq_len, probs, acc, rows, dim, is_bf16);
    store_row(w->output, w->rows[req] * w->output_row_stride, acc, w->num_heads * dim, is_bf16);
}

/* The common head sizes get their own copy with the loop bounds known to the compiler. */
static void run_task(const Work *w, int64_t req, float *buf) {
    switch (w->head_dim * 2 + w->is_bf16) {
    case 64 * 2 + 1: task_body(w, req, buf, 64, 1); break;
    case 64 * 2: task_body(w, req, buf, 64, 0); break;
    case 128 * 2 + 1: task_body(w, req, buf, 128, 1); break;
    case 128 * 2: task_body(w, req, buf, 128, 0); break;
    default:
        if (w->is_bf16) task_body(w, req, buf, w->head_dim, 1);
        else task_body(w, req, buf, w->head_dim, 0);
    }
}

/* Scratch floats one thread needs (see task_body). */
static int64_t scratch_floats(const Work *w) {
    int64_t max_len = 0;
    for (int64_t i = 0; i < w->num_reqs; i++) max_len = w->seq_lens[i] > max_len ? w->seq_lens[i] : max_len;
    return (2 * w->num_heads + w->block_size * w->num_kv_heads) * w->head_dim + w->num_heads * max_len;
}

/* Every request of `w`, shared among the threads of the enclosing OpenMP region (a team of
 * one outside any), which meet at the loop's end; buf: this thread's scratch_floats(w). */
static inline void attend_shared(const Work *w, float *buf) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t req = 0; req < w->num_reqs; req++) run_task(w, req, buf);
}

/* Every request of `w`, `num_threads` OpenMP threads sharing them; returns how many were
 * left undone (a thread could not allocate its scratch). */
static inline int64_t attend_requests(const Work *w, int num_threads) {
    const size_t scratch = (size_t)scratch_floats(w) * sizeof(float);
    int64_t undone = 0;
#pragma omp parallel num_threads(num_threads > 1 ? num_threads : 1) reduction(+ : undone)
    {
        float *buf = malloc(scratch);
#pragma omp for schedule(dynamic, 1)
        for (int64_t req = 0; req < w->num_reqs; req++) {
            if (buf != NULL) run_task(w, req, buf);
            else undone++;
        }
        free(buf);
    }
    return undone;
}

#endif
