/* A test entry point into tokenwise/native/common.h: each function applies one of its
 * conversions (or the polynomial exp) to an array, so tests/native/test_common_h.py can hold
 * them against torch's. Built by that test only (it ships nowhere). */
#include "common.h"

void t_exp(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = tw_exp(x[i]);
}

void t_f32_to_bf16(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = f32_to_bf16(x[i]);
}

void t_bf16_to_f32(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = bf16_to_f32(x[i]);
}

void t_f16_to_f32(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = f16_to_f32(x[i]);
}

void t_fp8_to_f32(const uint8_t *x, float *y, int64_t n, int e5m2) {
    for (int64_t i = 0; i < n; i++) y[i] = fp8_to_f32(x[i], e5m2);
}

void t_f32_to_fp8(const float *x, uint8_t *y, int64_t n, int e5m2) {
    for (int64_t i = 0; i < n; i++) y[i] = f32_to_fp8(x[i], e5m2);
}

/* The F16C vector widening, 16 bytes at a time (n a multiple of 16); 0 without F16C. */
int t_fp8x16_to_f32(const uint8_t *x, float *y, int64_t n, int e5m2) {
#if defined(__F16C__)
    for (int64_t i = 0; i < n; i += 16)
        for (int half = 0; half < 2; half++) {
            const __m256 v = e5m2 ? e5m2x8_to_f32(x + i + 8 * half)
                                  : _mm256_mul_ps(e4m3x8_to_f32(x + i + 8 * half),
                                                  _mm256_set1_ps(TW_E4M3_UNIT));
            _mm256_storeu_ps(y + i + 8 * half, v);
        }
#if defined(__AVX512F__)
    float wide[16];
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = e5m2 ? e5m2x16_to_f32(x + i)
                              : _mm512_mul_ps(e4m3x16_to_f32(x + i), _mm512_set1_ps(TW_E4M3_UNIT));
        _mm512_storeu_ps(wide, v);
        if (memcmp(wide, y + i, sizeof wide)) return -1; /* the 8- and 16-wide paths disagree */
    }
#endif
    return 1;
#else
    (void)x, (void)y, (void)n, (void)e5m2;
    return 0;
#endif
}
