/* The glue of a gated full-attention layer (Qwen3.5, Qwen3-Next) at decode size, in C.
 *
 * Around its projections and the attention kernel, such a layer runs per token: a
 * zero-centred RMSNorm of every q and k head (scale 1 + weight), RoPE over the first `rot`
 * channels of each head only (partial rotary), the attention output scaled by
 * sigmoid(gate) (the gate rows sit beside q's in `q_proj`'s output) and two residual adds.
 * In torch that is some forty ops (slices, copies, cats), each a few microseconds at one
 * token, and none of them can be recorded into a CPU graph (tokenwise/compilation/cpu_graph.py):
 * these kernels make the layer replayable and the eager step cheaper.
 *
 * Rounding follows the torch code they stand for: a bf16 norm output is rounded once after the
 * float32 scale (GemmaRMSNorm), RoPE's products and sums each rounded (as fused.c's rope),
 * sigmoid(gate) rounded before the product. The norm's sum of squares is a plain float32 sum,
 * not ATen's cascade: float32 results may differ from torch's by an ulp.
 *
 * Every kernel has a `_packed` entry (common.h) for the CPU graph's replay.
 */
#include "common.h"

static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float rnd(float f, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline void st(void *p, int64_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* One head of d values at src: zero-centred RMSNorm (rounded to the dtype), then neox RoPE
 * over its first `rot` channels with the rounded cos / sin `c`, `s`, into dst. */
static void norm_rope_head(const void *src, int64_t at, const void *w, float eps, int64_t d,
                           int64_t rot, const float *c, const float *s, void *dst,
                           int64_t out_at, int bf16) {
    float x[d];
    float ss = 0.0f;
    for (int64_t j = 0; j < d; j++) {
        x[j] = ld(src, at + j, bf16);
        ss += x[j] * x[j];
    }
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t j = 0; j < d; j++) x[j] = rnd(x[j] * inv * (1.0f + ld(w, j, bf16)), bf16);
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[half + i];
        const float a = rnd(x1 * c[i], bf16), b = rnd(x2 * s[i], bf16);
        const float e = rnd(x2 * c[i], bf16), f = rnd(x1 * s[i], bf16);
        st(dst, out_at + i, a - b, bf16);
        st(dst, out_at + half + i, e + f, bf16);
    }
    for (int64_t j = rot; j < d; j++) st(dst, out_at + j, x[j], bf16);
}

/* q and k of `tokens` tokens from the fused projection `qkv` (row stride `stride`: per q head
 * its d q values then its d gate values, then the k heads) normed and rotated at `positions`
 * (`cos_sin`: float32 [cos | sin] rows of `rot`) into contiguous `q_out` [tokens, heads d] and
 * `k_out` [tokens, kv_heads d]. Returns -1 for sizes it refuses. */
int tw_gated_qk(const void *qkv, int64_t stride, const int64_t *positions, const float *cos_sin,
                const void *q_w, const void *k_w, float eps, int64_t tokens, int64_t heads,
                int64_t kv_heads, int64_t d, int64_t rot, void *q_out, void *k_out,
                int64_t bf16) {
    if (d < 1 || d > 4096 || rot < 0 || rot > d || rot % 2) return -1;
    const int b = bf16 != 0;
    float c[2048], s[2048];
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = cos_sin + positions[t] * rot;
        for (int64_t i = 0; i < rot / 2; i++) {
            c[i] = rnd(row[i], b);
            s[i] = rnd(row[rot / 2 + i], b);
        }
        for (int64_t h = 0; h < heads; h++)
            norm_rope_head(qkv, t * stride + h * 2 * d, q_w, eps, d, rot, c, s, q_out,
                           (t * heads + h) * d, b);
        for (int64_t h = 0; h < kv_heads; h++)
            norm_rope_head(qkv, t * stride + heads * 2 * d + h * d, k_w, eps, d, rot, c, s,
                           k_out, (t * kv_heads + h) * d, b);
    }
    return 0;
}

/* out[t, h d + j] = attn[t, h d + j] * sigmoid(gate of head h, channel j of token t's row of
 * `qkv`), `attn` contiguous [tokens, heads d]. */
int tw_sigmoid_gate(const void *attn, const void *qkv, int64_t stride, int64_t tokens,
                    int64_t heads, int64_t d, void *out, int64_t bf16) {
    const int b = bf16 != 0;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t j = 0; j < d; j++) {
                const float g = ld(qkv, t * stride + h * 2 * d + d + j, b);
                const float sg = rnd(1.0f / (1.0f + expf(-g)), b);
                const int64_t at = (t * heads + h) * d + j;
                st(out, at, ld(attn, at, b) * sg, b);
            }
    return 0;
}

/* out = a + b over n values (the residual adds). */
int tw_add(const void *a, const void *b, void *out, int64_t n, int64_t bf16) {
    const int h = bf16 != 0;
    if (h) {
        for (int64_t i = 0; i < n; i++) st(out, i, ld(a, i, 1) + ld(b, i, 1), 1);
    } else {
        const float *x = a, *y = b;
        float *o = out;
        for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i];
    }
    return 0;
}

int tw_gated_qk_packed(const int64_t *a) {
    return tw_gated_qk(TW_PTR(0), a[1], TW_PTR(2), TW_PTR(3), TW_PTR(4), TW_PTR(5),
                       tw_f32_arg(a[6]), a[7], a[8], a[9], a[10], a[11], TW_PTR(12), TW_PTR(13),
                       a[14]);
}

int tw_sigmoid_gate_packed(const int64_t *a) {
    return tw_sigmoid_gate(TW_PTR(0), TW_PTR(1), a[2], a[3], a[4], a[5], TW_PTR(6), a[7]);
}

int tw_add_packed(const int64_t *a) { return tw_add(TW_PTR(0), TW_PTR(1), TW_PTR(2), a[3], a[4]); }
