/* Causal prefill attention on the CPU over the paged KV cache: the query rows of every prompt
 * (or prompt chunk after a cached prefix) of a step in one call, keys and values read through
 * the block table (the step's own already written).
 *
 * Layouts (row strides in elements, the last axis contiguous):
 *   query, output [num_rows, num_heads, head_dim]
 *   cache   [num_blocks, block_size, num_kv_heads, head_dim] (keys; values alike)
 *   block_table int32 [*, table_stride]
 *   reqs    int64 [num_reqs, 4]: first query row, query_len, seq_len, block-table row
 * Query row i of a request sits at position seq_len - query_len + i and sees keys 0 .. that
 * position. Query head h reads KV head h / group. Scores, softmax and the weighted sum are
 * fp32 (bf16 scores on AVX512-BF16 from its dot-product instruction: exact products).
 *
 * A task is (request, KV head, CHUNK query rows): it copies the keys and values it sees into
 * buffers laid out for its products (keys transposed in tiles of 16, values widened), then
 * for each of its rows and each query head of the group: scores, softmax, weighted values.
 */
#include <stdint.h>
#include <stdlib.h>

#include "paged_attention.h"
#include "row_ops.h"

#define CHUNK 64
#define TILE 16
#define GROUP 4 /* tiles in flight: independent sums hide the multiply's latency */

typedef struct {
    const void *query, *key_cache, *value_cache;
    const int32_t *block_table;
    const int64_t *reqs;
    void *output;
    int64_t num_reqs, num_heads, num_kv_heads, head_dim, block_size, table_stride;
    int64_t query_row_stride, output_row_stride, cache_block_stride;
    float scale;
} Prefill;

/* Cache row of key t of KV head g of a request (table: its block-table row). */
ALWAYS_INLINE int64_t cache_at(const Prefill *a, const int32_t *table, int64_t t, int64_t g) {
    return table[t / a->block_size] * a->cache_block_stride
           + ((t % a->block_size) * a->num_kv_heads + g) * a->head_dim;
}

/* kt: keys 0..n-1 in tiles of 16, zero-padded. bf16 on AVX512-BF16: [tile][D / 2][16][2] (the
 * pairs the dot-product instruction reads); else fp32 [tile][D][16]. vf: values fp32 [n][D]. */
ALWAYS_INLINE void pack_kv(const Prefill *a, const int32_t *table, int64_t g, int64_t n,
                           void *kt, float *vf, const int64_t dim, const int is_bf16,
                           const int pairs) {
    const int64_t tiles = (n + TILE * GROUP - 1) / (TILE * GROUP) * GROUP;
    memset(kt, 0, (size_t)(tiles * TILE * dim) * (pairs ? 2 : 4));
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = cache_at(a, table, t, g), tile = t / TILE, j = t % TILE;
        if (pairs) { /* a pair of bf16 moves as one 32-bit word */
            const uint16_t *k = (const uint16_t *)a->key_cache + at;
            uint16_t *dst = (uint16_t *)kt + tile * TILE * dim + j * 2;
            for (int64_t dp = 0; dp < dim / 2; dp++) memcpy(dst + dp * TILE * 2, k + 2 * dp, 4);
        } else {
            float *dst = (float *)kt + tile * TILE * dim + j;
            for (int64_t d = 0; d < dim; d++) dst[d * TILE] = load(a->key_cache, at + d, is_bf16);
        }
        load_row(a->value_cache, at, vf + t * dim, dim, is_bf16);
    }
}

/* s[0 : 16 * tiles] = scale * q . key for the first `tiles` tiles of kt (kt holds at least
 * `tiles` rounded up to GROUP tiles). */
ALWAYS_INLINE void tile_scores(const void *query, int64_t q_at, const void *kt, int64_t tiles,
                               float scale, float *s, float *qf, const int64_t dim,
                               const int is_bf16, const int pairs) {
#if HAVE_DPBF16
    if (pairs) {
        const uint16_t *qb = (const uint16_t *)query + q_at, *k = (const uint16_t *)kt;
        for (int64_t t0 = 0; t0 < tiles; t0 += GROUP) {
            __m512 acc[GROUP];
            for (int u = 0; u < GROUP; u++) acc[u] = _mm512_setzero_ps();
            for (int64_t dp = 0; dp < dim / 2; dp++) {
                uint32_t pair;
                memcpy(&pair, qb + 2 * dp, sizeof pair);
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int u = 0; u < GROUP; u++)
                    acc[u] = _mm512_dpbf16_ps(acc[u], qv, (__m512bh)_mm512_loadu_si512(
                                                  k + ((t0 + u) * dim / 2 + dp) * 32));
            }
            for (int u = 0; u < GROUP; u++)
                _mm512_storeu_ps(s + (t0 + u) * TILE, _mm512_mul_ps(acc[u], _mm512_set1_ps(scale)));
        }
        return;
    }
#endif
    load_row(query, q_at, qf, dim, is_bf16);
    const float *k = (const float *)kt;
    for (int64_t t0 = 0; t0 < tiles; t0 += GROUP) {
        float acc[GROUP][TILE] = {{0}};
        for (int64_t d = 0; d < dim; d++)
            for (int u = 0; u < GROUP; u++) {
#pragma omp simd
                for (int64_t j = 0; j < TILE; j++)
                    acc[u][j] += qf[d] * k[((t0 + u) * dim + d) * TILE + j];
            }
        for (int u = 0; u < GROUP; u++)
            for (int64_t j = 0; j < TILE; j++) s[(t0 + u) * TILE + j] = acc[u][j] * scale;
    }
}

/* The scores of two query rows (q_at[0], q_at[1]) over the first `tiles` tiles, each key tile
 * read once: s0 and s1 as tile_scores writes them. */
ALWAYS_INLINE void tile_scores_two(const void *query, const int64_t *q_at, const void *kt,
                                   int64_t tiles, float scale, float *s0, float *s1, float *qf,
                                   const int64_t dim, const int is_bf16, const int pairs) {
#if HAVE_DPBF16
    if (pairs) {
        const uint16_t *q0 = (const uint16_t *)query + q_at[0];
        const uint16_t *q1 = (const uint16_t *)query + q_at[1], *k = (const uint16_t *)kt;
        for (int64_t t0 = 0; t0 < tiles; t0 += GROUP) {
            __m512 acc0[GROUP], acc1[GROUP];
            for (int u = 0; u < GROUP; u++) acc0[u] = acc1[u] = _mm512_setzero_ps();
            for (int64_t dp = 0; dp < dim / 2; dp++) {
                uint32_t p0, p1;
                memcpy(&p0, q0 + 2 * dp, sizeof p0);
                memcpy(&p1, q1 + 2 * dp, sizeof p1);
                const __m512bh v0 = (__m512bh)_mm512_set1_epi32((int)p0);
                const __m512bh v1 = (__m512bh)_mm512_set1_epi32((int)p1);
                for (int u = 0; u < GROUP; u++) {
                    const __m512bh kv = (__m512bh)_mm512_loadu_si512(
                        k + ((t0 + u) * dim / 2 + dp) * 32);
                    acc0[u] = _mm512_dpbf16_ps(acc0[u], v0, kv);
                    acc1[u] = _mm512_dpbf16_ps(acc1[u], v1, kv);
                }
            }
            const __m512 sc = _mm512_set1_ps(scale);
            for (int u = 0; u < GROUP; u++) {
                _mm512_storeu_ps(s0 + (t0 + u) * TILE, _mm512_mul_ps(acc0[u], sc));
                _mm512_storeu_ps(s1 + (t0 + u) * TILE, _mm512_mul_ps(acc1[u], sc));
            }
        }
        return;
    }
#endif
    tile_scores(query, q_at[0], kt, tiles, scale, s0, qf, dim, is_bf16, pairs);
    tile_scores(query, q_at[1], kt, tiles, scale, s1, qf, dim, is_bf16, pairs);
}

/* s[0:n] = exp(s - max s); returns 1 / their sum. The exponentials in a loop of their own:
 * the compiler calls the vector expf there (with a reduction in the same loop it does not). */
static inline float softmax_unnormalized(float *s, int64_t n) {
    float max = s[0], sum = 0.0f;
#pragma omp simd reduction(max : max)
    for (int64_t t = 0; t < n; t++) max = s[t] > max ? s[t] : max;
#pragma omp simd
    for (int64_t t = 0; t < n; t++) s[t] = expf(s[t] - max);
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) sum += s[t];
    return 1.0f / sum;
}

/* a0 = sum over t < n of p0[t] * v[t], a1 the same of p1: two rows' sums over one read of the
 * values (v fp32 [n, dim]), twice the independent sums in flight. */
ALWAYS_INLINE void accumulate_two(float *a0, float *a1, const float *p0, const float *p1,
                                  const float *v, int64_t n, const int64_t dim) {
#if defined(__AVX512F__)
    if (dim == 64 || dim == 128) {
        __m512 s0[8], s1[8]; /* dim / 16 of each used */
#pragma GCC unroll 8
        for (int64_t c = 0; c < dim / 16; c++) s0[c] = s1[c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m512 w0 = _mm512_set1_ps(p0[t]), w1 = _mm512_set1_ps(p1[t]);
#pragma GCC unroll 8
            for (int64_t c = 0; c < dim / 16; c++) {
                const __m512 x = _mm512_loadu_ps(v + t * dim + 16 * c);
                s0[c] = _mm512_fmadd_ps(w0, x, s0[c]);
                s1[c] = _mm512_fmadd_ps(w1, x, s1[c]);
            }
        }
#pragma GCC unroll 8
        for (int64_t c = 0; c < dim / 16; c++) {
            _mm512_storeu_ps(a0 + 16 * c, s0[c]);
            _mm512_storeu_ps(a1 + 16 * c, s1[c]);
        }
        return;
    }
#endif
    memset(a0, 0, (size_t)dim * sizeof(float));
    memset(a1, 0, (size_t)dim * sizeof(float));
    accumulate_rows(a0, p0, v, n, dim, dim);
    accumulate_rows(a1, p1, v, n, dim, dim);
}

/* One task: `rows` query rows from row r0 of request `req`, KV head g, two rows at a time (the
 * second sees one key more: the first's weight for it is 0). buf: see the allocation. */
ALWAYS_INLINE void prefill_task(const Prefill *a, int64_t req, int64_t g, int64_t r0,
                                int64_t rows, float *buf, const int64_t dim, const int is_bf16,
                                const int pairs) {
    const int64_t *rq = a->reqs + req * 4;
    const int64_t first = rq[0], query_len = rq[1], seq_len = rq[2];
    const int32_t *table = a->block_table + rq[3] * a->table_stride;
    const int64_t start = seq_len - query_len, n = start + r0 + rows; /* keys this task sees */
    const int64_t padded = (seq_len + TILE * GROUP - 1) / (TILE * GROUP) * TILE * GROUP;
    const int64_t group = a->num_heads / a->num_kv_heads;
    float *vf = buf, *s0 = vf + seq_len * dim, *s1 = s0 + padded, *acc = s1 + padded;
    float *qf = acc + 2 * dim;
    void *kt = qf + dim;
    pack_kv(a, table, g, n, kt, vf, dim, is_bf16, pairs);
    for (int64_t i = r0; i < r0 + rows; i += 2) {
        const int64_t seen = start + i + 1, two = i + 1 < r0 + rows;
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            float inv[2] = {0.0f, 0.0f};
            const int64_t q_at[2] = {(first + i) * a->query_row_stride + h * dim,
                                     (first + i + two) * a->query_row_stride + h * dim};
            if (two)
                tile_scores_two(a->query, q_at, kt, (seen + 1 + TILE - 1) / TILE, a->scale, s0,
                                s1, qf, dim, is_bf16, pairs);
            else
                tile_scores(a->query, q_at[0], kt, (seen + TILE - 1) / TILE, a->scale, s0, qf,
                            dim, is_bf16, pairs);
            for (int64_t k = 0; k <= two; k++) inv[k] = softmax_unnormalized(k ? s1 : s0, seen + k);
            s0[seen] = 0.0f;
            if (!two) memset(s1, 0, (size_t)(seen + 1) * sizeof(float));
            accumulate_two(acc, acc + dim, s0, s1, vf, seen + two, dim);
            for (int64_t k = 0; k <= two; k++) {
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) acc[k * dim + d] *= inv[k];
                const int64_t out_at = (first + i + k) * a->output_row_stride + h * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) store(a->output, out_at + d, acc[k * dim + d], is_bf16);
            }
        }
    }
}

static void run_prefill_task(const Prefill *a, int64_t req, int64_t g, int64_t r0, int64_t rows,
                     float *buf, int is_bf16) {
    const int pairs = HAVE_DPBF16 && is_bf16 && a->head_dim % 2 == 0;
    if (a->head_dim == 64 && pairs) prefill_task(a, req, g, r0, rows, buf, 64, 1, 1);
    else if (a->head_dim == 128 && pairs) prefill_task(a, req, g, r0, rows, buf, 128, 1, 1);
    else if (a->head_dim == 64 && !is_bf16) prefill_task(a, req, g, r0, rows, buf, 64, 0, 0);
    else if (a->head_dim == 128 && !is_bf16) prefill_task(a, req, g, r0, rows, buf, 128, 0, 0);
    else if (pairs) prefill_task(a, req, g, r0, rows, buf, a->head_dim, 1, 1);
    else if (is_bf16) prefill_task(a, req, g, r0, rows, buf, a->head_dim, 1, 0);
    else prefill_task(a, req, g, r0, rows, buf, a->head_dim, 0, 0);
}

/* Returns 0 on success, 1 if tasks were left undone (a thread could not allocate its buffer). */
int paged_prefill_attention(const Prefill *a, int is_bf16, int num_threads) {
    int64_t max_len = 0, tasks = 0;
    for (int64_t i = 0; i < a->num_reqs; i++) {
        max_len = a->reqs[i * 4 + 2] > max_len ? a->reqs[i * 4 + 2] : max_len;
        tasks += (a->reqs[i * 4 + 1] + CHUNK - 1) / CHUNK;
    }
    const int64_t dim = a->head_dim;
    const int64_t padded = (max_len + TILE * GROUP - 1) / (TILE * GROUP) * TILE * GROUP;
    /* vf [max_len, D], s0 and s1 [padded], acc [2, D], qf [D], kt [padded, D] (fp32 at most) */
    const size_t floats = (size_t)(max_len * dim + 2 * padded + 3 * dim + padded * dim + 16);
    int undone = 0;
#pragma omp parallel num_threads(num_threads > 1 ? num_threads : 1) reduction(+ : undone)
    {
        float *buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t task = 0; task < tasks; task++) {
            for (int64_t g = 0; g < a->num_kv_heads; g++) {
                if (buf == NULL) { undone++; continue; }
                int64_t req = 0, chunk = task;
                while (chunk >= (a->reqs[req * 4 + 1] + CHUNK - 1) / CHUNK)
                    chunk -= (a->reqs[req * 4 + 1] + CHUNK - 1) / CHUNK, req++;
                const int64_t r0 = chunk * CHUNK, left = a->reqs[req * 4 + 1] - r0;
                run_prefill_task(a, req, g, r0, left < CHUNK ? left : CHUNK, buf, is_bf16);
            }
        }
        free(buf);
    }
    return undone != 0;
}
