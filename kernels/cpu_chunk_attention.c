/* Causal attention of a prompt chunk over a bfloat16 paged pool, on the CPU, with AVX512-BF16.
 *
 * The torch path for a prompt chunk (`paged_attention_reference`: the sequence's K and V gathered and
 * widened to float32, then SDPA's CPU flash kernel) runs a prompt's attention at a small fraction of the
 * projections' speed, a large part of its prefill time (docs/PERFORMANCE.md, "Prompt-chunk attention").
 * Here, per KV head, the sequence's keys are packed once for `vdpbf16ps` (16 keys x a pair of head dims per
 * register), so a block of 4 query rows x 32 keys is 8 accumulators fed by 2 key loads and 4 broadcasts per
 * pair of dims; values are widened to float32 once and the probabilities multiply them in float32 FMAs (no
 * rounding of the probabilities to bfloat16). Query tiles of 16 positions skip the key blocks causality hides
 * from all of them.
 *
 * Arithmetic: scores are exact products of the bfloat16 q and k summed in float32 in the decode kernel's
 * order (`score_rows`), times the scale; the causal mask; a float32 softmax (its sum in 16 lanes); the
 * weighted sum of the values in key order: step for step what the decode kernel (cpu_attention.c) computes for
 * the same row, so a prompt row's attention is the same float whichever of the two kernels took it.
 *
 * Full attention only (no window, soft cap or sinks: those go to the reference), head_dim a multiple of
 * 32 up to 256. Built by kernels/cpu_attention.build_library; `pdserve_chunk_attention_supported` says
 * whether the CPU had AVX512-BF16 when it was compiled.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#endif
#if defined(PDSERVE_LIBMVEC)
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

#define TQ 16    /* query positions per tile */
#define KB 32    /* keys per score block (two registers of 16) */
#define RB 4     /* query rows per score block */
#define MAX_D 256

int pdserve_chunk_attention_supported(void) {
#if defined(HAVE_BF16_DOT)
    return 1;
#else
    return 0;
#endif
}

#if defined(HAVE_BF16_DOT)
typedef uint16_t bf16;

static inline int64_t chunk_row_at(const int32_t *table, int pos, int block_size, int64_t s_block, int64_t s_tok) {
    return (int64_t)table[pos / block_size] * s_block + (int64_t)(pos % block_size) * s_tok;
}

/* K of one head, keys 0..len-1 -> kp[(c / 16)][D / 2][16][2]: for each block of 16 keys and each pair of
 * dims, the 16 keys' two values side by side (zero past len). */
static void pack_keys(const bf16 *kv, int64_t head_off, const int32_t *table, int len, int D, int block_size,
                      int64_t s_block, int64_t s_tok, uint32_t *kp) {
    const int nb = (len + 15) / 16, D2 = D / 2;
    memset(kp, 0, (size_t)nb * D2 * 16 * sizeof(uint32_t));
    for (int c = 0; c < len; c++) {
        const uint32_t *row = (const uint32_t *)(kv + head_off + chunk_row_at(table, c, block_size, s_block, s_tok));
        uint32_t *dst = kp + (size_t)(c / 16) * D2 * 16 + (c % 16);
        for (int p = 0; p < D2; p++) dst[p * 16] = row[p];
    }
}

/* V of one head, keys 0..len-1, widened to float32 rows [len][D]. */
static void widen_values(const bf16 *kv, int64_t head_off, const int32_t *table, int len, int D, int block_size,
                         int64_t s_block, int64_t s_tok, float *vf) {
    for (int c = 0; c < len; c++) {
        const bf16 *row = kv + head_off + chunk_row_at(table, c, block_size, s_block, s_tok);
        float *dst = vf + (size_t)c * D;
        for (int d = 0; d < D; d += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(row + d));
            _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
    }
}

/* 16 vectors of partial sums, lane-wise -> their sums, each paired exactly as _mm512_reduce_add_ps pairs its
 * lanes (i + i+8, then + i+4, + i+2, + i+1): what the decode kernel's reduction of one key's 16 lanes gives. */
static inline __m512 tree16(const __m512 *a) {
    __m512 s1[8], s2[4];
    for (int i = 0; i < 8; i++) s1[i] = _mm512_add_ps(a[i], a[i + 8]);
    for (int i = 0; i < 4; i++) s2[i] = _mm512_add_ps(s1[i], s1[i + 4]);
    return _mm512_add_ps(_mm512_add_ps(s2[0], s2[2]), _mm512_add_ps(s2[1], s2[3]));
}

/* scores[r][c] for RN rows (RN <= RB, a constant where inlined) and keys in blocks of 16 from 0 to
 * nkb * 16: q rows as bf16 pairs `qp[r][D / 2]`. A score is summed in the decode kernel's order
 * (`score_rows_dp_v`), not in the order of the dims: its pairs p = L, L + 16, L + 32, .. in partial sum L
 * (one lane of the decode kernel's dot product), the 16 partial sums then reduced as its lanes are
 * (`tree16`). So a row of a prompt chunk scores every key as the same row computed as a decode row does,
 * and a prompt's logits do not depend on how it was split into chunks or what of it was cached. */
static inline __attribute__((always_inline)) void score_rows(const uint32_t *qp, int D2, const uint32_t *kp, int nkb,
                                                             float *scores, int ld, const int RN) {
    int kb = 0;
    for (; kb + 1 < nkb; kb += 2) {
        __m512 part0[RB][16], part1[RB][16];
        const uint32_t *k0 = kp + (size_t)kb * D2 * 16, *k1 = k0 + (size_t)D2 * 16;
        for (int L = 0; L < 16; L++) {
            __m512 acc0[RB], acc1[RB];
            for (int r = 0; r < RN; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
            for (int p = L; p < D2; p += 16) {
                const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + p * 16);
                const __m512bh b = (__m512bh)_mm512_loadu_si512(k1 + p * 16);
                for (int r = 0; r < RN; r++) {
                    const __m512bh q = (__m512bh)_mm512_set1_epi32((int)qp[(size_t)r * D2 + p]);
                    acc0[r] = _mm512_dpbf16_ps(acc0[r], q, a);
                    acc1[r] = _mm512_dpbf16_ps(acc1[r], q, b);
                }
            }
            for (int r = 0; r < RN; r++) part0[r][L] = acc0[r], part1[r][L] = acc1[r];
        }
        for (int r = 0; r < RN; r++) {
            _mm512_storeu_ps(scores + (size_t)r * ld + kb * 16, tree16(part0[r]));
            _mm512_storeu_ps(scores + (size_t)r * ld + kb * 16 + 16, tree16(part1[r]));
        }
    }
    if (kb < nkb) {
        __m512 part0[RB][16];
        const uint32_t *k0 = kp + (size_t)kb * D2 * 16;
        for (int L = 0; L < 16; L++) {
            __m512 acc0[RB];
            for (int r = 0; r < RN; r++) acc0[r] = _mm512_setzero_ps();
            for (int p = L; p < D2; p += 16) {
                const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + p * 16);
                for (int r = 0; r < RN; r++)
                    acc0[r] = _mm512_dpbf16_ps(acc0[r], (__m512bh)_mm512_set1_epi32((int)qp[(size_t)r * D2 + p]), a);
            }
            for (int r = 0; r < RN; r++) part0[r][L] = acc0[r];
        }
        for (int r = 0; r < RN; r++) _mm512_storeu_ps(scores + (size_t)r * ld + kb * 16, tree16(part0[r]));
    }
}

static void score_block(const uint32_t *qp, int D2, const uint32_t *kp, int nkb, int rn, float *scores, int ld) {
    switch (rn) {
    case 4: score_rows(qp, D2, kp, nkb, scores, ld, 4); break;
    case 3: score_rows(qp, D2, kp, nkb, scores, ld, 3); break;
    case 2: score_rows(qp, D2, kp, nkb, scores, ld, 2); break;
    default: score_rows(qp, D2, kp, nkb, scores, ld, 1); break;
    }
}

/* out[r][:] = sum over c < maxk of p[r][c] * vf[c][:] for RB rows (p is zero past a row's own keys), each
 * value row loaded once for all of them; V = D / 16 registers per row. */
static inline __attribute__((always_inline)) void value_rows(const float *p, int ld, const float *vf, int maxk, int D,
                                                             float *out, int64_t out_ld, const int V) {
    __m512 acc[RB][MAX_D / 16];
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < V; i++) acc[r][i] = _mm512_setzero_ps();
    for (int c = 0; c < maxk; c++) {
        const float *v = vf + (size_t)c * D;
        __m512 vr[MAX_D / 16];
        for (int i = 0; i < V; i++) vr[i] = _mm512_loadu_ps(v + 16 * i);
        for (int r = 0; r < RB; r++) {
            const __m512 pw = _mm512_set1_ps(p[(size_t)r * ld + c]);
            for (int i = 0; i < V; i++) acc[r][i] = _mm512_fmadd_ps(pw, vr[i], acc[r][i]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < V; i++) _mm512_storeu_ps(out + (size_t)r * out_ld + 16 * i, acc[r][i]);
}

static void value_block(const float *p, int ld, const float *vf, int maxk, int D, float *out, int64_t out_ld) {
    if (D == 64) value_rows(p, ld, vf, maxk, D, out, out_ld, 4);
    else if (D == 128) value_rows(p, ld, vf, maxk, D, out, out_ld, 8);
    else value_rows(p, ld, vf, maxk, D, out, out_ld, D / 16);
}

/* The scratch one work item uses: a tile's scores (`R` rows of `ld` keys), its queries as bf16 pairs, and each
 * row's key count; sized for up to `len` keys and `group` query heads per KV head. */
static size_t chunk_scratch_bytes(int len, int group, int D) {
    const int R = (TQ * group + RB - 1) / RB * RB, ld = (len + 15) / 16 * 16;
    return (size_t)R * ld * sizeof(float) + (size_t)R * (D / 2) * sizeof(uint32_t) + (size_t)R * sizeof(int) + 64;
}

/* Bytes of one KV head's keys packed (`pack_keys`) and values widened (`widen_values`), over len keys. */
static size_t chunk_head_bytes(int len, int D) {
    return ((size_t)(len + 15) / 16 * 16 * (D / 2) * sizeof(uint32_t) + (size_t)len * D * sizeof(float) + 63) & ~(size_t)63;
}

/* Query tile t of KV head h: q rows (stride q_ld elements; query head qh of position j at q[j * q_ld + qh * D])
 * for positions len - n + 16t .. of the chunk, over the head's packed keys kp and widened values vf -> out
 * (float32, the same indexing with out_ld). scratch: chunk_scratch_bytes. */
static void chunk_tile(const bf16 *q, int64_t q_ld, float *out, int64_t out_ld, const uint32_t *kp, const float *vf,
                       int len, int n, int q_heads, int kv_heads, int D, float scale, int h, int t, void *scratch) {
    const int group = q_heads / kv_heads, D2 = D / 2, R = (TQ * group + RB - 1) / RB * RB, ld = (len + 15) / 16 * 16;
    float *scores = scratch;
    uint32_t *qp = (uint32_t *)(scores + (size_t)R * ld);
    int *keys = (int *)(qp + (size_t)R * D2);
    const int j0 = t * TQ, jn = n - j0 < TQ ? n - j0 : TQ, rows = jn * group;
    /* row r = j * group + g: query position j0 + j, query head h * group + g; it sees keys 0..len-n+j0+j */
    for (int r = 0; r < rows; r++) {
        const int j = r / group, g = r % group;
        memcpy(qp + (size_t)r * D2, q + (size_t)(j0 + j) * q_ld + (size_t)(h * group + g) * D, (size_t)D * 2);
        keys[r] = len - n + j0 + j + 1;
    }
    const int nkb = (keys[rows - 1] + 15) / 16; /* the tile's last row sees the most keys */
    for (int r0 = 0; r0 < rows; r0 += RB)
        score_block(qp + (size_t)r0 * D2, D2, kp, nkb, rows - r0 < RB ? rows - r0 : RB, scores + (size_t)r0 * ld, ld);
    /* the softmax of each row over its keys, 16 lanes at a time (the sum in 16 lanes, reduced in a fixed order):
     * scalar, the scale-and-max and the sum were a large part of a prompt's attention (docs/PERFORMANCE.md,
     * "Prompt-chunk attention") */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; r++) {
        float *sc = scores + (size_t)r * ld;
        const int kr = keys[r];
        __m512 vm = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < kr; c += 16) {
            const __mmask16 mk = kr - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (kr - c)) - 1u);
            const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, sc + c), vscale);
            _mm512_mask_storeu_ps(sc + c, mk, v);
            vm = _mm512_mask_max_ps(vm, mk, v, vm);
        }
        const float m = _mm512_reduce_max_ps(vm);
#pragma omp simd
        for (int c = 0; c < kr; c++) sc[c] = expf(sc[c] - m);
        __m512 vsum = _mm512_setzero_ps();
        for (int c = 0; c < kr; c += 16) {
            const __mmask16 mk = kr - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (kr - c)) - 1u);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_loadu_ps(mk, sc + c));
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
        for (int c = 0; c < nkb * 16; c += 16) { /* normalised; zero past the row's own keys */
            const __mmask16 mk = c >= kr ? 0 : kr - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (kr - c)) - 1u);
            _mm512_storeu_ps(sc + c, _mm512_maskz_mul_ps(mk, _mm512_loadu_ps(sc + c), inv));
        }
    }
    for (int r = rows; r < (rows + RB - 1) / RB * RB; r++) /* padding rows of the last block: no weight */
        memset(scores + (size_t)r * ld, 0, (size_t)nkb * 16 * sizeof(float));
    for (int r0 = 0; r0 < rows; r0 += RB) {
        const int rn = rows - r0 < RB ? rows - r0 : RB;
        const int maxk = keys[r0 + rn - 1]; /* the block's last row sees the most keys */
        float tmp[RB][MAX_D];
        value_block(scores + (size_t)r0 * ld, ld, vf, maxk, D, &tmp[0][0], MAX_D);
        for (int i = 0; i < rn; i++) {
            const int r = r0 + i, j = r / group, g = r % group;
            memcpy(out + (size_t)(j0 + j) * out_ld + (size_t)(h * group + g) * D, tmp[i], (size_t)D * sizeof(float));
        }
    }
}
#endif

/*
 * One sequence: q [n, q_heads, D] bfloat16 contiguous (the chunk's queries, positions len - n .. len - 1);
 * out [n, q_heads, D] float32. kv: the layer's bfloat16 pool with element strides s_kv (K -> V), s_head,
 * s_block, s_tok; table: the sequence's blocks (block_size positions each). Work items are (KV head h,
 * query tile t) numbered h * tiles + t, tiles = ceil(n / 16); this call computes items item0..item1-1 (so
 * callers may split one sequence across threads).
 * Returns 0; 1 when the table names a block outside 0..num_blocks-1; -1 when memory could not be had;
 * -2 when the kernel was built without AVX512-BF16 or D is not a multiple of 32 up to 256.
 */
int pdserve_chunk_attention(const uint16_t *q, float *out, const uint16_t *kv, int64_t s_kv, int64_t s_head,
                            int64_t s_block, int64_t s_tok, int64_t num_blocks, const int32_t *table, int len, int n,
                            int q_heads, int kv_heads, int D, int block_size, float scale, int item0, int item1) {
#if !defined(HAVE_BF16_DOT)
    (void)q; (void)out; (void)kv; (void)s_kv; (void)s_head; (void)s_block; (void)s_tok; (void)num_blocks;
    (void)table; (void)len; (void)n; (void)q_heads; (void)kv_heads; (void)D; (void)block_size; (void)scale;
    (void)item0; (void)item1;
    return -2;
#else
    if (D % 32 || D > MAX_D || n <= 0 || n > len) return -2;
    for (int b = 0; b <= (len - 1) / block_size; b++)
        if (table[b] < 0 || table[b] >= num_blocks) return 1;
    const int tiles = (n + TQ - 1) / TQ;
    const size_t kp_bytes = (size_t)(len + 15) / 16 * 16 * (D / 2) * sizeof(uint32_t);
    uint8_t *head = malloc(chunk_head_bytes(len, D));
    void *scratch = malloc(chunk_scratch_bytes(len, q_heads / kv_heads, D));
    int rc = 0;
    if (!head || !scratch) { rc = -1; goto done; }
    uint32_t *kp = (uint32_t *)head;
    float *vf = (float *)(head + kp_bytes);
    const bf16 *pool = (const bf16 *)kv;
    int packed_head = -1;
    for (int item = item0; item < item1; item++) {
        const int h = item / tiles, t = item % tiles;
        if (h != packed_head) {
            pack_keys(pool, (int64_t)h * s_head, table, len, D, block_size, s_block, s_tok, kp);
            widen_values(pool, s_kv + (int64_t)h * s_head, table, len, D, block_size, s_block, s_tok, vf);
            packed_head = h;
        }
        chunk_tile(q, (int64_t)q_heads * D, out, (int64_t)q_heads * D, kp, vf, len, n, q_heads, kv_heads, D, scale, h,
                   t, scratch);
    }
done:
    free(head); free(scratch);
    return rc;
#endif
}
