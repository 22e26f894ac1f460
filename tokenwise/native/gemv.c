/* y = x @ W^T for a few rows of x (decode-sized linear layers), streaming W once.
 *
 * W is [N, K] row-major, float32 or bfloat16; x is [M, K] (any M >= 1) of the same dtype; y is
 * [M, N] of that dtype; bias (optional) is [N] of that dtype. Accumulation is float32; bf16
 * results are rounded to nearest even once, at the end, as native bf16 kernels do.
 *
 * At M <= 8 the work is bound by reading W: each weight row is loaded once and multiplied into
 * all M rows of x (which stay in L1), a block of R weight rows at a time (R independent load
 * streams and R*M accumulators in registers). The rows are split over OpenMP threads in
 * contiguous ranges, so each thread walks one contiguous stretch of memory. Above
 * `TW_DIRECT_MAX_M` rows (2 with AVX2's 16 registers, 8 with AVX-512) a blocked path tiles the
 * rows of x instead (`run_rows_tiled`), so the loads per FMA stay low as M grows.
 *
 * The vector path is chosen when this file is compiled (-march=native for the machine it runs
 * on): AVX-512 with AVX512_BF16 (bf16 weights through vdpbf16ps, x read as bf16 pairs),
 * AVX-512 (bf16 weights widened to float32 by a shift), AVX2 + FMA, or plain C. `tw_gemv_isa`
 * says which, so the caller can keep its own path where this one would not be faster.
 */
#include "linear.h"
#include "gemv_row.h"

int tw_gemv_isa(void) {
#if defined(TW_AVX512_BF16)
    return 3;
#else
    return tw_vector_isa();
#endif
}

/* s plus the dot product of weight row r (float32, or bf16 when `wbf16`) with row m of x over
 * values [k0, K): the plain-C path, and the tail the AVX2 path leaves. */
INLINE float dot_tail(float s, const void *wv, int wbf16, const float *x, int64_t K, int64_t k0,
                      int r, int m) {
    for (int64_t j = k0; j < K; j++) {
        float wj = wbf16 ? bf16_to_f32(((const uint16_t *)wv)[r * K + j])
                         : ((const float *)wv)[r * K + j];
        s += wj * x[m * K + j];
    }
    return s;
}

#if defined(TW_AVX512) || defined(TW_AVX2)
/* TW_VW values of a float32 or bf16 row from k: with AVX-512 the row's last step is a masked
 * load; with AVX2 the vector loop stops before it and `dot_tail` adds the rest. */
#if defined(TW_AVX512)
#define STEP_MASK(k) const __mmask16 mask = K - (k) >= 16 ? 0xffff : (__mmask16)((1u << (K - (k))) - 1)
#define LOAD_F32(p) _mm512_maskz_loadu_ps(mask, p)
#define LOAD_BF16(p)                                                                       \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16))
#define STEPS_END K
#else
#define STEP_MASK(k) (void)(k)
#define LOAD_F32(p) _mm256_loadu_ps(p)
#define LOAD_BF16(p)                                                                       \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define STEPS_END (K - 7)
#endif

/* float32 weights (or bf16 widened in registers when `wbf16`), float32 x. */
INLINE void block_f32(const void *wv, int wbf16, const float *x, int64_t K, float *t,
                      const int R, const int M) {
    tw_vf acc[4][MAX_M];
    TW_FOR_RM(acc[r][m] = TW_V(setzero_ps)());
    int64_t k = 0;
    for (; k < STEPS_END; k += TW_VW) {
        STEP_MASK(k);
        tw_vf w[4];
        for (int r = 0; r < R; r++) {
            if (wbf16) {
                const uint16_t *p = (const uint16_t *)wv + r * K + k;
                PREFETCH(p);
                w[r] = LOAD_BF16(p);
            } else {
                const float *p = (const float *)wv + r * K + k;
                PREFETCH(p);
                w[r] = LOAD_F32(p);
            }
        }
        for (int m = 0; m < M; m++) {
            tw_vf xv = LOAD_F32(x + m * K + k);
            for (int r = 0; r < R; r++) acc[r][m] = TW_V(fmadd_ps)(w[r], xv, acc[r][m]);
        }
    }
    TW_FOR_RM(t[r * M + m] = dot_tail(TW_VSUM(acc[r][m]), wv, wbf16, x, K, k, r, m));
}
#else
/* Plain C, for CPUs without AVX2 (the caller does not use it there; kept for correctness). */
static void block_f32(const void *wv, int wbf16, const float *x, int64_t K, float *t, int R,
                      int M) {
    TW_FOR_RM(t[r * M + m] = dot_tail(0.0f, wv, wbf16, x, K, 0, r, m));
}
#endif

#if defined(TW_AVX512_BF16)
/* bf16 weights and bf16 x: vdpbf16ps multiplies bf16 pairs exactly and adds them in fp32. */
INLINE void block512_dpbf16(const uint16_t *w, const uint16_t *x, int64_t K, float *t,
                            const int R, const int M) {
    __m512 acc[4][MAX_M];
    TW_FOR_RM(acc[r][m] = _mm512_setzero_ps());
    for (int64_t k = 0; k < K; k += 32) {
        __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
        __m512bh wr[4];
        for (int r = 0; r < R; r++) {
            PREFETCH(w + r * K + k);
            wr[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
        }
        for (int m = 0; m < M; m++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
            for (int r = 0; r < R; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wr[r], xv);
        }
    }
    TW_FOR_RM(t[r * M + m] = _mm512_reduce_add_ps(acc[r][m]));
}
#endif

#define SWITCH_M(BLOCK_CALL) TW_SWITCH_M(Mr, BLOCK_CALL, R_FOR, N, bias, y, ybf16)

/* Register tiles of the blocked path (more than `TW_DIRECT_MAX_M` rows of x): TILE_R weight
 * rows by TILE_M rows of x, TILE_R * TILE_M accumulators plus TILE_R weight vectors and one x
 * vector in registers (16 ymm with AVX2, 32 zmm with AVX-512). Per step of TW_VW values that is
 * TILE_R + TILE_M loads for TILE_R * TILE_M FMAs, where the direct path's single weight row at
 * 8 rows of x needs 9 loads for 8 FMAs and stalls on loads. */
#if defined(TW_AVX512)
#define TW_DIRECT_MAX_M MAX_M
#ifndef TILE_R
#define TILE_R 4
#endif
#ifndef TILE_M
#define TILE_M 6
#endif
#else
#define TW_DIRECT_MAX_M 2
#ifndef TILE_R
#define TILE_R 3
#endif
#ifndef TILE_M
#define TILE_M 4
#endif
#endif

/* One tile: weight rows n..n+R-1 by x rows m0..m0+M-1, for compile-time R and M. */
#define TILE_CALL(RR, MM)                                                                  \
    do {                                                                                   \
        const int R = (RR), M = (MM);                                                      \
        if (dp) block512_dpbf16_tile;                                                      \
        else block_f32(wrow, wbf16, xf + m0 * K, K, t, R, M);                              \
        store(t, R, M, n, N, bias, ybf16 ? (void *)((uint16_t *)y + m0 * N)                \
                                            : (void *)((float *)y + m0 * N), ybf16);       \
    } while (0)

#if defined(TW_AVX512_BF16)
#define block512_dpbf16_tile block512_dpbf16((const uint16_t *)w + n * K, xh + m0 * K, K, t, R, M)
#else
#define block512_dpbf16_tile (void)0
#endif

/* The x-rows of one weight block of height RR: tiles of TILE_M rows, then the rest. */
#define TILE_ROWS_OF_X(RR)                                                                 \
    do {                                                                                   \
        int64_t m0 = 0;                                                                    \
        for (; m0 + TILE_M <= Mr; m0 += TILE_M) TILE_CALL(RR, TILE_M);                     \
        switch (Mr - m0) {                                                                 \
        case 0: break;                                                                     \
        case 1: TILE_CALL(RR, 1); break;                                                   \
        case 2: TILE_CALL(RR, 2); break;                                                   \
        case 3: TILE_CALL(RR, 3); break;                                                   \
        case 4: if (TILE_M > 4) TILE_CALL(RR, 4); break; /* (no code for an unused M) */   \
        case 5: if (TILE_M > 5) TILE_CALL(RR, 5); break;                                   \
        default: if (TILE_M > 6) TILE_CALL(RR, 6); break; /* TILE_M <= 7 */                \
        }                                                                                  \
    } while (0)

/* The blocked path for many rows of x: each block of TILE_R weight rows is read from memory
 * once and then, from the cache, against every tile of x (all M rows of x stay in L2: at 64
 * rows of 3072 float32 values, 768 KiB), so weights still stream once per call while the
 * work per weight row grows with M. */
static void run_rows_tiled(const void *w, int wbf16, const float *xf, const uint16_t *xh,
                           int64_t K, int64_t n0, int64_t n1, int64_t Mr, const void *bias,
                           void *y, int64_t N, int ybf16) {
    float t[4 * MAX_M];
    const int dp = wbf16 && xh != NULL;
    int64_t n = n0;
    for (; n + TILE_R <= n1; n += TILE_R) {
        const void *wrow = wbf16 ? (const void *)((const uint16_t *)w + n * K)
                                 : (const void *)((const float *)w + n * K);
        TILE_ROWS_OF_X(TILE_R);
    }
    for (; n < n1; n++) {
        const void *wrow = wbf16 ? (const void *)((const uint16_t *)w + n * K)
                                 : (const void *)((const float *)w + n * K);
        TILE_ROWS_OF_X(1);
    }
    (void)xh;
}

/* One thread's share: weight rows [n0, n1). `xf` is x as float32; `xh` x as bf16 (or NULL). */
static void run_rows(const void *w, int wbf16, const float *xf, const uint16_t *xh, int64_t K,
                     int64_t n0, int64_t n1, int Mr, const void *bias, void *y, int64_t N,
                     int ybf16) {
#if defined(TW_AVX512_BF16)
    if (wbf16 && xh) {
        const uint16_t *wh = (const uint16_t *)w;
        SWITCH_M(block512_dpbf16(wh + n * K, xh, K, t, R, M));
        return;
    }
#endif
    if (wbf16) {
        SWITCH_M(block_f32((const uint16_t *)w + n * K, 1, xf, K, t, R, M));
    } else {
        SWITCH_M(block_f32((const float *)w + n * K, 0, xf, K, t, R, M));
    }
    (void)xh;
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]); all contiguous, of one dtype (bf16 when `bf16`).
 * Returns 0, or -1 for bad sizes, -2 when the float32 copy of a bf16 x cannot be allocated. */
int tw_gemv(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
            int64_t K, int bf16, int num_threads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    const uint16_t *xh = NULL;
#if defined(TW_AVX512_BF16)
    if (bf16) xh = (const uint16_t *)x;
#endif
    float *widened; /* bf16 x widened, unless the bf16 dot products read it as it is */
    const float *xf = x_as_f32(x, M * K, bf16 && !xh, &widened);
    if (!xf) return -2;
    if (M == 1) /* one weight row after another (gemv_row.h) */
        TW_PARALLEL_ROWS(N, 16, run_one_row(w, bf16, xf, xh, K, n0, n1, bias, y));
    else if (M > TW_DIRECT_MAX_M)
        TW_PARALLEL_ROWS(N, 16, run_rows_tiled(w, bf16, xf, xh, K, n0, n1, M, bias, y, N, bf16));
    else
        TW_PARALLEL_ROWS(N, 16, run_rows(w, bf16, xf, xh, K, n0, n1, (int)M, bias, y, N, bf16));
    free(widened);
    return 0;
}

/* `tw_gemv`'s packed entry (common.h). */
int tw_gemv_packed(const int64_t *a) {
    return tw_gemv(TW_PTR(0), TW_PTR(1), TW_PTR(2), TW_PTR(3), a[4], a[5], a[6], (int)a[7],
                   (int)a[8]);
}
