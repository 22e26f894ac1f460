/* y = x @ W^T for a few rows of x with float8_e4m3fn weights, and W dequantized (prefill).
 *
 * W is [N, K] bytes (e4m3: sign, 4 exponent bits with bias 7, 3 mantissa bits). Its scales are
 * float32: one for the tensor (kind 0), one per row (kind 1), or one per [bn, bk] tile (kind 2,
 * `scale` [ceil(N / bn), scols], the last tiles partial). x is [M, K] (M <= 8) float32 or bf16;
 * y [M, N] of x's dtype; bias optional, of x's dtype. Accumulation is float32.
 *
 * Widening without a table: F16C widens an e4m3 byte moved into a float16 (common.h,
 * `e4m3x16_to_f32`), which reads as the value / 256; the 256 goes into the scale.
 *
 * Tile scales: a block of R weight rows never crosses a tile row (R divides bn, and threads
 * start on multiples of 16 rows), so all R rows share each tile's scale: x is multiplied by it
 * once per chunk, not each weight. Row and tensor scales are applied to the sums at the end.
 * Vector path: AVX-512 (16 weights a step) or AVX2 + F16C (8); the caller needs K % 16 == 0
 * and, with tiles, bk % 16 == 0 and bn % 4 == 0 (else it dequantizes with torch ops).
 */
#include "linear.h"

#if (defined(TW_AVX512) || defined(TW_AVX2)) && defined(__F16C__)
#define FP8_W TW_VW
typedef tw_vf vf;
#if FP8_W == 16
#define load_w8 e4m3x16_to_f32
#else
#define load_w8 e4m3x8_to_f32
#endif
#define FP8_R_FOR R_FOR
#else
#define FP8_R_FOR(M) 1
#endif

int tw_fp8_isa(void) {
#if defined(FP8_W)
    return FP8_W == 16 ? 2 : 1;
#else
    return 0;
#endif
}

/* 16 finite floats rounded to bf16 (nearest even), vectorised where the ISA allows. */
INLINE void bf16_row16(const float *v, uint16_t *out) {
#if defined(TW_AVX512)
    __m512i u = _mm512_castps_si512(_mm512_loadu_ps(v));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#else
    for (int j = 0; j < 16; j++) out[j] = f32_to_bf16(v[j]);
#endif
}

#ifndef TW_FP8_AHEAD
#define TW_FP8_AHEAD 1
#endif

typedef struct {
    const uint8_t *w;
    const float *scale;
    int kind;
    int64_t N, K, bn, bk, scols;
} fp8w;

#if defined(FP8_W)
/* Dot products of weight rows n..n+R-1 with the M rows of x: t[r * M + m], scaled. */
INLINE void block_fp8(const fp8w *W, int64_t n, const float *x, float *t, const int R,
                      const int M) {
    const int64_t K = W->K;
    vf acc[4][MAX_M];
    TW_FOR_RM(acc[r][m] = TW_V(setzero_ps)());
    const int64_t step = W->kind == 2 ? W->bk : K;
    /* fp8 rows are short (K bytes): prefetch the same place in the next row block, once per
     * cache line (on a 768-wide layer 1.5x the bandwidth of `PREFETCH`, 512 bytes ahead). */
    const int64_t ahead = (int64_t)TW_FP8_AHEAD * R * K;
    const float *srow = W->kind == 2 ? W->scale + (n / W->bn) * W->scols : NULL;
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        int64_t k1 = k0 + step < K ? k0 + step : K;
        vf s = TW_V(set1_ps)(srow ? srow[k0 / W->bk] * TW_E4M3_UNIT : TW_E4M3_UNIT);
        for (int64_t k = k0; k < k1; k += FP8_W) {
            vf w[4];
            for (int r = 0; r < R; r++) {
                const uint8_t *p = W->w + (n + r) * K + k;
                if (!(k & 63)) __builtin_prefetch(p + ahead, 0, 3);
                w[r] = load_w8(p);
            }
            for (int m = 0; m < M; m++) {
                vf xv = TW_V(mul_ps)(TW_V(loadu_ps)(x + m * K + k), s);
                for (int r = 0; r < R; r++) acc[r][m] = TW_V(fmadd_ps)(w[r], xv, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float rs = W->kind == 0 ? W->scale[0] : W->kind == 1 ? W->scale[n + r] : 1.0f;
        for (int m = 0; m < M; m++) t[r * M + m] = TW_VSUM(acc[r][m]) * rs;
    }
}
#else
static void block_fp8(const fp8w *W, int64_t n, const float *x, float *t, int R, int M) {
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < W->K; k++) {
                float s = W->kind == 0   ? W->scale[0]
                          : W->kind == 1 ? W->scale[n + r]
                                         : W->scale[((n + r) / W->bn) * W->scols + k / W->bk];
                sum += fp8_to_f32(W->w[(n + r) * W->K + k], 0) * s * x[m * W->K + k];
            }
            t[r * M + m] = sum;
        }
}
#endif

static void run_rows(const fp8w *W, const float *xf, int Mr, int64_t n0, int64_t n1,
                     const void *bias, void *y, int ybf16) {
    TW_SWITCH_M(Mr, block_fp8(W, n, xf, t, R, M), FP8_R_FOR, W->N, bias, y, ybf16)
}

static int check(int kind, int64_t N, int64_t K, int64_t bn, int64_t bk) {
    if (N < 1 || K < 1 || K % 16 || kind < 0 || kind > 2) return -1;
    if (kind == 2 && (bn < 4 || bn % 4 || bk < 16 || bk % 16)) return -1;
    return 0;
}

/* y[M, N] = x[M, K] @ dequant(w)^T (+ bias); x, y, bias bf16 when `bf16`, else float32.
 * Returns 0, -1 for sizes the kernel does not take, -2 when memory runs out. */
int tw_fp8_gemv(const void *x, const uint8_t *w, const float *scale, const void *bias, void *y,
                int64_t M, int64_t N, int64_t K, int kind, int64_t bn, int64_t bk, int bf16,
                int num_threads) {
    if (M < 1 || M > MAX_M || check(kind, N, K, bn, bk)) return -1;
    fp8w W = {w, scale, kind, N, K, bn, bk, kind == 2 ? (K + bk - 1) / bk : 1};
    float *widened;
    const float *xf = x_as_f32(x, M * K, bf16, &widened);
    if (!xf) return -2;
    int64_t align = kind == 2 ? (bn < 16 ? bn : 16) : 16;
    TW_PARALLEL_ROWS(N, align, run_rows(&W, xf, (int)M, n0, n1, bias, y, bf16));
    free(widened);
    return 0;
}

/* out[N, K] = dequant(w), bf16 (rounded to nearest even) when `bf16`, else float32. */
int tw_fp8_dequant(const uint8_t *w, const float *scale, void *out, int64_t N, int64_t K,
                   int kind, int64_t bn, int64_t bk, int bf16, int num_threads) {
    if (check(kind, N, K, bn, bk)) return -1;
    int64_t scols = kind == 2 ? (K + bk - 1) / bk : 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *srow = scale + (kind == 2 ? (n / bn) * scols : kind == 1 ? n : 0);
        for (int64_t k = 0; k < K; k += 16) {
            float s = srow[kind == 2 ? k / bk : 0], v[16];
#if defined(FP8_W)
            vf s8 = TW_V(set1_ps)(s * TW_E4M3_UNIT);
            for (int j = 0; j < 16; j += FP8_W)
                TW_V(storeu_ps)(v + j, TW_V(mul_ps)(load_w8(w + n * K + k + j), s8));
#else
            for (int j = 0; j < 16; j++) v[j] = fp8_to_f32(w[n * K + k + j], 0) * s;
#endif
            if (bf16)
                bf16_row16(v, (uint16_t *)out + n * K + k);
            else
                memcpy((float *)out + n * K + k, v, sizeof v);
        }
    }
    return 0;
}

/* `tw_fp8_gemv`'s packed entry (common.h). */
int tw_fp8_gemv_packed(const int64_t *a) {
    return tw_fp8_gemv(TW_PTR(0), TW_PTR(1), TW_PTR(2), TW_PTR(3), TW_PTR(4), a[5], a[6], a[7],
                       (int)a[8], a[9], a[10], (int)a[11], (int)a[12]);
}
