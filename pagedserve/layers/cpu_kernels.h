/* Helpers shared by the CPU's C kernels (layers/cpu_gemv.c,
 * attention/backends/cpu_native/paged_decode.c, model/cpu_decode.c): bf16 <-> fp32, one value
 * at a time and (AVX512) 16 at a time.
 *
 * bf16 is the top half of an fp32: widening is a shift (exact), narrowing rounds to nearest
 * even, as torch's casts do (a NaN stays a quiet NaN). The build hashes this header into the
 * name of every library that includes it.
 */
#ifndef PAGEDSERVE_CPU_KERNELS_H
#define PAGEDSERVE_CPU_KERNELS_H

#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* 8 fp32 lanes in GCC's vector extension, for the kernels' paths without AVX512: the compiler
 * maps them to the CPU's vectors (AVX2 registers on x86, NEON pairs on ARM). Loads and stores
 * through a v8f pointer need only float alignment. */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

/* The sum of a's 8 lanes. */
static inline float sum8(v8f a) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += a[i];
    return s;
}

/* f rounded to the nearest bf16, as an fp32: what a bf16 tensor would hold. */
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 values from base[i:] as fp32: bf16 widened by a shift (exact), or fp32 as they are. */
ALWAYS_INLINE __m512 load16(const void *base, int64_t i, const int is_bf16) {
    if (!is_bf16) return _mm512_loadu_ps((const float *)base + i);
    const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* 16 fp32 rounded to the model's dtype, kept as fp32: bf16 to nearest even (as
 * float_to_bf16, without its NaN branch), fp32 as they are. */
ALWAYS_INLINE __m512 rnd16(__m512 x, const int is_bf16) {
    if (!is_bf16) return x;
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32((int)0xffff0000u)));
}

/* 16 fp32 that hold values of the model's dtype already (rnd16's results) stored at base[i:]:
 * bf16 as their top halves, with no rounding left to do. */
ALWAYS_INLINE void store16_exact(void *base, int64_t i, __m512 x, const int is_bf16) {
    if (!is_bf16) {
        _mm512_storeu_ps((float *)base + i, x);
        return;
    }
    const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), _mm512_cvtepi32_epi16(top));
}

/* 16 fp32 stored at base[i:] in the model's dtype, rounded as rnd16. */
ALWAYS_INLINE void store16(void *base, int64_t i, __m512 x, const int is_bf16) {
    store16_exact(base, i, rnd16(x, is_bf16), is_bf16);
}

/* The lanes of a 16-lane step with `left` values left: all 16, or the first `left`. */
ALWAYS_INLINE __mmask16 lanes_left(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}
#endif

#endif
