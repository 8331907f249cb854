/* The prefill kernel's task layout: its arguments (Prefill), a thread's buffers (Scratch), a
 * block of query vectors (Block), and where a key sits in the paged cache (paged_prefill.c). */
#ifndef PREFILL_H
#define PREFILL_H

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
 * `scores` in place; the plain path keeps keys fp32 [t / 16][D][16], vals fp32 [t][D], q
 * and its sums in qf.
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

#endif

#endif
