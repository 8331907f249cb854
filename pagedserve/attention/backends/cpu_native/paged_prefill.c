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
 * position. Query head h reads KV head h / group.
 *
 * A task is (request, KV head, CHUNK query rows). It copies the keys and values it sees into
 * buffers laid out for its products (those its thread's buffers do not hold yet from a task
 * of the same request and KV head), then takes its query vectors, the (row, head) pairs of
 * its rows and the group's heads in that order, MB at a time: a block. The MB vectors of a
 * block share every load of a key tile and of a value vector, their sums in registers. Per
 * block: the scores over the keys its last row sees (the vectors of an earlier row give the
 * extra keys no weight), the softmax of each vector (16 lanes at a time, an inline
 * exponential), the weighted values.
 *
 * Numerics. Scores are fp32: bf16 queries and keys on AVX512-BF16 with its dot-product
 * instruction (exact products, fp32 sums), else fused multiply-adds on values widened to
 * fp32. The softmax is fp32. The weighted values of fp32 models are fp32 multiply-adds; those
 * of bf16 models on AVX512-BF16 use the dot-product instruction too: the unnormalized
 * probabilities exp(s - max), in (0, 1], are rounded to bf16 (as GPU attention kernels
 * multiply P in bf16), their products with the bf16 values exact, the sums fp32, and the
 * normalizer is the sum of the rounded probabilities. The output is rounded once, at the end.
 *
 * Where the build has no AVX512 or head_dim is not a multiple of 16, plain loops serve one
 * query vector at a time, all in fp32.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#include "paged_attention.h"
#include "row_ops.h"

#define CHUNK 64 /* query rows of a task */
#define TILE 16  /* keys of a score tile: one lane each */
#define MB 6     /* query vectors of a block */
#define UT 4     /* score tiles in flight: MB * UT = 24 sums and UT key tiles in 32 registers */
#define WV 4     /* output vectors in flight per query vector (64 columns): MB * WV = 24 sums */

typedef struct {
    const void *query, *key_cache, *value_cache;
    const int32_t *block_table;
    const int64_t *reqs;
    void *output;
    int64_t num_reqs, num_heads, num_kv_heads, head_dim, block_size, table_stride;
    int64_t query_row_stride, output_row_stride, cache_block_stride;
    float scale;
} Prefill;

/* A thread's buffers for one task; `padded` is the longest request's length rounded up to
 * TILE (a multiple of 2: whole key pairs). With `pairs` (bf16 on AVX512-BF16):
 *   keys  bf16 [tile][D / 2][16][2]: the word (tile, dp, j) holds elements 2 dp, 2 dp + 1 of
 *         key 16 tile + j, as the dot-product instruction reads them against a query pair
 *   vals  bf16 [t / 2][D][2]: the word (t / 2, d) holds element d of keys t (low half) and
 *         t + 1 (high half), read against the pair of their probabilities
 *   probs bf16 [MB][padded]
 * else (fp32 products): keys fp32 [tile][D][16], vals fp32 [t][D], the probabilities in
 * `scores` in place; the plain path keeps keys as vals, [t][D].
 * scores fp32 [MB][padded]; qf fp32 [MB][D]: the block's query vectors widened (bf16
 * without pairs; the plain path's query and sums).
 * keys and vals hold keys 0 .. packed - 1 of request `req`, KV head g (req -1: none): a task
 * of the same pair packs only the keys past them. */
typedef struct {
    void *keys, *vals;
    uint16_t *probs;
    float *scores, *qf;
    int64_t padded, req, g, packed;
} Scratch;

/* Cache row of key t of KV head g of a request (table: its block-table row). */
ALWAYS_INLINE int64_t cache_at(const Prefill *a, const int32_t *table, int64_t t, int64_t g) {
    return table[t / a->block_size] * a->cache_block_stride
           + ((t % a->block_size) * a->num_kv_heads + g) * a->head_dim;
}

/* The plain path: keys and values 0 .. n-1 widened to fp32 rows [t][D]. */
ALWAYS_INLINE void pack_rows(const Prefill *a, const int32_t *table, int64_t g, int64_t n,
                             const Scratch *b, const int64_t dim, const int is_bf16) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = cache_at(a, table, t, g);
        load_row(a->key_cache, at, (float *)b->keys + t * dim, dim, is_bf16);
        load_row(a->value_cache, at, (float *)b->vals + t * dim, dim, is_bf16);
    }
}

/* The plain path's task: one query vector at a time, fp32. */
ALWAYS_INLINE void plain_task(const Prefill *a, const int64_t *rq, int64_t g, int64_t r0,
                              int64_t rows, const Scratch *b, const int64_t dim,
                              const int is_bf16) {
    const int64_t first = rq[0], start = rq[2] - rq[1];
    const int64_t group = a->num_heads / a->num_kv_heads;
    const float *kf = (const float *)b->keys, *vf = (const float *)b->vals;
    float *s = b->scores, *q = b->qf, *acc = b->qf + dim;
    pack_rows(a, a->block_table + rq[3] * a->table_stride, g, start + r0 + rows, b, dim,
              is_bf16);
    for (int64_t i = r0; i < r0 + rows; i++) {
        const int64_t seen = start + i + 1;
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            load_row(a->query, (first + i) * a->query_row_stride + h * dim, q, dim, is_bf16);
            for (int64_t t = 0; t < seen; t++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += q[d] * kf[t * dim + d];
                s[t] = dot * a->scale;
            }
            float max = s[0], sum = 0.0f;
            for (int64_t t = 1; t < seen; t++) max = s[t] > max ? s[t] : max;
            for (int64_t t = 0; t < seen; t++) sum += s[t] = expf(s[t] - max);
            memset(acc, 0, (size_t)dim * sizeof(float));
            accumulate_rows(acc, s, vf, seen, dim, dim);
            const int64_t out_at = (first + i) * a->output_row_stride + h * dim;
            for (int64_t d = 0; d < dim; d++) store(a->output, out_at + d, acc[d] / sum, is_bf16);
        }
    }
}

#if defined(__AVX512F__)
/* The query vectors of a block: MB (row, head) pairs of a task, the first `real` its own (a
 * task's last block repeats its last vector, computed and not stored). seen: keys 0 .. seen-1
 * of the vector's row; seen_max: of the block's last row. */
typedef struct {
    int64_t real, seen_max;
    int64_t q_at[MB], out_at[MB], seen[MB];
} Block;

/* Vectors v0 .. v0 + MB - 1 of the task's `count` (vector v: row r0 + v / group, head
 * g * group + v % group). */
ALWAYS_INLINE Block block_at(const Prefill *a, const int64_t *rq, int64_t g, int64_t r0,
                             int64_t v0, int64_t count) {
    const int64_t group = a->num_heads / a->num_kv_heads, start = rq[2] - rq[1];
    Block blk = {count - v0 < MB ? count - v0 : MB, 0, {0}, {0}, {0}};
    for (int m = 0; m < MB; m++) {
        const int64_t v = v0 + m < count ? v0 + m : count - 1, row = r0 + v / group;
        const int64_t h = g * group + v % group;
        blk.q_at[m] = (rq[0] + row) * a->query_row_stride + h * a->head_dim;
        blk.out_at[m] = (rq[0] + row) * a->output_row_stride + h * a->head_dim;
        blk.seen[m] = start + row + 1;
        blk.seen_max = blk.seen[m] > blk.seen_max ? blk.seen[m] : blk.seen_max;
    }
    return blk;
}

/* 16 fp32 stored at out[at:] in the model's dtype (bf16: rounded to nearest even, as store). */
ALWAYS_INLINE void store16(void *out, int64_t at, __m512 x, const int is_bf16) {
    if (!is_bf16) {
        _mm512_storeu_ps((float *)out + at, x);
        return;
    }
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
}

/* r[0..15]: 16 rows of 16 32-bit words, transposed in place (r[w] lane j = word w of row j):
 * pairs of words, then of their pairs, within 128-bit lanes, then the lanes across vectors. */
ALWAYS_INLINE void transpose16(__m512i *r) {
    __m512i t[16];
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) { /* u_q lane k: word 4k + q of rows i .. i + 3 */
        const __m512i ab0 = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        const __m512i ab1 = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        const __m512i cd0 = _mm512_unpacklo_epi32(r[i + 2], r[i + 3]);
        const __m512i cd1 = _mm512_unpackhi_epi32(r[i + 2], r[i + 3]);
        t[i] = _mm512_unpacklo_epi64(ab0, cd0);
        t[i + 1] = _mm512_unpackhi_epi64(ab0, cd0);
        t[i + 2] = _mm512_unpacklo_epi64(ab1, cd1);
        t[i + 3] = _mm512_unpackhi_epi64(ab1, cd1);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) { /* word 4k + q: lane k of t[q], t[4 + q], t[8 + q], t[12 + q] */
        const __m512i v0 = _mm512_shuffle_i32x4(t[q], t[4 + q], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(t[q], t[4 + q], 0xee);
        const __m512i v2 = _mm512_shuffle_i32x4(t[8 + q], t[12 + q], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(t[8 + q], t[12 + q], 0xee);
        r[q] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + q] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        r[8 + q] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + q] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

/* Key tile `tile` (keys 16 tile .. 16 tile + 15; those from n on zeros, kept finite: their
 * scores are computed, never read) into its layout: a key row is a row of 32-bit words (pairs
 * of bf16, or fp32, bf16 widened without pairs), transposed 16 words at a time. */
ALWAYS_INLINE void pack_key_tile(const Prefill *a, const int32_t *table, int64_t g, int64_t n,
                                 int64_t tile, const Scratch *b, const int64_t dim,
                                 const int is_bf16, const int pairs) {
    const int64_t words = pairs ? dim / 2 : dim, elem = is_bf16 ? 2 : 4;
    const char *row[TILE];
#pragma GCC unroll 16
    for (int j = 0; j < TILE; j++) {
        const int64_t t = tile * TILE + j;
        row[j] = t < n ? (const char *)a->key_cache + cache_at(a, table, t, g) * elem : NULL;
    }
    uint32_t *dst = (uint32_t *)b->keys + tile * TILE * words;
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
        const int64_t left = words - w0 < 16 ? words - w0 : 16; /* pairs: 8 where dim % 32 */
        const __mmask16 mask = (__mmask16)_bzhi_u32(0xffffu, (uint32_t)left);
        __m512i r[16];
#pragma GCC unroll 16
        for (int j = 0; j < TILE; j++) {
            if (row[j] == NULL) r[j] = _mm512_setzero_si512();
            else if (pairs || !is_bf16) r[j] = _mm512_maskz_loadu_epi32(mask, row[j] + w0 * 4);
            else r[j] = _mm512_castps_si512(load16(row[j], w0, 1));
        }
        transpose16(r);
#pragma GCC unroll 16
        for (int w = 0; w < 16; w++)
            if (w < left) _mm512_storeu_si512(dst + (w0 + w) * TILE, r[w]);
    }
}

/* The value pair word row t / 2 from keys t (cache element at0) and t + 1 (at1; < 0: none,
 * zeros: its probability is 0, and the product must not be a NaN). */
ALWAYS_INLINE void pack_value_pair(const Prefill *a, int64_t at0, int64_t at1, uint32_t *dst,
                                   const int64_t dim) {
    const uint16_t *v0 = (const uint16_t *)a->value_cache + at0;
    const uint16_t *v1 = (const uint16_t *)a->value_cache + at1;
#pragma GCC unroll 8
    for (int64_t c = 0; c < dim; c += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + c)));
        const __m512i hi = at1 < 0 ? _mm512_setzero_si512()
                                   : _mm512_cvtepu16_epi32(
                                         _mm256_loadu_si256((const __m256i *)(v1 + c)));
        _mm512_storeu_si512(dst + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

/* Keys and values from..n-1 (from a multiple of TILE) into the layouts of Scratch. */
ALWAYS_INLINE void pack_kv(const Prefill *a, const int32_t *table, int64_t g, int64_t from,
                           int64_t n, const Scratch *b, const int64_t dim, const int is_bf16,
                           const int pairs) {
    for (int64_t tile = from / TILE; tile < (n + TILE - 1) / TILE; tile++)
        pack_key_tile(a, table, g, n, tile, b, dim, is_bf16, pairs);
    if (pairs) {
        for (int64_t t = from; t < n; t += 2)
            pack_value_pair(a, cache_at(a, table, t, g),
                            t + 1 < n ? cache_at(a, table, t + 1, g) : -1,
                            (uint32_t *)b->vals + t / 2 * dim, dim);
    } else {
        for (int64_t t = from; t < n; t++)
            load_row(a->value_cache, cache_at(a, table, t, g), (float *)b->vals + t * dim, dim,
                     is_bf16);
    }
}

/* scores[m][16 t0 : 16 (t0 + U)] = q_m . keys of tiles t0 .. t0 + U - 1, every vector m of
 * the block: each key vector loaded once for MB vectors. */
ALWAYS_INLINE void score_tiles(const Prefill *a, const Block *blk, const Scratch *b, int64_t t0,
                               const int64_t dim, const int is_bf16, const int pairs,
                               const int U) {
    __m512 acc[MB][UT];
#pragma GCC unroll 6
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) acc[m][u] = _mm512_setzero_ps();
#if HAVE_DPBF16
    if (pairs) {
        const uint32_t *k = (const uint32_t *)b->keys + t0 * TILE * (dim / 2);
        const uint16_t *q[MB];
#pragma GCC unroll 6
        for (int m = 0; m < MB; m++) q[m] = (const uint16_t *)a->query + blk->q_at[m];
        for (int64_t dp = 0; dp < dim / 2; dp++) {
            __m512bh kv[UT];
#pragma GCC unroll 4
            for (int u = 0; u < U; u++)
                kv[u] = (__m512bh)_mm512_loadu_si512(k + (u * dim / 2 + dp) * TILE);
#pragma GCC unroll 6
            for (int m = 0; m < MB; m++) {
                uint32_t pair;
                memcpy(&pair, q[m] + 2 * dp, sizeof pair);
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 4
                for (int u = 0; u < U; u++) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], qv, kv[u]);
            }
        }
    } else
#else
    (void)pairs;
#endif
    {
        const float *k = (const float *)b->keys + t0 * TILE * dim, *q[MB];
#pragma GCC unroll 6
        for (int m = 0; m < MB; m++)
            q[m] = is_bf16 ? b->qf + m * dim : (const float *)a->query + blk->q_at[m];
        for (int64_t d = 0; d < dim; d++) {
            __m512 kv[UT];
#pragma GCC unroll 4
            for (int u = 0; u < U; u++) kv[u] = _mm512_loadu_ps(k + (u * dim + d) * TILE);
#pragma GCC unroll 6
            for (int m = 0; m < MB; m++) {
                const __m512 qv = _mm512_set1_ps(q[m][d]);
#pragma GCC unroll 4
                for (int u = 0; u < U; u++) acc[m][u] = _mm512_fmadd_ps(qv, kv[u], acc[m][u]);
            }
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int u = 0; u < U; u++)
            _mm512_storeu_ps(b->scores + m * b->padded + (t0 + u) * TILE, acc[m][u]);
}

/* The block's scores over the tiles its last row sees, UT tiles at a time, then one. */
ALWAYS_INLINE void block_scores(const Prefill *a, const Block *blk, const Scratch *b,
                                const int64_t dim, const int is_bf16, const int pairs) {
    const int64_t tiles = (blk->seen_max + TILE - 1) / TILE;
    int64_t t = 0;
    for (; t + UT <= tiles; t += UT) score_tiles(a, blk, b, t, dim, is_bf16, pairs, UT);
    for (; t < tiles; t++) score_tiles(a, blk, b, t, dim, is_bf16, pairs, 1);
}

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

/* Output columns c0 .. c0 + 16 W of the block's vectors: inv[m] * the sum over keys t < end
 * of p[m][t] value[t] (with `pairs` a key pair per step), stored for its real vectors. */
ALWAYS_INLINE void value_columns(const Prefill *a, const Block *blk, const Scratch *b,
                                 int64_t end, int64_t c0, const float *inv, const int64_t dim,
                                 const int is_bf16, const int pairs, const int W) {
    __m512 acc[MB][WV];
#pragma GCC unroll 6
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int w = 0; w < W; w++) acc[m][w] = _mm512_setzero_ps();
#if HAVE_DPBF16
    if (pairs) {
        const uint32_t *v = (const uint32_t *)b->vals + c0;
        for (int64_t tp = 0; tp < end / 2; tp++) {
            __m512bh x[WV];
#pragma GCC unroll 4
            for (int w = 0; w < W; w++)
                x[w] = (__m512bh)_mm512_loadu_si512(v + tp * dim + 16 * w);
#pragma GCC unroll 6
            for (int m = 0; m < MB; m++) {
                uint32_t pair;
                memcpy(&pair, b->probs + m * b->padded + 2 * tp, sizeof pair);
                const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 4
                for (int w = 0; w < W; w++) acc[m][w] = _mm512_dpbf16_ps(acc[m][w], pv, x[w]);
            }
        }
    } else
#else
    (void)pairs;
#endif
    {
        const float *v = (const float *)b->vals + c0;
        for (int64_t t = 0; t < end; t++) {
            __m512 x[WV];
#pragma GCC unroll 4
            for (int w = 0; w < W; w++) x[w] = _mm512_loadu_ps(v + t * dim + 16 * w);
#pragma GCC unroll 6
            for (int m = 0; m < MB; m++) {
                const __m512 pv = _mm512_set1_ps(b->scores[m * b->padded + t]);
#pragma GCC unroll 4
                for (int w = 0; w < W; w++) acc[m][w] = _mm512_fmadd_ps(pv, x[w], acc[m][w]);
            }
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MB; m++) {
        if (m >= blk->real) break;
#pragma GCC unroll 4
        for (int w = 0; w < W; w++)
            store16(a->output, blk->out_at[m] + c0 + 16 * w,
                    _mm512_mul_ps(acc[m][w], _mm512_set1_ps(inv[m])), is_bf16);
    }
}

/* The query vectors of a block asked for (`bytes` each), a block ahead of their use: the
 * rows of a task are far apart in the query, each block's a cold read. */
ALWAYS_INLINE void prefetch_queries(const Prefill *a, const Block *blk, int64_t bytes) {
    const int64_t elem = bytes / a->head_dim;
    for (int m = 0; m < MB; m++) {
        const char *q = (const char *)a->query + blk->q_at[m] * elem;
        for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(q + at, _MM_HINT_T0);
        _mm_prefetch(q + bytes - 1, _MM_HINT_T0); /* the last line, if q is not aligned */
    }
}

/* One block: scores, softmax, weighted values (64 columns at a time, then 16). */
ALWAYS_INLINE void attend_block(const Prefill *a, const Block *blk, const Scratch *b,
                                const int64_t dim, const int is_bf16, const int pairs) {
    if (is_bf16 && !pairs)
        for (int m = 0; m < MB; m++) load_row(a->query, blk->q_at[m], b->qf + m * dim, dim, 1);
    block_scores(a, blk, b, dim, is_bf16, pairs);
    const int64_t end = pairs ? (blk->seen_max + 1) / 2 * 2 : blk->seen_max;
    float inv[MB];
    block_softmax(blk, b, end, a->scale, inv, pairs);
    int64_t c = 0;
    for (; c + 16 * WV <= dim; c += 16 * WV)
        value_columns(a, blk, b, end, c, inv, dim, is_bf16, pairs, WV);
    for (; c < dim; c += 16) value_columns(a, blk, b, end, c, inv, dim, is_bf16, pairs, 1);
}

/* One task (head_dim a multiple of 16): pack the keys it sees that the buffers do not hold
 * yet, then its query vectors a block at a time. */
ALWAYS_INLINE void vector_task(const Prefill *a, int64_t req, int64_t g, int64_t r0,
                               int64_t rows, Scratch *b, const int64_t dim, const int is_bf16,
                               const int pairs) {
    const int64_t *rq = a->reqs + req * 4;
    const int64_t count = rows * (a->num_heads / a->num_kv_heads); /* query vectors */
    const int64_t n = rq[2] - rq[1] + r0 + rows; /* keys the task sees */
    const int64_t held = b->req == req && b->g == g ? b->packed : 0;
    if (n > held) { /* from the tile of the first key not held: its tile was zero-padded */
        pack_kv(a, a->block_table + rq[3] * a->table_stride, g, held / TILE * TILE, n, b, dim,
                is_bf16, pairs);
        b->req = req, b->g = g, b->packed = n;
    }
    Block blk = block_at(a, rq, g, r0, 0, count);
    for (int64_t v0 = 0; v0 < count; v0 += MB) {
        const Block next = block_at(a, rq, g, r0, v0 + MB < count ? v0 + MB : v0, count);
        prefetch_queries(a, &next, dim * (is_bf16 ? 2 : 4));
        attend_block(a, &blk, b, dim, is_bf16, pairs);
        blk = next;
    }
}
#endif

/* A copy per common head size and dtype, the loop bounds known to the compiler. */
static void run_prefill_task(const Prefill *a, int64_t req, int64_t g, int64_t r0, int64_t rows,
                             Scratch *b, int is_bf16) {
    const int64_t *rq = a->reqs + req * 4, dim = a->head_dim;
#if defined(__AVX512F__)
    if (dim % 16 == 0) {
        if (HAVE_DPBF16 && is_bf16) {
            if (dim == 64) vector_task(a, req, g, r0, rows, b, 64, 1, 1);
            else if (dim == 128) vector_task(a, req, g, r0, rows, b, 128, 1, 1);
            else vector_task(a, req, g, r0, rows, b, dim, 1, 1);
        } else if (!is_bf16) {
            if (dim == 64) vector_task(a, req, g, r0, rows, b, 64, 0, 0);
            else if (dim == 128) vector_task(a, req, g, r0, rows, b, 128, 0, 0);
            else vector_task(a, req, g, r0, rows, b, dim, 0, 0);
        } else {
            vector_task(a, req, g, r0, rows, b, dim, 1, 0); /* bf16 widened: no dot products */
        }
        return;
    }
#endif
    if (is_bf16) plain_task(a, rq, g, r0, rows, b, dim, 1);
    else plain_task(a, rq, g, r0, rows, b, dim, 0);
}

/* A thread's scratch for requests of up to max_len keys (see Scratch; every part 64-byte
 * aligned), NULL if it cannot be allocated; free() releases it. */
static void *scratch_for(const Prefill *a, int64_t max_len, Scratch *b) {
    const int64_t dim = a->head_dim, padded = (max_len + TILE - 1) / TILE * TILE;
    const int64_t kv = (padded * dim + 15) / 16 * 16; /* floats: fp32 at most */
    const int64_t parts[5] = {kv, kv, MB * padded, (MB * padded / 2 + 15) / 16 * 16,
                              (MB * dim + 15) / 16 * 16};
    const int64_t floats = parts[0] + parts[1] + parts[2] + parts[3] + parts[4];
    float *buf = aligned_alloc(64, (size_t)floats * sizeof(float));
    if (buf == NULL) return NULL;
    b->keys = buf;
    b->vals = buf + parts[0];
    b->scores = buf + parts[0] + parts[1];
    b->probs = (uint16_t *)(b->scores + parts[2]);
    b->qf = b->scores + parts[2] + parts[3];
    b->padded = padded;
    b->req = -1;
    return buf;
}

/* Tasks of request `req`: each KV head's CHUNK-row chunks. */
static int64_t chunks_of(const Prefill *a, int64_t req) {
    return (a->reqs[req * 4 + 1] + CHUNK - 1) / CHUNK;
}

/* Returns 0 on success, 1 if tasks were left undone (a thread could not allocate its buffer).
 * Tasks are handed out by request, KV head, then chunk, the last chunk first: a thread's next
 * task of the same request and KV head finds the keys it sees already packed, and of a
 * request's tasks the largest go first. */
int paged_prefill_attention(const Prefill *a, int is_bf16, int num_threads) {
    int64_t max_len = 0, tasks = 0;
    for (int64_t i = 0; i < a->num_reqs; i++) {
        max_len = a->reqs[i * 4 + 2] > max_len ? a->reqs[i * 4 + 2] : max_len;
        tasks += a->num_kv_heads * chunks_of(a, i);
    }
    int undone = 0;
#pragma omp parallel num_threads(num_threads > 1 ? num_threads : 1) reduction(+ : undone)
    {
        Scratch b;
        void *buf = scratch_for(a, max_len, &b);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (buf == NULL) { undone++; continue; }
            int64_t req = 0, k = task;
            while (k >= a->num_kv_heads * chunks_of(a, req))
                k -= a->num_kv_heads * chunks_of(a, req), req++;
            const int64_t chunks = chunks_of(a, req), g = k / chunks;
            const int64_t r0 = (chunks - 1 - k % chunks) * CHUNK;
            const int64_t left = a->reqs[req * 4 + 1] - r0;
            run_prefill_task(a, req, g, r0, left < CHUNK ? left : CHUNK, &b, is_bf16);
        }
        free(buf);
    }
    return undone != 0;
}
