/* Paged decode attention for the CPU backend (float32, bfloat16 or fp8 caches, float32 math).
 *
 * Why C: in plain PyTorch a decode step must first gather each sequence's scattered KV blocks
 * into a contiguous copy before a matmul can read them, so every key and value crosses memory
 * three times (read, write, read again) and the op count grows with the number of sequences.
 * Decode attention is memory-bound, so reading each block exactly once, where it lies, is the
 * whole game. This kernel streams every sequence's blocks once, in token order, computing all
 * heads of a token row at a time (rows are [num_kv_heads, head_size] contiguous in the
 * token-major cache), then does an exact softmax and a second streaming pass over the values.
 *
 * Reading at the memory's pace also needs the arithmetic per byte to stay small (a first
 * version ran at half the read bandwidth even with the whole cache in L2): the inner loops
 * use explicit vectors of the widest float width the CPU has, the value pass accumulates
 * `TILE` token rows into the output per load/store of it, the softmax uses a vectorised
 * exponential, and no integer division is left in a per-token loop.
 *
 * It is built at first use by tokenwise/native/paged_decode.py with the machine's C
 * compiler (-O3 -march=native) and called through ctypes, which releases the GIL: the caller
 * splits the sequences over threads. No OpenMP runtime is linked (torch has its own), only
 * `omp simd` vectorisation hints. A bfloat16 cache is widened to float32 in registers as it is
 * read (a bf16 value is the top half of a float32), which needs no native bf16 instructions.
 * An fp8 cache (e4m3fn or e5m2, `kv_quant.py`) is widened by moving its exponent and mantissa
 * bits into float32 position and rebiasing the exponent, subnormals with one subtraction:
 * half the bytes of bf16 for a few integer ops per value. Its keys are read as stored * k_scale
 * (folded into the score scale) and values as stored * v_scale (applied to the output).
 */
#include "common.h"

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define TILE 4 /* value rows accumulated per pass over an output row */
#define PF_ROWS 4 /* token rows ahead that a thread prefetches its heads' part of */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint8_t vb __attribute__((vector_size(VW)));

/* Cache dtype codes (`paged_decode.kernel_code`). */
enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_E4M3 = 2, CACHE_E5M2 = 3 };

static inline size_t cache_elt(int cdt) { return cdt == CACHE_F32 ? 4 : cdt == CACHE_BF16 ? 2 : 1; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* VW fp8 values at p as float32 (common.h has the scalar conversion and says how). */
#if defined(__F16C__)
/* With F16C an fp8 byte becomes a float16 and one instruction widens VW of them: e5m2 is the
 * top byte of a float16; e4m3 reads as e4m3 / 256 (common.h), so `TW_E4M3_UNIT` multiplies
 * the scales that read them instead of each value. Measured on a Xeon (AVX-512): the
 * rebiasing below cost 1.35-1.65x a bf16 cache's time per key, this about as much as bf16. */
#define FP8_E4M3_UNIT TW_E4M3_UNIT
static inline vf fp8_load(const uint8_t *p, int cdt) {
#if VW == 16
    const __m512 f = cdt == CACHE_E5M2 ? e5m2x16_to_f32(p) : e4m3x16_to_f32(p);
#else
    const __m256 f = cdt == CACHE_E5M2 ? e5m2x8_to_f32(p) : e4m3x8_to_f32(p);
#endif
    vf out;
    memcpy(&out, &f, sizeof out);
    return out;
}
#else
#define FP8_E4M3_UNIT 1.0f
/* The rebiasing of `fp8_to_f32` on VW values. */
static inline vf fp8_load(const uint8_t *p, int cdt) {
    const int e5m2 = cdt == CACHE_E5M2;
    vb b;
    memcpy(&b, p, sizeof b);
    /* Widened in two steps: GCC scalarises a direct 8 -> 32-bit conversion vector. */
    const vu x = __builtin_convertvector(__builtin_convertvector(b, vh), vu);
    const vu sign = (x & 0x80u) << 24;
    const vu mag = (x & 0x7fu) << (e5m2 ? 21 : 20);
    const vu normal = mag + (e5m2 ? 112u << 23 : 120u << 23);
    const vu is_sub = (vu)(mag < (1u << 23));
    vf sub;
    const vu sub_bits = normal + (1u << 23);
    memcpy(&sub, &sub_bits, sizeof sub);
    sub -= TW_FP8_MIN_NORMAL(e5m2);
    vu sub_u;
    memcpy(&sub_u, &sub, sizeof sub_u);
    const vu bits = ((normal & ~is_sub) | (sub_u & is_sub)) | sign;
    vf out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
#endif

/* What `load_row` gives for an fp8 cache is the value / FP8_UNIT (exact: a power of two). */
static inline float fp8_unit(int cdt) { return cdt == CACHE_E4M3 ? FP8_E4M3_UNIT : 1.0f; }

/* VW cache values at element `i` of a row, as float32. */
static inline vf load_row(const void *row, int cdt, int64_t i) {
    if (cdt == CACHE_F32) return loadf((const float *)row + i);
    if (cdt >= CACHE_E4M3) return fp8_load((const uint8_t *)row + i, cdt);
    vh h;
    memcpy(&h, (const uint16_t *)row + i, sizeof h);
    vu bits = __builtin_convertvector(h, vu) << 16;
    vf out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline float scalar_at(const void *row, int cdt, int64_t i) {
    if (cdt == CACHE_F32) return ((const float *)row)[i];
    if (cdt >= CACHE_E4M3) return fp8_to_f32(((const uint8_t *)row)[i], cdt == CACHE_E5M2) / fp8_unit(cdt);
    uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VW; ++i) s += v[i];
    return s;
}

/* q . k over `n` values (q float32, k a cache row in its own dtype). */
static inline float dot(const float *q, const void *k, int cdt, int64_t n) {
    int64_t i = 0;
    float acc = 0.0f;
    if (n >= VW) {
        vf a0 = {0}, a1 = {0};
        for (; i + 2 * VW <= n; i += 2 * VW) {
            a0 += loadf(q + i) * load_row(k, cdt, i);
            a1 += loadf(q + i + VW) * load_row(k, cdt, i + VW);
        }
        for (; i + VW <= n; i += VW) a0 += loadf(q + i) * load_row(k, cdt, i);
        acc = hsum(a0 + a1);
    }
    for (; i < n; ++i) acc += q[i] * scalar_at(k, cdt, i);
    return acc;
}

/* o += sum_r p[r] * v_r over `rows` (<= TILE) value rows, `n` values each. */
static inline void accumulate(float *o, const float *p, const void *const *v, int rows,
                              int cdt, int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf acc = loadf(o + i);
        for (int r = 0; r < rows; ++r) acc += p[r] * load_row(v[r], cdt, i);
        storef(o + i, acc);
    }
    for (; i < n; ++i)
        for (int r = 0; r < rows; ++r) o[i] += p[r] * scalar_at(v[r], cdt, i);
}

/* Softmax of one head's `n` scores in place, soft-capped first when `softcap` > 0. A head
 * with an attention sink (`sink`, gpt-oss: a learned logit with no value) counts it in the
 * maximum and the denominator only, so the probabilities of the keys sum to less than one. */
static void softmax(float *sc, int64_t n, float softcap, const float *sink) {
    if (softcap > 0.0f)
        for (int64_t t = 0; t < n; ++t) sc[t] = softcap * tanhf(sc[t] / softcap);
    float m = sink ? *sink : -INFINITY;
    for (int64_t t = 0; t < n; ++t) m = sc[t] > m ? sc[t] : m;
    float sum = sink ? tw_exp(*sink - m) : 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
        sc[t] = tw_exp(sc[t] - m); /* common.h; vectorised here */
        sum += sc[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sc[t] *= inv;
}

/* One sequence, KV heads [kv_begin, kv_end) and their query heads: scores into `scores`
 * ([num_heads][n_keys]), output rows into `o`. Always inlined into one caller per cache dtype
 * with a constant `cdt`, so each dtype gets its own straight-line loops. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const void *key_cache, const void *value_cache, int cdt,
    const int32_t *table, int64_t base_block, int64_t start, int64_t n_keys, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_size, int64_t block_size, float scale, float softcap,
    int64_t kv_begin, int64_t kv_end, float *q_scaled, float *scores, float *o,
    const float *sinks) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_size; /* values per token in the cache */
    const size_t elt = cache_elt(cdt);
    const int64_t h_begin = kv_begin * group, h_end = kv_end * group;
    for (int64_t i = h_begin * head_size; i < h_end * head_size; ++i) q_scaled[i] = q[i] * scale;

    /* Pass 1, keys: runs of consecutive slots inside one block (no division per token);
     * each token row is read once for all heads. */
    for (int64_t t = 0; t < n_keys;) {
        const int64_t pos = start + t;
        const int64_t block = table[pos / block_size - base_block];
        const int64_t run = min64(block_size - pos % block_size, n_keys - t);
        const char *k = (const char *)key_cache + (block * block_size + pos % block_size) * row * elt;
        for (int64_t r = 0; r < run; ++r, ++t, k += row * elt) {
            /* A thread reads only its heads' part of each row, so the rows it streams are
             * strided: fetch the part PF_ROWS rows ahead (within the block) ourselves. */
            if (r + PF_ROWS < run)
                for (const char *pf = k + (PF_ROWS * row + kv_begin * head_size) * elt,
                                *pf_end = k + (PF_ROWS * row + kv_end * head_size) * elt;
                     pf < pf_end; pf += 64)
                    __builtin_prefetch(pf, 0, 3);
            int64_t h = h_begin;
            for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
                const char *kk = k + kh * head_size * elt;
                for (int64_t g = 0; g < group; ++g, ++h)
                    scores[h * n_keys + t] = dot(q_scaled + h * head_size, kk, cdt, head_size);
            }
        }
    }
    for (int64_t h = h_begin; h < h_end; ++h)
        softmax(scores + h * n_keys, n_keys, softcap, sinks ? sinks + h : NULL);

    /* Pass 2, values: the same runs, TILE rows at a time accumulated into the output. */
    memset(o + h_begin * head_size, 0, sizeof(float) * (size_t)((h_end - h_begin) * head_size));
    for (int64_t t = 0; t < n_keys;) {
        const int64_t pos = start + t;
        const int64_t block = table[pos / block_size - base_block];
        const int64_t run = min64(block_size - pos % block_size, n_keys - t);
        const char *v = (const char *)value_cache + (block * block_size + pos % block_size) * row * elt;
        for (int64_t r = 0; r < run; r += TILE) {
            const int rows = (int)min64(TILE, run - r);
            if (r + TILE + PF_ROWS <= run) /* the next tile's rows, PF_ROWS ahead (see pass 1) */
                for (int64_t j = 0; j < TILE; ++j)
                    for (const char *pf = v + ((r + PF_ROWS + j) * row + kv_begin * head_size) * elt,
                                    *pf_end = v + ((r + PF_ROWS + j) * row + kv_end * head_size) * elt;
                         pf < pf_end; pf += 64)
                        __builtin_prefetch(pf, 0, 3);
            int64_t h = h_begin;
            for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
                const void *vr[TILE];
                for (int j = 0; j < rows; ++j)
                    vr[j] = v + ((r + j) * row + kh * head_size) * elt;
                for (int64_t g = 0; g < group; ++g, ++h) {
                    float p[TILE];
                    for (int j = 0; j < rows; ++j) p[j] = scores[h * n_keys + t + r + j];
                    accumulate(o + h * head_size, p, vr, rows, cdt, head_size);
                }
            }
        }
        t += run;
    }
}

/* `attend` for one cache dtype (the constant CDT). */
#define ATTEND_FOR(NAME, CDT)                                                                  \
    static void NAME(const float *q, const void *kc, const void *vc, const int32_t *table,       \
                     int64_t base, int64_t start, int64_t n, int64_t nh, int64_t nkv,            \
                     int64_t hs, int64_t bs, float scale, float cap, int64_t kb, int64_t ke,     \
                     float *qs, float *sc, float *o, const float *sk) {                          \
        attend(q, kc, vc, CDT, table, base, start, n, nh, nkv, hs, bs, scale, cap, kb, ke, qs,   \
               sc, o, sk);                                                                       \
    }
ATTEND_FOR(attend_f32, CACHE_F32)
ATTEND_FOR(attend_bf16, CACHE_BF16)
ATTEND_FOR(attend_e4m3, CACHE_E4M3)
ATTEND_FOR(attend_e5m2, CACHE_E5M2)

typedef void (*attend_fn)(const float *, const void *, const void *, const int32_t *, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float,
                          int64_t, int64_t, float *, float *, float *, const float *);
static const attend_fn ATTEND[4] = {attend_f32, attend_bf16, attend_e4m3, attend_e5m2};

/* Sequences [seq_begin, seq_end), KV heads [kv_begin, kv_end), on the calling thread.
 * Returns 0, or -1 without scratch. */
static int attend_range(const void *query, const void *key_cache, const void *value_cache,
                        int cdt, int io_bf16, const int32_t *block_tables,
                        int64_t table_stride, const int32_t *seq_lens, const int32_t *first_block,
                        int64_t seq_begin, int64_t seq_end, int64_t kv_begin, int64_t kv_end,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                        int64_t block_size, int64_t window, float scale, float softcap,
                        float v_scale, void *out, const float *sinks) {
    const int64_t width = num_heads * head_size; /* one sequence's query / output row */
    int64_t max_len = 1;
    for (int64_t s = seq_begin; s < seq_end; ++s)
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    /* scores[h * n_keys + t] for all query heads, t counted from the first visible key; with
     * bf16 queries and outputs, one float32 row of each to widen into and narrow from. */
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_len));
    float *q_scaled = malloc(sizeof(float) * (size_t)(io_bf16 ? 3 * width : width));
    if (!scores || !q_scaled) {
        free(scores);
        free(q_scaled);
        return -1;
    }
    float *q_row = q_scaled + width, *o_row = q_scaled + 2 * width;
    const int64_t lo = kv_begin * (num_heads / num_kv_heads) * head_size;
    const int64_t hi = kv_end * (num_heads / num_kv_heads) * head_size;
    for (int64_t s = seq_begin; s < seq_end; ++s) {
        const int64_t len = seq_lens[s];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const float *q = (const float *)query + s * width;
        float *o = (float *)out + s * width;
        if (io_bf16) {
            const uint16_t *qh = (const uint16_t *)query + s * width;
            for (int64_t i = lo; i < hi; ++i) q_row[i] = bf16_to_f32(qh[i]);
            q = q_row;
            o = o_row;
        }
        ATTEND[cdt](
            q, key_cache, value_cache, block_tables + s * table_stride, (int64_t)first_block[s],
            start, len - start, num_heads, num_kv_heads, head_size, block_size, scale, softcap,
            kv_begin, kv_end, q_scaled, scores, o, sinks);
        if (v_scale != 1.0f) /* values were stored divided by v_scale (fp8 caches) */
            for (int64_t i = lo; i < hi; ++i) o[i] *= v_scale;
        if (io_bf16) { /* only this thread's heads: the others belong to other threads */
            uint16_t *oh = (uint16_t *)out + s * width;
            for (int64_t i = lo; i < hi; ++i) oh[i] = f32_to_bf16(o_row[i]);
        }
    }
    free(q_scaled);
    free(scores);
    return 0;
}

/* Decode attention of sequences [0, num_seqs), split over `num_threads` threads in
 * contiguous ranges of about equal key counts; or, with fewer sequences than threads (one
 * stream, a few), each sequence's KV heads split over the threads, every thread running all
 * sequences for its heads (a head's queries, keys, values and output are its own).
 *
 * query:        [num_seqs, num_heads, head_size] float32
 * key_cache:    [num_blocks, block_size, num_kv_heads, head_size]; `cdt`: float32, bf16,
 *               fp8 e4m3fn or e5m2 (CACHE_*)
 * value_cache:  same as key_cache
 * block_tables: [num_seqs, table_stride]; entry j holds absolute block first_block[s] + j
 * seq_lens:     keys per sequence (the new token included)
 * first_block:  absolute index of each table's first block (sliding-window tables skip some)
 * window:       sliding window in tokens, 0 for none
 * softcap:      caps every score as softcap * tanh(score / softcap) (Gemma 2), 0 for none
 * k_scale, v_scale: the cache holds keys / k_scale and values / v_scale (1 but for fp8)
 * out:          [num_seqs, num_heads, head_size] float32
 * sinks:        [num_heads] float32 attention-sink logits (gpt-oss), or NULL for none
 * Returns 0, or -1 when scratch memory could not be allocated.
 *
 * Threads come from OpenMP when the kernel was built with it, which the loader does only when
 * the process's OpenMP runtime is torch's libgomp: the library then binds to that very
 * runtime, so attention runs on the threads torch's matmuls just used (a second pool would
 * compete with them while they spin-wait for their next region). Otherwise one thread.
 */
static int decode(const void *query, const void *key_cache, const void *value_cache,
                  int cdt, int io_bf16, const int32_t *block_tables, int64_t table_stride,
                  const int32_t *seq_lens, const int32_t *first_block, int64_t num_seqs,
                  int64_t num_threads, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_size, int64_t block_size, int64_t window, float scale,
                  float softcap, float k_scale, float v_scale, void *out, const float *sinks) {
    /* q . (k_stored * k_scale) == (q * k_scale) . k_stored; likewise for v_scale, with the
     * fp8 rows read in units of fp8_unit (see fp8_to_f32). */
    if (cdt < CACHE_E4M3) k_scale = v_scale = 1.0f; /* scales belong to fp8 caches only */
    scale *= k_scale * fp8_unit(cdt);
    v_scale *= fp8_unit(cdt);
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; ++s) total += seq_lens[s];
    const int split_heads = num_threads > num_seqs && num_kv_heads > 1;
    if (split_heads && num_threads > num_kv_heads) num_threads = num_kv_heads;
    if (!split_heads && num_threads > num_seqs) num_threads = num_seqs;
    int status = 0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(num_threads > 1 ? (int)num_threads : 1) reduction(| : status)
#endif
    {
        int64_t part = 0, parts = 1;
#if defined(_OPENMP)
        part = omp_get_thread_num();
        parts = omp_get_num_threads();
#endif
        if (split_heads) {
            const int64_t kb = num_kv_heads * part / parts, ke = num_kv_heads * (part + 1) / parts;
            if (ke > kb)
                status |= attend_range(query, key_cache, value_cache, cdt, io_bf16,
                                       block_tables, table_stride, seq_lens, first_block, 0,
                                       num_seqs, kb, ke,
                                       num_heads, num_kv_heads, head_size, block_size, window,
                                       scale, softcap, v_scale, out, sinks);
        } else {
        /* This thread's range: the sequences whose first key falls in its share of keys. */
        const int64_t lo = total * part / parts, hi = total * (part + 1) / parts;
        int64_t begin = 0, end = 0, seen = 0;
        for (int64_t s = 0; s < num_seqs; ++s) {
            if (seen < lo) begin = s + 1;
            if (seen < hi) end = s + 1;
            seen += seq_lens[s];
        }
        if (end > begin)
            status |= attend_range(query, key_cache, value_cache, cdt, io_bf16,
                                   block_tables, table_stride, seq_lens, first_block, begin,
                                   end, 0,
                                   num_kv_heads, num_heads, num_kv_heads, head_size, block_size,
                                   window, scale, softcap, v_scale, out, sinks);
        }
    }
    return status ? -1 : 0;
}

int paged_decode(const float *query, const void *key_cache, const void *value_cache,
                 int cache_dtype, const int32_t *block_tables, int64_t table_stride,
                 const int32_t *seq_lens, const int32_t *first_block, int64_t num_seqs,
                 int64_t num_threads, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_size, int64_t block_size, int64_t window, float scale,
                 float softcap, float k_scale, float v_scale, float *out, const float *sinks) {
    return decode(query, key_cache, value_cache, cache_dtype, 0, block_tables, table_stride,
                  seq_lens, first_block, num_seqs, num_threads, num_heads, num_kv_heads,
                  head_size, block_size, window, scale, softcap, k_scale, v_scale, out, sinks);
}

/* A whole decode step of one layer in one call (what the backend's per-layer Python cost to
 * do in five or six torch ops): write each sequence's new key and value row into its cache
 * slot, then `paged_decode`, with queries, new rows and outputs in bf16 (`io_bf16`) or float32;
 * the cache in its own dtype (`cache_dtype`: the io dtype, or fp8, written saturating and
 * divided by k_scale / v_scale).
 *
 * new_keys / new_values: [num_seqs] rows of num_kv_heads * head_size values, `key_stride` /
 *                        `value_stride` values apart (views into a fused qkv output are fine)
 * slot_mapping:          [num_seqs] int64 cache slots; a negative slot (padding) is not written
 * query, out:            [num_seqs, num_heads, head_size], contiguous
 */
int paged_decode_step(const void *query, const void *new_keys, const void *new_values,
                      int64_t key_stride, int64_t value_stride, const int64_t *slot_mapping,
                      void *key_cache, void *value_cache, int cache_dtype, int io_bf16,
                      const int32_t *block_tables,
                      int64_t table_stride, const int32_t *seq_lens, const int32_t *first_block,
                      int64_t num_seqs, int64_t num_threads, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_size, int64_t block_size,
                      int64_t window, float scale, float softcap, float k_scale,
                      float v_scale, void *out, const float *sinks) {
    const size_t elt = cache_elt(cache_dtype);
    const int64_t width = num_kv_heads * head_size;
    const size_t row = (size_t)width * elt;
    for (int64_t s = 0; s < num_seqs; ++s) {
        if (slot_mapping[s] < 0) continue;
        const size_t at = (size_t)slot_mapping[s] * row;
        const int64_t kj = s * key_stride, vj = s * value_stride;
        if (cache_dtype < CACHE_E4M3) {
            memcpy((char *)key_cache + at, (const char *)new_keys + (size_t)kj * elt, row);
            memcpy((char *)value_cache + at, (const char *)new_values + (size_t)vj * elt, row);
            continue;
        }
        uint8_t *kd = (uint8_t *)key_cache + at, *vd = (uint8_t *)value_cache + at;
        const int e5m2 = cache_dtype == CACHE_E5M2;
        for (int64_t i = 0; i < width; ++i) {
            const float k = io_bf16 ? bf16_to_f32(((const uint16_t *)new_keys)[kj + i])
                                    : ((const float *)new_keys)[kj + i];
            const float v = io_bf16 ? bf16_to_f32(((const uint16_t *)new_values)[vj + i])
                                    : ((const float *)new_values)[vj + i];
            kd[i] = f32_to_fp8(k / k_scale, e5m2); /* torch's order: divide, then round */
            vd[i] = f32_to_fp8(v / v_scale, e5m2);
        }
    }
    return decode(query, key_cache, value_cache, cache_dtype, io_bf16, block_tables,
                  table_stride, seq_lens, first_block, num_seqs, num_threads, num_heads,
                  num_kv_heads, head_size, block_size, window, scale, softcap, k_scale, v_scale,
                  out, sinks);
}

/* `paged_decode_step`'s packed entry (common.h). */
int paged_decode_step_packed(const int64_t *a) {
    return paged_decode_step(TW_PTR(0), TW_PTR(1), TW_PTR(2), a[3], a[4], TW_PTR(5), TW_PTR(6),
                             TW_PTR(7), (int)a[8], (int)a[9], TW_PTR(10), a[11], TW_PTR(12),
                             TW_PTR(13), a[14], a[15], a[16], a[17], a[18], a[19], a[20],
                             tw_f32_arg(a[21]), tw_f32_arg(a[22]), tw_f32_arg(a[23]),
                             tw_f32_arg(a[24]), TW_PTR(25), TW_PTR(26));
}
