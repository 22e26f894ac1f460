/* Decode-sized RMSNorm (with its residual add) and rotary embedding for CPU, one call each.
 *
 * Why C: at one token per step these ops touch a few kilobytes, and each costs far less than
 * the ten or so torch ops the Python modules spell them with (an RMSNorm with residual: add,
 * cast, pow, mean (sum + div), add, rsqrt, mul, cast, mul; RoPE: gather, two casts, split,
 * four multiplies, add, sub, cat, per tensor). Every op is a few microseconds of dispatch, paid
 * 25 + 12 times per step for a 12-layer model.
 *
 * Results are bit for bit those of the torch ops they replace (tests/layers/test_cpu_fused.py
 * checks it), so greedy tokens do not move:
 * - every operation rounds where torch's does: bf16 values are widened to float32 exactly, each
 *   float32 result of a bf16 op is rounded to bf16 (nearest even), as torch's bf16 kernels do;
 * - no fused multiply-add and no reassociation (built with -ffp-contract=off and none of the
 *   fast-math flags), and 1 / sqrt, not an approximate reciprocal square root;
 * - the sum of squares adds in torch's order for an inner float32 sum (ATen's cascade sum over
 *   8-float vectors, four interleaved accumulators, levels of 16 steps; the vector width of
 *   its reduction kernels on x86), then divides by n, as `mean` does on CPU.
 * The gated activation (`tw_act_mul`) is the exception: its exponential is a polynomial, not
 * torch's, so silu may differ by a float32 ulp and, rarely, its bf16 rounding by one bf16 ulp.
 *
 * Each kernel also has a `_packed` entry taking its arguments as one int64 array (pointers and
 * integers as they are, a float's bits in the low half): a replayed CPU graph
 * (tokenwise/compilation/cpu_graph.py) calls every recorded kernel through that one signature.
 */
#include "common.h"

#define LANES 8
#define ILP 4
#define LEVELS 4

/* A value of the model's dtype as float32, and a float32 result rounded to it. */
static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float round_to(float f, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline void store(void *p, int64_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) ++bits;
    return bits;
}

/* ATen's `multi_row_sum` over `size` steps of ILP interleaved vectors of `lanes` floats
 * (vector v of step i at sq[(i * ILP + k) * lanes]): sums in levels of `step` additions, so
 * that only partial sums of similar size meet. Leaves ILP partial vectors in `acc[0]`. */
static void multi_row_sum(const float *sq, int64_t size, int lanes,
                          float acc[LEVELS][ILP][LANES]) {
    int64_t power = ceil_log2(size) / LEVELS;
    if (power < 4) power = 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    memset(acc, 0, sizeof(float) * LEVELS * ILP * LANES);
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int64_t k = 0; k < ILP; ++k)
                for (int l = 0; l < lanes; ++l) acc[0][k][l] += sq[(i * ILP + k) * lanes + l];
        for (int64_t j = 1; j < LEVELS; ++j) {
            for (int64_t k = 0; k < ILP; ++k)
                for (int l = 0; l < lanes; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int64_t k = 0; k < ILP; ++k)
            for (int l = 0; l < lanes; ++l) acc[0][k][l] += sq[(i * ILP + k) * lanes + l];
    for (int64_t j = 1; j < LEVELS; ++j)
        for (int64_t k = 0; k < ILP; ++k)
            for (int l = 0; l < lanes; ++l) acc[0][k][l] += acc[j][k][l];
}

/* sum(sq[0:n]) in ATen's order (see the top of this file): its vectorised inner sum from one
 * vector of values on, its scalar `row_sum` below that. */
static float cascade_sum(const float *sq, int64_t n) {
    float acc[LEVELS][ILP][LANES];
    const int lanes = n >= LANES ? LANES : 1;
    const int64_t nvec = n / lanes, size = nvec / ILP;
    multi_row_sum(sq, size, lanes, acc);
    float part[LANES];
    memcpy(part, acc[0][0], sizeof part);
    for (int64_t v = size * ILP; v < nvec; ++v) /* vectors left over from the ILP split */
        for (int l = 0; l < lanes; ++l) part[l] += sq[v * lanes + l];
    for (int64_t k = 1; k < ILP; ++k)
        for (int l = 0; l < lanes; ++l) part[l] += acc[0][k][l];
    if (lanes == 1) return part[0];
    float total = 0.0f;
    for (int64_t e = nvec * LANES; e < n; ++e) total += sq[e]; /* the scalar tail first */
    for (int l = 0; l < LANES; ++l) total += part[l];
    return total;
}

/* out = weight * (x / sqrt(mean(x^2) + eps)) over `rows` rows of `n`, with HF's rounding (the
 * normalised row rounded to the model's dtype before the weight multiplies it); with `gemma`,
 * out = (1 + weight) * (x / sqrt(mean(x^2) + eps)) in float32, rounded once (Gemma's norm, which
 * stores weight - 1 and scales before the cast back, as transformers does). With `res`,
 * x is first x + res (rounded), which is also written to `sum_out`. x's rows come in groups of
 * `group_rows` contiguous rows, `group_stride` values apart (per-head q/k norms read a strided
 * view of the fused qkv output: a group is a token's heads); res, out and sum_out are
 * contiguous. Returns 0, or -1 when scratch memory could not be allocated. */
int tw_rms_norm(const void *x, const void *res, const void *weight, void *out, void *sum_out,
                int64_t rows, int64_t n, float eps, int bf16, int64_t group_rows,
                int64_t group_stride, int gemma) {
    /* Two float rows of scratch: on the stack up to 2048 values (callers may be threads with
     * small stacks), else from the heap. */
    float local[2 * 2048];
    float *h = n <= 2048 ? local : malloc(sizeof(float) * 2 * (size_t)n);
    if (!h) return -1;
    float *sq = h + n;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = r * n, in = (r / group_rows) * group_stride + (r % group_rows) * n;
        for (int64_t i = 0; i < n; ++i) {
            float v = load(x, in + i, bf16);
            if (res) {
                v = round_to(v + load(res, base + i, bf16), bf16);
                store(sum_out, base + i, v, bf16);
            }
            h[i] = v;
            sq[i] = v * v;
        }
        const float mean = cascade_sum(sq, n) / (float)n;
        const float inv = 1.0f / sqrtf(mean + eps);
        if (gemma) {
            for (int64_t i = 0; i < n; ++i)
                store(out, base + i, (h[i] * inv) * (1.0f + load(weight, i, bf16)), bf16);
            continue;
        }
        for (int64_t i = 0; i < n; ++i) {
            const float normed = round_to(h[i] * inv, bf16);
            store(out, base + i, load(weight, i, bf16) * normed, bf16);
        }
    }
    if (h != local) free(h);
    return 0;
}

/* Neox-style rotary embedding of one tensor's `heads` heads of `head_dim` per token, from x
 * (token rows `x_stride` values apart) into contiguous `out`: with (x1, x2) the halves of a
 * head and c, s the token's cos and sin (rounded to the model's dtype first, as HF casts
 * them), out = (x1 c - x2 s, x2 c + x1 s), each product and sum rounded as a torch op of that
 * dtype rounds it. */
static void rope_one(const void *x, void *out, const float *c, const float *s, int64_t t,
                     int64_t heads, int64_t head_dim, int64_t x_stride, int bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; ++h) {
        const int64_t in = t * x_stride + h * head_dim, at = (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = load(x, in + i, bf16), x2 = load(x, in + half + i, bf16);
            const float a = round_to(x1 * c[i], bf16), b = round_to(x2 * s[i], bf16);
            const float d = round_to(x2 * c[i], bf16), e = round_to(x1 * s[i], bf16);
            store(out, at + i, a - b, bf16);
            store(out, at + half + i, d + e, bf16);
        }
    }
}

/* q and k of `tokens` tokens rotated at `positions` (the float32 table `cos_sin` holds
 * [cos | sin] per position) into `q_out` and `k_out`; `head_dim` <= 1024. */
void tw_rope_neox(const void *q, const void *k, void *q_out, void *k_out,
                  const int64_t *positions, const float *cos_sin, int64_t tokens,
                  int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t q_stride,
                  int64_t k_stride, int bf16) {
    const int64_t half = head_dim / 2;
    float c[512], s[512];
    for (int64_t t = 0; t < tokens; ++t) {
        const float *row = cos_sin + positions[t] * head_dim;
        for (int64_t i = 0; i < half; ++i) {
            c[i] = round_to(row[i], bf16);
            s[i] = round_to(row[half + i], bf16);
        }
        rope_one(q, q_out, c, s, t, q_heads, head_dim, q_stride, bf16);
        rope_one(k, k_out, c, s, t, k_heads, head_dim, k_stride, bf16);
    }
}

/* Per row of `rows` float32 rows of `n`: the index of the largest value, the first one on
 * ties, and the first NaN's where the row has one: what torch.argmax returns. Its CPU kernel
 * carries an index with every element and took 40 µs for a 32k vocabulary (190 µs at 152k);
 * here a first pass finds the maximum (and whether there is a NaN) in independent lanes the
 * compiler vectorises, and a second finds where it first occurs, a block of lanes at a time. */
#define AW 16
typedef float vf16 __attribute__((vector_size(AW * 4)));
typedef int32_t vi16 __attribute__((vector_size(AW * 4)));

static inline vf16 load16(const float *p) {
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline int any16(vi16 m) {
    int32_t lanes[AW];
    memcpy(lanes, &m, sizeof lanes);
    int32_t hit = 0;
    for (int l = 0; l < AW; ++l) hit |= lanes[l];
    return hit != 0;
}

/* The first index in row[0:n] holding `best` (a NaN when `nan`). */
static int64_t first_at(const float *row, int64_t n, float best, int nan) {
    const vf16 bv = {best, best, best, best, best, best, best, best,
                     best, best, best, best, best, best, best, best};
    int64_t i = 0;
    for (; i + AW <= n; i += AW) {
        const vf16 v = load16(row + i);
        if (any16(nan ? v != v : v == bv)) break;
    }
    for (; i < n; ++i)
        if (nan ? row[i] != row[i] : row[i] == best) return i;
    return 0;
}

void tw_argmax(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        float best = row[0];
        int nan = row[0] != row[0];
        int64_t i = 0;
        if (n >= AW) {
            vf16 acc = load16(row);
            vi16 nans = acc != acc;
            for (i = AW; i + AW <= n; i += AW) {
                const vf16 v = load16(row + i);
                const vi16 greater = v > acc;
                acc = (vf16)(((vi16)v & greater) | ((vi16)acc & ~greater));
                nans |= v != v;
            }
            nan = any16(nans);
            float lanes[AW];
            memcpy(lanes, &acc, sizeof lanes);
            for (int l = 0; l < AW; ++l) best = lanes[l] > best ? lanes[l] : best;
        }
        for (; i < n; ++i) {
            best = row[i] > best ? row[i] : best;
            nan |= row[i] != row[i];
        }
        out[r] = first_at(row, n, best, nan);
    }
}

/* `tw_exp` (common.h) of AW values at once, the same operations in the same order (so the same
 * results), written with vector types: the scalar version's clamps are branches to GCC
 * (float compares may trap), which keeps it from vectorising that loop. */
static inline vf16 select16(vi16 mask, vf16 a, vf16 b) {
    return (vf16)(((vi16)a & mask) | ((vi16)b & ~mask));
}

static inline vf16 exp16(vf16 x) {
    const vf16 zero = {0};
    x = select16(x < -87.0f, zero - 87.0f, x);
    x = select16(x > 89.0f, zero + 89.0f, x);
    const vf16 t = x * TW_LOG2E;
    const vi16 n = __builtin_convertvector(t + select16(t >= 0.0f, zero + 0.5f, zero - 0.5f), vi16);
    const vf16 nf = __builtin_convertvector(n, vf16);
    const vf16 r = x - nf * TW_LN2_HI - nf * TW_LN2_LO;
    const vi16 n1 = n / 2;
    return TW_EXP_POLY(r) * (vf16)((n1 + 127) << 23) * (vf16)((n - n1 + 127) << 23);
}

/* SwiGLU's `silu(gate) * up` over `rows` rows of [gate | up] (2 * d values each) into
 * contiguous [rows, d], rounded where torch's two ops round (silu's result to the dtype, then
 * the product). `act` 0 is silu, the only one so far (others are declined in Python). */
int tw_act_mul(const void *x, void *out, int64_t rows, int64_t d, int act, int bf16) {
    if (act != 0) return -1;
    float g[256], u[256];
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i0 = 0; i0 < d; i0 += 256) {
            const int64_t m = d - i0 < 256 ? d - i0 : 256, in = r * 2 * d + i0;
            for (int64_t i = 0; i < m; ++i) {
                g[i] = load(x, in + i, bf16);
                u[i] = load(x, in + d + i, bf16);
            }
            int64_t i = 0;
            for (; i + AW <= m; i += AW) {
                const vf16 v = load16(g + i), y = v / (1.0f + exp16(-v));
                memcpy(g + i, &y, sizeof y);
            }
            for (; i < m; ++i) g[i] = g[i] / (1.0f + tw_exp(-g[i]));
            if (bf16) {
                uint16_t *o = (uint16_t *)out + r * d + i0;
                for (int64_t i = 0; i < m; ++i) g[i] = bf16_to_f32(f32_to_bf16(g[i]));
                for (int64_t i = 0; i < m; ++i) o[i] = f32_to_bf16(g[i] * u[i]);
            } else {
                for (int64_t i = 0; i < m; ++i) ((float *)out)[r * d + i0 + i] = g[i] * u[i];
            }
        }
    return 0;
}

/* Rows `ids[0:n]` of a dense [vocab, row_bytes] table, copied into contiguous `out`. */
int tw_embed_rows(const void *table, const int64_t *ids, int64_t n, int64_t row_bytes,
                  void *out) {
    for (int64_t t = 0; t < n; ++t)
        memcpy((char *)out + t * row_bytes, (const char *)table + ids[t] * row_bytes,
               (size_t)row_bytes);
    return 0;
}

/* The `_packed` entries (common.h). */
int tw_rms_norm_packed(const int64_t *a) {
    return tw_rms_norm(TW_PTR(0), TW_PTR(1), TW_PTR(2), TW_PTR(3), TW_PTR(4), a[5], a[6],
                       tw_f32_arg(a[7]), (int)a[8], a[9], a[10], (int)a[11]);
}

int tw_rope_neox_packed(const int64_t *a) {
    tw_rope_neox(TW_PTR(0), TW_PTR(1), TW_PTR(2), TW_PTR(3), TW_PTR(4), TW_PTR(5), a[6], a[7],
                 a[8], a[9], a[10], a[11], (int)a[12]);
    return 0;
}

int tw_act_mul_packed(const int64_t *a) {
    return tw_act_mul(TW_PTR(0), TW_PTR(1), a[2], a[3], (int)a[4], (int)a[5]);
}

int tw_embed_rows_packed(const int64_t *a) {
    return tw_embed_rows(TW_PTR(0), TW_PTR(1), a[2], a[3], TW_PTR(4));
}
