/* y = x @ W^T for a few rows of x with float8_e4m3fn weights, and W dequantized (prefill).
 *
 * W is [N, K] bytes (e4m3: sign, 4 exponent bits with bias 7, 3 mantissa bits). Its scales are
 * float32: one for the tensor (kind 0), one per row (kind 1), or one per [bn, bk] tile (kind 2,
 * `scale` [ceil(N / bn), scols], the last tiles partial). x is [M, K] (M <= 8) float32 or bf16;
 * y [M, N] of x's dtype; bias optional, of x's dtype. Accumulation is float32.
 *
 * Widening without a table: an e4m3 byte's bits shifted into an IEEE half, `(b & 0x7f) << 7`
 * with the sign at bit 15, are the half whose value is the e4m3 value times 2^-8 (normal and
 * subnormal alike: both formats' mantissas line up and the exponent bias differs by 8), and
 * F16C widens halves to float32 in one instruction. In vectors: the byte in a lane's high
 * half, shifted right arithmetically by one (the sign lands on bits 15 and 14), bit 14 cleared. The 2^8 goes into the scale. (e4m3fn's
 * NaN, 0x7f, would read as 480: checkpoints have none.)
 *
 * Tile scales: a block of R weight rows never crosses a tile row (R divides bn, and threads
 * start on multiples of 16 rows), so all R rows share each tile's scale: x is multiplied by it
 * once per chunk, not each weight. Row and tensor scales are applied to the sums at the end.
 * Vector path: AVX-512 (16 weights a step) or AVX2 + F16C (8); the caller needs K % 16 == 0
 * and, with tiles, bk % 16 == 0 and bn % 4 == 0 (else it dequantizes with torch ops).
 */
#include "common.h"

#if defined(TW_AVX512) && defined(__F16C__)
#define FP8_W 16
typedef __m512 vf;
INLINE vf load_w8(const uint8_t *p) {
    __m256i b = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8);
    b = _mm256_and_si256(_mm256_srai_epi16(b, 1), _mm256_set1_epi16((short)0xbfff));
    return _mm512_cvtph_ps(b);
}
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSET1(s) _mm512_set1_ps(s)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSUM(v) _mm512_reduce_add_ps(v)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define R_FOR(M) ((M) <= 4 ? 4 : 2)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FP8_W 8
typedef __m256 vf;
INLINE vf load_w8(const uint8_t *p) {
    __m128i b = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8);
    b = _mm_and_si128(_mm_srai_epi16(b, 1), _mm_set1_epi16((short)0xbfff));
    return _mm256_cvtph_ps(b);
}
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSET1(s) _mm256_set1_ps(s)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSUM(v) hsum256(v)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define R_FOR(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)
#endif

/* One e4m3 byte as float32 (exact), for the scalar paths. */
INLINE float fp8_to_f32(uint8_t b) {
    uint16_t h = (uint16_t)(((b & 0x7fu) << 7) | ((b & 0x80u) << 8));
    return f16_to_f32(h) * 256.0f;
}

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
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = VZERO();
    const int64_t step = W->kind == 2 ? W->bk : K;
    /* fp8 rows are short (K bytes): prefetch the same place in the next row block, once per
     * cache line (on a 768-wide layer 1.5x the bandwidth of `PREFETCH`, 512 bytes ahead). */
    const int64_t ahead = (int64_t)TW_FP8_AHEAD * R * K;
    const float *srow = W->kind == 2 ? W->scale + (n / W->bn) * W->scols : NULL;
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        int64_t k1 = k0 + step < K ? k0 + step : K;
        vf s = VSET1(srow ? srow[k0 / W->bk] * 256.0f : 256.0f);
        for (int64_t k = k0; k < k1; k += FP8_W) {
            vf w[4];
            for (int r = 0; r < R; r++) {
                const uint8_t *p = W->w + (n + r) * K + k;
                if (!(k & 63)) __builtin_prefetch(p + ahead, 0, 3);
                w[r] = load_w8(p);
            }
            for (int m = 0; m < M; m++) {
                vf xv = VMUL(VLOAD(x + m * K + k), s);
                for (int r = 0; r < R; r++) acc[r][m] = VFMA(w[r], xv, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float rs = W->kind == 0 ? W->scale[0] : W->kind == 1 ? W->scale[n + r] : 1.0f;
        for (int m = 0; m < M; m++) t[r * M + m] = VSUM(acc[r][m]) * rs;
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
                sum += fp8_to_f32(W->w[(n + r) * W->K + k]) * s * x[m * W->K + k];
            }
            t[r * M + m] = sum;
        }
}
#define R_FOR(M) 1
#endif

#define ROWS(RR, MM)                                                                       \
    do {                                                                                   \
        float t[4 * MAX_M];                                                                \
        int64_t n = n0;                                                                    \
        for (; n + (RR) <= n1; n += (RR)) {                                                \
            block_fp8(W, n, xf, t, (RR), (MM));                                            \
            store(t, (RR), (MM), n, W->N, bias, y, ybf16);                                 \
        }                                                                                  \
        for (; n < n1; n++) {                                                              \
            block_fp8(W, n, xf, t, 1, (MM));                                               \
            store(t, 1, (MM), n, W->N, bias, y, ybf16);                                    \
        }                                                                                  \
    } while (0)

static void run_rows(const fp8w *W, const float *xf, int M, int64_t n0, int64_t n1,
                     const void *bias, void *y, int ybf16) {
    switch (M) {
    case 1: ROWS(R_FOR(1), 1); break;
    case 2: ROWS(R_FOR(2), 2); break;
    case 3: ROWS(R_FOR(3), 3); break;
    case 4: ROWS(R_FOR(4), 4); break;
    case 5: ROWS(R_FOR(5), 5); break;
    case 6: ROWS(R_FOR(6), 6); break;
    case 7: ROWS(R_FOR(7), 7); break;
    default: ROWS(R_FOR(8), 8); break;
    }
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
#ifdef _OPENMP
    if (num_threads > 1 && N >= 32) {
#pragma omp parallel num_threads(num_threads)
        {
            int tid = omp_get_thread_num(), nth = omp_get_num_threads();
            int64_t per = (N + nth - 1) / nth;
            per = (per + align - 1) / align * align;
            int64_t n0 = tid * per, n1 = n0 + per < N ? n0 + per : N;
            if (n0 < n1) run_rows(&W, xf, (int)M, n0, n1, bias, y, bf16);
        }
        free(widened);
        return 0;
    }
#endif
    (void)num_threads;
    (void)align;
    run_rows(&W, xf, (int)M, 0, N, bias, y, bf16);
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
            vf s8 = VSET1(s * 256.0f);
            for (int j = 0; j < 16; j += FP8_W)
                VSTORE(v + j, VMUL(load_w8(w + n * K + k + j), s8));
#else
            for (int j = 0; j < 16; j++) v[j] = fp8_to_f32(w[n * K + k + j]) * s;
#endif
            if (bf16)
                bf16_row16(v, (uint16_t *)out + n * K + k);
            else
                memcpy((float *)out + n * K + k, v, sizeof v);
        }
    }
    return 0;
}

/* `tw_fp8_gemv` with its arguments as one int64 array, the one signature a replayed CPU graph
 * calls kernels through (tokenwise/compilation/cpu_graph.py, tokenwise/native/graph.c). */
int tw_fp8_gemv_packed(const int64_t *a) {
    return tw_fp8_gemv((const void *)(intptr_t)a[0], (const uint8_t *)(intptr_t)a[1],
                       (const float *)(intptr_t)a[2], (const void *)(intptr_t)a[3],
                       (void *)(intptr_t)a[4], a[5], a[6], a[7], (int)a[8], a[9], a[10],
                       (int)a[11], (int)a[12]);
}
