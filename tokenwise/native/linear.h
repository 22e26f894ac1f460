/* The driver the small-M linear kernels share (gemv.c, qgemv.c, fp8_gemv.c): y = x @ W^T for
 * M <= MAX_M rows of x, W streamed once, R weight rows at a time.
 *
 * Each kernel supplies a block function that fills t[r * M + m], the dot products of weight
 * rows n..n+R-1 with the M rows of x, for compile-time R and M (so its accumulators stay in
 * registers); `TW_SWITCH_M` instantiates it per M, `store` adds the bias and writes y, and
 * `tw_thread_rows` splits the weight rows over OpenMP threads in contiguous ranges, so each
 * thread walks one contiguous stretch of memory.
 */
#ifndef TW_LINEAR_H
#define TW_LINEAR_H

#include "common.h"

#define MAX_M 8

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

/* The vector path of this build: 2 AVX-512, 1 AVX2 + FMA, 0 plain C. */
INLINE int tw_vector_isa(void) {
#if defined(TW_AVX512)
    return 2;
#elif defined(TW_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Block height by M for the float paths: R * M accumulators must fit the vector registers
 * (32 with AVX-512, 16 with AVX2). */
#if defined(TW_AVX512)
#define R_FOR(M) ((M) <= 4 ? 4 : 2)
#elif defined(TW_AVX2)
#define R_FOR(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)
#else
#define R_FOR(M) 1
#endif

/* The statement `...` for every (r, m) of a block: R weight rows by M rows of x. */
#define TW_FOR_RM(...)                                                                     \
    for (int r = 0; r < R; r++)                                                            \
        for (int m = 0; m < M; m++) __VA_ARGS__

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

/* Weight rows [n0, n1) in blocks of RR (then single rows), for a compile-time MM: BLOCK_CALL
 * is a statement that fills `t` for rows n.. with the constants R and M in scope. */
#define TW_ROWS(BLOCK_CALL, RR, MM, N, BIAS, Y, YBF16)                                     \
    do {                                                                                   \
        float t[4 * MAX_M];                                                                \
        int64_t n = n0;                                                                    \
        for (; n + (RR) <= n1; n += (RR)) {                                                \
            { const int R = (RR), M = (MM); BLOCK_CALL; }                                  \
            store(t, (RR), (MM), n, N, BIAS, Y, YBF16);                                    \
        }                                                                                  \
        for (; n < n1; n++) {                                                              \
            { const int R = 1, M = (MM); BLOCK_CALL; }                                     \
            store(t, 1, (MM), n, N, BIAS, Y, YBF16);                                       \
        }                                                                                  \
    } while (0)

/* `TW_ROWS` for the run-time `Mr` (1..MAX_M), the block height `R_FOR_M(M)`. */
#define TW_SWITCH_M(Mr, BLOCK_CALL, R_FOR_M, N, BIAS, Y, YBF16)                            \
    switch (Mr) {                                                                          \
    case 1: TW_ROWS(BLOCK_CALL, R_FOR_M(1), 1, N, BIAS, Y, YBF16); break;                  \
    case 2: TW_ROWS(BLOCK_CALL, R_FOR_M(2), 2, N, BIAS, Y, YBF16); break;                  \
    case 3: TW_ROWS(BLOCK_CALL, R_FOR_M(3), 3, N, BIAS, Y, YBF16); break;                  \
    case 4: TW_ROWS(BLOCK_CALL, R_FOR_M(4), 4, N, BIAS, Y, YBF16); break;                  \
    case 5: TW_ROWS(BLOCK_CALL, R_FOR_M(5), 5, N, BIAS, Y, YBF16); break;                  \
    case 6: TW_ROWS(BLOCK_CALL, R_FOR_M(6), 6, N, BIAS, Y, YBF16); break;                  \
    case 7: TW_ROWS(BLOCK_CALL, R_FOR_M(7), 7, N, BIAS, Y, YBF16); break;                  \
    default: TW_ROWS(BLOCK_CALL, R_FOR_M(8), 8, N, BIAS, Y, YBF16); break;                 \
    }

#ifdef _OPENMP
/* This OpenMP thread's contiguous share [*n0, *n1) of N rows, each share a multiple of
 * `align` rows (but the last). */
INLINE void tw_thread_rows(int64_t N, int64_t align, int64_t *n0, int64_t *n1) {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    int64_t per = (N + nth - 1) / nth;
    per = (per + align - 1) / align * align;
    *n0 = tid * per;
    *n1 = *n0 + per < N ? *n0 + per : N;
}

/* The statement RUN over weight rows [n0, n1) covering [0, N): from 32 rows on split over the
 * caller's `num_threads` OpenMP threads (`tw_thread_rows`), else on the calling thread. */
#define TW_PARALLEL_ROWS(N, ALIGN, RUN)                                                    \
    do {                                                                                   \
        if (num_threads > 1 && (N) >= 32) {                                                \
            _Pragma("omp parallel num_threads(num_threads)")                               \
            {                                                                              \
                int64_t n0, n1;                                                            \
                tw_thread_rows(N, ALIGN, &n0, &n1);                                        \
                if (n0 < n1) RUN;                                                          \
            }                                                                              \
        } else {                                                                           \
            const int64_t n0 = 0, n1 = (N);                                                \
            RUN;                                                                           \
        }                                                                                  \
    } while (0)
#else
#define TW_PARALLEL_ROWS(N, ALIGN, RUN)                                                    \
    do {                                                                                   \
        const int64_t n0 = 0, n1 = (N);                                                    \
        (void)num_threads, (void)(ALIGN);                                                  \
        RUN;                                                                               \
    } while (0)
#endif

#endif
