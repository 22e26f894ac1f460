/* The one-row float32 path of `tw_gemv` (gemv.c): y[N] = x[K] @ W[N, K]^T, one weight row
 * after another.
 *
 * Why not the R-rows-at-a-time blocks of the small-M path: at one row of x there is nothing
 * to share between weight rows, and reading R rows side by side makes R short memory streams
 * (a row of 768 float32 values is 3 KiB, less than a page) that start and stop at every block.
 * The hardware prefetchers follow one long ascending stream best: walking the rows in order
 * reads each thread's share of W as one contiguous stretch. Measured on an AVX-512 EPYC built
 * for haswell (benchmarks/linear_bandwidth.py, one thread, cold weights): the Llama ~100M
 * shapes went from 12-17 to 22-25 GB/s, next to 27-29 GB/s for a plain sum over the same
 * bytes. Four accumulators per row hide the FMA latency, so the loop stays load-bound.
 *
 * Summation order: per row, four vector accumulators over blocks of 4 * TW_VW values, then a
 * single vector over whole vectors, added up and summed across lanes, then the scalar tail.
 * The AVX2 and AVX-512 builds therefore differ in rounding only (float32 accumulation both).
 */
#ifndef TW_GEMV_ROW_H
#define TW_GEMV_ROW_H

#include "common.h"

#if defined(TW_AVX512) || defined(TW_AVX2)
/* The dot product of one float32 weight row with x. */
INLINE float dot_row_f32(const float *w, const float *x, int64_t K) {
    tw_vf a0 = TW_V(setzero_ps)(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 4 * TW_VW <= K; k += 4 * TW_VW) {
        a0 = TW_V(fmadd_ps)(TW_V(loadu_ps)(w + k), TW_V(loadu_ps)(x + k), a0);
        a1 = TW_V(fmadd_ps)(TW_V(loadu_ps)(w + k + TW_VW), TW_V(loadu_ps)(x + k + TW_VW), a1);
        a2 = TW_V(fmadd_ps)(TW_V(loadu_ps)(w + k + 2 * TW_VW),
                            TW_V(loadu_ps)(x + k + 2 * TW_VW), a2);
        a3 = TW_V(fmadd_ps)(TW_V(loadu_ps)(w + k + 3 * TW_VW),
                            TW_V(loadu_ps)(x + k + 3 * TW_VW), a3);
    }
    for (; k + TW_VW <= K; k += TW_VW)
        a0 = TW_V(fmadd_ps)(TW_V(loadu_ps)(w + k), TW_V(loadu_ps)(x + k), a0);
    float s = TW_VSUM(TW_V(add_ps)(TW_V(add_ps)(a0, a1), TW_V(add_ps)(a2, a3)));
    for (; k < K; k++) s += w[k] * x[k];
    return s;
}
#else
INLINE float dot_row_f32(const float *w, const float *x, int64_t K) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; k++) s += w[k] * x[k];
    return s;
}
#endif

/* Weight rows [n0, n1) of y = x @ W^T (+ bias) for one float32 row of x. */
static void run_one_row_f32(const float *w, const float *x, int64_t K, int64_t n0, int64_t n1,
                            const float *bias, float *y) {
    for (int64_t n = n0; n < n1; n++) {
        const float s = dot_row_f32(w + n * K, x, K);
        y[n] = bias ? s + bias[n] : s;
    }
}

#endif
