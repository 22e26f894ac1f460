/* Paged decode attention for the CPU backend (float32 or bfloat16 caches, float32 math).
 *
 * Why C: in plain PyTorch a decode step must first gather each sequence's scattered KV blocks
 * into a contiguous copy before a matmul can read them, so every key and value crosses memory
 * three times (read, write, read again) and the op count grows with the number of sequences.
 * Decode attention is memory-bound, so reading each block exactly once, where it lies, is the
 * whole game. This kernel streams every sequence's blocks once, in token order, computing all
 * heads of a token row at a time (rows are [num_kv_heads, head_size] contiguous in the
 * token-major cache), then does an exact softmax and a second streaming pass over the values.
 *
 * It is built at first use by tokenwise/attention/backends/cpu_kernels.py with the machine's C
 * compiler (-O3 -march=native) and called through ctypes, which releases the GIL: the caller
 * splits the sequences over threads. No OpenMP runtime is linked (torch has its own), only
 * `omp simd` vectorisation hints. A bfloat16 cache is widened to float32 row by row as it is
 * read, which needs no native bf16 instructions.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Token row `at` of a cache as float32: a float32 cache is read in place; a bf16 row is widened
 * into `buf` (a bf16 value is the top half of a float32, so widening is a shift). */
static inline const float *row_f32(const void *cache, int is_bf16, int64_t at, int64_t n,
                                   float *buf) {
    if (!is_bf16) return (const float *)cache + at;
    const uint16_t *src = (const uint16_t *)cache + at;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(buf + i, &bits, sizeof(float));
    }
    return buf;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

/* Attend sequences [seq_begin, seq_end) of a decode batch.
 *
 * query:        [num_seqs, num_heads, head_size] float32
 * key_cache:    [num_blocks, block_size, num_kv_heads, head_size], float32 or bf16 (is_bf16)
 * value_cache:  same as key_cache
 * block_tables: [num_seqs, table_stride]; entry j holds absolute block first_block[s] + j
 * seq_lens:     keys per sequence (the new token included)
 * first_block:  absolute index of each table's first block (sliding-window tables skip some)
 * window:       sliding window in tokens, 0 for none
 * softcap:      caps every score as softcap * tanh(score / softcap) (Gemma 2), 0 for none
 * out:          [num_seqs, num_heads, head_size] float32
 * Returns 0, or -1 when scratch memory could not be allocated.
 */
int paged_decode(const float *query, const void *key_cache, const void *value_cache,
                 int is_bf16, const int32_t *block_tables, int64_t table_stride,
                 const int32_t *seq_lens, const int32_t *first_block, int64_t seq_begin,
                 int64_t seq_end, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                 int64_t block_size, int64_t window, float scale, float softcap,
                 float *out) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_size; /* values per token in the cache */
    int64_t max_len = 1;
    for (int64_t s = seq_begin; s < seq_end; ++s)
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    /* scores[h * n_keys + t] for all query heads, t counted from the first visible key */
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_len));
    float *line = malloc(sizeof(float) * (size_t)row); /* one bf16 token row, widened */
    if (!scores || !line) {
        free(scores);
        free(line);
        return -1;
    }

    for (int64_t s = seq_begin; s < seq_end; ++s) {
        const int64_t len = seq_lens[s];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int64_t n_keys = len - start;
        const int64_t base_block = (int64_t)first_block[s];
        const int32_t *table = block_tables + s * table_stride;
        const float *q = query + s * num_heads * head_size;
        float *o = out + s * num_heads * head_size;

        /* Pass 1, keys: runs of consecutive slots inside one block (no division per token);
         * each token row is read once for all heads. */
        for (int64_t t = 0; t < n_keys;) {
            const int64_t pos = start + t;
            const int64_t block = table[pos / block_size - base_block];
            const int64_t run = min64(block_size - pos % block_size, n_keys - t);
            int64_t at = (block * block_size + pos % block_size) * row;
            for (int64_t r = 0; r < run; ++r, ++t, at += row) {
                const float *k = row_f32(key_cache, is_bf16, at, row, line);
                for (int64_t h = 0; h < num_heads; ++h)
                    scores[h * n_keys + t] =
                        dot(q + h * head_size, k + (h / group) * head_size, head_size) * scale;
            }
        }
        /* Exact softmax per head (scores soft-capped first when asked). */
        for (int64_t h = 0; h < num_heads; ++h) {
            float *sc = scores + h * n_keys;
            if (softcap > 0.0f)
                for (int64_t t = 0; t < n_keys; ++t) sc[t] = softcap * tanhf(sc[t] / softcap);
            float m = -INFINITY;
            for (int64_t t = 0; t < n_keys; ++t) m = sc[t] > m ? sc[t] : m;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n_keys; ++t) {
                sc[t] = expf(sc[t] - m);
                sum += sc[t];
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t t = 0; t < n_keys; ++t) sc[t] *= inv;
        }
        /* Pass 2, values: the same runs, accumulated into the output rows. */
        memset(o, 0, sizeof(float) * (size_t)(num_heads * head_size));
        for (int64_t t = 0; t < n_keys;) {
            const int64_t pos = start + t;
            const int64_t block = table[pos / block_size - base_block];
            const int64_t run = min64(block_size - pos % block_size, n_keys - t);
            int64_t at = (block * block_size + pos % block_size) * row;
            for (int64_t r = 0; r < run; ++r, ++t, at += row) {
                const float *v = row_f32(value_cache, is_bf16, at, row, line);
                for (int64_t h = 0; h < num_heads; ++h) {
                    const float p = scores[h * n_keys + t];
                    const float *vh = v + (h / group) * head_size;
                    float *oh = o + h * head_size;
#pragma omp simd
                    for (int64_t d = 0; d < head_size; ++d) oh[d] += p * vh[d];
                }
            }
        }
    }
    free(line);
    free(scores);
    return 0;
}
