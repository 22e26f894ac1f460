/* What the group-quantized linear kernel (qgemv.c) and its integer paths (qgemv_x16.h,
 * qgemv_x8.h) share: the context of one call and the reading of the weights' group parameters.
 */
#ifndef TW_QGEMV_H
#define TW_QGEMV_H

#include "linear.h"

/* The most rows of x one call takes (more than MAX_M go in tiles: qgemv.c's `run_tiles`). */
#define QMAX_ROWS 64

/* Element i of a float32 (`f32`) or float16 parameter array, as float32. */
INLINE float param(const void *p, int64_t i, int f32) {
    return f32 ? ((const float *)p)[i] : f16_to_f32(((const uint16_t *)p)[i]);
}

/* Group g's scale and offset of weight row `row` (ng groups per row). */
INLINE void group_params(const void *sc, const void *of, int64_t row, int64_t ng, int64_t g,
                         int bits, int sf32, float *s, float *o) {
    *s = param(sc, row * ng + g, sf32);
    *o = of ? param(of, row * ng + g, sf32) : (bits == 4 ? -8.0f * *s : 0.0f);
}

/* What one call computes: the weights, x (float32, and as int16 for the integer path), y. */
typedef struct {
    const uint8_t *q;
    const void *sc, *of;
    int bits, sf32;
    int64_t K, G, N;
    const float *xf;
    const int16_t *xq;
    const int8_t *xq8;
    const int32_t *xcorr;
    const float *xs, *xsum;
    const void *bias;
    void *y;
    int ybf16;
    int64_t ng;     /* groups per row */
    int x8_tshift; /* the int8-activation path's parameter layout (qgemv_x8.h) */
} qctx;

/* Quantized value k of one row (`qrow`: that row's bytes), before scale and offset. */
INLINE int qint(const uint8_t *qrow, int bits, int64_t k) {
    if (bits == 8) return ((const int8_t *)qrow)[k];
    uint8_t byte = qrow[(k / 32) * 16 + (k % 16)];
    return (k % 32) < 16 ? (byte & 15) : (byte >> 4);
}

#if defined(TW_AVX512) || defined(TW_AVX2)
/* Eight consecutive group parameters as floats (fewer when `valid` < 8: the rest are 0). */
INLINE __m256 load8(const void *p, int64_t i, int valid, int f32) {
#if defined(__F16C__)
    if (valid == 8)
        return f32 ? _mm256_loadu_ps((const float *)p + i)
                   : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#endif
    float tmp[8] = {0};
    for (int j = 0; j < valid; j++) tmp[j] = param(p, i + j, f32);
    return _mm256_loadu_ps(tmp);
}
#endif

#endif
