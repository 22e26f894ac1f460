/* What every native kernel shares: the ISA switches, the float conversions (bf16, fp16, fp8),
 * the polynomial exp, a few vector helpers and the unpacking of a replayed CPU graph's
 * arguments. Written once here so that two kernels never round a conversion differently.
 * `native.build` keys its cache on this header too.
 *
 * Every conversion here is exact or rounds to nearest even, as torch's does, so a kernel's
 * bf16 output is bit for bit what torch's copy of its float32 result would be.
 */
#ifndef TW_COMMON_H
#define TW_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TW_AVX512 1
#if defined(__AVX512BF16__)
#define TW_AVX512_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define TW_AVX2 1
#endif

#define INLINE static inline __attribute__((always_inline))

/* ---- bf16 and fp16 ---- */

/* A bf16 value is the top half of a float32: widening is exact. */
INLINE float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even (NaN stays a quiet NaN), without a branch so that loops over it
 * vectorise. */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* IEEE half to float32 (the hardware instruction where the CPU has F16C). */
INLINE float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* ---- fp8 (float8_e4m3fn, float8_e5m2) ---- */

/* The smallest normal fp8 value: 2^-6 (e4m3), 2^-14 (e5m2). */
#define TW_FP8_MIN_NORMAL(e5m2) ((e5m2) ? 6.103515625e-05f : 0.015625f)

/* One fp8 byte as float32, exactly: exponent and mantissa moved to float32's positions with
 * the exponent rebiased; a subnormal (exponent 0) is rebuilt as the smallest normal plus its
 * mantissa, minus the smallest normal. e4m3fn's NaN (0x7f) reads as 480: stored values
 * saturate, and checkpoints have none. */
INLINE float fp8_to_f32(uint8_t b, int e5m2) {
    const uint32_t mag = (uint32_t)(b & 0x7fu) << (e5m2 ? 21 : 20);
    uint32_t bits = mag + (e5m2 ? 112u << 23 : 120u << 23);
    float f;
    if (mag < (1u << 23)) {
        bits += 1u << 23;
        memcpy(&f, &bits, sizeof f);
        f -= TW_FP8_MIN_NORMAL(e5m2);
    } else {
        memcpy(&f, &bits, sizeof f);
    }
    return (b & 0x80u) ? -f : f;
}

/* float32 -> fp8, rounding to nearest even as torch does; the caller has clamped to the
 * finite range already (`kv_quant.quantize`), and an infinity saturates here too. */
INLINE uint8_t f32_to_fp8(float x, int e5m2) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    uint32_t abits = bits & 0x7fffffffu;
    if (abits > 0x7f800000u) return sign | (e5m2 ? 0x7e : 0x7f); /* NaN stays NaN */
    float a;
    memcpy(&a, &abits, sizeof a);
    if (!(a <= (e5m2 ? 57344.0f : 448.0f))) return sign | (e5m2 ? 0x7b : 0x7e);
    if (a < TW_FP8_MIN_NORMAL(e5m2)) /* subnormal: a multiple of 2^-16 / 2^-9 */
        return sign | (uint8_t)(int)rintf(a * (e5m2 ? 65536.0f : 512.0f));
    const int shift = e5m2 ? 21 : 20;
    abits += ((1u << (shift - 1)) - 1u) + ((abits >> shift) & 1u);
    return sign | (uint8_t)((abits >> shift) - (e5m2 ? 112u << 2 : 120u << 3));
}

#if defined(__F16C__)
/* e4m3 bytes widened through F16C: a byte's sign, exponent and mantissa shifted into a float16
 * (the byte in a 16-bit lane's high half, shifted right arithmetically by one: the sign lands
 * on bits 15 and 14; bit 14 cleared) read as the float16 of 2^-8 times the e4m3 value, normal
 * and subnormal alike (both formats' mantissas line up and the biases differ by 8). So these
 * give e4m3 / 256, exactly: the caller folds the 256 into a scale. */
#define TW_E4M3_UNIT 256.0f

/* 8 e4m3 bytes at p, as float32 / 256. */
INLINE __m256 e4m3x8_to_f32(const uint8_t *p) {
    __m128i b = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8);
    b = _mm_and_si128(_mm_srai_epi16(b, 1), _mm_set1_epi16((short)0xbfff));
    return _mm256_cvtph_ps(b);
}

/* 8 e5m2 bytes at p, as float32 (exact): an e5m2 byte is the top byte of a float16. */
INLINE __m256 e5m2x8_to_f32(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
}

#if defined(__AVX512F__)
/* 16 e4m3 bytes at p, as float32 / 256. */
INLINE __m512 e4m3x16_to_f32(const uint8_t *p) {
    __m256i b = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8);
    b = _mm256_and_si256(_mm256_srai_epi16(b, 1), _mm256_set1_epi16((short)0xbfff));
    return _mm512_cvtph_ps(b);
}

/* 16 e5m2 bytes at p, as float32. */
INLINE __m512 e5m2x16_to_f32(const uint8_t *p) {
    return _mm512_cvtph_ps(
        _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
}
#endif
#endif

/* ---- exp ---- */

/* exp(r) for |r| <= ln2 / 2 by its degree-6 Taylor polynomial, for a float or a GCC vector. */
#define TW_EXP_POLY(r)                                                                     \
    ((((((1.0f / 720.0f * (r) + 1.0f / 120.0f) * (r) + 1.0f / 24.0f) * (r) + 1.0f / 6.0f) * \
        (r) + 0.5f) * (r) + 1.0f) * (r) + 1.0f)
#define TW_LOG2E 1.44269504088896341f
/* ln 2 in two parts, the first with a short mantissa, so n * TW_LN2_HI is exact. */
#define TW_LN2_HI 0.693145751953125f
#define TW_LN2_LO 1.42860682030941723e-6f

/* 2^n for -126 <= n <= 127, through the exponent field. */
INLINE float pow2i(int n) {
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* exp(x) within a few float ulps: n = x / ln2 rounded (half away from zero), r = x - n ln2,
 * exp(x) = 2^n p(r). Tiny below -87, infinite above 88.72 (as expf overflows): 2^n is applied
 * in two halves so that n = 128 overflows the product, not the exponent field (built with
 * -fassociative-math, as paged_decode.c is, the halves may be merged: there x <= 0). Plain
 * arithmetic, so a loop over it vectorises (libm's expf is one call per value). */
INLINE float tw_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 89.0f ? 89.0f : x);
    const int n = x >= 0.0f ? (int)(x * TW_LOG2E + 0.5f) : (int)(x * TW_LOG2E - 0.5f);
    const float r = x - (float)n * TW_LN2_HI - (float)n * TW_LN2_LO;
    const int n1 = n / 2;
    return TW_EXP_POLY(r) * pow2i(n1) * pow2i(n - n1);
}

/* ---- vector helpers ---- */

#if defined(__AVX2__) || defined(__AVX512F__)
/* v rounded to the nearest integer, ties to even (the default rounding mode), in one
 * instruction: lrintf is a library call unless errno handling is switched off. */
INLINE int round_even(float v) { return _mm_cvtss_si32(_mm_set_ss(v)); }

/* The sum of a 256-bit vector's eight floats. */
INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* The widest float vector of the build, for code written once for AVX-512 and AVX2:
 * TW_V(fmadd_ps) is _mm512_fmadd_ps or _mm256_fmadd_ps, tw_vf its vector of TW_VW floats,
 * tw_vi the integer vector of the same width (TW_VI_ZERO, _LOAD, _AND, _XOR its operations). */
#if defined(TW_AVX512)
#define TW_VW 16
typedef __m512 tw_vf;
typedef __m512i tw_vi;
#define TW_V(op) _mm512_##op
#define TW_VSUM(v) _mm512_reduce_add_ps(v)
#define TW_VI_ZERO() _mm512_setzero_si512()
#define TW_VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define TW_VI_AND _mm512_and_si512
#define TW_VI_XOR _mm512_xor_si512
#elif defined(TW_AVX2)
#define TW_VW 8
typedef __m256 tw_vf;
typedef __m256i tw_vi;
#define TW_V(op) _mm256_##op
#define TW_VSUM(v) hsum256(v)
#define TW_VI_ZERO() _mm256_setzero_si256()
#define TW_VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define TW_VI_AND _mm256_and_si256
#define TW_VI_XOR _mm256_xor_si256
#endif

/* ---- a replayed CPU graph's arguments ---- */

/* Each recordable kernel has a `<name>_packed(const int64_t *a)` entry: its arguments as one
 * int64 array (pointers and integers as they are, a float's bits in the low half), the one
 * signature a replayed CPU graph (graph.c) calls every kernel through. */
typedef int (*tw_packed_fn)(const int64_t *a);
#define TW_PTR(i) ((void *)(intptr_t)a[i])

INLINE float tw_f32_arg(int64_t bits) {
    const uint32_t low = (uint32_t)bits;
    float f;
    memcpy(&f, &low, sizeof f);
    return f;
}

#endif
