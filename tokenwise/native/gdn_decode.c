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
        for (int64_t e = 0; e < numel; e++) S[e] = bf16_to_f32(S16[e]);
        const int64_t kh = i * nk + h / ratio;
        head_update(S, q + kh * dk, k + kh * dk, v + p * dv, g[p], beta[p], out + p * dv, dk,
                    dv);
        for (int64_t e = 0; e < numel; e++) S16[e] = f32_to_bf16(S[e]);
    }
    return 0;
}
