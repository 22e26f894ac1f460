/* Pieces shared by the small-M CPU linear kernels (gemv.c, qgemv.c): the ISA switches,
 * bf16 <-> float32 conversions, fp16 -> float32, the prefetch macro, and the store of a block
 * of dot products with bias and rounding. `native_build` keys its cache on this header too.
 */
#ifndef TW_CPU_KERNEL_COMMON_H
#define TW_CPU_KERNEL_COMMON_H

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

#define MAX_M 8
#define INLINE static inline __attribute__((always_inline))

/* Software prefetch distance in bytes ahead of each weight row's current position. */
#ifndef TW_PREFETCH
#define TW_PREFETCH 512
#endif
#ifndef TW_PF_HINT
#define TW_PF_HINT 3
#endif
#if TW_PREFETCH > 0
#define PREFETCH(p) __builtin_prefetch((const char *)(p) + TW_PREFETCH, 0, TW_PF_HINT)
#else
#define PREFETCH(p) ((void)(p))
#endif

INLINE float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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

/* Write the R x M dot products of weight rows n..n+R-1 (t[r * M + m]) into y, with bias. */
INLINE void store(const float *t, int R, int M, int64_t n, int64_t N, const void *bias, void *y,
                  int bf16) {
    for (int r = 0; r < R; r++) {
        float b = 0.0f;
        if (bias) b = bf16 ? bf16_to_f32(((const uint16_t *)bias)[n + r]) : ((const float *)bias)[n + r];
        for (int m = 0; m < M; m++) {
            float v = t[r * M + m] + b;
            if (bf16)
                ((uint16_t *)y)[m * N + n + r] = f32_to_bf16(v);
            else
                ((float *)y)[m * N + n + r] = v;
        }
    }
}

/* x as float32: `x` itself, or a malloc'ed widened copy of a bf16 x (*widened, to be freed). */
INLINE const float *x_as_f32(const void *x, int64_t count, int bf16, float **widened) {
    *widened = NULL;
    if (!bf16) return (const float *)x;
    float *w = (float *)malloc((size_t)count * sizeof(float));
    if (!w) return NULL;
    for (int64_t i = 0; i < count; i++) w[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    *widened = w;
    return w;
}

#endif
