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
 * Where the build has no AVX512 or head_dim is not a multiple of 16, the plain path serves a
 * row's query heads a few at a time, all in fp32, in 8-lane vectors the compiler maps to the
 * CPU's (below).
 */
#include "prefill.h"
#include "prefill_pack.h"
#include "prefill_softmax.h"

/* The plain path: 8-lane fp32 vectors (v8f, cpu_kernels.h), a row's query heads of the group
 * PLAIN_HEADS at a time. Keys are packed as in prefill_pack.h's pack_plain, [t / 16][D][16]:
 * the two loads of 16 keys' element d meet a broadcast of each head's q[d], so a score needs
 * no horizontal sum, and the 2 x heads sums are independent chains of multiply-adds (one
 * chain a head stalled on the adds' latency). */
#define PLAIN_HEADS 4

/* s[hh][t] = scale * q_hh . key t for t < seen (rounded up to TILE), HB heads. */
ALWAYS_INLINE void plain_scores(const float *kt, const float *q, int64_t seen, float *s,
                                int64_t padded, float scale, const int64_t dim, const int HB) {
    for (int64_t t0 = 0; t0 < seen; t0 += TILE) {
        const float *k = kt + t0 * dim; /* tile t0 / 16 */
        v8f acc[PLAIN_HEADS][2];
#pragma GCC unroll 4
        for (int hh = 0; hh < HB; hh++) acc[hh][0] = acc[hh][1] = (v8f){0};
        for (int64_t d = 0; d < dim; d++) {
            const v8f k0 = *(const v8f *)(k + d * TILE), k1 = *(const v8f *)(k + d * TILE + 8);
#pragma GCC unroll 4
            for (int hh = 0; hh < HB; hh++) {
                acc[hh][0] += q[hh * dim + d] * k0;
                acc[hh][1] += q[hh * dim + d] * k1;
            }
        }
#pragma GCC unroll 4
        for (int hh = 0; hh < HB; hh++) {
            *(v8f *)(s + hh * padded + t0) = acc[hh][0] * scale;
            *(v8f *)(s + hh * padded + t0 + 8) = acc[hh][1] * scale;
        }
    }
}

/* The row s[0:seen] -> exp(s - max), in place; returns their sum. */
ALWAYS_INLINE float plain_softmax(float *s, int64_t seen) {
    float max = s[0], sum = 0.0f;
#pragma omp simd reduction(max : max)
    for (int64_t t = 1; t < seen; t++) max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < seen; t++) {
        s[t] = expf(s[t] - max);
        sum += s[t];
    }
    return sum;
}

/* out[hh][0:dim] = sum over t < seen of p[hh][t] * vals[t] for HB heads (p's rows `padded`
 * apart), 8 W columns at a time with their HB x W sums in registers. Each load of a value
 * vector serves the HB heads: a row's values (64 KB at 256 keys of 64) come from L2, which
 * one head's multiply-adds alone would outrun. */
ALWAYS_INLINE void plain_values(const float *vals, const float *p, int64_t padded, int64_t seen,
                                float *out, const int64_t dim, const int HB) {
    const int W = HB == 1 ? 8 : HB == 4 ? 2 : 4; /* vectors of columns: HB W + W <= 16 */
    int64_t c0 = 0;
    for (; c0 + 8 * W <= dim; c0 += 8 * W) {
        v8f acc[PLAIN_HEADS][8];
#pragma GCC unroll 4
        for (int hh = 0; hh < HB; hh++)
#pragma GCC unroll 8
            for (int c = 0; c < W; c++) acc[hh][c] = (v8f){0};
        for (int64_t t = 0; t < seen; t++) {
            v8f v[8];
#pragma GCC unroll 8
            for (int c = 0; c < W; c++) v[c] = *(const v8f *)(vals + t * dim + c0 + 8 * c);
#pragma GCC unroll 4
            for (int hh = 0; hh < HB; hh++)
#pragma GCC unroll 8
                for (int c = 0; c < W; c++) acc[hh][c] += p[hh * padded + t] * v[c];
        }
#pragma GCC unroll 4
        for (int hh = 0; hh < HB; hh++) memcpy(out + hh * dim + c0, acc[hh], W * sizeof(v8f));
    }
    for (int hh = 0; hh < HB; hh++) /* columns past the last whole 8 W */
        for (int64_t d = c0; d < dim; d++) {
            float sum = 0.0f;
            for (int64_t t = 0; t < seen; t++) sum += p[hh * padded + t] * vals[t * dim + d];
            out[hh * dim + d] = sum;
        }
}

/* Heads h0 .. h0 + HB - 1 of query row `row` (it sees `seen` keys): scores, softmax, values. */
ALWAYS_INLINE void plain_heads(const Prefill *a, const Scratch *b, int64_t row, int64_t h0,
                               int64_t seen, const int64_t dim, const int is_bf16, const int HB) {
    float *q = b->qf, *out = b->qf; /* out replaces q once the scores are made */
    for (int hh = 0; hh < HB; hh++)
        load_row(a->query, row * a->query_row_stride + (h0 + hh) * dim, q + hh * dim, dim,
                 is_bf16);
    plain_scores((const float *)b->keys, q, seen, b->scores, b->padded, a->scale, dim, HB);
    float inv[PLAIN_HEADS];
    for (int hh = 0; hh < HB; hh++)
        inv[hh] = 1.0f / plain_softmax(b->scores + hh * b->padded, seen);
    plain_values((const float *)b->vals, b->scores, b->padded, seen, out, dim, HB);
    for (int hh = 0; hh < HB; hh++) {
        const int64_t out_at = row * a->output_row_stride + (h0 + hh) * dim;
        for (int64_t d = 0; d < dim; d++)
            store(a->output, out_at + d, out[hh * dim + d] * inv[hh], is_bf16);
    }
}

/* The plain path's task: each row's heads of KV head g, PLAIN_HEADS at a time. */
ALWAYS_INLINE void plain_task(const Prefill *a, const int64_t *rq, int64_t g, int64_t r0,
                              int64_t rows, const Scratch *b, const int64_t dim,
                              const int is_bf16) {
    const int64_t start = rq[2] - rq[1], group = a->num_heads / a->num_kv_heads;
    pack_plain(a, a->block_table + rq[3] * a->table_stride, g, start + r0 + rows, b, dim,
               is_bf16);
    for (int64_t i = r0; i < r0 + rows; i++) {
        const int64_t row = rq[0] + i, seen = start + i + 1;
        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += PLAIN_HEADS) {
            const int64_t left = (g + 1) * group - h0;
            switch (left < PLAIN_HEADS ? left : PLAIN_HEADS) {
            case 1: plain_heads(a, b, row, h0, seen, dim, is_bf16, 1); break;
            case 2: plain_heads(a, b, row, h0, seen, dim, is_bf16, 2); break;
            case 3: plain_heads(a, b, row, h0, seen, dim, is_bf16, 3); break;
            default: plain_heads(a, b, row, h0, seen, dim, is_bf16, 4);
            }
        }
    }
}

#if defined(__AVX512F__)
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

/* plain_task with the dtype known to the compiler. */
ALWAYS_INLINE void plain_task_of_dtype(const Prefill *a, const int64_t *rq, int64_t g,
                                       int64_t r0, int64_t rows, const Scratch *b,
                                       const int64_t dim, int is_bf16) {
    if (is_bf16) plain_task(a, rq, g, r0, rows, b, dim, 1);
    else plain_task(a, rq, g, r0, rows, b, dim, 0);
}

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
    if (dim == 64) plain_task_of_dtype(a, rq, g, r0, rows, b, 64, is_bf16);
    else if (dim == 128) plain_task_of_dtype(a, rq, g, r0, rows, b, 128, is_bf16);
    else plain_task_of_dtype(a, rq, g, r0, rows, b, dim, is_bf16);
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
        Scratch b = {0};
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

