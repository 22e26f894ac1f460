/* The one-row path of `tw_gemv` (gemv.c): y[N] = x[K] @ W[N, K]^T (+ bias), one weight row
 * after another, float32 or bf16 weights.
 *
 * Why not the R-rows-at-a-time blocks of the small-M path: at one row of x there is nothing
 * to share between weight rows, and reading R rows side by side makes R short memory streams
 * (a row of 768 float32 values is 3 KiB, less than a page) that start and stop at every block.
 * The hardware prefetchers follow one long ascending stream best: walking the rows in order
 * reads each thread's share of W as one contiguous stretch. Measured on an AVX-512 EPYC (one
 * thread, weights cycled over 1 GiB of copies so they come from memory): float32 built for
 * haswell 14-21 -> 25-27 GB/s on the Llama ~100M and Qwen3-0.6B layer shapes, the same with
 * the AVX-512 build; bf16 through vdpbf16ps 12-17 -> 22-27 GB/s; a plain sum over the same
 * bytes read 27-30 GB/s. Several accumulators per row hide the FMA latency, so the loop stays
 * bound by loads.
 *
 * Summation order, per row: a few vector accumulators over whole blocks, one over the vectors
 * left, added up and summed across lanes, then the scalar tail (the AVX-512 paths end on a
 * masked step instead). The builds differ in rounding only: float32 accumulation everywhere,
 * bf16 results rounded once (to nearest even) at the end, as the small-M path does.
 */
#ifndef TW_GEMV_ROW_H
#define TW_GEMV_ROW_H

#include "common.h"

#if defined(TW_AVX512) || defined(TW_AVX2)
/* TW_VW bf16 weights widened to float32 (exact: a bf16 is the top half of a float32). */
INLINE tw_vf row_load_bf16(const uint16_t *p) {
#if defined(TW_AVX512)
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#endif
}

/* The TW_VW weights at w + k, float32 or bf16. */
#define ROW_W(k) (wbf16 ? row_load_bf16((const uint16_t *)wv + (k)) : TW_V(loadu_ps)((const float *)wv + (k)))

/* The dot product of one weight row (float32, or bf16 when `wbf16`) with float32 x. */
INLINE float dot_row(const void *wv, int wbf16, const float *x, int64_t K) {
    tw_vf a0 = TW_V(setzero_ps)(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 4 * TW_VW <= K; k += 4 * TW_VW) {
        a0 = TW_V(fmadd_ps)(ROW_W(k), TW_V(loadu_ps)(x + k), a0);
        a1 = TW_V(fmadd_ps)(ROW_W(k + TW_VW), TW_V(loadu_ps)(x + k + TW_VW), a1);
        a2 = TW_V(fmadd_ps)(ROW_W(k + 2 * TW_VW), TW_V(loadu_ps)(x + k + 2 * TW_VW), a2);
        a3 = TW_V(fmadd_ps)(ROW_W(k + 3 * TW_VW), TW_V(loadu_ps)(x + k + 3 * TW_VW), a3);
    }
    for (; k + TW_VW <= K; k += TW_VW) a0 = TW_V(fmadd_ps)(ROW_W(k), TW_V(loadu_ps)(x + k), a0);
    float s = TW_VSUM(TW_V(add_ps)(TW_V(add_ps)(a0, a1), TW_V(add_ps)(a2, a3)));
    for (; k < K; k++)
        s += (wbf16 ? bf16_to_f32(((const uint16_t *)wv)[k]) : ((const float *)wv)[k]) * x[k];
    return s;
}
#undef ROW_W
#else
INLINE float dot_row(const void *wv, int wbf16, const float *x, int64_t K) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; k++)
        s += (wbf16 ? bf16_to_f32(((const uint16_t *)wv)[k]) : ((const float *)wv)[k]) * x[k];
    return s;
}
#endif

#if defined(TW_AVX512_BF16)
/* bf16 weights and bf16 x through vdpbf16ps (bf16 pairs multiplied exactly, added in fp32). */
INLINE float dot_row_dpbf16(const uint16_t *w, const uint16_t *x, int64_t K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k),
                              (__m512bh)_mm512_loadu_si512(x + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32),
                              (__m512bh)_mm512_loadu_si512(x + k + 32));
    }
    for (; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, w + k),
                              (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
#endif

/* Weight rows [n0, n1) for one row of x: `xf` is x as float32, `xh` x as bf16 where the bf16
 * dot products read it as it is (else NULL); bias, y and W are bf16 when `bf16`. */
static void run_one_row(const void *w, int bf16, const float *xf, const uint16_t *xh, int64_t K,
                        int64_t n0, int64_t n1, const void *bias, void *y) {
    for (int64_t n = n0; n < n1; n++) {
        float s;
#if defined(TW_AVX512_BF16)
        if (xh)
            s = dot_row_dpbf16((const uint16_t *)w + n * K, xh, K);
        else
#endif
            s = bf16 ? dot_row((const uint16_t *)w + n * K, 1, xf, K)
                     : dot_row((const float *)w + n * K, 0, xf, K);
        if (bias) s += bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
        if (bf16)
            ((uint16_t *)y)[n] = f32_to_bf16(s);
        else
            ((float *)y)[n] = s;
    }
    (void)xh;
}

#endif
