/* One Llama-style decoder layer of a small bfloat16 step (decode, verification) in one native call.
 *
 * transformers runs a layer as some forty torch ops and their Python; at one to a few rows on a CPU that
 * costs more than the layer's matmuls (a SmolLM2-135M step: 48 ms, of which oneDNN's kernels ~19). Here a
 * layer is: norm, q/k/v projection (+ bias), rotary embedding, K/V written into the paged pool, paged
 * attention (cpu_attention.c, included), o projection, residual, norm, gate/up projection, SiLU * up, down
 * projection, residual. Every intermediate is rounded to bfloat16 where transformers' bfloat16 modules
 * round it, so the layer computes what theirs does up to the summation order of the matmuls.
 *
 * Projections are GEMVs over weights packed for AVX512-BF16 (`pack`): groups of 32 outputs, each holding,
 * for every pair of inputs, the 32 outputs' two weights side by side, which `vdpbf16ps` multiplies with a
 * broadcast pair of activations into 2 x 16 float32 sums at once. The weights stream from memory exactly once
 * per step however many rows (up to 8 per pass; a block is re-read from cache for more).
 *
 * Where the CPU has AMX (Sapphire Rapids and later) and the kernel grants this process its tile state, the
 * same packed weights feed AMX tiles instead: each 32-input stretch of a group's rows is one 16 x 64-byte B
 * tile read with a 128-byte stride, so `tdpbf16ps` multiplies up to 16 rows by 32 outputs' weights per pair
 * of tile loads (a 16-row SmolLM2-135M step, Xeon with AMX: 78 ms on AVX512-BF16). A process uses one path
 * for every step, whatever its row count, so a sequence's logits never depend on what shares its batch.
 */
#include "cpu_attention.c"

typedef uint16_t bf16;

static inline float f32(bf16 h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline bf16 round_bf16(float f) { /* round to nearest even, as torch's float -> bfloat16 */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x7fffffu)) return (bf16)((v.u >> 16) | 0x40); /* NaN */
    return (bf16)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline bf16 mul_bf16(bf16 a, bf16 b) { return round_bf16(f32(a) * f32(b)); }
static inline bf16 add_bf16(bf16 a, bf16 b) { return round_bf16(f32(a) + f32(b)); }

/* W [n, k] bfloat16 (row-major, k even) -> packed [ceil(n/32)][k/2][32][2]: per group of 32 outputs and
 * pair of inputs, the 32 outputs' two weights side by side (two registers); outputs past n are zero. */
void pdserve_pack_bf16(const bf16 *w, bf16 *packed, int n, int k) {
    const int ng = (n + 31) / 32, k2 = k / 2;
    for (int b = 0; b < ng; b++)
        for (int p = 0; p < k2; p++)
            for (int j = 0; j < 32; j++) {
                const int o = b * 32 + j;
                bf16 *dst = packed + (((size_t)b * k2 + p) * 32 + j) * 2;
                dst[0] = o < n ? w[(size_t)o * k + 2 * p] : 0;
                dst[1] = o < n ? w[(size_t)o * k + 2 * p + 1] : 0;
            }
}

#if defined(__AVX512BF16__)
#define HAVE_BF16_GEMV 1
/* The epilogue both projection paths share, for up to 16 outputs from o0 (`mask`): their bias widened to
 * float32 (zero without one), and a row's float32 sums plus that bias rounded to bfloat16 into y. */
static inline __m512 bias16(const bf16 *bias, int o0, __mmask16 mask) {
    if (!bias) return _mm512_setzero_ps();
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + o0)), 16));
}

static inline void store16(bf16 *y, __mmask16 mask, __m512 sums, __m512 bv) {
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums, bv)));
}

/* y[r][o] = x[r] . W[o] (+ bias) for the 32 outputs of group g and rows < ROWS <= 8, rounded to bfloat16
 * into y (row stride ldy): 2 * ROWS accumulators; the group's weights are one linear stream (two
 * registers per pair of inputs), each used for every row. Each output sums its products in input order
 * whatever ROWS is, so the row count never changes a result. */
static inline __attribute__((always_inline)) void gemv_tile(const bf16 *x, int ldx, const bf16 *packed, int n, int k,
                                                            const bf16 *bias, bf16 *y, int ldy, int g, const int ROWS) {
    const int k2 = k / 2;
    __m512 acc[2][8];
    for (int r = 0; r < ROWS; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    const bf16 *wp = packed + (size_t)g * k2 * 64;
    for (int p = 0; p < k2; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wp + (size_t)p * 64));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wp + (size_t)p * 64 + 32));
        for (int r = 0; r < ROWS; r++) {
            uint32_t pair;
            memcpy(&pair, x + (size_t)r * ldx + 2 * p, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[0][r] = _mm512_dpbf16_ps(acc[0][r], xv, w0);
            acc[1][r] = _mm512_dpbf16_ps(acc[1][r], xv, w1);
        }
    }
    for (int j = 0; j < 2; j++) {
        const int o0 = g * 32 + j * 16, m = n - o0 < 16 ? n - o0 : 16;
        if (m <= 0) break;
        const __mmask16 mask = (__mmask16)((1u << m) - 1u);
        const __m512 bv = bias16(bias, o0, mask);
        for (int r = 0; r < ROWS; r++) store16(y + (size_t)r * ldy + o0, mask, acc[j][r], bv);
    }
}

/* y = x . W^T for `rows` rows: output groups outermost, passes of up to 8 rows inside, so a group's weights
 * come from memory once per step and from cache for every further pass; the row count of a pass a
 * compile-time constant, so its accumulators stay in registers. */
static void gemv(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y,
                 int ldy) {
    const int ng = (n + 31) / 32;
    for (int g = 0; g < ng; g++)
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const int m = rows - r0 < 8 ? rows - r0 : 8;
            const bf16 *xr = x + (size_t)r0 * ldx;
            bf16 *yr = y + (size_t)r0 * ldy;
            switch (m) {
            case 1: gemv_tile(xr, ldx, packed, n, k, bias, yr, ldy, g, 1); break;
            case 2: gemv_tile(xr, ldx, packed, n, k, bias, yr, ldy, g, 2); break;
            case 3: gemv_tile(xr, ldx, packed, n, k, bias, yr, ldy, g, 3); break;
            case 4: gemv_tile(xr, ldx, packed, n, k, bias, yr, ldy, g, 4); break;
            case 5: gemv_tile(xr, ldx, packed, n, k, bias, yr, ldy, g, 5); break;
            case 6: gemv_tile(xr, ldx, packed, n, k, bias, yr, ldy, g, 6); break;
            case 7: gemv_tile(xr, ldx, packed, n, k, bias, yr, ldy, g, 7); break;
            default: gemv_tile(xr, ldx, packed, n, k, bias, yr, ldy, g, 8); break;
            }
        }
}
#else
#define HAVE_BF16_GEMV 0
static void gemv(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y,
                 int ldy) {
    (void)x; (void)ldx; (void)rows; (void)packed; (void)n; (void)k; (void)bias; (void)y; (void)ldy;
}
#endif

#if HAVE_BF16_GEMV && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tiles 0-3: the sums of up to 16 rows by 4 x 16 outputs; 4: 16 rows x 32 inputs of x; 5, 6: weights */
static void amx_configure(int m) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) c.rows[t] = (uint8_t)m, c.colsb[t] = 64;
    for (int t = 5; t < 7; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* y rows [0, m) x outputs of groups g0 and (when two) g0 + 1, over k a multiple of 32; tiles configured for m */
static void amx_block(const bf16 *x, int ldx, int m, const bf16 *packed, int n, int k, const bf16 *bias,
                      bf16 *y, int ldy, int g0, int two) {
    const size_t k2 = (size_t)k / 2;
    const bf16 *w0 = packed + (size_t)g0 * k2 * 64, *w1 = w0 + k2 * 64;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < k; kb += 32) {
        const size_t p = (size_t)kb / 2 * 64;
        _tile_loadd(4, x + kb, ldx * 2);
        _tile_loadd(5, w0 + p, 128);
        _tile_loadd(6, w0 + p + 32, 128);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        if (two) {
            _tile_loadd(5, w1 + p, 128);
            _tile_loadd(6, w1 + p + 32, 128);
            _tile_dpbf16ps(2, 4, 5);
            _tile_dpbf16ps(3, 4, 6);
        }
    }
    float c[16][64] __attribute__((aligned(64)));
    _tile_stored(0, &c[0][0], 256);
    _tile_stored(1, &c[0][16], 256);
    if (two) {
        _tile_stored(2, &c[0][32], 256);
        _tile_stored(3, &c[0][48], 256);
    }
    for (int j = 0; j < (two ? 4 : 2); j++) {
        const int o0 = g0 * 32 + j * 16, cnt = n - o0 < 16 ? n - o0 : 16;
        if (cnt <= 0) break;
        const __mmask16 mask = (__mmask16)((1u << cnt) - 1u);
        const __m512 bv = bias16(bias, o0, mask);
        for (int r = 0; r < m; r++) store16(y + (size_t)r * ldy + o0, mask, _mm512_load_ps(&c[r][j * 16]), bv);
    }
}

/* y = x . W^T on AMX: blocks of 64 outputs outermost (their weights, at most 64 x k x 2 bytes, stay in cache
 * for every further block of 16 rows), rows inside. */
static void amx_gemm(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias,
                     bf16 *y, int ldy) {
    const int ng = (n + 31) / 32;
    int configured = 0;
    for (int g = 0; g < ng; g += 2)
        for (int r0 = 0; r0 < rows; r0 += 16) {
            const int m = rows - r0 < 16 ? rows - r0 : 16;
            if (m != configured) amx_configure(configured = m);
            amx_block(x + (size_t)r0 * ldx, ldx, m, packed, n, k, bias, y + (size_t)r0 * ldy, ldy, g, g + 1 < ng);
        }
    _tile_release();
}

static int amx_on = -1; /* -1: not yet asked; 0: AVX512-BF16; 1: AMX */

static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* Every GEMV of this process on AMX (on = 1, where the kernel grants the tile state) or AVX512-BF16 (0);
 * on < 0 changes nothing. Returns whether AMX is now in use. */
int pdserve_use_amx(int on) {
    if (on >= 0) amx_on = on && amx_granted();
    else if (amx_on < 0) amx_on = amx_granted();
    return amx_on;
}

static inline int use_amx(int k) { return pdserve_use_amx(-1) && k % 32 == 0; }
#else
int pdserve_use_amx(int on) { (void)on; return 0; }
static inline int use_amx(int k) { (void)k; return 0; }
static void amx_gemm(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias,
                     bf16 *y, int ldy) {
    (void)x; (void)ldx; (void)rows; (void)packed; (void)n; (void)k; (void)bias; (void)y; (void)ldy;
}
#endif

/* The projection: AMX where this process uses it and k is a multiple of 32, else the AVX512-BF16 GEMV. */
static void project(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y,
                    int ldy) {
    if (use_amx(k))
        amx_gemm(x, ldx, rows, packed, n, k, bias, y, ldy);
    else
        gemv(x, ldx, rows, packed, n, k, bias, y, ldy);
}

int pdserve_bf16_gemv_available(void) { return HAVE_BF16_GEMV; }

void pdserve_bf16_gemv(const bf16 *x, int rows, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y) {
    project(x, k, rows, packed, n, k, bias, y, n);
}

/* transformers' Llama norm in bfloat16: normalise in float32, round, scale by the bfloat16 weight, round. */
static void rms_norm(const bf16 *x, const bf16 *w, float eps, int rows, int h, bf16 *y) {
    for (int r = 0; r < rows; r++) {
        const bf16 *xr = x + (size_t)r * h;
        float ss = 0.f;
        for (int i = 0; i < h; i++) ss += f32(xr[i]) * f32(xr[i]);
        const float inv = 1.0f / sqrtf(ss / (float)h + eps);
        for (int i = 0; i < h; i++) y[(size_t)r * h + i] = mul_bf16(w[i], round_bf16(f32(xr[i]) * inv));
    }
}

/* x * cos + rotate_half(x) * sin, each product and the sum rounded (bfloat16 tensor ops). */
static inline void rotary(bf16 *x, const bf16 *cos, const bf16 *sin, int d) {
    const int half = d / 2;
    bf16 tmp[512];
    memcpy(tmp, x, (size_t)d * sizeof(bf16));
    for (int i = 0; i < d; i++) {
        const bf16 rot = i < half ? (bf16)(tmp[i + half] ^ 0x8000u) : tmp[i - half];
        x[i] = add_bf16(mul_bf16(tmp[i], cos[i]), mul_bf16(rot, sin[i]));
    }
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

struct layer_weights {
    const bf16 *ln1, *qkv, *qkv_bias, *o, *ln2, *gate_up, *down;
};

/* h [rows, hidden] bfloat16, updated in place. cos/sin [rows, head_dim] bfloat16. kv: this layer's pool
 * [num_blocks, 2, kv_heads, block_size, head_dim] bfloat16 (strides in elements); slots [rows] int64.
 * scratch: at least rows * (2 * hidden + 4 * inter + (q_heads + 2 * kv_heads) * head_dim * 3) * 4 bytes.
 * Returns 0, -1 (no memory), -2 (head_dim over 512), or 1 + the sequence whose block table is out of range. */
int pdserve_llama_layer(bf16 *h, int rows, int hidden, int inter, const struct layer_weights *w, float eps,
                        int q_heads, int kv_heads, int head_dim, const bf16 *cos, const bf16 *sin, bf16 *kv,
                        int64_t s_kv, int64_t s_head, int64_t s_block, int64_t s_tok, int64_t num_blocks,
                        const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                        const int32_t *seq_lens, const int32_t *query_start, int S, int block_size, float scale,
                        void *scratch) {
    if (head_dim > 512) return -2;
    const int nq = q_heads * head_dim, nkv = kv_heads * head_dim, nqkv = nq + 2 * nkv;
    bf16 *x = scratch;                                  /* [rows, hidden] normed input */
    bf16 *qkv = x + (size_t)rows * hidden;              /* [rows, nqkv] */
    bf16 *attn = qkv + (size_t)rows * nqkv;             /* [rows, nq] */
    bf16 *gu = attn + (size_t)rows * nq;                /* [rows, 2 * inter] */
    bf16 *act = gu + (size_t)rows * 2 * inter;          /* [rows, inter] */
    bf16 *proj = act + (size_t)rows * inter;            /* [rows, hidden] */
    float *qf = (float *)(proj + (size_t)rows * hidden + 16); /* [rows, nq] float32 */
    qf = (float *)(((uintptr_t)qf + 63) & ~(uintptr_t)63);
    float *of = qf + (size_t)rows * nq;

    rms_norm(h, w->ln1, eps, rows, hidden, x);
    project(x, hidden, rows, w->qkv, nqkv, hidden, w->qkv_bias, qkv, nqkv);
    for (int r = 0; r < rows; r++) {
        bf16 *row = qkv + (size_t)r * nqkv;
        const bf16 *c = cos + (size_t)r * head_dim, *s = sin + (size_t)r * head_dim;
        for (int hd = 0; hd < q_heads + kv_heads; hd++) rotary(row + (size_t)hd * head_dim, c, s, head_dim);
        for (int i = 0; i < nq; i++) qf[(size_t)r * nq + i] = f32(row[i]);
        const int64_t slot = slots[r], blk = slot / block_size, off = slot % block_size;
        for (int g = 0; g < kv_heads; g++) {
            bf16 *kdst = kv + blk * s_block + g * s_head + off * s_tok;
            memcpy(kdst, row + nq + (size_t)g * head_dim, (size_t)head_dim * sizeof(bf16));
            memcpy(kdst + s_kv, row + nq + nkv + (size_t)g * head_dim, (size_t)head_dim * sizeof(bf16));
        }
    }
    int rc = pdserve_paged_attention(qf, of, kv, 1, s_kv, s_head, s_block, s_tok, num_blocks, block_tables, bt_stride,
                                     seq_lens, query_start, S, q_heads, kv_heads, head_dim, block_size, scale, 0,
                                     0.0f, NULL);
    if (rc) return rc;
    for (size_t i = 0; i < (size_t)rows * nq; i++) attn[i] = round_bf16(of[i]);
    project(attn, nq, rows, w->o, hidden, nq, NULL, proj, hidden);
    for (size_t i = 0; i < (size_t)rows * hidden; i++) h[i] = add_bf16(h[i], proj[i]);

    rms_norm(h, w->ln2, eps, rows, hidden, x);
    project(x, hidden, rows, w->gate_up, 2 * inter, hidden, NULL, gu, 2 * inter);
    for (int r = 0; r < rows; r++) {
        const bf16 *g = gu + (size_t)r * 2 * inter, *u = g + inter;
        for (int i = 0; i < inter; i++)
            act[(size_t)r * inter + i] = mul_bf16(round_bf16(silu(f32(g[i]))), u[i]);
    }
    project(act, inter, rows, w->down, hidden, inter, NULL, proj, hidden);
    for (size_t i = 0; i < (size_t)rows * hidden; i++) h[i] = add_bf16(h[i], proj[i]);
    return 0;
}
