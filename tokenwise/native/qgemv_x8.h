/* The int8-activation path of qgemv.c: x quantized to int8 per block of 32 values, dot
 * products of unsigned by signed bytes into int32 (vpdpbusd).
 *
 * This is the arithmetic llama.cpp uses for its Q8_0 / Q4_0 dot products: x becomes int8 with
 * one scale per 32 values (xs = max|x| / 127), and one instruction sums four byte products
 * into each int32 lane: twice the work per instruction of the int16 path (qgemv_x16.h),
 * and no widening of the weights at all:
 *   int4: the nibbles u in [0, 15] are the unsigned operand as they are (an and, a shift);
 *   int8: w + 128 (an xor) is the unsigned operand.
 * The constant part of the weights (the -8 of symmetric int4, the +128 of the int8 shift) is
 * taken back out in integers: each lane's sum starts from -8 (or -128) times the sum of the x
 * values that lane multiplies (`xcorr`, made with the quantization), so every lane ends
 * holding exactly sum(q * x) and no large float terms cancel. A block's lanes are then folded
 * once: converted to float and scaled by s * xs. Stored offsets (asymmetric formats) add
 * o * xs * sum(x) per block. The result is the dot product of the dequantized weights with the
 * int8-rounded x, up to float summation order.
 *
 * Precision: x loses up to 1/254 of its block's largest value, against 1/65534 in the int16
 * path: the error llama.cpp accepts (the same order as the weights' own rounding). So the path
 * is chosen per call (`xbits` 8), for float32 x only when the user asked for it.
 * Without VNNI the byte products go through vpmaddubsw (saturating int16 pairs), so there int8
 * weights use |w| and x with w's sign instead of the shift (|w| * |x| * 2 <= 32512 cannot
 * saturate); int4 nibbles need nothing (15 * 127 * 2).
 * Integer range: a lane sums at most 8 products of at most 255 * 127, plus its correction.
 */
#ifndef TW_QGEMV_X8_H
#define TW_QGEMV_X8_H

#include "qgemv.h"

#if defined(TW_AVX512) || defined(TW_AVX2)
#define X8_BLOCK 32

#if defined(TW_AVX512) && defined(__AVX512VNNI__)
#define X8_VNNI 1
#elif defined(TW_AVX2) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define X8_VNNI 1
#else
#define X8_VNNI 0
#endif

/* Values per step: int4 64 bytes (128 values, 4 blocks) in 512 bits, 32 bytes (64) in 256;
 * int8 64 values in 512 bits, 32 in 256. */
#if defined(TW_AVX512)
#define X8_Q4_STEP 128
#define X8_Q8_STEP 64
#else
#define X8_Q4_STEP 64
#define X8_Q8_STEP 32
#endif

/* Whether the int8-activation path takes these shapes: whole blocks within groups, and whole
 * steps in a row. */
INLINE int x8_fits(int bits, int64_t K, int64_t G) {
    if (G % X8_BLOCK) return 0;
    return bits == 8 ? K % 64 == 0 : K % X8_Q4_STEP == 0;
}

/* The integer each lane's sum starts from, per 4 bytes of x in a step (see above). */
static void x8_corrections(const int8_t *xq, int64_t M, int64_t K, int bits, int offsets,
                           int32_t *corr) {
    const int shift = bits == 4 ? (offsets ? 0 : -8) : X8_VNNI ? -128 : 0;
    if (bits == 8) { /* lane j of the row: x[4j..4j+3] */
        for (int64_t i = 0; i < M * K / 4; i++)
            corr[i] = shift * (xq[4 * i] + xq[4 * i + 1] + xq[4 * i + 2] + xq[4 * i + 3]);
        return;
    }
    /* int4: lane i of a step holds the products of low nibbles with x bytes 4i.. of the step's
     * first half and of high nibbles with those of its second half. */
    const int64_t S = X8_Q4_STEP, lanes = S / 8;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += S) {
            const int8_t *p = xq + m * K + k;
            int32_t *out = corr + (m * K + k) / 8;
            for (int64_t i = 0; i < lanes; i++) {
                int sum = 0;
                for (int j = 0; j < 4; j++) sum += p[4 * i + j] + p[S / 2 + 4 * i + j];
                out[i] = shift * sum;
            }
        }
}

/* x [M, K] float -> int8 [M, K] (int4: each step's values in the order its nibbles come out,
 * the blocks' values 0..15 first, then 16..31), the scale xs and xs * sum(int8 x) per block,
 * and the lanes' corrections (`corr`: M * K / 4 int32 for int8, M * K / 8 for int4; for the
 * -8 of symmetric int4 only when the weights have no stored `offsets`). */
/* One block of 32 values to int8: returns the scale, writes the values and their sum. */
INLINE float quantize_block8(const float *v, int8_t *out, int *sum) {
#if defined(TW_AVX512)
    const __m512 a0 = _mm512_loadu_ps(v), a1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, inv)); /* ties to even */
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, inv));
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(i1));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#elif defined(TW_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        a[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, a[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; i++) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv)); /* ties to even */
    /* int32 -> int8 with the packs' lane interleave undone by one permute */
    const __m256i p01 = _mm256_packs_epi32(i32[0], i32[1]), p23 = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, p8);
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *sum = _mm_cvtsi128_si32(t);
#else
    float amax = 0.0f;
    for (int i = 0; i < X8_BLOCK; i++) {
        float a = v[i] < 0 ? -v[i] : v[i];
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    int s = 0;
    for (int i = 0; i < X8_BLOCK; i++) {
        int qv = round_even(v[i] * inv);
        out[i] = (int8_t)qv;
        s += qv;
    }
    *sum = s;
#endif
    return amax / 127.0f;
}

/* x [M, K] float -> int8 [M, K] (int4: each step's values in the order its nibbles come out,
 * the blocks' values 0..15 first, then 16..31), the scale xs and xs * sum(int8 x) per block,
 * and the lanes' corrections (`corr`: M * K / 4 int32 for int8, M * K / 8 for int4; for the
 * -8 of symmetric int4 only when the weights have no stored `offsets`). */
static void quantize_x8(const float *x, int64_t M, int64_t K, int bits, int offsets, int8_t *xq,
                        float *xs, float *xsum, int32_t *corr) {
    const int64_t nb = K / X8_BLOCK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            int sum;
            const float scale = quantize_block8(x + m * K + b * X8_BLOCK, xq + m * K + b * X8_BLOCK, &sum);
            xs[m * nb + b] = scale;
            xsum[m * nb + b] = scale * (float)sum;
        }
    if (bits == 4) {
        const int64_t S = X8_Q4_STEP, bps = S / X8_BLOCK;
        int8_t tmp[X8_Q4_STEP];
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k += S) {
                int8_t *p = xq + m * K + k;
                memcpy(tmp, p, S);
                for (int64_t b = 0; b < bps; b++) {
                    memcpy(p + 16 * b, tmp + 32 * b, 16);
                    memcpy(p + S / 2 + 16 * b, tmp + 32 * b + 16, 16);
                }
            }
    }
    x8_corrections(xq, M, K, bits, offsets, corr);
}

/* Group g of G = 32 t covers blocks g t .. g t + t - 1. With t a power of two (`x8_tshift`)
 * a chunk of 8 or 16 blocks (starting at a multiple of its size) takes its parameters with one
 * vector load and a lane shuffle; other t (rare) take this scalar fill. */
static void x8_params_scalar(const qctx *c, int64_t n, int64_t b0, int count, float *s, float *o) {
    const int64_t t = c->G / X8_BLOCK;
    for (int i = 0; i < count; i++) {
        const int64_t g = (b0 + i) / t;
        s[i] = param(c->sc, n * c->ng + g, c->sf32);
        o[i] = c->of ? param(c->of, n * c->ng + g, c->sf32) : 0.0f;
    }
}

static void x8_setup(qctx *c) {
    const int64_t t = c->G / X8_BLOCK;
    c->x8_tshift = (t & (t - 1)) == 0 ? __builtin_ctzll((unsigned long long)t) : -1;
}

/* acc + the sums of four unsigned-by-signed byte products per int32 lane. */
INLINE tw_vi dpbu8(tw_vi acc, tw_vi u, tw_vi s) {
#if X8_VNNI && defined(TW_AVX512)
    return _mm512_dpbusd_epi32(acc, u, s);
#elif X8_VNNI && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif X8_VNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return TW_V(add_epi32)(acc, TW_V(madd_epi16)(TW_V(maddubs_epi16)(u, s), TW_V(set1_epi16)(1)));
#endif
}

/* What differs between the 512- and 256-bit paths; the block functions below serve both. */
#if defined(TW_AVX512)

/* sum(w * x) per 4 bytes for signed w without VNNI: |w| times x with w's sign. */
INLINE __m512i dot_signed(__m512i w, __m512i xv) {
    const __mmask64 neg = _mm512_movepi8_mask(w);
    __m512i sx = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
    return dpbu8(_mm512_setzero_si512(), _mm512_abs_epi8(w), sx);
}

/* `count` (<= 16) consecutive parameters from index i as floats, the rest 0. */
INLINE __m512 x8_loadv(const void *p, int64_t i, int count, int f32) {
    const __mmask16 live = (__mmask16)((1u << count) - 1);
    return f32 ? _mm512_maskz_loadu_ps(live, (const float *)p + i)
               : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, (const uint16_t *)p + i));
}

#define X8_LOG2_VW 4
#define X8_LANE_IDS _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define X8_PERMUTE(idx, v) _mm512_permutexvar_ps(idx, v)
#else /* AVX2 */
INLINE __m256i dot_signed(__m256i w, __m256i xv) {
    return dpbu8(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
}

#define x8_loadv load8
#define X8_LOG2_VW 3
#define X8_LANE_IDS _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0)
#define X8_PERMUTE(idx, v) _mm256_permutevar8x32_ps(v, idx)
#endif

/* Scales and offsets of the TW_VW blocks from b0 of row n, one lane per block. */
INLINE void x8_params(const qctx *c, int64_t n, int64_t b0, int nbc, tw_vf *s, tw_vf *o) {
    const int ts = c->x8_tshift;
    if (ts >= 0) {
        const int64_t g0 = n * c->ng + (b0 >> ts);
        const int count = ts >= X8_LOG2_VW ? 1 : (nbc + (1 << ts) - 1) >> ts;
        const tw_vi lane = TW_V(srli_epi32)(X8_LANE_IDS, ts >= X8_LOG2_VW ? 31 : ts);
        *s = X8_PERMUTE(lane, x8_loadv(c->sc, g0, count, c->sf32));
        if (c->of) *o = X8_PERMUTE(lane, x8_loadv(c->of, g0, count, c->sf32));
    } else {
        float sv[TW_VW] = {0}, ov[TW_VW] = {0};
        x8_params_scalar(c, n, b0, nbc, sv, ov);
        *s = TW_V(loadu_ps)(sv);
        *o = TW_V(loadu_ps)(ov);
    }
}

/* A chunk of TW_VW blocks of rows n..n+R-1: per (r, m) the blocks' s * xs, and the stored
 * offsets' terms o * xs * sum(x) added to `off`. */
#define X8_CHUNK()                                                                         \
    const int nbc = nb - b0 < TW_VW ? (int)(nb - b0) : TW_VW;                              \
    tw_vf sc[4][MAX_M];                                                                    \
    for (int r = 0; r < R; r++) {                                                          \
        tw_vf sv, ov = TW_V(setzero_ps)();                                                 \
        x8_params(c, n + r, b0, nbc, &sv, &ov);                                            \
        for (int m = 0; m < M; m++) {                                                      \
            sc[r][m] = TW_V(mul_ps)(sv, x8_loadv(c->xs, m * nb + b0, nbc, 1));             \
            if (c->of)                                                                     \
                off[r][m] =                                                                \
                    TW_V(fmadd_ps)(ov, x8_loadv(c->xsum, m * nb + b0, nbc, 1), off[r][m]); \
        }                                                                                  \
    }

/* int4 weights: 4 * TW_VW bytes (8 * TW_VW values, TW_VW / 4 blocks) per step; int32 lane i
 * sums bytes 4i..4i+3, so lanes 4j..4j+3 hold block j's low and high nibbles' products. */
INLINE void q4x8_block(const qctx *c, int64_t n, float *t, const int R, const int M) {
    const int64_t K = c->K, nb = K / X8_BLOCK, rb = K / 2;
    const uint8_t *q = c->q + n * rb;
    const int8_t *xq = c->xq8;
    const int32_t *corr = c->xcorr;
    const tw_vi low4 = TW_V(set1_epi8)(15);
    const tw_vi lane0 = TW_V(srli_epi32)(X8_LANE_IDS, 2);
    tw_vf acc[4][MAX_M], off[4][MAX_M];
    TW_FOR_RM(acc[r][m] = off[r][m] = TW_V(setzero_ps)());
    for (int64_t b0 = 0; b0 < nb; b0 += TW_VW) {
        X8_CHUNK()
        for (int j = 0; j < nbc / (TW_VW / 4); j++) {
            const int64_t k = (b0 + (TW_VW / 4) * j) * X8_BLOCK;
            const tw_vi lane = TW_V(add_epi32)(lane0, TW_V(set1_epi32)((TW_VW / 4) * j));
            tw_vi lo[4], hi[4];
            for (int r = 0; r < R; r++) {
                const uint8_t *p = q + r * rb + k / 2;
                if (!(k & 127)) PREFETCH(p);
                tw_vi v = TW_VI_LOAD(p);
                lo[r] = TW_VI_AND(v, low4);
                hi[r] = TW_VI_AND(TW_V(srli_epi16)(v, 4), low4);
            }
            for (int m = 0; m < M; m++) {
                tw_vi xl = TW_VI_LOAD(xq + m * K + k);
                tw_vi xh = TW_VI_LOAD(xq + m * K + k + 4 * TW_VW);
                tw_vi c0 = TW_VI_LOAD(corr + (m * K + k) / 8);
                for (int r = 0; r < R; r++) {
                    tw_vi d = dpbu8(dpbu8(c0, lo[r], xl), hi[r], xh);
                    acc[r][m] = TW_V(fmadd_ps)(TW_V(cvtepi32_ps)(d), X8_PERMUTE(lane, sc[r][m]),
                                               acc[r][m]);
                }
            }
        }
    }
    TW_FOR_RM(t[r * M + m] = TW_VSUM(TW_V(add_ps)(acc[r][m], off[r][m])));
}

/* int8 weights: 4 * TW_VW values (TW_VW / 8 blocks) per step; lanes 8j..8j+7 hold block j. */
INLINE void q8x8_block(const qctx *c, int64_t n, float *t, const int R, const int M) {
    const int64_t K = c->K, nb = K / X8_BLOCK;
    const int8_t *q = (const int8_t *)c->q + n * K;
    const int8_t *xq = c->xq8;
    const int32_t *corr = c->xcorr;
    const tw_vi lane0 = TW_V(srli_epi32)(X8_LANE_IDS, 3);
    tw_vf acc[4][MAX_M], off[4][MAX_M];
    TW_FOR_RM(acc[r][m] = off[r][m] = TW_V(setzero_ps)());
    for (int64_t b0 = 0; b0 < nb; b0 += TW_VW) {
        X8_CHUNK()
        for (int j = 0; j < nbc / (TW_VW / 8); j++) {
            const int64_t k = (b0 + (TW_VW / 8) * j) * X8_BLOCK;
            const tw_vi lane = TW_V(add_epi32)(lane0, TW_V(set1_epi32)((TW_VW / 8) * j));
            tw_vi w[4];
            for (int r = 0; r < R; r++) {
                const int8_t *p = q + r * K + k;
                if (!(k & 63)) PREFETCH(p);
                w[r] = TW_VI_LOAD(p);
#if X8_VNNI
                w[r] = TW_VI_XOR(w[r], TW_V(set1_epi8)((char)0x80));
#endif
            }
            for (int m = 0; m < M; m++) {
                tw_vi xv = TW_VI_LOAD(xq + m * K + k);
#if X8_VNNI
                tw_vi c0 = TW_VI_LOAD(corr + (m * K + k) / 4);
#endif
                for (int r = 0; r < R; r++) {
#if X8_VNNI
                    tw_vi d = dpbu8(c0, w[r], xv);
#else
                    tw_vi d = dot_signed(w[r], xv);
#endif
                    acc[r][m] = TW_V(fmadd_ps)(TW_V(cvtepi32_ps)(d), X8_PERMUTE(lane, sc[r][m]),
                                               acc[r][m]);
                }
            }
        }
    }
    TW_FOR_RM(t[r * M + m] = TW_VSUM(TW_V(add_ps)(acc[r][m], off[r][m])));
}
#endif

#endif
