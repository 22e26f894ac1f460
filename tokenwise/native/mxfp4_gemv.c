/* y = x @ dequant(W)^T + b for MXFP4 weights (OCP microscaling FP4, as gpt-oss publishes its
 * experts), streaming W once: the decode-time product of one expert projection.
 *
 * Weights: N rows of K values in groups of 32 consecutive values of a row. A group is 16 bytes
 * of packed e2m1 values (byte j: value 2j in its low nibble, value 2j+1 in its high one) and
 * one e8m0 scale byte s (the power of two 2^(s - 127)); an e2m1 code is a sign bit and one of
 * the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6. `blocks` is uint8 [N, K / 32, 16], `scales`
 * uint8 [N, K / 32]: the checkpoint's `*_blocks` / `*_scales` of one expert, as they are.
 * x is float32 [M, K] (M small: decode), y float32 [M, N]; bias float32 [N] or NULL.
 *
 * Why this shape: at one row a product is bound by reading W, and MXFP4 is 4.25 bits a weight
 * (about half of int8, like int4). With AVX2 a group decodes in registers: 8 bytes widen to 8
 * int32 lanes, their low and high nibbles index the 8 magnitudes with one lane permute each
 * and the sign bit is moved to bit 31; that gives the even- and odd-indexed values of 16
 * consecutive weights. x is reordered once per call to the same order (each group's evens,
 * then its odds), so the dot product needs no shuffle of the weights. The group's scale
 * multiplies its decoded weights (exact: a power of two). With AVX-512 the 16-entry code table
 * fits one register and a single permute decodes 16 codes, sign included. Rows are split over
 * OpenMP threads. Without AVX2 + FMA, a plain C loop computes the same (summation order aside).
 */
#include "common.h"

/* 2^(s - 127) for an e8m0 code, built from its bits: the code is the float32 exponent field
 * (0 is 2^-127, a subnormal; 255, NaN in the format, reads as inf). A libm ldexpf per group
 * took a third of the time of a one-row product. */
static inline float scale_of(uint8_t s) {
    const uint32_t bits = s ? (uint32_t)s << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

#define MAX_M 8

/* x [M, K] -> xp [M, K] in the order a vector decode yields a group's weights: `lanes` even
 * values (0, 2, ..), then as many odd ones, per 2 * lanes values (8 lanes: 0, 2, .., 14, 1,
 * .., 15, 16, .., 30, 17, .., 31; 16 lanes: 0, .., 30, 1, .., 31). */
static void permute_x(const float *x, float *xp, int64_t M, int64_t K, int lanes) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < K; g += 2 * lanes)
            for (int j = 0; j < lanes; ++j) {
                xp[m * K + g + j] = x[m * K + g + 2 * j];
                xp[m * K + g + lanes + j] = x[m * K + g + 2 * j + 1];
            }
}

#if defined(__AVX512F__)
#define TW_MXFP4_ISA 2
#define TW_MXFP4_LANES 16
/* R consecutive weight rows from n (R a compile-time 1 or 2: two rows share each load of x).
 * With 16 lanes one permute of a 16-entry table decodes 16 codes, sign included (the table is
 * the whole e2m1 code space). */
static inline __attribute__((always_inline)) void row_block512(
    const float *xp, const uint8_t *blocks, const uint8_t *scales, const float *bias, float *y,
    int64_t M, int64_t N, int64_t K, int64_t n, const int R) {
    const int64_t ng = K / 32;
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const __m512i low4 = _mm512_set1_epi32(15);
    __m512 acc[2][MAX_M];
    for (int r = 0; r < R; ++r)
        for (int64_t m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
        __m512 we[2], wo[2];
        for (int r = 0; r < R; ++r) {
            const uint8_t *q = blocks + ((n + r) * ng + g) * 16;
            if (!(g & 3)) _mm_prefetch((const char *)(q + 8 * 16), _MM_HINT_T0);
            const __m512 s = _mm512_set1_ps(scale_of(scales[(n + r) * ng + g]));
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
            we[r] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v, low4), lut), s);
            wo[r] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut), s);
        }
        for (int64_t m = 0; m < M; ++m) {
            const float *xg = xp + m * K + g * 32;
            const __m512 xe = _mm512_loadu_ps(xg), xo = _mm512_loadu_ps(xg + 16);
            for (int r = 0; r < R; ++r) {
                acc[r][m] = _mm512_fmadd_ps(we[r], xe, acc[r][m]);
                acc[r][m] = _mm512_fmadd_ps(wo[r], xo, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int64_t m = 0; m < M; ++m)
            y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[n + r] : 0.0f);
}

/* Rows [n0, n1): two at a time for several rows of x (measured at M = 4 and 8: 1.4-1.6x
 * faster than one at a time), one at a time for one (about 15% faster there). */
static void rows_vector(const float *xp, const uint8_t *blocks, const uint8_t *scales,
                        const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t n0,
                        int64_t n1) {
    int64_t n = n0;
    if (M > 1)
        for (; n + 2 <= n1; n += 2) row_block512(xp, blocks, scales, bias, y, M, N, K, n, 2);
    for (; n < n1; ++n) row_block512(xp, blocks, scales, bias, y, M, N, K, n, 1);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define TW_MXFP4_ISA 1
#define TW_MXFP4_LANES 8
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows [n0, n1) for M rows of the permuted x. */
static void rows_vector(const float *xp, const uint8_t *blocks, const uint8_t *scales,
                      const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t n0,
                      int64_t n1) {
    const int64_t ng = K / 32;
    const __m256 mags = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *q = blocks + n * ng * 16;
        const uint8_t *sc = scales + n * ng;
        __m256 acc[MAX_M];
        for (int64_t m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; ++g) {
            if (!(g & 3)) _mm_prefetch((const char *)(q + (g + 8) * 16), _MM_HINT_T0);
            const __m256 s = _mm256_set1_ps(scale_of(sc[g]));
            __m256 w[4];
            for (int half = 0; half < 2; ++half) {
                const __m256i v =
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + g * 16 + 8 * half)));
                const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_srli_epi32(v, 4);
                const __m256 lo_f = _mm256_or_ps(
                    _mm256_permutevar8x32_ps(mags, lo),
                    _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(lo, 28), sign)));
                const __m256 hi_f = _mm256_or_ps(
                    _mm256_permutevar8x32_ps(mags, hi),
                    _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(hi, 28), sign)));
                w[2 * half] = _mm256_mul_ps(lo_f, s);
                w[2 * half + 1] = _mm256_mul_ps(hi_f, s);
            }
            for (int64_t m = 0; m < M; ++m) {
                const float *xg = xp + m * K + g * 32;
                __m256 a = acc[m];
                a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), a);
                a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), a);
                a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), a);
                a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), a);
                acc[m] = a;
            }
        }
        for (int64_t m = 0; m < M; ++m) y[m * N + n] = hsum8(acc[m]) + (bias ? bias[n] : 0.0f);
    }
}
#endif

/* The same over the original order of x, one weight at a time. */
static void rows_scalar(const float *x, const uint8_t *blocks, const uint8_t *scales,
                        const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t n0,
                        int64_t n1) {
    const int64_t ng = K / 32;
    for (int64_t n = n0; n < n1; ++n) {
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0.0f;
            for (int64_t g = 0; g < ng; ++g) {
                const uint8_t *q = blocks + (n * ng + g) * 16;
                float part = 0.0f;
                for (int j = 0; j < 16; ++j) {
                    part += E2M1[q[j] & 15] * x[m * K + g * 32 + 2 * j];
                    part += E2M1[q[j] >> 4] * x[m * K + g * 32 + 2 * j + 1];
                }
                acc += part * scale_of(scales[n * ng + g]);
            }
            y[m * N + n] = acc + (bias ? bias[n] : 0.0f);
        }
    }
}

/* 2: the AVX-512 path was compiled in, 1: AVX2 + FMA, 0: plain C. */
int tw_mxfp4_isa(void) {
#if defined(TW_MXFP4_ISA)
    return TW_MXFP4_ISA;
#else
    return 0;
#endif
}

/* y [M, N] = x [M, K] @ dequant(blocks, scales)^T + bias, M <= MAX_M, K a multiple of 32.
 * Returns 0, -1 for bad sizes, -2 without scratch memory. */
int tw_mxfp4_gemv(const float *x, const uint8_t *blocks, const uint8_t *scales,
                  const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                  int64_t num_threads) {
    if (M < 1 || M > MAX_M || K % 32 || N < 1) return -1;
#if defined(TW_MXFP4_ISA)
    float *xp = malloc(sizeof(float) * (size_t)(M * K));
    if (!xp) return -2;
    permute_x(x, xp, M, K, TW_MXFP4_LANES);
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads > 1 && N >= 64 ? (int)num_threads : 1)
#endif
    {
        int64_t part = 0, parts = 1;
#ifdef _OPENMP
        part = omp_get_thread_num();
        parts = omp_get_num_threads();
#endif
        const int64_t n0 = N * part / parts, n1 = N * (part + 1) / parts;
        rows_vector(xp, blocks, scales, bias, y, M, N, K, n0, n1);
    }
    free(xp);
#else
    (void)num_threads;
    (void)permute_x;
    rows_scalar(x, blocks, scales, bias, y, M, N, K, 0, N);
#endif
    return 0;
}

/* The plain C path whatever the build: the definition the vector path is tested against. */
int tw_mxfp4_gemv_scalar(const float *x, const uint8_t *blocks, const uint8_t *scales,
                         const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || K % 32 || N < 1) return -1;
    rows_scalar(x, blocks, scales, bias, y, M, N, K, 0, N);
    return 0;
}

/* `tw_mxfp4_gemv`'s packed entry, for a replayed CPU graph (common.h). */
int tw_mxfp4_gemv_packed(const int64_t *a) {
    return tw_mxfp4_gemv(TW_PTR(0), TW_PTR(1), TW_PTR(2), TW_PTR(3), TW_PTR(4), a[5], a[6], a[7],
                         a[8]);
}
