/* Paged attention on the CPU: the contract of kernels/paged_attention.py, read in place from the pool.
 *
 * The torch reference gathers each sequence's K and V, converts them to float32 (two copies of the
 * whole context, per layer, per step), then runs 8-10 small ops: a large share of a batched bfloat16
 * decode step (docs/PERFORMANCE.md, "Decode attention"). Here each key and value row is read once from its
 * block, widened to float32 in registers, and used for every query row of its KV head (GQA's group, and a
 * verification's k + 1 rows) while it is in cache.
 *
 * Arithmetic, the same for every row count (so a k-row verification computes each row exactly as a
 * one-row step does): float32 scores q . k as 16 independent lanes summed in a fixed order, times the
 * scale, an optional soft cap, the causal / sliding-window mask, a softmax over the visible keys (and an
 * optional sink logit), then the probability-weighted sum of the values in key order. No fast-math: the
 * compiler vectorises the lanes, not the reductions. The native decoder's rows (`pdserve_paged_attention_bq`:
 * bfloat16 queries over a bfloat16 pool) take their scores from `vdpbf16ps` instead, each lane the sum of
 * its pairs of dims, under the same row-count rule.
 *
 * Built once per machine by kernels/cpu_attention.py (cc -O3 -march=native), called through ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define MAX_VEC 16 /* head_dim up to 256 in registers */
#endif
#if defined(PDSERVE_LIBMVEC)
/* glibc's vector expf (libmvec, <= 1 ULP), declared as its math.h does only under fast-math */
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

#define LANES 16

static inline float widen_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float dot(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int i = 0; i < LANES; i++) acc[i] += a[d + i] * b[d + i];
    float tail = 0.0f;
    for (; d < n; d++) tail += a[d] * b[d];
    /* the lanes summed as a tree (fixed order, vector-wide steps) */
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) acc[i] += acc[i + w];
    return acc[0] + tail;
}

/* Element offset of cache position `pos`'s row in its block (within one head of K or V). */
static inline int64_t row_at(const int32_t *table, int pos, int block_size, int64_t s_block, int64_t s_tok) {
    return (int64_t)table[pos / block_size] * s_block + (int64_t)(pos % block_size) * s_tok;
}

/* One row of K or V at element offset `off` of the pool, as float32 into `dst`. */
static inline void load_row(const void *kv, int bf16, int64_t off, int n, float *dst) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)kv + off;
        for (int d = 0; d < n; d++) dst[d] = widen_bf16(p[d]);
    } else {
        memcpy(dst, (const float *)kv + off, (size_t)n * sizeof(float));
    }
}

#if defined(__AVX512F__)
static inline __m512 load16(const void *kv, int bf16, int64_t off) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)kv + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)kv + off);
}

/* Key c's row of one head of K or V into V registers (widened to float32); offs[c]: the row's element
 * offset in the pool (one head's), computed once per sequence (`key_offsets`) rather than by a division
 * per key, per head, for K and for V. */
static inline __attribute__((always_inline)) void load_vrow(__m512 *dst, const void *kv, int bf16, int64_t head_off,
                                                            const int64_t *offs, int c, const int V) {
    const int64_t off = head_off + offs[c];
    for (int i = 0; i < V; i++) dst[i] = load16(kv, bf16, off + 16 * i);
}

/* The cache lines of a row of D elements at element offset `off`, asked for ahead of their use: a sequence's
 * blocks lie anywhere in the pool, so the hardware prefetcher loses the stream at every block boundary and
 * the score loop waits on the K loads (docs/PERFORMANCE.md, "Decode attention"). */
static inline void prefetch_row(const void *kv, int bf16, int64_t off, int D) {
    const char *p = (const char *)kv + off * (bf16 ? 2 : 4);
    const int bytes = D * (bf16 ? 2 : 4);
    for (int b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* 16 vectors of per-lane partial sums -> one vector of their 16 sums, key c in lane c. Each sum pairs its
 * lanes exactly as _mm512_reduce_add_ps does (i + i+8, then + i+4, + i+2, + i+1), so a score is the same
 * float as the one-key reduction computes, but four shuffle-and-add stages serve 16 keys at once. */
static inline __m512 reduce16(__m512 *a) {
    __m512 s1[8], s2[4], s3[2];
    for (int m = 0; m < 8; m++) /* [a_2m lanes i+i8 | a_2m+1 lanes i+i8] */
        s1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                              _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; m++) /* quarter q: key 4m + q, 4 lanes */
        s2[m] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * m], s1[2 * m + 1], 0x88),
                              _mm512_shuffle_f32x4(s1[2 * m], s1[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; m++) /* 128-bit lane L: key 8m + L (2 lanes), key 8m + 4 + L (2 lanes) */
        s3[m] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * m], s2[2 * m + 1], 0x44),
                              _mm512_shuffle_ps(s2[2 * m], s2[2 * m + 1], 0xEE));
    /* lane 4L + j: key L + 4j */
    const __m512 s4 = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, s4);
}

/* The scores of every query row of KV head h against keys first..len-1. Keys in runs of 16: their rows
 * widened once into a float32 buffer (L1), each query row's 16 products kept as 16 vectors of lane sums
 * and reduced together (`reduce16`); a last run of fewer keys one key at a time. Either way a score is
 * the lanes q[d] * k[d] accumulated over d in steps of 16, then reduced in _mm512_reduce_add_ps's order. */
static inline __attribute__((always_inline)) void score_rows_v(
        const float *q, const void *kv, int bf16, int64_t head_off, const int64_t *offs, int first, int len, int n,
        int q0, int q_heads, int h, int group, int D, float scale, int window, float softcap, float *scores,
        const int V) {
    const int keys = len - first;
    __m512 kbuf[16 * MAX_VEC];
    int c = 0;
    for (; c + 16 <= keys; c += 16) {
        for (int t = c + 16; t < c + 32 && t < keys; t++) prefetch_row(kv, bf16, head_off + offs[t], D);
        for (int t = 0; t < 16; t++)
            load_vrow(kbuf + t * V, kv, bf16, head_off, offs, c + t, V);
        for (int j = 0; j < n; j++) {
            const int qpos = len - n + j;
            if (first + c > qpos) { /* the whole run lies past this row (a prompt chunk's causal mask) */
                for (int g = 0; g < group; g++)
                    for (int t = 0; t < 16; t++) scores[(int64_t)(j * group + g) * keys + c + t] = -INFINITY;
                continue;
            }
            for (int g = 0; g < group; g++) {
                const float *qr = q + ((int64_t)(q0 + j) * q_heads + h * group + g) * D;
                __m512 qv[MAX_VEC], acc[16];
                for (int i = 0; i < V; i++) qv[i] = _mm512_loadu_ps(qr + 16 * i);
                for (int t = 0; t < 16; t++) {
                    __m512 x = _mm512_mul_ps(qv[0], kbuf[t * V]);
                    for (int i = 1; i < V; i++) x = _mm512_fmadd_ps(qv[i], kbuf[t * V + i], x);
                    acc[t] = x;
                }
                float *row = scores + (int64_t)(j * group + g) * keys + c;
                _mm512_storeu_ps(row, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
                for (int t = 0; t < 16; t++) {
                    const int pos = first + c + t;
                    if (!(pos <= qpos && (window <= 0 || pos > qpos - window))) row[t] = -INFINITY;
                    else if (softcap > 0.0f) row[t] = tanhf(row[t] / softcap) * softcap;
                }
            }
        }
    }
    __m512 k[MAX_VEC];
    for (; c < keys; c++) {
        const int pos = first + c;
        load_vrow(k, kv, bf16, head_off, offs, c, V);
        for (int j = 0; j < n; j++) {
            const int qpos = len - n + j;
            const int visible = pos <= qpos && (window <= 0 || pos > qpos - window);
            for (int g = 0; g < group; g++) {
                float x = -INFINITY;
                if (visible) {
                    const float *qr = q + ((int64_t)(q0 + j) * q_heads + h * group + g) * D;
                    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qr), k[0]);
                    for (int i = 1; i < V; i++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * i), k[i], acc);
                    x = _mm512_reduce_add_ps(acc) * scale;
                    if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
                }
                scores[(int64_t)(j * group + g) * keys + c] = x;
            }
        }
    }
}

/* acc[r] += p[r][c] * v[c] over the keys, in key order: each value row loaded (and widened) into
 * registers once, the sums of RB rows at a time held in registers (not re-read from memory per key). */
static inline __attribute__((always_inline)) void value_rows_v(
        const void *kv, int bf16, int64_t head_off, const int64_t *offs, int keys, int R, int D, const float *scores,
        const int *visible, float *acc, const int V) {
    const int RB = V <= 4 ? 4 : V <= 8 ? 2 : 1;
    for (int r0 = 0; r0 < R; r0 += RB) {
        const int rn = R - r0 < RB ? R - r0 : RB;
        int upto = 0; /* past the last key any row of this block sees */
        for (int r = 0; r < rn; r++) upto = visible[r0 + r] > upto ? visible[r0 + r] : upto;
        __m512 a[4][MAX_VEC];
        for (int r = 0; r < rn; r++)
            for (int i = 0; i < V; i++) a[r][i] = _mm512_loadu_ps(acc + (int64_t)(r0 + r) * D + 16 * i);
        __m512 v[MAX_VEC];
        for (int c = 0; c < upto; c++) {
            if (c + 16 < upto) prefetch_row(kv, bf16, head_off + offs[c + 16], D);
            load_vrow(v, kv, bf16, head_off, offs, c, V);
            for (int r = 0; r < rn; r++) {
                const float p = scores[(int64_t)(r0 + r) * keys + c];
                if (p == 0.0f) continue; /* masked (or underflowed) keys add nothing, NaN values included */
                const __m512 pv = _mm512_set1_ps(p);
                for (int i = 0; i < V; i++) a[r][i] = _mm512_fmadd_ps(pv, v[i], a[r][i]);
            }
        }
        for (int r = 0; r < rn; r++)
            for (int i = 0; i < V; i++) _mm512_storeu_ps(acc + (int64_t)(r0 + r) * D + 16 * i, a[r][i]);
    }
}

/* head_dim 64 and 128 (most models) with the vector count known, so the rows stay in registers */
static void score_rows_avx512(const float *q, const void *kv, int bf16, int64_t head_off, const int64_t *offs,
                              int first, int len, int n, int q0, int q_heads, int h, int group, int D, float scale,
                              int window, float softcap, float *scores) {
#define SCORE_ARGS q, kv, bf16, head_off, offs, first, len, n, q0, q_heads, h, group, D, scale, window, softcap, scores
    if (D == 64) score_rows_v(SCORE_ARGS, 4);
    else if (D == 128) score_rows_v(SCORE_ARGS, 8);
    else score_rows_v(SCORE_ARGS, D / 16);
}

static void value_rows_avx512(const void *kv, int bf16, int64_t head_off, const int64_t *offs, int keys, int R, int D,
                              const float *scores, const int *visible, float *acc) {
#define VALUE_ARGS kv, bf16, head_off, offs, keys, R, D, scores, visible, acc
    if (D == 64) value_rows_v(VALUE_ARGS, 4);
    else if (D == 128) value_rows_v(VALUE_ARGS, 8);
    else value_rows_v(VALUE_ARGS, D / 16);
}

#if defined(__AVX512BF16__)
/* `score_rows_v` for bfloat16 queries over a bfloat16 pool (the native decoder's rows: q is the rotary's
 * bfloat16 output), with `vdpbf16ps`: a key row is two registers as stored (no widening) and each query head
 * takes D / 32 dot-product instructions per key where the float32 path took D / 16 FMAs plus two ops per 16
 * elements to widen, so the scores stop being the part of a decode step that cannot keep up with memory.
 * A key's lanes each hold the sum of its pairs of dims (the instruction's order), then the lanes are reduced
 * in _mm512_reduce_add_ps's order, in a run of 16 keys (`reduce16`) and one at a time alike: a score does
 * not depend on the run it falls in, so a k-row verification still computes each row as a one-row step. */
static inline __attribute__((always_inline)) void score_rows_dp_v(
        const uint16_t *qb, int64_t ldq, const void *kv, int64_t head_off, const int64_t *offs, int first, int len,
        int n, int q0, int h, int group, int D, float scale, int window, float softcap, float *scores, const int P) {
    const int keys = len - first;
    const uint16_t *pool = (const uint16_t *)kv;
    __m512i kbuf[16 * (MAX_VEC / 2)];
    int c = 0;
    for (; c + 16 <= keys; c += 16) {
        for (int t = c + 16; t < c + 32 && t < keys; t++) prefetch_row(kv, 1, head_off + offs[t], D);
        for (int t = 0; t < 16; t++)
            for (int i = 0; i < P; i++) kbuf[t * P + i] = _mm512_loadu_si512(pool + head_off + offs[c + t] + 32 * i);
        for (int j = 0; j < n; j++) {
            const int qpos = len - n + j;
            if (first + c > qpos) { /* the whole run lies past this row (a prompt chunk's causal mask) */
                for (int g = 0; g < group; g++)
                    for (int t = 0; t < 16; t++) scores[(int64_t)(j * group + g) * keys + c + t] = -INFINITY;
                continue;
            }
            for (int g = 0; g < group; g++) {
                const uint16_t *qr = qb + (int64_t)(q0 + j) * ldq + (int64_t)(h * group + g) * D;
                __m512i qv[MAX_VEC / 2];
                __m512 acc[16];
                for (int i = 0; i < P; i++) qv[i] = _mm512_loadu_si512(qr + 32 * i);
                for (int t = 0; t < 16; t++) {
                    __m512 x = _mm512_setzero_ps();
                    for (int i = 0; i < P; i++) x = _mm512_dpbf16_ps(x, (__m512bh)qv[i], (__m512bh)kbuf[t * P + i]);
                    acc[t] = x;
                }
                float *row = scores + (int64_t)(j * group + g) * keys + c;
                _mm512_storeu_ps(row, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
                for (int t = 0; t < 16; t++) {
                    const int pos = first + c + t;
                    if (!(pos <= qpos && (window <= 0 || pos > qpos - window))) row[t] = -INFINITY;
                    else if (softcap > 0.0f) row[t] = tanhf(row[t] / softcap) * softcap;
                }
            }
        }
    }
    for (; c < keys; c++) {
        const int pos = first + c;
        __m512i k[MAX_VEC / 2];
        for (int i = 0; i < P; i++) k[i] = _mm512_loadu_si512(pool + head_off + offs[c] + 32 * i);
        for (int j = 0; j < n; j++) {
            const int qpos = len - n + j;
            const int visible = pos <= qpos && (window <= 0 || pos > qpos - window);
            for (int g = 0; g < group; g++) {
                float x = -INFINITY;
                if (visible) {
                    const uint16_t *qr = qb + (int64_t)(q0 + j) * ldq + (int64_t)(h * group + g) * D;
                    __m512 a = _mm512_setzero_ps();
                    for (int i = 0; i < P; i++)
                        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qr + 32 * i), (__m512bh)k[i]);
                    x = _mm512_reduce_add_ps(a) * scale;
                    if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
                }
                scores[(int64_t)(j * group + g) * keys + c] = x;
            }
        }
    }
}

static void score_rows_dp(const uint16_t *qb, int64_t ldq, const void *kv, int64_t head_off, const int64_t *offs,
                          int first, int len, int n, int q0, int h, int group, int D, float scale, int window,
                          float softcap, float *scores) {
#define DP_ARGS qb, ldq, kv, head_off, offs, first, len, n, q0, h, group, D, scale, window, softcap, scores
    if (D == 64) score_rows_dp_v(DP_ARGS, 2);
    else if (D == 128) score_rows_dp_v(DP_ARGS, 4);
    else score_rows_dp_v(DP_ARGS, D / 32);
}
#endif
#endif

/* A score row's max and sum: 16 lanes, then the lanes reduced (a fixed order for a given length, so a row's
 * result never depends on the rows beside it). Summed one by one, a prompt's score rows are one serial chain
 * of dependent additions, a sizeable share of its attention (docs/PERFORMANCE.md, "Prompt-chunk attention"). */
static inline float row_max(const float *x, int n, float init) {
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(init);
    int c = 0;
    for (; c + 16 <= n; c += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + c));
    if (c < n) m = _mm512_mask_max_ps(m, (__mmask16)((1u << (n - c)) - 1u), m, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - c)) - 1u), x + c));
    return _mm512_reduce_max_ps(m);
#else
    float m = init;
    for (int c = 0; c < n; c++) m = x[c] > m ? x[c] : m;
    return m;
#endif
}

static inline float row_sum(const float *x, int n) {
#if defined(__AVX512F__)
    __m512 a = _mm512_setzero_ps();
    int c = 0;
    for (; c + 16 <= n; c += 16) a = _mm512_add_ps(a, _mm512_loadu_ps(x + c));
    if (c < n) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - c)) - 1u), x + c));
    return _mm512_reduce_add_ps(a);
#else
    float sum = 0.0f;
    for (int c = 0; c < n; c++) sum += x[c];
    return sum;
#endif
}

/* The scores and sums buffers outlive a call, one each per thread, up to 32 MB: freed, a prompt chunk's scores
 * (hundreds of KB) goes back to the kernel, and the next layer's call faults in and zeroes fresh pages for
 * it, a large part of a native prefill's time (docs/PERFORMANCE.md, "Prompt-chunk attention"). */
static __thread float *tl_scores, *tl_acc;
static __thread size_t tl_scores_cap, tl_acc_cap;

static void keep(float **slot, size_t *slot_cap, float *buf, size_t cap) {
    if (buf && cap * sizeof(float) <= ((size_t)32 << 20)) {
        *slot = buf, *slot_cap = cap;
    } else {
        free(buf);
    }
}

/*
 * q [T, q_heads, D] float32 contiguous; out the same. kv: the layer's pool with element strides
 * s_kv (K -> V), s_head, s_block, s_tok (a row's D elements contiguous); bf16 != 0: bfloat16 elements, else
 * float32. block_tables [S, bt_stride] int32, seq_lens [S], query_start [S + 1]. window <= 0: none;
 * softcap <= 0: none; sinks NULL or [q_heads] float32.
 * Returns 0, or 1 + the index of a sequence whose table names a block outside 0..num_blocks-1 (out untouched
 * for it), or -1 when memory for the scores could not be had.
 */
static int paged_attention(const float *q, const uint16_t *qb, int64_t ldq, float *out, const void *kv, int bf16,
                           int64_t s_kv, int64_t s_head, int64_t s_block, int64_t s_tok, int64_t num_blocks,
                           const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                           const int32_t *query_start, int S, int q_heads, int kv_heads, int D, int block_size,
                           float scale, int window, float softcap, const float *sinks) {
    const int group = q_heads / kv_heads;
    float *row = malloc((size_t)D * sizeof(float));
    float *scores = NULL, *acc = NULL;
    int64_t *offs = NULL; /* key c's row offset within one head of K or V, per sequence */
    int *visible = NULL;  /* per score row: how many keys (from `first`) it sees */
    size_t scores_cap = 0, acc_cap = 0, offs_cap = 0, visible_cap = 0;
    int rc = 0;
    if (!row) return -1;
    if (tl_scores_cap) { /* this thread's kept buffers (see `keep`) */
        scores = tl_scores, scores_cap = tl_scores_cap;
        tl_scores = NULL, tl_scores_cap = 0;
    }
    if (tl_acc_cap) {
        acc = tl_acc, acc_cap = tl_acc_cap;
        tl_acc = NULL, tl_acc_cap = 0;
    }
    for (int s = 0; s < S && rc == 0; s++) {
        const int q0 = query_start[s], n = query_start[s + 1] - q0, len = seq_lens[s];
        if (n <= 0) continue;
        const int32_t *table = block_tables + (int64_t)s * bt_stride;
        int first = 0;
        if (window > 0 && len - n - window + 1 > first) first = len - n - window + 1;
        /* from a multiple of LANES: a key's lane in the softmax's sum is then its position's, so a row's sum never
         * depends on where its call's rows begin (a prompt in chunks, a decode row alone); the keys before the
         * window are masked like any the row does not see */
        first -= first % LANES;
        const int keys = len - first, R = n * group;
        int bad = 0;
        for (int b = first / block_size; b <= (len - 1) / block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks) bad = 1;
        if (bad) { rc = 1 + s; break; }
        if ((size_t)R * keys > scores_cap) {
            free(scores);
            scores_cap = (size_t)R * keys;
            scores = malloc(scores_cap * sizeof(float));
            if (!scores) { rc = -1; break; }
        }
        if ((size_t)R * D > acc_cap) {
            free(acc);
            acc_cap = (size_t)R * D;
            acc = malloc(acc_cap * sizeof(float));
            if (!acc) { rc = -1; break; }
        }
        if ((size_t)keys > offs_cap) {
            free(offs);
            offs_cap = (size_t)keys;
            offs = malloc(offs_cap * sizeof(int64_t));
            if (!offs) { rc = -1; break; }
        }
        if ((size_t)R > visible_cap) {
            free(visible);
            visible_cap = (size_t)R;
            visible = malloc(visible_cap * sizeof(int));
            if (!visible) { rc = -1; break; }
        }
        for (int r = 0; r < R; r++) { /* causal: query row j sees keys up to its own position */
            const int v = len - n + r / group - first + 1;
            visible[r] = v < keys ? v : keys;
        }
        for (int c = 0; c < keys; c++) offs[c] = row_at(table, first + c, block_size, s_block, s_tok);
        for (int h = 0; h < kv_heads; h++) {
            /* scores[r][c], r = j * group + g: query row j, query head h * group + g */
#if defined(__AVX512BF16__)
            if (qb && bf16 && D % 32 == 0 && D / 16 <= MAX_VEC) {
                score_rows_dp(qb, ldq, kv, h * s_head, offs, first, len, n, q0, h, group, D, scale, window, softcap,
                              scores);
            } else
#endif
#if defined(__AVX512F__)
            if (D % 16 == 0 && D / 16 <= MAX_VEC) {
                score_rows_avx512(q, kv, bf16, h * s_head, offs, first, len, n, q0, q_heads, h, group, D, scale, window,
                                  softcap, scores);
            } else
#endif
            for (int c = 0; c < keys; c++) {
                const int pos = first + c;
                const int64_t off = h * s_head + row_at(table, pos, block_size, s_block, s_tok);
                load_row(kv, bf16, off, D, row);
                for (int j = 0; j < n; j++) {
                    const int qpos = len - n + j;
                    const int visible = pos <= qpos && (window <= 0 || pos > qpos - window);
                    for (int g = 0; g < group; g++) {
                        float x = -INFINITY;
                        if (visible) {
                            x = dot(q + ((int64_t)(q0 + j) * q_heads + h * group + g) * D, row, D) * scale;
                            if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
                        }
                        scores[(int64_t)(j * group + g) * keys + c] = x;
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                float *sc = scores + (int64_t)r * keys;
                const float sink = sinks ? sinks[h * group + r % group] : -INFINITY;
                /* keys past the row's own position are masked: exp(-inf) = 0, so they are set, not computed */
                const int vis = visible[r];
                float m = row_max(sc, vis, sink);
                float sum = sinks ? expf(sink - m) : 0.0f;
#pragma omp simd
                for (int c = 0; c < vis; c++) sc[c] = expf(sc[c] - m);
                for (int c = vis; c < keys; c++) sc[c] = 0.0f;
                sum += row_sum(sc, vis);
                const float inv = 1.0f / sum;
                for (int c = 0; c < vis; c++) sc[c] *= inv;
            }
            memset(acc, 0, (size_t)R * D * sizeof(float));
#if defined(__AVX512F__)
            if (D % 16 == 0 && D / 16 <= MAX_VEC) {
                value_rows_avx512(kv, bf16, s_kv + h * s_head, offs, keys, R, D, scores, visible, acc);
            } else
#endif
            for (int c = 0; c < keys; c++) {
                const int pos = first + c;
                const int64_t off = s_kv + h * s_head + row_at(table, pos, block_size, s_block, s_tok);
                load_row(kv, bf16, off, D, row);
                for (int r = 0; r < R; r++) {
                    const float p = scores[(int64_t)r * keys + c];
                    if (p == 0.0f) continue; /* masked (or underflowed) keys add nothing, NaN values included */
                    float *a = acc + (int64_t)r * D;
                    for (int d = 0; d < D; d++) a[d] += p * row[d];
                }
            }
            for (int r = 0; r < R; r++) {
                const int j = r / group, g = r % group;
                memcpy(out + ((int64_t)(q0 + j) * q_heads + h * group + g) * D, acc + (int64_t)r * D,
                       (size_t)D * sizeof(float));
            }
        }
    }
    free(row);
    keep(&tl_scores, &tl_scores_cap, scores, scores_cap);
    keep(&tl_acc, &tl_acc_cap, acc, acc_cap);
    free(offs);
    free(visible);
    return rc;
}

int pdserve_paged_attention(const float *q, float *out, const void *kv, int bf16, int64_t s_kv, int64_t s_head,
                            int64_t s_block, int64_t s_tok, int64_t num_blocks, const int32_t *block_tables,
                            int64_t bt_stride, const int32_t *seq_lens, const int32_t *query_start, int S,
                            int q_heads, int kv_heads, int D, int block_size, float scale, int window,
                            float softcap, const float *sinks) {
    return paged_attention(q, NULL, 0, out, kv, bf16, s_kv, s_head, s_block, s_tok, num_blocks, block_tables, bt_stride,
                           seq_lens, query_start, S, q_heads, kv_heads, D, block_size, scale, window, softcap, sinks);
}

/* The same with the queries also in bfloat16 (`qb`: row r's q_heads * D elements at qb + r * ldq, the same
 * values as `q`): over a bfloat16 pool with D a multiple of 32, the scores take `score_rows_dp`. */
int pdserve_paged_attention_bq(const float *q, const uint16_t *qb, int64_t ldq, float *out, const void *kv, int bf16,
                               int64_t s_kv, int64_t s_head, int64_t s_block, int64_t s_tok, int64_t num_blocks,
                               const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                               const int32_t *query_start, int S, int q_heads, int kv_heads, int D, int block_size,
                               float scale, int window, float softcap, const float *sinks) {
    return paged_attention(q, qb, ldq, out, kv, bf16, s_kv, s_head, s_block, s_tok, num_blocks, block_tables, bt_stride,
                           seq_lens, query_start, S, q_heads, kv_heads, D, block_size, scale, window, softcap, sinks);
}
