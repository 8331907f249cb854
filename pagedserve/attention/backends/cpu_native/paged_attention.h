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
/* a . b over dim bf16 values (dim a multiple of 32) with the CPU's bf16 dot-product
 * instruction: products exact, sums in fp32, no widening pass. */
ALWAYS_INLINE float dot_bf16(const uint16_t *a, const uint16_t *b, const int64_t dim) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d),
                               (__m512bh)_mm512_loadu_si512(b + d));
    return _mm512_reduce_add_ps(acc);
}
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

/* The request's `n` tokens from t0 (one block) of one cache, widened: rows[t][kv_head][d]. */
ALWAYS_INLINE void load_block(const Work *w, const void *cache, const int32_t *table, int64_t t0,
                              int64_t n, float *rows, const int64_t dim, const int is_bf16) {
    const int64_t base = table[t0 / w->block_size] * w->cache_block_stride;
    for (int64_t i = 0; i < n * w->num_kv_heads; i++) /* a block is contiguous: one pass */
        load_row(cache, base + i * dim, rows + i * dim, dim, is_bf16);
}

/* scores[h][t] = q[h] . key[t][h / group], q pre-scaled; keys widened a block at a time. */
ALWAYS_INLINE void widened_scores(const Work *w, const int32_t *table, int64_t seq_len,
                                  const float *q, float *scores, float *rows, const int64_t dim,
                                  const int is_bf16) {
    const int64_t group = w->num_heads / w->num_kv_heads;
    for (int64_t t0 = 0; t0 < seq_len; t0 += w->block_size) {
        const int64_t n = t0 + w->block_size < seq_len ? w->block_size : seq_len - t0;
        load_block(w, w->key_cache, table, t0, n, rows, dim, is_bf16);
        for (int64_t t = 0; t < n; t++) {
            for (int64_t h = 0; h < w->num_heads; h++) {
                const float *qh = q + h * dim, *k = rows + (t * w->num_kv_heads + h / group) * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += qh[d] * k[d];
                scores[h * seq_len + t0 + t] = dot;
            }
        }
    }
}

#if HAVE_DPBF16
/* The same scores from the bf16 query and keys as stored (dim a multiple of 32): no widening. */
static void bf16_scores(const Work *w, int64_t req, const int32_t *table, int64_t seq_len,
                        float *scores) {
    const int64_t group = w->num_heads / w->num_kv_heads, dim = w->head_dim;
    const uint16_t *query = (const uint16_t *)w->query + w->rows[req] * w->query_row_stride;
    for (int64_t t = 0; t < seq_len; t++) {
        const uint16_t *key = (const uint16_t *)w->key_cache
                              + table[t / w->block_size] * w->cache_block_stride
                              + (t % w->block_size) * w->num_kv_heads * dim;
        for (int64_t h = 0; h < w->num_heads; h++)
            scores[h * seq_len + t] = w->scale * dot_bf16(query + h * dim, key + (h / group) * dim, dim);
    }
}
#endif

/* Each of the num_heads rows of seq_len scores becomes its softmax, in place. */
static void softmax_rows(float *scores, int64_t num_heads, int64_t seq_len) {
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * seq_len, max = s[0], sum = 0.0f;
        for (int64_t t = 1; t < seq_len; t++) max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < seq_len; t++) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < seq_len; t++) s[t] *= inv;
    }
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
    for (int64_t t = 0; t < n; t++) {
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) a[d] += p[t] * v[t * stride + d];
    }
}

/* acc[h] = sum over t of probs[h][t] * value[t][h / group], one widened block at a time. */
ALWAYS_INLINE void weighted_values(const Work *w, const int32_t *table, int64_t seq_len,
                                   const float *probs, float *acc, float *rows, const int64_t dim,
                                   const int is_bf16) {
    const int64_t group = w->num_heads / w->num_kv_heads;
    memset(acc, 0, (size_t)(w->num_heads * dim) * sizeof(float));
    for (int64_t t0 = 0; t0 < seq_len; t0 += w->block_size) {
        const int64_t n = t0 + w->block_size < seq_len ? w->block_size : seq_len - t0;
        load_block(w, w->value_cache, table, t0, n, rows, dim, is_bf16);
        const int64_t token_stride = w->num_kv_heads * dim;
        for (int64_t h = 0; h < w->num_heads; h++) {
            const float *p = probs + h * seq_len + t0, *v = rows + (h / group) * dim;
            accumulate_rows(acc + h * dim, p, v, n, token_stride, dim);
        }
    }
}

/* buf floats: num_heads * dim (q) + num_heads * dim (acc) + block_size * num_kv_heads * dim
 * (rows) + num_heads * seq_len (probs). dim and is_bf16 are compile-time constants at every
 * call site (see run_task). */
ALWAYS_INLINE void task_body(const Work *w, int64_t req, float *buf, const int64_t dim,
                             const int is_bf16) {
    const int64_t seq_len = w->seq_lens[req];
    const int32_t *table = w->block_table + req * w->table_stride;
    float *q = buf, *acc = q + w->num_heads * dim, *rows = acc + w->num_heads * dim;
    float *probs = rows + w->block_size * w->num_kv_heads * dim;
    if (seq_len <= 0) return;

#if HAVE_DPBF16
    if (is_bf16 && dim % 32 == 0) {
        bf16_scores(w, req, table, seq_len, probs);
    } else
#endif
    {
        load_row(w->query, w->rows[req] * w->query_row_stride, q, w->num_heads * dim, is_bf16);
        for (int64_t i = 0; i < w->num_heads * dim; i++) q[i] *= w->scale;
        widened_scores(w, table, seq_len, q, probs, rows, dim, is_bf16);
    }
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

/* Every request of `w`, `num_threads` OpenMP threads sharing them; returns how many were
 * left undone (a thread could not allocate its scratch). */
static int64_t attend_requests(const Work *w, int num_threads) {
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
