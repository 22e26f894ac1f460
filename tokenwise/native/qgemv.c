/* y = x @ dequant(Q)^T for group-quantized weights (int8 or int4, weight-only), streaming Q once.
 *
 * Weights: N rows of K values, in groups of G consecutive values of a row, each group with a
 * scale s and (optionally) an offset o, both float16 or both float32 (`sf32`): w = q * s + o. Without offsets, int8 is
 * symmetric (o = 0) and int4 is centred on 8 (o = -8 s), as GGUF's Q8_0 and Q4_0 are.
 *   int8: q is int8 [N, K]; G a multiple of 16.
 *   int4: q is uint8 [N, K / 2]; each 32 values of a row are 16 bytes, byte j holding value j in
 *         its low nibble and value j + 16 in its high one (GGUF's Q4_0 order); G a multiple of 32.
 *   scales, offsets: float16 or float32 [N, K / G].
 * x is [M, K] float32 or bfloat16 (M <= QMAX_ROWS; above MAX_M in tiles of rows, `run_tiles`),
 * widened to float32 once; y is [M, N] of x's dtype.
 *
 * Decode is bound by reading the weights: each group is loaded once and multiplied into all M
 * rows of x, R weight rows at a time; rows are split over OpenMP threads in contiguous ranges,
 * as in gemv.c. float32 x: each weight is widened to float32 in registers (w = q * s + o,
 * one fused multiply-add), exact; or, when the caller asks (`xbits` 8), x quantized to int8 as
 * bf16 x is. bf16 x: the integer paths of qgemv_x8.h (int8 x, default) and qgemv_x16.h, fewer
 * instructions per weight. `tw_qdequant` writes the dense weights, for the larger row counts of prefill.
 */
#include "qgemv.h"
#include "qgemv_x16.h"
#include "qgemv_x8.h"

int tw_qgemv_isa(void) { return tw_vector_isa(); }

#if defined(TW_AVX512) || defined(TW_AVX2)
/* TW_VW int8 / uint8 values at p widened to int32 lanes. */
#if defined(TW_AVX512)
#define LOAD_I8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#else
#define LOAD_I8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define LOAD_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#endif

/* float32 x: each weight widened to float32 in registers (w = q * s + o), TW_VW at a time. */
INLINE void qblock(const qctx *c, int64_t n, float *t, const int R, const int M) {
    const uint8_t *q = c->q + n * (c->bits == 8 ? c->K : c->K / 2);
    const void *sc = c->sc, *of = c->of;
    const int bits = c->bits, sf32 = c->sf32;
    const float *x = c->xf;
    const int64_t K = c->K, G = c->G;
    tw_vf acc[4][MAX_M];
    TW_FOR_RM(acc[r][m] = TW_V(setzero_ps)());
    const int64_t ng = K / G, row_bytes = bits == 8 ? K : K / 2;
    const tw_vi low4 = TW_V(set1_epi32)(15);
    for (int64_t g = 0; g < ng; g++) {
        tw_vf s[4], o[4];
        for (int r = 0; r < R; r++) {
            float sv, ov;
            group_params(sc, of, n + r, ng, g, bits, sf32, &sv, &ov);
            s[r] = TW_V(set1_ps)(sv);
            o[r] = TW_V(set1_ps)(ov);
        }
        if (bits == 8) {
            for (int64_t k = g * G; k < (g + 1) * G; k += TW_VW) {
                tw_vf w[4];
                for (int r = 0; r < R; r++) {
                    const uint8_t *p = q + r * row_bytes + k;
                    if (!(k & 63)) PREFETCH(p);
                    w[r] = TW_V(fmadd_ps)(TW_V(cvtepi32_ps)(LOAD_I8(p)), s[r], o[r]);
                }
                for (int m = 0; m < M; m++) {
                    tw_vf xv = TW_V(loadu_ps)(x + m * K + k);
                    for (int r = 0; r < R; r++) acc[r][m] = TW_V(fmadd_ps)(w[r], xv, acc[r][m]);
                }
            }
            continue;
        }
        /* int4: 32 values (16 bytes) a step, in parts of TW_VW bytes: byte j of a part holds
         * value j of it (low nibble) and value 16 + j (high). */
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            for (int part = 0; part < 16 / TW_VW; part++) {
                tw_vf lo[4], hi[4];
                for (int r = 0; r < R; r++) {
                    const uint8_t *p = q + r * row_bytes + k / 2 + TW_VW * part;
                    if (!(k & 127) && !part) PREFETCH(p);
                    const tw_vi v = LOAD_U8(p);
                    lo[r] = TW_V(fmadd_ps)(TW_V(cvtepi32_ps)(TW_VI_AND(v, low4)), s[r], o[r]);
                    hi[r] = TW_V(fmadd_ps)(TW_V(cvtepi32_ps)(TW_V(srli_epi32)(v, 4)), s[r], o[r]);
                }
                for (int m = 0; m < M; m++) {
                    tw_vf xl = TW_V(loadu_ps)(x + m * K + k + TW_VW * part);
                    tw_vf xh = TW_V(loadu_ps)(x + m * K + k + 16 + TW_VW * part);
                    for (int r = 0; r < R; r++) {
                        acc[r][m] = TW_V(fmadd_ps)(lo[r], xl, acc[r][m]);
                        acc[r][m] = TW_V(fmadd_ps)(hi[r], xh, acc[r][m]);
                    }
                }
            }
        }
    }
    TW_FOR_RM(t[r * M + m] = TW_VSUM(acc[r][m]));
}
#endif

#if !defined(TW_AVX512) && !defined(TW_AVX2)
static void qblock_scalar(const qctx *c, int64_t n, float *t, int R, int M) {
    const uint8_t *q = c->q + n * (c->bits == 8 ? c->K : c->K / 2);
    const void *sc = c->sc, *of = c->of;
    const int bits = c->bits, sf32 = c->sf32;
    const float *x = c->xf;
    const int64_t K = c->K, G = c->G;
    const int64_t row_bytes = bits == 8 ? K : K / 2;
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                float s, o;
                group_params(sc, of, n + r, K / G, k / G, bits, sf32, &s, &o);
                acc += ((float)qint(q + r * row_bytes, bits, k) * s + o) * x[m * K + k];
            }
            t[r * M + m] = acc;
        }
}
#endif

#define SWITCH_M(BLOCK, R_FOR_M)                                                           \
    TW_SWITCH_M(Mr, BLOCK(c, n, t, R, M), R_FOR_M, c->N, c->bias, c->y, c->ybf16)

#if defined(TW_AVX512)
#define QR_FOR(M) ((M) <= 2 ? 4 : 2)
#define QR8_FOR QR_FOR
#elif defined(TW_AVX2)
#define QR_FOR(M) ((M) <= 1 ? 4 : (M) <= 2 ? 2 : 1)
/* int8 weights on AVX2: one row at a time (1.3-1.5x faster than 4 at M <= 2, measured
 * 2026-11-28: the widened weights of 4 rows and their scales do not fit 16 registers). */
#define QR8_FOR(M) 1
#else
#define qblock qblock_scalar
#define QR_FOR(M) 1
#define QR8_FOR QR_FOR
#endif
/* The integer path keeps R * M int32 and R * M float accumulators live. */
#define X16R_FOR(M) ((M) <= 2 ? 4 : (M) <= 4 ? 2 : 1)
/* The int8-activation path on AVX2 takes one weight row at a time at every M: with 16 vector
 * registers, more rows spill the per-block scales and accumulators to the stack, and each
 * block's few integer instructions then wait on memory (measured 2.4x slower at M = 1 with 4
 * rows, benchmarks/RESULTS.md, 2026-11-28). AVX-512's 32 registers hold the wider blocks. */
#if defined(TW_AVX512)
#define X8R_FOR X16R_FOR
#else
#define X8R_FOR(M) 1
#endif

static void run_rows(const qctx *c, int64_t n0, int64_t n1, int Mr) {
#if defined(TW_AVX512) || defined(TW_AVX2)
    if (c->xq8) {
        if (c->bits == 8)
            SWITCH_M(q8x8_block, X8R_FOR)
        else
            SWITCH_M(q4x8_block, X8R_FOR)
        return;
    }
    if (c->xq) {
        if (c->bits == 8) {
            SWITCH_M(q8x16_block, X16R_FOR)
#if defined(TW_AVX512)
        } else if (q4_wide(c->K, c->G)) {
            SWITCH_M(q4x16_block512, X16R_FOR)
#endif
        } else {
            SWITCH_M(q4x16_block256, X16R_FOR)
        }
        return;
    }
#endif
    if (c->bits == 8)
        SWITCH_M(qblock, QR8_FOR)
    else
        SWITCH_M(qblock, QR_FOR)
}

/* More than MAX_M rows of x (decode batches of 8-64 sequences): the rows of x go in tiles of
 * at most TW_QTILE_M, each tile a context of its own (`tile_of`), and the weight rows in blocks
 * of about TW_QBLOCK_BYTES; each block is read from memory once and then, from the cache,
 * against every tile (x, quantized once for all rows, stays in L2). Running the 8-row kernel
 * once per 8 rows instead reads all weights again per call; dequantizing them for torch's
 * matmul writes and reads 4 bytes per weight (at 48 rows of the Qwen3-0.6B shape's layers on
 * AVX2, one thread: int4 2.4-3.1x, int8 1.05-1.3x slower than these tiles). Tiles of 8 rows
 * measured 1.0-1.2x faster than tiles of 4 there. */
#ifndef TW_QTILE_M
#define TW_QTILE_M 8
#endif
#ifndef TW_QBLOCK_BYTES
#define TW_QBLOCK_BYTES 16384
#endif

/* Rows m0.. of x (and of y) as a context of their own. */
static qctx tile_of(const qctx *c, int64_t m0) {
    qctx t = *c;
    const int64_t K = c->K;
    t.xf = c->xf + m0 * K;
#if defined(TW_AVX512) || defined(TW_AVX2)
    if (c->xq8) {
        const int64_t nb = K / X8_BLOCK;
        t.xq8 = c->xq8 + m0 * K;
        t.xcorr = c->xcorr + m0 * K / (c->bits == 8 ? 4 : 8);
        t.xs = c->xs + m0 * nb;
        t.xsum = c->xsum + m0 * nb;
    } else if (c->xq) {
        t.xq = c->xq + m0 * K;
        t.xs = c->xs + m0 * c->ng;
        t.xsum = c->xsum + m0 * c->ng;
    }
#endif
    t.y = (char *)c->y + m0 * c->N * (c->ybf16 ? 2 : 4);
    return t;
}

/* One thread's share [n0, n1) of the weight rows for M > MAX_M rows of x (M <= QMAX_ROWS). */
static void run_tiles(const qctx *c, int64_t n0, int64_t n1, int64_t M) {
    qctx tiles[QMAX_ROWS / TW_QTILE_M + 1];
    int rows[QMAX_ROWS / TW_QTILE_M + 1], count = 0;
    for (int64_t m0 = 0; m0 < M; m0 += TW_QTILE_M, count++) {
        tiles[count] = tile_of(c, m0);
        rows[count] = (int)(M - m0 < TW_QTILE_M ? M - m0 : TW_QTILE_M);
    }
    const int64_t row_bytes = c->bits == 8 ? c->K : c->K / 2;
    int64_t block = TW_QBLOCK_BYTES / row_bytes;
    block = block < 4 ? 4 : block / 4 * 4;
    for (int64_t n = n0; n < n1; n += block) {
        const int64_t end = n + block < n1 ? n + block : n1;
        for (int i = 0; i < count; i++) run_rows(&tiles[i], n, end, rows[i]);
    }
}

static int check_shape(int64_t N, int64_t K, int bits, int64_t G) {
    if (N < 1 || K < 1 || G < 1 || K % G) return -1;
    if (bits == 8) return G % 16 ? -1 : 0;
    if (bits == 4) return G % 32 ? -1 : 0;
    return -1;
}

/* y[M, N] = x[M, K] @ dequant(q)^T (+ bias[N]); x, bias and y of one dtype (bf16 when `xbf16`).
 * x takes an integer path where the groups allow it: as int8 per 32 values when `xbits` is 8
 * (qgemv_x8.h; float32 x too, as llama.cpp does: the caller asks for it only when the user
 * did), else bf16 x as int16 per group when `xbits` is 16 (qgemv_x16.h); otherwise the exact
 * float path.
 * Returns 0; -1 for bad sizes; -2 when a copy of x cannot be allocated. */
int tw_qgemv(const void *x, const uint8_t *q, const void *sc, const void *of,
             const void *bias, void *y, int64_t M, int64_t N, int64_t K, int bits, int64_t G,
             int sf32, int xbf16, int xbits, int num_threads) {
    if (M < 1 || M > QMAX_ROWS || check_shape(N, K, bits, G)) return -1;
    float *widened;
    const float *xf = x_as_f32(x, M * K, xbf16, &widened);
    if (!xf) return -2;
    qctx c = {q, sc, of, bits, sf32, K, G, N, xf, NULL, NULL, NULL, NULL, NULL, bias, y, xbf16,
              K / G, -1};
    void *x16 = NULL;
#if defined(TW_AVX512) || defined(TW_AVX2)
    if (xbits == 8 && x8_fits(bits, K, G)) {
        const int64_t nb = K / X8_BLOCK;
        /* int8 x, then (4-byte aligned: M * K is a multiple of 64) the lanes' corrections and
         * the blocks' scales and scaled sums */
        x16 = malloc((size_t)(M * K) + (size_t)(M * K / 4) * sizeof(int32_t) +
                     (size_t)(2 * M * nb) * sizeof(float));
        if (!x16) {
            free(widened);
            return -2;
        }
        int32_t *corr = (int32_t *)((int8_t *)x16 + M * K);
        float *xs = (float *)(corr + M * K / 4);
        quantize_x8(xf, M, K, bits, of != NULL, (int8_t *)x16, xs, xs + M * nb, corr);
        c.xq8 = (const int8_t *)x16;
        c.xcorr = corr;
        c.xs = xs;
        c.xsum = xs + M * nb;
        x8_setup(&c);
    } else if (xbf16 && G % 32 == 0 && G <= X16_MAX_GROUP) {
        const int64_t ng = K / G;
        x16 = malloc((size_t)(M * K) * sizeof(int16_t) + (size_t)(2 * M * ng) * sizeof(float));
        if (!x16) {
            free(widened);
            return -2;
        }
        float *xs = (float *)((int16_t *)x16 + M * K);
        quantize_x16(xf, M, K, G, (int16_t *)x16, xs, xs + M * ng);
#if defined(TW_AVX512)
        if (bits == 4 && q4_wide(K, G)) x4_order((int16_t *)x16, M * K);
#endif
        c.xq = (const int16_t *)x16;
        c.xs = xs;
        c.xsum = xs + M * ng;
    }
#endif
    if (M > MAX_M)
        TW_PARALLEL_ROWS(N, 16, run_tiles(&c, n0, n1, M));
    else
        TW_PARALLEL_ROWS(N, 16, run_rows(&c, n0, n1, (int)M));
    free(x16);
    free(widened);
    return 0;
}

/* Row `row` of dequant(q) into `out` (K values, float32 or rounded bf16). */
static void dequant_row(const uint8_t *q, const void *sc, const void *of, int64_t row,
                        void *out, int64_t K, int bits, int64_t G, int sf32, int out_bf16) {
    const int64_t row_bytes = bits == 8 ? K : K / 2, ng = K / G;
    const uint8_t *qrow = q + row * row_bytes;
    for (int64_t g = 0; g < ng; g++) {
        float s, o;
        group_params(sc, of, row, ng, g, bits, sf32, &s, &o);
        for (int64_t k = g * G; k < (g + 1) * G; k++) {
            float v = (float)qint(qrow, bits, k) * s + o;
            if (out_bf16)
                ((uint16_t *)out)[k] = f32_to_bf16(v);
            else
                ((float *)out)[k] = v;
        }
    }
}

/* out[N, K] = dequant(q) as float32, or bfloat16 (rounded to nearest even) when `out_bf16`. */
int tw_qdequant(const uint8_t *q, const void *sc, const void *of, void *out, int64_t N,
                int64_t K, int bits, int64_t G, int sf32, int out_bf16, int num_threads) {
    if (check_shape(N, K, bits, G)) return -1;
    const size_t out_row = (size_t)K * (out_bf16 ? 2 : 4);
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++)
        dequant_row(q, sc, of, n, (char *)out + n * out_row, K, bits, G, sf32, out_bf16);
    return 0;
}

/* Rows `ids[0:n]` of dequant(q) (an embedding lookup), as `tw_qdequant` writes them. */
int tw_qrows(const uint8_t *q, const void *sc, const void *of, const int64_t *ids, int64_t n,
             void *out, int64_t K, int bits, int64_t G, int sf32, int out_bf16) {
    if (check_shape(1, K, bits, G)) return -1;
    const size_t out_row = (size_t)K * (out_bf16 ? 2 : 4);
    for (int64_t t = 0; t < n; t++)
        dequant_row(q, sc, of, ids[t], (char *)out + t * out_row, K, bits, G, sf32, out_bf16);
    return 0;
}

/* The packed entries (common.h). */
int tw_qgemv_packed(const int64_t *a) {
    return tw_qgemv(TW_PTR(0), TW_PTR(1), TW_PTR(2), TW_PTR(3), TW_PTR(4), TW_PTR(5), a[6], a[7],
                    a[8], (int)a[9], a[10], (int)a[11], (int)a[12], (int)a[13], (int)a[14]);
}

int tw_qrows_packed(const int64_t *a) {
    return tw_qrows(TW_PTR(0), TW_PTR(1), TW_PTR(2), TW_PTR(3), a[4], TW_PTR(5), a[6], (int)a[7],
                    a[8], (int)a[9], (int)a[10]);
}
