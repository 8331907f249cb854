/* The prefill kernel's packing: the keys and values a task sees copied from the paged cache
 * into the layouts of Scratch (prefill.h), which its products read. */
#ifndef PREFILL_PACK_H
#define PREFILL_PACK_H

#include "prefill.h"

/* The plain path (paged_prefill.c): keys 0 .. n-1 widened to fp32 in tiles of TILE keys,
 * [t / 16][D][16] (key t at lane t % 16; the last tile's lanes past n zeros: their scores are
 * computed, never read), values fp32 rows [t][D]. */
ALWAYS_INLINE void pack_plain(const Prefill *a, const int32_t *table, int64_t g, int64_t n,
                              const Scratch *b, const int64_t dim, const int is_bf16) {
    float *kt = (float *)b->keys, *row = b->qf; /* row: a key widened; qf is free here */
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = cache_at(a, table, t, g);
        load_row(a->key_cache, at, row, dim, is_bf16);
        float *tile = kt + t / TILE * TILE * dim + t % TILE;
        for (int64_t d = 0; d < dim; d++) tile[d * TILE] = row[d];
        load_row(a->value_cache, at, (float *)b->vals + t * dim, dim, is_bf16);
    }
    for (int64_t t = n; t % TILE; t++) {
        float *tile = kt + t / TILE * TILE * dim + t % TILE;
        for (int64_t d = 0; d < dim; d++) tile[d * TILE] = 0.0f;
    }
}

#if defined(__AVX512F__)
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

#endif

#endif
