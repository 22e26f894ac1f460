/* One decode token of the gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) for every
 * value head of a batch of state slots, updating each state in place.
 *
 * Per head the state S is dk rows of dv floats. The token decays it by exp(g), recalls
 * r = S^T k, writes delta = beta (v - exp(g) r) under k (S = exp(g) S + k delta^T) and reads
 * o = S^T q. Decode is bound by memory: every byte of the state is read and written once per
 * token, so the kernel makes two passes over a head's rows (the recall, then update and
 * read-out fused), the second hitting the cache the first filled (a head of 128 x 128 floats
 * is 64 KiB).
 *
 * Layout: the layer's cache is one row of `row_stride` floats per slot; a slot's delta-rule
 * state starts `state_offset` floats into its row (the conv state comes first), heads one after
 * the other. q and k have `nk` heads (value head h reads key head h / (nv / nk)), already
 * L2-normalised and q scaled; q, k, v, g, beta, out are contiguous float32.
 *
 * `gdn_decode_bf16` is the same step over a bf16 cache (a model run in bf16 keeps its states
 * in bf16, as vLLM's mamba_ssm_cache_dtype "auto" does): each head is widened into a float32
 * scratch (exact), updated there and rounded back to nearest even, so the result is what the
 * float32 step followed by torch's `.to(torch.bfloat16)` gives, while half the bytes move.
 */
#include "common.h"

#if defined(TW_VW)
#define GDN_VEC 1
#endif

/* ---- bf16 state rows, TW_VW values at a time ----
 * Widening is exact (a bf16 is the top half of a float32: zero-extend, shift left 16).
 * Narrowing rounds to nearest even with integer operations, as common.h's scalar
 * `f32_to_bf16` does (NaN kept quiet). Not AVX-512 BF16's VCVTNEPS2BF16: it treats input
 * denormals as zero whatever MXCSR says, so a state decayed into the denormal range would
 * round differently from torch's `.to(torch.bfloat16)`. */
#if defined(TW_AVX512)
#define GDN_AS_INT _mm512_castps_si512
#define GDN_AS_FLOAT _mm512_castsi512_ps
#define GDN_OR _mm512_or_si512
/* TW_VW bf16 values zero-extended to 32-bit lanes, and 32-bit lanes (each below 2^16) back. */
INLINE tw_vi gdn_load_u16(const uint16_t *p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
}
INLINE void gdn_store_u16(uint16_t *p, tw_vi r) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
INLINE tw_vi gdn_where_nan(tw_vf x, tw_vi nan, tw_vi other) {
    return _mm512_mask_mov_epi32(other, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
}
#elif defined(TW_AVX2)
#define GDN_AS_INT _mm256_castps_si256
#define GDN_AS_FLOAT _mm256_castsi256_ps
#define GDN_OR _mm256_or_si256
INLINE tw_vi gdn_load_u16(const uint16_t *p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
}
INLINE void gdn_store_u16(uint16_t *p, tw_vi r) {
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
INLINE tw_vi gdn_where_nan(tw_vf x, tw_vi nan, tw_vi other) {
    return _mm256_blendv_epi8(other, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
#endif

#ifdef GDN_VEC
INLINE tw_vf bf16_load_v(const uint16_t *p) {
    return GDN_AS_FLOAT(TW_V(slli_epi32)(gdn_load_u16(p), 16));
}

/* common.h's `f32_to_bf16`, a vector at a time. */
INLINE void bf16_store_v(uint16_t *p, tw_vf x) {
    const tw_vi u = GDN_AS_INT(x), hi = TW_V(srli_epi32)(u, 16);
    const tw_vi odd = TW_VI_AND(hi, TW_V(set1_epi32)(1));
    const tw_vi up = TW_V(add_epi32)(TW_V(add_epi32)(u, TW_V(set1_epi32)(0x7fff)), odd);
    const tw_vi quiet = GDN_OR(hi, TW_V(set1_epi32)(0x40));
    gdn_store_u16(p, gdn_where_nan(x, quiet, TW_V(srli_epi32)(up, 16)));
}
#endif

static void head_update(float *S, const float *q, const float *k, const float *v, float g,
                        float beta, float *out, int64_t dk, int64_t dv) {
    const float decay = tw_exp(g);
    float delta[dv];
    for (int64_t j = 0; j < dv; j++) delta[j] = 0.0f;
    /* Pass 1: the recall r = S^T k (into delta). */
    for (int64_t i = 0; i < dk; i++) {
        const float *row = S + i * dv;
        const float ki = k[i];
        int64_t j = 0;
#ifdef GDN_VEC
        const tw_vf kv = TW_V(set1_ps)(ki);
        for (; j + TW_VW <= dv; j += TW_VW)
            TW_V(storeu_ps)(delta + j, TW_V(fmadd_ps)(TW_V(loadu_ps)(row + j), kv,
                                                      TW_V(loadu_ps)(delta + j)));
#endif
        for (; j < dv; j++) delta[j] += row[j] * ki;
    }
    for (int64_t j = 0; j < dv; j++) {
        delta[j] = (v[j] - decay * delta[j]) * beta;
        out[j] = 0.0f;
    }
    /* Pass 2: S = decay S + k delta^T, and o = S^T q, row by row. */
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i], qi = q[i];
        int64_t j = 0;
#ifdef GDN_VEC
        const tw_vf dec = TW_V(set1_ps)(decay), kv = TW_V(set1_ps)(ki), qv = TW_V(set1_ps)(qi);
        for (; j + TW_VW <= dv; j += TW_VW) {
            const tw_vf s = TW_V(fmadd_ps)(TW_V(loadu_ps)(row + j), dec,
                                           TW_V(mul_ps)(kv, TW_V(loadu_ps)(delta + j)));
            TW_V(storeu_ps)(row + j, s);
            TW_V(storeu_ps)(out + j, TW_V(fmadd_ps)(s, qv, TW_V(loadu_ps)(out + j)));
        }
#endif
        for (; j < dv; j++) {
            const float s = row[j] * decay + ki * delta[j];
            row[j] = s;
            out[j] += s * qi;
        }
    }
}

/* `head_update` over a bf16 head `S16` (NULL: a zero state, left unwritten, for padding rows),
 * the conversions folded into its two passes: pass 1 widens each row into the float32 scratch
 * `S` while it recalls, pass 2 rounds each updated row straight back. So the bf16 bytes are
 * read once and written once, and the float32 copy (64 KiB for a 128 x 128 head) stays in
 * cache between the passes. Results equal widening the head, `head_update`, then rounding. */
static void head_update_bf16(uint16_t *S16, float *S, const float *q, const float *k,
                             const float *v, float g, float beta, float *out, int64_t dk,
                             int64_t dv) {
    const float decay = tw_exp(g);
    float delta[dv];
    for (int64_t j = 0; j < dv; j++) delta[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const uint16_t *src = S16 ? S16 + i * dv : NULL;
        const float ki = k[i];
        int64_t j = 0;
#ifdef GDN_VEC
        const tw_vf kv = TW_V(set1_ps)(ki);
        for (; j + TW_VW <= dv; j += TW_VW) {
            const tw_vf s = src ? bf16_load_v(src + j) : TW_V(setzero_ps)();
            TW_V(storeu_ps)(row + j, s);
            TW_V(storeu_ps)(delta + j, TW_V(fmadd_ps)(s, kv, TW_V(loadu_ps)(delta + j)));
        }
#endif
        for (; j < dv; j++) {
            row[j] = src ? bf16_to_f32(src[j]) : 0.0f;
            delta[j] += row[j] * ki;
        }
    }
    for (int64_t j = 0; j < dv; j++) {
        delta[j] = (v[j] - decay * delta[j]) * beta;
        out[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        const float *row = S + i * dv;
        uint16_t *dst = S16 ? S16 + i * dv : NULL;
        const float ki = k[i], qi = q[i];
        int64_t j = 0;
#ifdef GDN_VEC
        const tw_vf dec = TW_V(set1_ps)(decay), kv = TW_V(set1_ps)(ki), qv = TW_V(set1_ps)(qi);
        for (; j + TW_VW <= dv; j += TW_VW) {
            const tw_vf s = TW_V(fmadd_ps)(TW_V(loadu_ps)(row + j), dec,
                                           TW_V(mul_ps)(kv, TW_V(loadu_ps)(delta + j)));
            if (dst) bf16_store_v(dst + j, s);
            TW_V(storeu_ps)(out + j, TW_V(fmadd_ps)(s, qv, TW_V(loadu_ps)(out + j)));
        }
#endif
        for (; j < dv; j++) {
            const float s = row[j] * decay + ki * delta[j];
            if (dst) dst[j] = f32_to_bf16(s);
            out[j] += s * qi;
        }
    }
}

/* The largest head the bf16 form widens on the stack (256 KiB of float32 scratch). */
#define GDN_MAX_HEAD 65536

/* Returns 0, or -1 for sizes it refuses (nv not a multiple of nk, an empty head). */
int gdn_decode(float *states, int64_t row_stride, int64_t state_offset, const int64_t *slots,
               int64_t n, const float *q, const float *k, const float *v, const float *g,
               const float *beta, float *out, int64_t nk, int64_t nv, int64_t dk, int64_t dv) {
    if (nk < 1 || nv < nk || nv % nk || dk < 1 || dv < 1 || dv > 4096) return -1;
    const int64_t ratio = nv / nk, heads = n * nv;
    /* A thread per (slot, head) pair once there are enough state bytes to share out. */
#pragma omp parallel for schedule(static) if (heads * dk * dv >= 65536)
    for (int64_t p = 0; p < heads; p++) {
        const int64_t i = p / nv, h = p % nv;
        float *S = states + slots[i] * row_stride + state_offset + h * dk * dv;
        const int64_t kh = i * nk + h / ratio;
        head_update(S, q + kh * dk, k + kh * dk, v + p * dv, g[p], beta[p], out + p * dv, dk,
                    dv);
    }
    return 0;
}

int gdn_decode_bf16(uint16_t *states, int64_t row_stride, int64_t state_offset,
                    const int64_t *slots, int64_t n, const float *q, const float *k, const float *v,
                    const float *g, const float *beta, float *out, int64_t nk, int64_t nv,
                    int64_t dk, int64_t dv) {
    if (nk < 1 || nv < nk || nv % nk || dk < 1 || dv < 1 || dv > 4096) return -1;
    if (dk * dv > GDN_MAX_HEAD) return -1;
    const int64_t ratio = nv / nk, heads = n * nv, numel = dk * dv;
#pragma omp parallel for schedule(static) if (heads * numel >= 65536)
    for (int64_t p = 0; p < heads; p++) {
        const int64_t i = p / nv, h = p % nv;
        uint16_t *S16 = states + slots[i] * row_stride + state_offset + h * numel;
        float S[numel];
        const int64_t kh = i * nk + h / ratio;
        head_update_bf16(S16, S, q + kh * dk, k + kh * dk, v + p * dv, g[p], beta[p],
                         out + p * dv, dk, dv);
    }
    return 0;
}

/* ---- the whole decode step of a Gated DeltaNet layer between its two projections ----
 *
 * In eager PyTorch the step between `in_proj` and `out_proj` is some forty small ops per layer
 * (the conv and its state shift, SiLU, two L2 norms, the gates, the delta rule, the gated
 * RMSNorm, each with its dtype casts); at batch 1 their dispatch costs more than their
 * arithmetic. `gdn_decode_step` does all of it in one call for `n` decode tokens:
 *
 *   proj  [*, proj_stride] (row rows[i]): mixed (q, k, v: `channels`), z (nv dv), b (nv), a (nv)
 *   state row of slot slots[i]: the conv state [K - 1, channels], then the delta-rule state
 *   out   [*, nv dv] (row rows[i]): RMSNorm(o_h) * norm_w * silu(z_h) per value head
 *
 * Every tensor is float32, or every one bf16 (`bf16` set: proj, states, conv_w [channels, K],
 * a_log, dt_bias, norm_w and out); the arithmetic is float32 throughout, rounding once where
 * a value is stored. */

INLINE float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

static float l2_scale(const float *x, int64_t d, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
    return scale / sqrtf(ss + 1e-6f);
}

int gdn_decode_step(void *proj, int64_t proj_stride, const int64_t *rows, void *states,
                    int64_t row_stride, int64_t num_slots, const int64_t *slots, int64_t n,
                    const void *conv_w, int64_t taps, const void *a_log, const void *dt_bias,
                    const void *norm_w, float eps, void *out, int64_t nk, int64_t nv, int64_t dk,
                    int64_t dv, int64_t bf16) {
    if (nk < 1 || nv < nk || nv % nk || dk < 1 || dv < 1 || dv > 4096 || taps < 1) return -1;
    if (dk * dv > GDN_MAX_HEAD || n < 0) return -1;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] >= num_slots) return -3;
    const int b16 = bf16 != 0;
    const int64_t kd = nk * dk, channels = 2 * kd + nv * dv, ratio = nv / nk;
    const int64_t conv_numel = (taps - 1) * channels, numel = dk * dv;
    float *x = malloc(sizeof(float) * (size_t)(n * channels + 2 * n * nv + n * nv * dv + 1));
    if (!x) return -2;
    float *g = x + n * channels, *beta = g + n * nv, *o = beta + n * nv;
    /* 1. Per token: the conv over its window (state, then the new input) with SiLU, the state
     *    shifted by one input; q and k L2-normalised (q scaled by dk^-1/2); the gates. A
     *    negative slot (a padding row of a replayed CPU graph) starts from a zero state and
     *    writes nothing back. */
#pragma omp parallel for schedule(static) if (n * channels * taps >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = rows[i], s = slots[i];
        float *xi = x + i * channels;
        for (int64_t c = 0; c < channels; c++) {
            const float in = ld(proj, r * proj_stride + c, b16);
            const int64_t base = s * row_stride + c;
            float acc = in * ld(conv_w, c * taps + taps - 1, b16);
            for (int64_t j = 0; s >= 0 && j < taps - 1; j++) {
                const float prev = ld(states, base + j * channels, b16);
                acc += prev * ld(conv_w, c * taps + j, b16);
                if (j > 0) st(states, base + (j - 1) * channels, prev, b16);
            }
            if (taps > 1 && s >= 0) st(states, base + (taps - 2) * channels, in, b16);
            xi[c] = acc / (1.0f + tw_exp(-acc));
        }
        for (int64_t h = 0; h < nk; h++) {
            float *q = xi + h * dk, *k = xi + kd + h * dk;
            const float qs = l2_scale(q, dk, 1.0f / sqrtf((float)dk)), ks = l2_scale(k, dk, 1.0f);
            for (int64_t e = 0; e < dk; e++) q[e] *= qs, k[e] *= ks;
        }
        const int64_t zb = r * proj_stride + channels + nv * dv;
        for (int64_t h = 0; h < nv; h++) {
            const float bv = ld(proj, zb + h, b16), av = ld(proj, zb + nv + h, b16);
            const float sp = av + ld(dt_bias, h, b16);
            const float soft = sp > 20.0f ? sp : log1pf(expf(sp));
            g[i * nv + h] = -expf(ld(a_log, h, b16)) * soft;
            beta[i * nv + h] = 1.0f / (1.0f + expf(-bv));
        }
    }
    /* 2. Per (token, value head): the delta rule on its state, then the gated RMSNorm. */
    const int64_t heads = n * nv;
#pragma omp parallel for schedule(static) if (heads * numel >= 65536)
    for (int64_t p = 0; p < heads; p++) {
        const int64_t i = p / nv, h = p % nv, r = rows[i];
        const float *xi = x + i * channels;
        const int64_t kh = h / ratio, at = slots[i] * row_stride + conv_numel + h * numel;
        float *oh = o + p * dv;
        const float *q = xi + kh * dk, *k = xi + kd + kh * dk, *v = xi + 2 * kd + h * dv;
        float S[numel];
        if (b16 || slots[i] < 0) {
            uint16_t *S16 = (b16 && slots[i] >= 0) ? (uint16_t *)states + at : NULL;
            head_update_bf16(S16, S, q, k, v, g[p], beta[p], oh, dk, dv);
        } else {
            head_update((float *)states + at, q, k, v, g[p], beta[p], oh, dk, dv);
        }
        float ss = 0.0f;
        for (int64_t j = 0; j < dv; j++) ss += oh[j] * oh[j];
        const float rms = 1.0f / sqrtf(ss / (float)dv + eps);
        const int64_t zr = r * proj_stride + channels + h * dv, orow = r * nv * dv + h * dv;
        for (int64_t j = 0; j < dv; j++) {
            const float z = ld(proj, zr + j, b16);
            st(out, orow + j, oh[j] * rms * ld(norm_w, j, b16) * (z / (1.0f + tw_exp(-z))), b16);
        }
    }
    free(x);
    return 0;
}

/* The `_packed` entry (common.h): a replayed CPU graph's call, the slot and row indices read
 * from the persistent buffers the runner fills before each replay. */
int gdn_decode_step_packed(const int64_t *a) {
    return gdn_decode_step(TW_PTR(0), a[1], TW_PTR(2), TW_PTR(3), a[4], a[5], TW_PTR(6), a[7],
                           TW_PTR(8), a[9], TW_PTR(10), TW_PTR(11), TW_PTR(12),
                           tw_f32_arg(a[13]), TW_PTR(14), a[15], a[16], a[17], a[18], a[19]);
}
