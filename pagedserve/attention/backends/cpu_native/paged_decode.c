/* Paged decode attention on the CPU: one query row per request over its keys in the paged
 * KV cache, read in place through the block table (no gather, no padding).
 *
 * Built by cpu_native/__init__.py with the system C compiler into a small shared library
 * and called through ctypes; no Python or torch headers, so it compiles quickly.
 * Compiled with -ffast-math but linked without it (see COMPILE_FLAGS there).
 *
 * Layouts (row strides in elements, the last axis contiguous):
 *   query   [num_rows, num_heads, head_dim]       row r of request i is rows[i]
 *   cache   [num_blocks, block_size, num_kv_heads, head_dim] (keys; values alike)
 *   block_table int32 [num_reqs, table_stride], seq_lens int32 [num_reqs]
 *   output  [num_rows, num_heads, head_dim]       written at rows[i]
 * Query head h reads KV head h / group (GQA). Scores, softmax and the weighted sum of values
 * are fp32 whatever the storage dtype (bf16 is widened by a shift, rounded back to nearest even;
 * on CPUs with AVX512-BF16 the bf16 scores use its dot-product instruction: exact products,
 * fp32 sums). Built with -ffast-math: nothing here produces an infinity or relies on NaN
 * propagation (a NaN input gives an unspecified row).
 *
 * One task is one request (all its heads: a cache block [block_size, Hkv, D] is read as one
 * contiguous run); `num_threads` OpenMP threads share the requests. With AVX512 and D a
 * multiple of 16, a block is read as runs of up to 16 tokens: one score vector of 16 tokens per
 * query head, values summed straight from the cache for up to four heads of a group per load,
 * and the cache blocks two ahead prefetched a part per head (a request's blocks are scattered),
 * the next request's first keys after a request's last values; other builds and head sizes take
 * plain loops over an fp32 copy of each block.
 */
#include <stdint.h>

#include "paged_attention.h"

/* Returns 0 on success, 1 if requests were left undone (a thread could not allocate its
 * scratch). The threads are OpenMP's: in a torch process this library's libgomp.so.1 is the
 * one torch loaded (same soname), so the kernel runs on torch's own intra-op threads instead of
 * competing with them for the cores. */
int paged_decode_attention(const void *query, const void *key_cache, const void *value_cache,
                           const int64_t *rows, const int32_t *block_table, const int32_t *seq_lens,
                           void *output, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t table_stride,
                           int64_t query_row_stride, int64_t output_row_stride,
                           int64_t cache_block_stride, float scale, int is_bf16, int num_threads) {
    const Work w = {query, key_cache, value_cache, rows, block_table, seq_lens, output,
                    num_reqs, num_heads, num_kv_heads, head_dim, block_size, table_stride,
                    query_row_stride, output_row_stride, cache_block_stride, scale, is_bf16};
    return attend_requests(&w, num_threads) != 0;
}
