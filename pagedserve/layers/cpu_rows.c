/* Row-wise kernels of the torch layers on the CPU, for steps of many rows (prompts): RMSNorm
 * with the residual add, SiLU-and-mul, and the rotary embedding with the KV-cache write; and the
 * argmax of logit rows for greedy sampling. Each
 * is one pass over its rows where the torch code is several ops, each a pass with a cast; they
 * round as the torch code does (row_ops.h, shared with the decode step in model/cpu_decode.c).
 *
 * Tensors are bf16 or fp32 (`is_bf16`), all of one dtype; rows may be strided (a given row
 * stride, in elements), each row contiguous. Rows are split over `num_threads` threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"
#include "row_ops.h"

/* Row r of x widened to fp32. */
ALWAYS_INLINE void widen(const void *x, int64_t at, float *dst, int64_t n, int is_bf16) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = load(x, at + i, is_bf16);
}

ALWAYS_INLINE void narrow(void *y, int64_t at, const float *src, int64_t n, int is_bf16) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) store(y, at + i, src[i], is_bf16);
}

#if defined(__AVX512F__)
/* norm_row for n a multiple of 16, in two passes of 16 lanes: the sum (stored rounded when
 * there is a residual, kept in fp32 in buf) with its squares, then the normalized product. */
ALWAYS_INLINE void norm_row16(const void *x, const void *residual, const void *w, float eps,
                              void *out, void *sum_out, int64_t r, int64_t n, float *sum,
                              int is_bf16) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __m512 s = load16(x, r * n + i, is_bf16);
        if (residual != NULL) {
            s = _mm512_add_ps(s, load16(residual, r * n + i, is_bf16));
            store16(sum_out, r * n + i, s, is_bf16);
        }
        _mm512_storeu_ps(sum + i, s);
        squares = _mm512_fmadd_ps(s, s, squares);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 normed = rnd16(_mm512_mul_ps(_mm512_loadu_ps(sum + i), inv), is_bf16);
        store16(out, r * n + i, _mm512_mul_ps(load16(w, i, is_bf16), normed), is_bf16);
    }
}
#endif

ALWAYS_INLINE void norm_row(const void *x, const void *residual, const void *w, float eps,
                            void *out, void *sum_out, int64_t r, int64_t n, float *buf,
                            int is_bf16) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        norm_row16(x, residual, w, eps, out, sum_out, r, n, buf, is_bf16);
        return;
    }
#endif
    float *sum = buf, *normed = buf + n;
    widen(x, r * n, sum, n, is_bf16);
    if (residual != NULL) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) sum[i] += load(residual, r * n + i, is_bf16);
        narrow(sum_out, r * n, sum, n, is_bf16);
    }
    rms_norm(sum, w, eps, n, normed, is_bf16);
    narrow(out, r * n, normed, n, is_bf16);
}

/* out = RMSNorm(x + residual) and sum_out = x + residual (residual NULL: out = RMSNorm(x),
 * sum_out unused); x, residual, out, sum_out [m, n] contiguous, w [n]. 1: no memory. */
int add_rms_norm_rows(const void *x, const void *residual, const void *w, float eps, void *out,
                      void *sum_out, int64_t m, int64_t n, int is_bf16, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buf = malloc((size_t)(2 * n) * sizeof(float)); /* fp32 [2, n] */
        if (buf == NULL) failed = 1;
        else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) {
                if (is_bf16) norm_row(x, residual, w, eps, out, sum_out, r, n, buf, 1);
                else norm_row(x, residual, w, eps, out, sum_out, r, n, buf, 0);
            }
        }
        free(buf);
    }
    return failed;
}

/* Row r of out from row r of x in one pass, 16 columns at a time where the build has AVX512;
 * the columns past a multiple of 16 through buf (fp32 [3, d] at least). */
ALWAYS_INLINE void silu_row(const void *x, int64_t x_stride, void *out, int64_t r, int64_t d,
                            float *buf, int is_bf16) {
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= d; c += 16) {
        /* silu_mul16 rounds its result to the dtype: only the narrowing is left */
        store16_exact(out, r * d + c, silu_mul16(load16(x, r * x_stride + c, is_bf16),
                                                 load16(x, r * x_stride + d + c, is_bf16),
                                                 is_bf16), is_bf16);
    }
#endif
    const int64_t left = d - c;
    float *gate = buf, *up = buf + left, *act = buf + 2 * left;
    widen(x, r * x_stride + c, gate, left, is_bf16);
    widen(x, r * x_stride + d + c, up, left, is_bf16);
    silu_mul_tail(gate, up, act, left, is_bf16);
    narrow(out, r * d + c, act, left, is_bf16);
}

/* out [m, d] = silu(x[:, :d]) * x[:, d:]; x [m, 2 d] with row stride x_stride. 1: no memory. */
int silu_and_mul_rows(const void *x, int64_t x_stride, void *out, int64_t m, int64_t d,
                      int is_bf16, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buf = malloc((size_t)(3 * d) * sizeof(float)); /* fp32 [3, d] */
        if (buf == NULL) failed = 1;
        else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) {
                if (is_bf16) silu_row(x, x_stride, out, r, d, buf, 1);
                else silu_row(x, x_stride, out, r, d, buf, 0);
            }
        }
        free(buf);
    }
    return failed;
}

typedef struct {
    const void *query, *key, *value; /* [m, Hq D], [m, Hkv D], [m, Hkv D]: row strides below */
    const void *cos_sin;             /* [m, D]: each row's cos half | sin half */
    const int64_t *slots;            /* [m]; -1: no cache write */
    void *query_out;                 /* [m, Hq D] contiguous: the rotated queries */
    void *key_cache, *value_cache;   /* blocks of [block_size, Hkv, D], block stride below */
    int64_t m, num_heads, num_kv_heads, head_dim, block_size, cache_block_stride;
    int64_t query_stride, key_stride, value_stride;
} RopeRows;

/* Where the cache row of `slot` starts in either cache. */
ALWAYS_INLINE int64_t cache_row(const RopeRows *a, int64_t slot) {
    return (slot / a->block_size) * a->cache_block_stride
           + (slot % a->block_size) * a->num_kv_heads * a->head_dim;
}

/* Row r's values copied to the cache row `at` as they are (the same dtype). */
ALWAYS_INLINE void copy_value(const RopeRows *a, int64_t r, int64_t at, int is_bf16) {
    const int64_t width = is_bf16 ? 2 : 4, hkv = a->num_kv_heads * a->head_dim;
    memcpy((char *)a->value_cache + at * width, (const char *)a->value + r * a->value_stride * width,
           (size_t)(hkv * width));
}

#if defined(__AVX512F__)
/* rope_row for D/2 a multiple of 16: each head read, rotated and stored in one pass. */
ALWAYS_INLINE void rope_row16(const RopeRows *a, int64_t r, int is_bf16) {
    const int64_t d = a->head_dim;
    rotate_into16(a->query, r * a->query_stride, is_bf16, a->query_out, r * a->num_heads * d,
                  a->num_heads, d, a->cos_sin, r * d, is_bf16);
    const int64_t slot = a->slots[r];
    if (slot < 0) return;
    const int64_t at = cache_row(a, slot);
    rotate_into16(a->key, r * a->key_stride, is_bf16, a->key_cache, at, a->num_kv_heads, d,
                  a->cos_sin, r * d, is_bf16);
    copy_value(a, r, at, is_bf16);
}
#endif

/* Row r: its rotated query into query_out; at its slot, its rotated key and its value into the
 * caches. buf: fp32 [Hq D + Hkv D] (the widened row where the 16-lane pass does not apply). */
ALWAYS_INLINE void rope_row(const RopeRows *a, int64_t r, float *buf, int is_bf16) {
    const int64_t d = a->head_dim, hq = a->num_heads * d, hkv = a->num_kv_heads * d;
#if defined(__AVX512F__)
    if ((d / 2) % 16 == 0) {
        rope_row16(a, r, is_bf16);
        return;
    }
#endif
    float *q = buf, *k = buf + hq;
    widen(a->query, r * a->query_stride, q, hq, is_bf16);
    rotate(q, a->num_heads, d, a->cos_sin, r, is_bf16);
    narrow(a->query_out, r * hq, q, hq, is_bf16);
    const int64_t slot = a->slots[r];
    if (slot < 0) return;
    widen(a->key, r * a->key_stride, k, hkv, is_bf16);
    rotate(k, a->num_kv_heads, d, a->cos_sin, r, is_bf16);
    const int64_t at = cache_row(a, slot);
    narrow(a->key_cache, at, k, hkv, is_bf16);
    copy_value(a, r, at, is_bf16);
}

/* The rotary embedding of each row's query and key; the rotated keys and the values written to
 * the cache at the row's slot. 1: no memory. */
int rope_write_kv_rows(const RopeRows *a, int is_bf16, int num_threads) {
    int failed = 0;
    const int64_t width = (a->num_heads + a->num_kv_heads) * a->head_dim;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buf = malloc((size_t)width * sizeof(float)); /* fp32 [Hq D + Hkv D] */
        if (buf == NULL) failed = 1;
        else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < a->m; r++) {
                if (is_bf16) rope_row(a, r, buf, 1);
                else rope_row(a, r, buf, 0);
            }
        }
        free(buf);
    }
    return failed;
}

/* The index of row r's largest value, the first where several are equal (torch.argmax's
 * rule); n >= 1. AVX512: each lane keeps its largest value and where it was (a strictly
 * larger value replaces it, so a lane keeps its first), then the lanes holding the maximum
 * give their smallest index. Built with -ffast-math: a row with a NaN gets an unspecified
 * index. */
ALWAYS_INLINE int64_t argmax_row(const void *x, int64_t at, int64_t n, int is_bf16) {
    int64_t i = 0, best_i = 0;
    float best = load(x, at, is_bf16);
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 max = _mm512_set1_ps(-INFINITY);
        __m512i where = _mm512_setzero_si512();
        __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        for (; i + 16 <= n; i += 16) {
            const __m512 v = load16(x, at + i, is_bf16);
            const __mmask16 larger = _mm512_cmp_ps_mask(v, max, _CMP_GT_OQ);
            max = _mm512_mask_blend_ps(larger, max, v);
            where = _mm512_mask_blend_epi32(larger, where, index);
            index = _mm512_add_epi32(index, step);
        }
        best = _mm512_reduce_max_ps(max);
        const __mmask16 holders = _mm512_cmp_ps_mask(max, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_i = _mm512_mask_reduce_min_epi32(holders, where);
    }
#endif
    for (; i < n; i++) { /* the tail, or the whole row without AVX512 */
        const float v = load(x, at + i, is_bf16);
        if (v > best) best = v, best_i = i;
    }
    return best_i;
}

/* out[r] = argmax of row r of x [m, n] (row stride x_stride), for greedy sampling: torch's CPU
 * argmax reads the row several times slower than this. int32 indices in the vector part: n
 * below 2^31. */
void argmax_rows(const void *x, int64_t x_stride, int64_t m, int64_t n, int is_bf16,
                 int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m > 1)
    for (int64_t r = 0; r < m; r++)
        out[r] = is_bf16 ? argmax_row(x, r * x_stride, n, 1) : argmax_row(x, r * x_stride, n, 0);
}
