/* The integer path of qgemv.c: bf16 activations as int16, dot products in int32.
 *
 * Widening every weight to float32 costs three instructions per 16 weights before its multiply
 * (convert to int32, to float, scale), which left the float path compute-bound below the
 * memory bandwidth. Here x is quantized once per call, per group of G values of each row, to
 * int16 with its own scale (xs = max|x| / 32767), and each weight group's dot product runs on
 * integers: int8 (or int4) weights widened to int16 multiply-add with x in pairs into int32
 * lanes (vpdpwssd with AVX512_VNNI / AVX-VNNI, else vpmaddwd + vpaddd), then once per group
 * the lanes are converted to float and scaled by s * xs. The offset term o * sum(x) of a group
 * uses x's exact float sum, computed with the quantization.
 *
 * Precision: x loses at most 1/65534 of its group's largest value, 2^-7 of a bf16 value's own
 * rounding step at that magnitude: for bf16 activations the result is as close as the float
 * path's, so float32 activations keep the float path (their parity tests are at 1e-4).
 * Integer range: |q x| <= 128 * 32767 per product, so G <= 256 keeps a group's sum in int32.
 */
#ifndef TW_QGEMV_X16_H
#define TW_QGEMV_X16_H

#include "qgemv.h"

#define X16_MAX_GROUP 256

#if defined(TW_AVX512) || defined(TW_AVX2)
/* x [M, K] float -> int16 [M, K], scale [M, K / G] and float sum [M, K / G] per group. */
static void quantize_x16(const float *x, int64_t M, int64_t K, int64_t G, int16_t *xq, float *xs,
                         float *xsum) {
    const int64_t ng = K / G;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            const float *v = x + m * K + g * G;
            float amax = 0.0f, sum = 0.0f;
            for (int64_t i = 0; i < G; i++) {
                float a = v[i] < 0 ? -v[i] : v[i];
                amax = a > amax ? a : amax;
                sum += v[i];
            }
            float inv = amax > 0 ? 32767.0f / amax : 0.0f;
            for (int64_t i = 0; i < G; i++) xq[m * K + g * G + i] = (int16_t)round_even(v[i] * inv);
            xs[m * ng + g] = amax / 32767.0f;
            xsum[m * ng + g] = sum;
        }
}

INLINE __m256i dp16_256(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* One (r, m)'s result: its group sums' accumulator plus the offsets' (256-bit accumulators). */
INLINE float x16_sum256(__m256 acc, __m256 off) { return hsum256(_mm256_add_ps(acc, off)); }

/* Groups are folded eight at a time: the weights' scales (and offsets) of groups g0..g0+7
 * of each row are loaded as one vector and multiplied by x's group scales once, so a group's
 * fold is a lane broadcast, a conversion and a multiply-add; the offset term o * sum(x) of all
 * eight is one multiply-add. `prod[r][m]` lane j = s(r, g0 + j) * xs(m, g0 + j). */
#define X16_CHUNK_BEGIN()                                                                  \
    const int valid = ng - g0 < 8 ? (int)(ng - g0) : 8;                                    \
    __m256 prod[4][MAX_M];                                                                 \
    float pbuf[4][MAX_M][8];                                                               \
    for (int r = 0; r < R; r++) {                                                          \
        __m256 s8 = load8(c->sc, (n + r) * ng + g0, valid, c->sf32);                       \
        __m256 o8 = c->of ? load8(c->of, (n + r) * ng + g0, valid, c->sf32)                \
                          : _mm256_mul_ps(s8, _mm256_set1_ps(c->bits == 4 ? -8.0f : 0.0f)); \
        for (int m = 0; m < M; m++) {                                                      \
            prod[r][m] = _mm256_mul_ps(s8, load8(c->xs, m * ng + g0, valid, 1));           \
            _mm256_storeu_ps(pbuf[r][m], prod[r][m]);                                      \
            off[r][m] = _mm256_fmadd_ps(o8, load8(c->xsum, m * ng + g0, valid, 1), off[r][m]); \
        }                                                                                  \
    }

/* One step of int4 weights in W-bit registers (W / 8 values: W / 16 bytes of each row): the
 * nibbles widened to int16 (`lo`: values 0..15 of each 32-value block, `hi`: 16..31), times x
 * (in that order: `x4_order` for 512 bits) into `gi`. */
#define X16_LOAD_U4_256(p) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define X16_LOAD_X_256(p) _mm256_loadu_si256((const __m256i *)(p))
#define X16_LOAD_U4_512(p) _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define X16_LOAD_X_512(p) _mm512_loadu_si512((const void *)(p))
#define X16_Q4_STEP(W)                                                                     \
    for (int r = 0; r < R; r++) {                                                          \
        const uint8_t *p = q + r * rb + k / 2;                                             \
        if (!(k & 127)) PREFETCH(p);                                                       \
        const __m##W##i v = X16_LOAD_U4_##W(p);                                            \
        lo[r] = _mm##W##_and_si##W(v, low4);                                               \
        hi[r] = _mm##W##_srli_epi16(v, 4);                                                 \
    }                                                                                      \
    for (int m = 0; m < M; m++) {                                                          \
        const __m##W##i xl = X16_LOAD_X_##W(c->xq + m * K + k);                            \
        const __m##W##i xh = X16_LOAD_X_##W(c->xq + m * K + k + W / 16);                  \
        for (int r = 0; r < R; r++) {                                                      \
            gi[r][m] = dp16_##W(gi[r][m], lo[r], xl);                                      \
            gi[r][m] = dp16_##W(gi[r][m], hi[r], xh);                                      \
        }                                                                                  \
    }

/* int4 weights, 32 values (16 bytes) at a time in 256-bit registers: low nibbles are values
 * 0..15 of the block, high nibbles 16..31. */
INLINE void q4x16_block256(const qctx *c, int64_t n, float *t, const int R, const int M) {
    const int64_t K = c->K, G = c->G, ng = K / G, rb = K / 2;
    const uint8_t *q = c->q + n * rb;
    const __m256i low4 = _mm256_set1_epi16(15);
    __m256 acc[4][MAX_M], off[4][MAX_M];
    TW_FOR_RM(acc[r][m] = off[r][m] = _mm256_setzero_ps());
    for (int64_t g0 = 0; g0 < ng; g0 += 8) {
        X16_CHUNK_BEGIN()
        for (int j = 0; j < valid; j++) {
            const int64_t g = g0 + j;
            __m256i gi[4][MAX_M];
            TW_FOR_RM(gi[r][m] = _mm256_setzero_si256());
            for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
                __m256i lo[4], hi[4];
                X16_Q4_STEP(256)
            }
            for (int r = 0; r < R; r++)
                for (int m = 0; m < M; m++)
                    acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gi[r][m]),
                                                _mm256_set1_ps(pbuf[r][m][j]), acc[r][m]);
        }
    }
    TW_FOR_RM(t[r * M + m] = x16_sum256(acc[r][m], off[r][m]));
}

#if defined(TW_AVX512)
INLINE __m512i dp16_512(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* As x16_sum256, for 512-bit accumulators. */
INLINE float x16_sum512(__m512 acc, __m256 off) { return _mm512_reduce_add_ps(acc) + hsum256(off); }

/* Whether int4 weights take the 512-bit path: 64 values (two 32-value blocks) per step, which
 * needs steps that never straddle two groups' folds (G 32, or a multiple of 64). */
INLINE int q4_wide(int64_t K, int64_t G) { return K % 64 == 0 && (G == 32 || G % 64 == 0); }

/* x in the 512-bit int4 order: per 64 values [0..15, 32..47, 16..31, 48..63], so that the low
 * nibbles of two blocks (their values 0..15) meet x's first 32 and the high ones the rest. */
static void x4_order(int16_t *xq, int64_t count) {
    int16_t tmp[64];
    for (int64_t c = 0; c < count; c += 64) {
        memcpy(tmp, xq + c, sizeof tmp);
        memcpy(xq + c + 16, tmp + 32, 16 * sizeof(int16_t));
        memcpy(xq + c + 32, tmp + 16, 16 * sizeof(int16_t));
    }
}

/* int4 weights, 64 values (32 bytes) per step in 512-bit registers: int32 lanes 0..7 hold the
 * first block's sums, 8..15 the second's (for G = 32, two groups folded at once). */
INLINE void q4x16_block512(const qctx *c, int64_t n, float *t, const int R, const int M) {
    const int64_t K = c->K, G = c->G, ng = K / G, rb = K / 2;
    const uint8_t *q = c->q + n * rb;
    const __m512i low4 = _mm512_set1_epi16(15);
    __m512 acc[4][MAX_M];
    __m256 off[4][MAX_M];
    TW_FOR_RM(acc[r][m] = _mm512_setzero_ps(), off[r][m] = _mm256_setzero_ps());
    for (int64_t g0 = 0; g0 < ng; g0 += 8) {
        X16_CHUNK_BEGIN()
        __m512i gi[4][MAX_M];
        TW_FOR_RM(gi[r][m] = _mm512_setzero_si512());
        for (int64_t k = g0 * G; k < (g0 + valid) * G; k += 64) {
            __m512i lo[4], hi[4];
            X16_Q4_STEP(512)
            if (G == 32 || (k + 64) % G == 0) {
                const int a = (int)(k / G - g0), b = (int)((k + 32) / G - g0);
                const __m512i lane =
                    _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(a), _mm512_set1_epi32(b));
                for (int r = 0; r < R; r++)
                    for (int m = 0; m < M; m++) {
                        __m512 scale = _mm512_permutexvar_ps(lane, _mm512_castps256_ps512(prod[r][m]));
                        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(gi[r][m]), scale, acc[r][m]);
                        gi[r][m] = _mm512_setzero_si512();
                    }
            }
        }
    }
    TW_FOR_RM(t[r * M + m] = x16_sum512(acc[r][m], off[r][m]));
}

#endif

/* int8 weights, 2 * TW_VW values at a time widened to int16 in the widest integer register. */
#if defined(TW_AVX512)
#define X16_LOAD_I8(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define X16_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define X16_DP dp16_512
#define X16_SUM x16_sum512
#else
#define X16_LOAD_I8(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define X16_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define X16_DP dp16_256
#define X16_SUM x16_sum256
#endif
INLINE void q8x16_block(const qctx *c, int64_t n, float *t, const int R, const int M) {
    const int64_t K = c->K, G = c->G, ng = K / G;
    const int8_t *q = (const int8_t *)c->q + n * K;
    tw_vf acc[4][MAX_M];
    __m256 off[4][MAX_M];
    TW_FOR_RM(acc[r][m] = TW_V(setzero_ps)(), off[r][m] = _mm256_setzero_ps());
    for (int64_t g0 = 0; g0 < ng; g0 += 8) {
        X16_CHUNK_BEGIN()
        for (int j = 0; j < valid; j++) {
            const int64_t g = g0 + j;
            tw_vi gi[4][MAX_M];
            TW_FOR_RM(gi[r][m] = TW_VI_ZERO());
            for (int64_t k = g * G; k < (g + 1) * G; k += 2 * TW_VW) {
                tw_vi w[4];
                for (int r = 0; r < R; r++) {
                    const int8_t *p = q + r * K + k;
                    if (!(k & 63)) PREFETCH(p);
                    w[r] = X16_LOAD_I8(p);
                }
                for (int m = 0; m < M; m++) {
                    tw_vi xv = X16_LOAD(c->xq + m * K + k);
                    for (int r = 0; r < R; r++) gi[r][m] = X16_DP(gi[r][m], w[r], xv);
                }
            }
            /* The scale is broadcast from memory (a load port), not shuffled out of `prod`:
             * the shuffle port already widens every weight vector. */
            for (int r = 0; r < R; r++)
                for (int m = 0; m < M; m++)
                    acc[r][m] = TW_V(fmadd_ps)(TW_V(cvtepi32_ps)(gi[r][m]),
                                               TW_V(set1_ps)(pbuf[r][m][j]), acc[r][m]);
        }
    }
    TW_FOR_RM(t[r * M + m] = X16_SUM(acc[r][m], off[r][m]));
}

#endif

#endif
