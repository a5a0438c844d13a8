/* One Llama-style decoder layer of a small bfloat16 step (decode, verification) in one native call.
 *
 * transformers runs a layer as some forty torch ops and their Python; at one to a few rows on a CPU that
 * costs more than the layer's matmuls (docs/PERFORMANCE.md, "Native decoder layer"). Here a layer is: norm,
 * q/k/v projection (+ bias), rotary embedding, K/V written into the paged pool, attention (decode rows:
 * cpu_attention.c's paged kernel; a prompt chunk of more than 16 rows: cpu_chunk_attention.c's tiles, both
 * included), o projection, residual, norm, gate/up projection, SiLU * up, down projection, residual. Every
 * intermediate is rounded to bfloat16 where transformers' bfloat16 modules round it, so the layer computes
 * what theirs does up to the summation order of the matmuls and reductions.
 *
 * A layer's phases split over the threads the process may use now (`run_items`, below): one on its own
 * core, two when the prefill worker borrows decode's idle core for a prompt or decode runs on prefill's
 * while it has none (pdserve.cpulease). Prompts are why a chunk has an attention kernel of its own and the
 * elementwise passes run 16 lanes: with the decode kernel and scalar passes, those two were a large part of a
 * prompt's time (docs/PERFORMANCE.md, "Native decoder layer").
 *
 * Projections are GEMVs over weights packed for AVX512-BF16 (`pack`): groups of 32 outputs, each holding,
 * for every pair of inputs, the 32 outputs' two weights side by side, which `vdpbf16ps` multiplies with a
 * broadcast pair of activations into 2 x 16 float32 sums at once. The weights stream from memory exactly once
 * per step however many rows (up to 8 per pass; a block is re-read from cache for more).
 *
 * Where the CPU has AMX (Sapphire Rapids and later) and the kernel grants this process its tile state, the
 * same packed weights feed AMX tiles instead: each 32-input stretch of a group's rows is one 16 x 64-byte B
 * tile read with a 128-byte stride, so `tdpbf16ps` multiplies up to 16 rows by 32 outputs' weights per pair
 * of tile loads, where the AVX512-BF16 GEMV is compute-bound past a few rows (docs/PERFORMANCE.md, "AMX"). A
 * process uses one path for every step, whatever its row count, so a sequence's logits never depend on what
 * shares its batch.
 */
#define _GNU_SOURCE /* pthread_sigmask, clock_gettime, syscall under -std=c11 */
#include "cpu_attention.c"
#include "cpu_chunk_attention.c"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <signal.h>
#include <sched.h>
#include <limits.h>
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t bf16;

/* A spin-wait's pause: the instruction for it where there is one. immintrin.h (which declares _mm_pause) is
 * included above only for AVX-512 builds, and an undeclared _mm_pause compiled to a call of a symbol no library
 * has: the .so then failed to load on every CPU without AVX-512. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

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

/* A row's experts: the top k of softmax(logits [E]) (ties: the lower index), their probabilities renormalised
 * over the k where `norm`; `p` is E floats of scratch. In float32, in a fixed order. */
static void route_row(const float *logits, int E, int K, int norm, float *p, int *sel, float *prob) {
    float m = -INFINITY, sum = 0.0f;
    for (int e = 0; e < E; e++) m = logits[e] > m ? logits[e] : m;
    for (int e = 0; e < E; e++) p[e] = expf(logits[e] - m), sum += p[e];
    for (int e = 0; e < E; e++) p[e] /= sum;
    for (int k = 0; k < K; k++) {
        int best = 0;
        for (int e = 1; e < E; e++) best = p[e] > p[best] ? e : best;
        sel[k] = best, prob[k] = p[best], p[best] = -1.0f;
    }
    if (norm) {
        float total = 0.0f;
        for (int k = 0; k < K; k++) total += prob[k];
        for (int k = 0; k < K; k++) prob[k] /= total;
    }
}

/* The rows that chose expert e, in row order, and which of their k slots it is; returns how many. */
static int expert_rows(const int *sel, int rows, int K, int e, int *idx, int *slot) {
    int n = 0;
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < K; k++)
            if (sel[r * K + k] == e) idx[n] = r, slot[n] = k, n++;
    return n;
}

static uint8_t *kept_moe; /* the experts' scratch, kept between calls (main thread) */
static size_t kept_moe_cap;

/* GELU, tanh approximation, as torch's CPU kernel computes it in float32 */
static inline float gelu_tanh(float x) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
    const float cube = x * x * x;
    return 0.5f * x * (1.0f + tanhf(beta * (x + kappa * cube)));
}

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

/* y = x . W^T for `rows` rows and the outputs of groups g0..g1-1: output groups outermost, passes of up to 8
 * rows inside, so a group's weights come from memory once per step and from cache for every further pass; the
 * row count of a pass a compile-time constant, so its accumulators stay in registers. */
static void gemv(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y,
                 int ldy, int g0, int g1) {
    for (int g = g0; g < g1; g++)
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
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_BF16_GEMV 1
/* x86-64-v3 (AVX2 + FMA: Zen 3 and older, client CPUs, pre-Cooper Lake Xeons) over the same packed weights:
 * each 32-bit lane of a packed pair holds one output's two bfloat16 weights, which widen to float32 with one
 * shift (the even input's) and one mask (the odd's), so the weights still stream as bfloat16, half the bytes
 * of a float32 copy. Each output adds its two products per pair as vdpbf16ps defines it: the odd input's, then
 * the even's, each product exact in float32 and each sum one FMA's rounding. */
static inline __m256 widen_even(__m256i u) { return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)); }
static inline __m256 widen_odd(__m256i u) { return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u))); }

/* y[0][o] for the 32 outputs of group g, one row (decode): the group's weights one stream, 4 accumulators */
static void gemv_row(const bf16 *x, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y, int g) {
    const int k2 = k / 2;
    __m256 acc[4];
    for (int j = 0; j < 4; j++) acc[j] = _mm256_setzero_ps();
    const bf16 *wp = packed + (size_t)g * k2 * 64;
    for (int p = 0; p < k2; p++) {
        const __m256 xe = _mm256_set1_ps(f32(x[2 * p])), xo = _mm256_set1_ps(f32(x[2 * p + 1]));
        for (int j = 0; j < 4; j++) {
            const __m256i u = _mm256_loadu_si256((const __m256i *)(wp + (size_t)p * 64 + j * 16));
            acc[j] = _mm256_fmadd_ps(xo, widen_odd(u), acc[j]);
            acc[j] = _mm256_fmadd_ps(xe, widen_even(u), acc[j]);
        }
    }
    float out[32];
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
    const int o0 = g * 32, m = n - o0 < 32 ? n - o0 : 32;
    for (int o = 0; o < m; o++) y[o0 + o] = round_bf16(out[o] + (bias ? f32(bias[o0 + o]) : 0.0f));
}

/* y[r][o] for 16 outputs (half `half` of group g) and rows < ROWS <= 4, x already widened to float32 (xf, row
 * stride k): 8 accumulators, 4 widened weights, and activations broadcast straight from memory (load ports,
 * not the vector pipes the FMAs need) */
static inline __attribute__((always_inline)) void gemv_tile(const float *xf, int k, const bf16 *packed, int n,
                                                            const bf16 *bias, bf16 *y, int ldy, int g, int half,
                                                            const int ROWS) {
    const int k2 = k / 2;
    __m256 acc[4][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const bf16 *wp = packed + (size_t)g * k2 * 64 + half * 32;
    for (int p = 0; p < k2; p++) {
        const __m256i u0 = _mm256_loadu_si256((const __m256i *)(wp + (size_t)p * 64));
        const __m256i u1 = _mm256_loadu_si256((const __m256i *)(wp + (size_t)p * 64 + 16));
        const __m256 o0 = widen_odd(u0), e0 = widen_even(u0), o1 = widen_odd(u1), e1 = widen_even(u1);
        for (int r = 0; r < ROWS; r++) {
            const __m256 xo = _mm256_broadcast_ss(xf + (size_t)r * k + 2 * p + 1);
            acc[r][0] = _mm256_fmadd_ps(xo, o0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xo, o1, acc[r][1]);
            const __m256 xe = _mm256_broadcast_ss(xf + (size_t)r * k + 2 * p);
            acc[r][0] = _mm256_fmadd_ps(xe, e0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xe, e1, acc[r][1]);
        }
    }
    float out[4][16];
    for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(out[r], acc[r][0]), _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    const int o0 = g * 32 + half * 16, m = n - o0 < 16 ? n - o0 : 16;
    for (int r = 0; r < ROWS; r++)
        for (int o = 0; o < m; o++)
            y[(size_t)r * ldy + o0 + o] = round_bf16(out[r][o] + (bias ? f32(bias[o0 + o]) : 0.0f));
}

static __thread float *tl_xf;
static __thread size_t tl_xf_cap;

/* y = x . W^T for `rows` rows and the outputs of groups g0..g1-1. One row streams each group once
 * (`gemv_row`); more rows go in passes of 4, each pass's activations widened to float32 once, each group's
 * weights from memory once and from cache for further passes. Every output sums its pairs in input order with
 * the same FMAs on either path, so the row count never changes a result. */
static void gemv(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y,
                 int ldy, int g0, int g1) {
    if (rows == 1) {
        for (int g = g0; g < g1; g++) gemv_row(x, packed, n, k, bias, y, g);
        return;
    }
    const size_t need = (size_t)4 * k;
    if (need > tl_xf_cap) {
        float *buf = realloc(tl_xf, need * sizeof(float));
        if (!buf) { /* no memory for the widened rows: one row at a time, the same sums */
            for (int r = 0; r < rows; r++)
                for (int g = g0; g < g1; g++) gemv_row(x + (size_t)r * ldx, packed, n, k, bias, y + (size_t)r * ldy, g);
            return;
        }
        tl_xf = buf, tl_xf_cap = need;
    }
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const int m = rows - r0 < 4 ? rows - r0 : 4;
        for (int r = 0; r < m; r++)
            for (int i = 0; i < k; i++) tl_xf[(size_t)r * k + i] = f32(x[(size_t)(r0 + r) * ldx + i]);
        bf16 *yr = y + (size_t)r0 * ldy;
        for (int g = g0; g < g1; g++)
            for (int half = 0; half < 2; half++) {
                if (g * 32 + half * 16 >= n) break;
                switch (m) {
                case 1: gemv_tile(tl_xf, k, packed, n, bias, yr, ldy, g, half, 1); break;
                case 2: gemv_tile(tl_xf, k, packed, n, bias, yr, ldy, g, half, 2); break;
                case 3: gemv_tile(tl_xf, k, packed, n, bias, yr, ldy, g, half, 3); break;
                default: gemv_tile(tl_xf, k, packed, n, bias, yr, ldy, g, half, 4); break;
                }
            }
    }
}
#else
#define HAVE_BF16_GEMV 0
static void gemv(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y,
                 int ldy, int g0, int g1) {
    (void)x; (void)ldx; (void)rows; (void)packed; (void)n; (void)k; (void)bias; (void)y; (void)ldy; (void)g0; (void)g1;
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

/* tiles 0-3: the sums of 32 rows by 32 outputs (2 x 2 tiles of 16 x 16); 4, 5: two 16-row halves of x; 6, 7:
 * the group's two 16-output halves of weights */
static void amx_configure32(void) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* The sums of rows [0, 32) by the 32 outputs of group g into tiles 0-3: each pair of x and weight tiles feeds
 * four products (the 16-row block's one x tile fed four weight tiles from L2; a group's weights, 32 x k x 2
 * bytes, stay in L1 for every further 32 rows). Tiles configured by amx_configure32. */
static inline void amx_sums32(const bf16 *x, int ldx, const bf16 *packed, int k, int g) {
    const size_t k2 = (size_t)k / 2;
    const bf16 *w = packed + (size_t)g * k2 * 64;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < k; kb += 32) {
        const size_t p = (size_t)kb / 2 * 64;
        _tile_loadd(4, x + kb, ldx * 2);
        _tile_loadd(6, w + p, 128);
        _tile_loadd(7, w + p + 32, 128);
        _tile_loadd(5, x + (size_t)16 * ldx + kb, ldx * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

static inline void amx_store32(float c[32][32]) {
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    _tile_stored(2, &c[16][0], 128);
    _tile_stored(3, &c[16][16], 128);
}

/* y rows [0, 32) x group g's outputs from the block's float32 sums c, plus bias, rounded */
static void amx_finish32(float c[32][32], const bf16 *bias, int n, bf16 *y, int ldy, int g) {
    for (int j = 0; j < 2; j++) {
        const int o0 = g * 32 + j * 16, cnt = n - o0 < 16 ? n - o0 : 16;
        if (cnt <= 0) break;
        const __mmask16 mask = (__mmask16)((1u << cnt) - 1u);
        const __m512 bv = bias16(bias, o0, mask);
        for (int r = 0; r < 32; r++) store16(y + (size_t)r * ldy + o0, mask, _mm512_load_ps(&c[r][j * 16]), bv);
    }
}

/* y = x . W^T on AMX for the outputs of groups g0..g1-1. Rows in blocks of 32 per group (amx_sums32), the
 * remaining < 32 in blocks of up to 16 rows by 64 outputs (their weights, at most 64 x k x 2 bytes, in cache for
 * the next block). Tile state is the calling thread's: configured here, released at the end. */
static void amx_gemm(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias,
                     bf16 *y, int ldy, int g0, int g1) {
    const int full = rows / 32 * 32;
    if (full) {
        /* block b's sums are rounded into y while block b + 1's products run: the vector unit's epilogue
         * overlaps the tile unit's work instead of waiting, after each block, for its sums to reach memory */
        float c[2][32][32] __attribute__((aligned(64)));
        int pg = -1, pr = 0, cur = 0;
        amx_configure32();
        for (int g = g0; g < g1; g++)
            for (int r0 = 0; r0 < full; r0 += 32) {
                amx_sums32(x + (size_t)r0 * ldx, ldx, packed, k, g);
                if (pg >= 0) amx_finish32(c[cur ^ 1], bias, n, y + (size_t)pr * ldy, ldy, pg);
                amx_store32(c[cur]);
                pg = g, pr = r0, cur ^= 1;
            }
        amx_finish32(c[cur ^ 1], bias, n, y + (size_t)pr * ldy, ldy, pg);
    }
    int configured = 0;
    for (int g = g0; g < g1; g += 2)
        for (int r0 = full; r0 < rows; r0 += 16) {
            const int m = rows - r0 < 16 ? rows - r0 : 16;
            if (m != configured) amx_configure(configured = m);
            amx_block(x + (size_t)r0 * ldx, ldx, m, packed, n, k, bias, y + (size_t)r0 * ldy, ldy, g, g + 1 < g1);
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
                     bf16 *y, int ldy, int g0, int g1) {
    (void)x; (void)ldx; (void)rows; (void)packed; (void)n; (void)k; (void)bias; (void)y; (void)ldy; (void)g0; (void)g1;
}
#endif

/* ---- threads ---------------------------------------------------------------------------------------------
 * A step's work split over the threads the process may use now (`pdserve_native_threads`: the prefill worker
 * adds decode's idle core for a step it borrows, pdserve.cpulease). Every phase of a layer is a list of
 * independent items (a pair of output groups of a projection, a few rows of an elementwise pass, a tile of a
 * prompt's attention, a decode sequence's attention) that the threads claim one at a time from one atomic
 * ticket, so a helper the scheduler delays takes fewer items rather than stalling the step: the caller runs
 * whatever nobody claimed and waits only for items already begun. Which thread computes an item never changes
 * its arithmetic, so results do not depend on the thread count.
 * The ticket packs gen (20 bits) | threads (4) | items (20) | next (20): a claim is one compare-and-swap that
 * also proves the phase it belongs to is still the current one. Helpers spin briefly between phases (a layer's
 * phases are microseconds apart), then sleep on a futex, so a lent core is handed back within SPIN_NS. */
#define MAX_THREADS 15
#define SPIN_NS 50000

typedef void (*item_fn)(const void *ctx, int item);

static struct {
    _Atomic uint64_t ticket;
    _Atomic int done;
    _Atomic int sleepers;
    _Atomic uint32_t wake;
    item_fn fn;
    const void *ctx;
    uint32_t gen;
    int helpers, wanted;
    const _Atomic int32_t *lender; /* threads another process lends now (pdserve.cpulease's lent-back word), or NULL */
    uint32_t start_gen[MAX_THREADS];
} pool = {.wanted = 1};

#define T_GEN(t) ((uint32_t)((t) >> 44))
#define T_THREADS(t) ((int)(((t) >> 40) & 0xf))
#define T_ITEMS(t) ((int)(((t) >> 20) & 0xfffff))
#define T_NEXT(t) ((int)((t) & 0xfffff))

static void futex(_Atomic uint32_t *word, int op, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)word, op, val, NULL, NULL, 0);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Claim and run items of phase `gen` while there are any and thread `index` takes part in it. */
static void claim(int index, uint32_t gen) {
    uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    for (;;) {
        if (T_GEN(t) != gen || index >= T_THREADS(t) || T_NEXT(t) >= T_ITEMS(t)) return;
        if (atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire)) {
            pool.fn(pool.ctx, T_NEXT(t)); /* the phase is still gen's: it ends only when this item is done */
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
            t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        }
    }
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = pool.start_gen[index];
    for (;;) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        if (T_GEN(t) == seen) {
            const uint64_t until = now_ns() + SPIN_NS;
            for (int spins = 0; T_GEN(t) == seen; spins++) {
                cpu_relax();
                if ((spins & 255) == 255 && now_ns() > until) {
                    atomic_fetch_add(&pool.sleepers, 1);
                    const uint32_t w = atomic_load(&pool.wake);
                    if (T_GEN(atomic_load(&pool.ticket)) == seen) futex(&pool.wake, FUTEX_WAIT_PRIVATE, w);
                    atomic_fetch_sub(&pool.sleepers, 1);
                    spins = 0;
                }
                t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
            }
        }
        seen = T_GEN(t);
        claim(index, seen);
    }
    return NULL;
}

static void forget_helpers(void) { pool.helpers = 0; } /* a forked child has none of its parent's threads */

/* Helpers 1..n-1 running (each blocks every signal: Python's handlers belong to its own threads). */
static int start_helpers(int n) {
    static int registered;
    if (!registered) registered = pthread_atfork(NULL, NULL, forget_helpers) == 0;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    while (pool.helpers + 1 < n) {
        const int index = pool.helpers + 1;
        pool.start_gen[index] = pool.gen;
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&th, &attr, helper_main, (void *)(intptr_t)index);
        pthread_attr_destroy(&attr);
        if (rc) break;
        pool.helpers = index;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pool.helpers + 1;
}

int pdserve_native_threads_in_use(void);

/* fn(ctx, i) for every i < items, over up to `pool.wanted` threads; returns when all are done. */
static void run_items(item_fn fn, const void *ctx, int items) {
    int T = pdserve_native_threads_in_use();
    T = T < items ? T : items;
    if (T > 1) { /* as many as could be started */
        const int have = start_helpers(T);
        T = T < have ? T : have;
    }
    if (T <= 1 || items > 0xfffff) {
        for (int i = 0; i < items; i++) fn(ctx, i);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    pool.gen = (pool.gen + 1) & 0xfffff;
    atomic_store(&pool.ticket, (uint64_t)pool.gen << 44 | (uint64_t)T << 40 | (uint64_t)items << 20);
    if (atomic_load(&pool.sleepers)) {
        atomic_fetch_add(&pool.wake, 1);
        futex(&pool.wake, FUTEX_WAKE_PRIVATE, INT_MAX);
    }
    claim(0, pool.gen);
    /* the rest are items a helper began; one the scheduler preempted (a client, the front) may be queued on
     * this very core: after a short spin, yield to it */
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < items; spins++) {
        cpu_relax();
        if (spins > 2000) sched_yield();
    }
}

/* The threads native steps use from now on (n >= 1; at most MAX_THREADS + 1); n <= 0 changes nothing.
 * Returns the count in force. */
int pdserve_native_threads(int n) {
    if (n > 0) pool.wanted = n < MAX_THREADS + 1 ? n : MAX_THREADS + 1;
    return pool.wanted;
}

/* Threads lent by another process, read at every phase: `word` (an int32 in memory shared with it, the
 * count it lends now, 0 while it works) is added to `pdserve_native_threads`'s count; NULL: none. */
void pdserve_native_lender(const int32_t *word) { pool.lender = (const _Atomic int32_t *)word; }

/* The threads a native phase would use now: pdserve_native_threads's count plus what is lent. */
int pdserve_native_threads_in_use(void) {
    const _Atomic int32_t *lender = pool.lender;
    const int32_t lent = lender ? atomic_load_explicit(lender, memory_order_relaxed) : 0;
    const int T = pool.wanted + (lent > 0 ? lent : 0);
    return T < MAX_THREADS + 1 ? T : MAX_THREADS + 1;
}

/* ---- projections ----------------------------------------------------------------------------------------- */

struct proj_task {
    const bf16 *x, *packed, *bias;
    bf16 *y;
    int ldx, rows, n, k, ldy, amx;
};

/* item i: the outputs of groups 2i and 2i + 1 (AMX's block of 64 outputs) */
static void proj_item(const void *ctx, int i) {
    const struct proj_task *p = ctx;
    const int ng = (p->n + 31) / 32, g1 = 2 * i + 2 < ng ? 2 * i + 2 : ng;
    if (p->amx)
        amx_gemm(p->x, p->ldx, p->rows, p->packed, p->n, p->k, p->bias, p->y, p->ldy, 2 * i, g1);
    else
        gemv(p->x, p->ldx, p->rows, p->packed, p->n, p->k, p->bias, p->y, p->ldy, 2 * i, g1);
}

/* The projection: AMX where this process uses it and k is a multiple of 32, else the AVX512-BF16 GEMV. */
static void project(const bf16 *x, int ldx, int rows, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y,
                    int ldy) {
    const struct proj_task p = {x, packed, bias, y, ldx, rows, n, k, ldy, use_amx(k)};
    run_items(proj_item, &p, ((n + 31) / 32 + 1) / 2);
}

int pdserve_bf16_gemv_available(void) { return HAVE_BF16_GEMV; }

/* The instruction set this build's projections run on: "amx", "avx512-bf16", "avx2-fma", or "" (none). */
const char *pdserve_native_isa(void) {
#if defined(__AVX512BF16__)
    return pdserve_use_amx(-1) ? "amx" : "avx512-bf16";
#elif HAVE_BF16_GEMV
    return "avx2-fma";
#else
    return "";
#endif
}

void pdserve_bf16_gemv(const bf16 *x, int rows, const bf16 *packed, int n, int k, const bf16 *bias, bf16 *y) {
    project(x, k, rows, packed, n, k, bias, y, n);
}

#if HAVE_BF16_GEMV
#if defined(__AVX512BF16__)
/* ---- elementwise, 16 lanes at a time: every product and sum rounded to bfloat16 where transformers'
 * bfloat16 tensor ops round it (vcvtneps2bf16 rounds to nearest even, as torch does). ---------------------- */

static inline __mmask16 tail_mask(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

static inline __m512 load_bf16(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m512 rounded(__m512 v) { /* v rounded to bfloat16, as float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline void store_bf16(bf16 *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* transformers' Llama norm in bfloat16: normalise in float32, round, scale by the bfloat16 weight, round. */
static void rms_norm_row(const bf16 *x, const bf16 *w, float eps, int h, bf16 *y) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < h; i += 16) {
        const __m512 v = load_bf16(x + i, tail_mask(h - i));
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)h + eps));
    for (int i = 0; i < h; i += 16) {
        const __mmask16 m = tail_mask(h - i);
        store_bf16(y + i, m, _mm512_mul_ps(load_bf16(w + i, m), rounded(_mm512_mul_ps(load_bf16(x + i, m), inv))));
    }
}

/* Gemma's norm in bfloat16: normalise and scale by (1 + weight) (`w1`, float32) in float32, one rounding. */
static void gemma_norm_row(const bf16 *x, const float *w1, float eps, int h, bf16 *y) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < h; i += 16) {
        const __m512 v = load_bf16(x + i, tail_mask(h - i));
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)h + eps));
    for (int i = 0; i < h; i += 16) {
        const __mmask16 m = tail_mask(h - i);
        store_bf16(y + i, m, _mm512_mul_ps(_mm512_mul_ps(load_bf16(x + i, m), inv), _mm512_maskz_loadu_ps(m, w1 + i)));
    }
}

/* h += p, rounded */
static void residual_row(bf16 *h, const bf16 *p, int n) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        store_bf16(h + i, m, _mm512_add_ps(load_bf16(h + i, m), load_bf16(p + i, m)));
    }
}

/* x * cos + rotate_half(x) * sin, each product and the sum rounded (bfloat16 tensor ops). */
static void rotary(bf16 *x, const bf16 *cos, const bf16 *sin, int d) {
    const int half = d / 2;
    if (half % 16 == 0) {
        const __m512 sign = _mm512_set1_ps(-0.0f);
        for (int i = 0; i < half; i += 16) {
            const __m512 a = load_bf16(x + i, 0xffff), b = load_bf16(x + half + i, 0xffff);
            const __m512 lo = _mm512_add_ps(rounded(_mm512_mul_ps(a, load_bf16(cos + i, 0xffff))),
                                            rounded(_mm512_xor_ps(_mm512_mul_ps(b, load_bf16(sin + i, 0xffff)), sign)));
            const __m512 hi = _mm512_add_ps(rounded(_mm512_mul_ps(b, load_bf16(cos + half + i, 0xffff))),
                                            rounded(_mm512_mul_ps(a, load_bf16(sin + half + i, 0xffff))));
            store_bf16(x + i, 0xffff, lo);
            store_bf16(x + half + i, 0xffff, hi);
        }
        return;
    }
    bf16 tmp[512];
    memcpy(tmp, x, (size_t)d * sizeof(bf16));
    for (int i = 0; i < d; i++) {
        const bf16 rot = i < half ? (bf16)(tmp[i + half] ^ 0x8000u) : tmp[i - half];
        x[i] = add_bf16(mul_bf16(tmp[i], cos[i]), mul_bf16(rot, sin[i]));
    }
}

/* act = round(silu(g)) * u, rounded */
static void silu_row(const bf16 *g, const bf16 *u, int n, bf16 *act) {
    float v[16] __attribute__((aligned(64)));
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_store_ps(v, load_bf16(g + i, m));
#pragma omp simd simdlen(16) aligned(v : 64)
        for (int j = 0; j < 16; j++) v[j] = v[j] / (1.0f + expf(-v[j]));
        store_bf16(act + i, m, _mm512_mul_ps(rounded(_mm512_load_ps(v)), load_bf16(u + i, m)));
    }
}

/* act = round(gelu_tanh(g)) * u, rounded (Gemma's gelu_pytorch_tanh, in torch's order) */
static void gelu_row(const bf16 *g, const bf16 *u, int n, bf16 *act) {
    float v[16] __attribute__((aligned(64)));
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_store_ps(v, load_bf16(g + i, m));
        for (int j = 0; j < 16; j++) v[j] = gelu_tanh(v[j]);
        store_bf16(act + i, m, _mm512_mul_ps(rounded(_mm512_load_ps(v)), load_bf16(u + i, m)));
    }
}


/* a row widened to float32, and float32 rounded to bfloat16 */
static void widen_row(const bf16 *x, float *y, int n) {
    for (int j = 0; j < n; j += 16) _mm512_storeu_ps(y + j, load_bf16(x + j, tail_mask(n - j)));
}

static void round_row(const float *x, bf16 *y, int n) {
    for (int j = 0; j < n; j += 16) {
        const __mmask16 m = tail_mask(n - j);
        store_bf16(y + j, m, _mm512_maskz_loadu_ps(m, x + j));
    }
}

#else
/* ---- elementwise, portable C the compiler vectorises: the same roundings as the AVX-512 passes above, and
 * the norm's sum of squares in their order (16 lanes of FMAs, then the lanes added as a tree: i + 8, i + 4,
 * i + 2, then the last two), so the two builds normalise a row to the same bits. ------------------------ */

static void rms_norm_row(const bf16 *x, const bf16 *w, float eps, int h, bf16 *y) {
    float ss[16] = {0};
    int i = 0;
    for (; i + 16 <= h; i += 16)
        for (int l = 0; l < 16; l++) ss[l] = fmaf(f32(x[i + l]), f32(x[i + l]), ss[l]);
    for (int l = 0; i + l < h; l++) ss[l] = fmaf(f32(x[i + l]), f32(x[i + l]), ss[l]);
    for (int w2 = 8; w2 >= 2; w2 /= 2)
        for (int l = 0; l < w2; l++) ss[l] += ss[l + w2];
    const float inv = 1.0f / sqrtf((ss[0] + ss[1]) / (float)h + eps);
#pragma omp simd
    for (int j = 0; j < h; j++) y[j] = round_bf16(f32(w[j]) * f32(round_bf16(f32(x[j]) * inv)));
}

static void gemma_norm_row(const bf16 *x, const float *w1, float eps, int h, bf16 *y) {
    float ss[16] = {0};
    int i = 0;
    for (; i + 16 <= h; i += 16)
        for (int l = 0; l < 16; l++) ss[l] = fmaf(f32(x[i + l]), f32(x[i + l]), ss[l]);
    for (int l = 0; i + l < h; l++) ss[l] = fmaf(f32(x[i + l]), f32(x[i + l]), ss[l]);
    for (int w2 = 8; w2 >= 2; w2 /= 2)
        for (int l = 0; l < w2; l++) ss[l] += ss[l + w2];
    const float inv = 1.0f / sqrtf((ss[0] + ss[1]) / (float)h + eps);
#pragma omp simd
    for (int j = 0; j < h; j++) y[j] = round_bf16(f32(x[j]) * inv * w1[j]);
}

static void residual_row(bf16 *h, const bf16 *p, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) h[i] = round_bf16(f32(h[i]) + f32(p[i]));
}

static void rotary(bf16 *x, const bf16 *cos, const bf16 *sin, int d) {
    const int half = d / 2;
    bf16 tmp[512];
    memcpy(tmp, x, (size_t)d * sizeof(bf16));
    for (int i = 0; i < d; i++) {
        const bf16 rot = i < half ? (bf16)(tmp[i + half] ^ 0x8000u) : tmp[i - half];
        x[i] = add_bf16(mul_bf16(tmp[i], cos[i]), mul_bf16(rot, sin[i]));
    }
}

static void silu_row(const bf16 *g, const bf16 *u, int n, bf16 *act) {
    float v[16] __attribute__((aligned(64)));
    for (int i = 0; i < n; i += 16) {
        const int m = n - i < 16 ? n - i : 16;
        for (int j = 0; j < 16; j++) v[j] = j < m ? f32(g[i + j]) : 0.0f;
#pragma omp simd simdlen(8) aligned(v : 64)
        for (int j = 0; j < 16; j++) v[j] = v[j] / (1.0f + expf(-v[j]));
        for (int j = 0; j < m; j++) act[i + j] = round_bf16(f32(round_bf16(v[j])) * f32(u[i + j]));
    }
}

static void gelu_row(const bf16 *g, const bf16 *u, int n, bf16 *act) {
    for (int j = 0; j < n; j++) act[j] = round_bf16(f32(round_bf16(gelu_tanh(f32(g[j])))) * f32(u[j]));
}

static void widen_row(const bf16 *x, float *y, int n) {
#pragma omp simd
    for (int j = 0; j < n; j++) y[j] = f32(x[j]);
}

static void round_row(const float *x, bf16 *y, int n) {
#pragma omp simd
    for (int j = 0; j < n; j++) y[j] = round_bf16(x[j]);
}
#endif

/* ---- the layer --------------------------------------------------------------------------------------------- */

/* A layer's weights and what sets its attention apart: per-head RMS norms of q and k before the rotary (Qwen3;
 * NULL: none), a sliding window of `window` keys (<= 0: full attention), a soft cap of the scores (<= 0: none),
 * and one sink logit per query head (gpt-oss; NULL: none). The float32 layer's struct has the same fields. */
struct layer_weights {
    const bf16 *ln1, *qkv, *qkv_bias, *o, *ln2, *gate_up, *down;
    const bf16 *q_norm, *k_norm;
    const float *sinks;
    const bf16 *post_attn, *post_ffn; /* Gemma's norms of the attention's and the MLP's outputs, or NULL */
    int window;
    float softcap;
    int gemma_norm; /* norms are Gemma's: every norm weight above is float32 (1 + weight) */
    int gelu;       /* the MLP's gate takes GELU (tanh approximation), not SiLU */
    /* a mixture of experts in place of the MLP (Qwen3-MoE; router NULL: the dense gate_up/down above): the router's
     * packed [hidden -> n_experts], each expert's packed gate/up and down one after another (strides in elements),
     * top_k experts a row, their probabilities renormalised over the k where norm_topk */
    const bf16 *router, *experts_gate_up, *experts_down;
    int64_t expert_gu_stride, expert_down_stride;
    int n_experts, top_k, norm_topk;
};

/* a norm of the layer, Llama's or Gemma's (whose weights are float32 1 + w) */
static inline void layer_norm_row(const struct layer_weights *w, const bf16 *x, const bf16 *weight, float eps, int h,
                                  bf16 *y) {
    if (w->gemma_norm) gemma_norm_row(x, (const float *)(const void *)weight, eps, h, y);
    else rms_norm_row(x, weight, eps, h, y);
}

#define ROWS_PER_ITEM 4 /* elementwise items: a few rows each (a row is a microsecond or less) */
#define CHUNK_MIN_ROWS 16 /* a sequence with more query rows than this takes the prompt-chunk attention kernel */
#define TILE_ROWS 16 /* query rows per item of the decode kernel */

struct attn_item { int seq, head, tile; }; /* head < 0: rows [TILE_ROWS * tile, + TILE_ROWS) by the decode kernel */

struct layer_task {
    bf16 *h;
    int rows, hidden, inter, q_heads, kv_heads, head_dim, nq, nkv, nqkv;
    const struct layer_weights *w;
    float eps, scale;
    const bf16 *cos, *sin;
    bf16 *kv;
    int64_t s_kv, s_head, s_block, s_tok, num_blocks, bt_stride;
    const int64_t *slots;
    const int32_t *block_tables, *seq_lens, *query_start;
    int block_size;
    bf16 *x, *qkv, *attn, *gu, *act, *proj;
    float *qf, *of;
    struct attn_item *items;
    uint8_t **heads; /* [S * kv_heads]: a chunk sequence's KV head's packed keys and widened values, else NULL */
    _Atomic int rc;
};

static inline int row_items(int rows) { return (rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM; }
#define FOR_ROWS(t, i, r) for (int r = (i) * ROWS_PER_ITEM, r##_end = r + ROWS_PER_ITEM < (t)->rows ? r + ROWS_PER_ITEM : (t)->rows; r < r##_end; r++)

static void norm1_item(const void *ctx, int i) {
    const struct layer_task *t = ctx;
    FOR_ROWS(t, i, r) layer_norm_row(t->w, t->h + (size_t)r * t->hidden, t->w->ln1, t->eps, t->hidden,
                                     t->x + (size_t)r * t->hidden);
}

/* rotary on q and k, q widened to float32 for the decode kernel, K and V written to the row's slot */
static void rope_item(const void *ctx, int i) {
    const struct layer_task *t = ctx;
    const int D = t->head_dim;
    FOR_ROWS(t, i, r) {
        bf16 *row = t->qkv + (size_t)r * t->nqkv;
        const bf16 *c = t->cos + (size_t)r * D, *s = t->sin + (size_t)r * D;
        for (int hd = 0; hd < t->q_heads + t->kv_heads; hd++) {
            const bf16 *norm = hd < t->q_heads ? t->w->q_norm : t->w->k_norm;
            if (norm) layer_norm_row(t->w, row + (size_t)hd * D, norm, t->eps, D, row + (size_t)hd * D);
            rotary(row + (size_t)hd * D, c, s, D);
        }
        widen_row(row, t->qf + (size_t)r * t->nq, t->nq);
        const int64_t slot = t->slots[r], blk = slot / t->block_size, off = slot % t->block_size;
        for (int g = 0; g < t->kv_heads; g++) {
            bf16 *kdst = t->kv + blk * t->s_block + g * t->s_head + off * t->s_tok;
            memcpy(kdst, row + t->nq + (size_t)g * D, (size_t)D * sizeof(bf16));
            memcpy(kdst + t->s_kv, row + t->nq + t->nkv + (size_t)g * D, (size_t)D * sizeof(bf16));
        }
    }
}

/* item s * kv_heads + h of the chunk sequences' packing: head h's keys packed, values widened */
static void pack_item(const void *ctx, int i) {
    const struct layer_task *t = ctx;
    const int s = i / t->kv_heads, h = i % t->kv_heads;
    uint8_t *buf = t->heads[i];
    if (!buf) return;
#if defined(HAVE_BF16_DOT)
    const int len = t->seq_lens[s], D = t->head_dim;
    const int32_t *table = t->block_tables + (int64_t)s * t->bt_stride;
    const size_t kp_bytes = (size_t)(len + 15) / 16 * 16 * (D / 2) * sizeof(uint32_t);
    pack_keys(t->kv, (int64_t)h * t->s_head, table, len, D, t->block_size, t->s_block, t->s_tok, (uint32_t *)buf);
    widen_values(t->kv, t->s_kv + (int64_t)h * t->s_head, table, len, D, t->block_size, t->s_block, t->s_tok,
                 (float *)(buf + kp_bytes));
#else
    (void)s, (void)h;
#endif
}

#if defined(HAVE_BF16_DOT)
static __thread void *tl_chunk;
static __thread size_t tl_chunk_cap;
#endif

static void attn_item(const void *ctx, int i) {
    struct layer_task *t = (struct layer_task *)ctx;
    const struct attn_item it = t->items[i];
    const int s = it.seq, q0 = t->query_start[s], n = t->query_start[s + 1] - q0, len = t->seq_lens[s], D = t->head_dim;
    if (it.head < 0) {
        /* rows a..b-1 of the sequence: a sequence of its own, ending at row b - 1's position. q also as the rotary
         * left it, in bfloat16 (the first nq elements of each qkv row): the scores take `vdpbf16ps` on the
         * stored keys where the CPU has it */
        const int a = it.tile * TILE_ROWS, b = a + TILE_ROWS < n ? a + TILE_ROWS : n;
        const int32_t rows[2] = {q0 + a, q0 + b}, seen = len - n + b;
        const int rc = pdserve_paged_attention_bq(t->qf, t->qkv, t->nqkv, t->of, t->kv, 1, t->s_kv, t->s_head,
                                                  t->s_block, t->s_tok, t->num_blocks,
                                                  t->block_tables + (int64_t)s * t->bt_stride, t->bt_stride,
                                                  &seen, rows, 1, t->q_heads, t->kv_heads, D,
                                                  t->block_size, t->scale, t->w->window, t->w->softcap,
                                                  t->w->sinks);
        if (rc) atomic_store(&t->rc, rc == 1 ? 1 + s : rc);
        return;
    }
#if defined(HAVE_BF16_DOT)
    const size_t need = chunk_scratch_bytes(len, t->q_heads / t->kv_heads, D);
    if (need > tl_chunk_cap) {
        free(tl_chunk);
        tl_chunk = malloc(need);
        tl_chunk_cap = tl_chunk ? need : 0;
        if (!tl_chunk) { atomic_store(&t->rc, -1); return; }
    }
    const uint8_t *buf = t->heads[s * t->kv_heads + it.head];
    const size_t kp_bytes = (size_t)(len + 15) / 16 * 16 * (D / 2) * sizeof(uint32_t);
    chunk_tile(t->qkv + (size_t)q0 * t->nqkv, t->nqkv, t->of + (size_t)q0 * t->nq, t->nq, (const uint32_t *)buf,
               (const float *)(buf + kp_bytes), len, n, t->q_heads, t->kv_heads, D, t->scale, it.head, it.tile, tl_chunk);
#endif
}

static void round_item(const void *ctx, int i) {
    const struct layer_task *t = ctx;
    FOR_ROWS(t, i, r) round_row(t->of + (size_t)r * t->nq, t->attn + (size_t)r * t->nq, t->nq);
}

static void resid_norm2_item(const void *ctx, int i) {
    const struct layer_task *t = ctx;
    FOR_ROWS(t, i, r) {
        bf16 *hr = t->h + (size_t)r * t->hidden, *pr = t->proj + (size_t)r * t->hidden;
        if (t->w->post_attn) layer_norm_row(t->w, pr, t->w->post_attn, t->eps, t->hidden, pr);
        residual_row(hr, pr, t->hidden);
        layer_norm_row(t->w, hr, t->w->ln2, t->eps, t->hidden, t->x + (size_t)r * t->hidden);
    }
}

static void silu_item(const void *ctx, int i) {
    const struct layer_task *t = ctx;
    FOR_ROWS(t, i, r) {
        const bf16 *g = t->gu + (size_t)r * 2 * t->inter;
        (t->w->gelu ? gelu_row : silu_row)(g, g + t->inter, t->inter, t->act + (size_t)r * t->inter);
    }
}

static void resid_item(const void *ctx, int i) {
    const struct layer_task *t = ctx;
    FOR_ROWS(t, i, r) {
        bf16 *pr = t->proj + (size_t)r * t->hidden;
        if (t->w->post_ffn) layer_norm_row(t->w, pr, t->w->post_ffn, t->eps, t->hidden, pr);
        residual_row(t->h + (size_t)r * t->hidden, pr, t->hidden);
    }
}

/* The attention's work list and the chunk sequences' packing buffers: kept between calls (main thread). */
static struct attn_item *kept_items;
static size_t kept_items_cap;
static uint8_t *kept_heads, **kept_head_ptrs;
static size_t kept_heads_cap, kept_head_ptrs_cap;

static int grow(void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    void *p = realloc(*buf, need);
    if (!p) return -1;
    *buf = p, *cap = need;
    return 0;
}

/* Fill t->items (and t->heads): chunk sequences' tiles, largest (latest) first, then decode sequences. Built
 * without the chunk kernel, a chunk's tiles are `TILE_ROWS` items of the decode kernel (its rows computed as
 * whole-sequence calls compute them, so a prompt's logits do not depend on how it was split or cached). */
static int plan_attention(struct layer_task *t, int S, int *n_items, int *n_chunk) {
#if defined(HAVE_BF16_DOT)
    /* the chunk kernel computes full attention only: windows, soft caps and sinks take the decode kernel */
    const int D = t->head_dim, chunks_ok = D % 32 == 0 && D <= MAX_D && t->w->window <= 0 && t->w->softcap <= 0.0f &&
                                          !t->w->sinks;
#else
    const int chunks_ok = 0;
#endif
    size_t items = 0, bytes = 0;
    int chunk = 0;
    for (int s = 0; s < S; s++) {
        const int n = t->query_start[s + 1] - t->query_start[s];
        if (n <= 0) continue;
        if (chunks_ok && n > CHUNK_MIN_ROWS) {
#if defined(HAVE_BF16_DOT)
            items += (size_t)t->kv_heads * ((n + TQ - 1) / TQ);
            bytes += (size_t)t->kv_heads * chunk_head_bytes(t->seq_lens[s], D);
#endif
            chunk++;
        } else {
            items += (size_t)(n + TILE_ROWS - 1) / TILE_ROWS;
        }
    }
    if (grow((void **)&kept_items, &kept_items_cap, (items + 1) * sizeof(struct attn_item)) ||
        grow((void **)&kept_head_ptrs, &kept_head_ptrs_cap, ((size_t)S * t->kv_heads + 1) * sizeof(uint8_t *)) ||
        grow((void **)&kept_heads, &kept_heads_cap, bytes + 64))
        return -1;
    t->items = kept_items;
    t->heads = kept_head_ptrs;
#if defined(HAVE_BF16_DOT)
    uint8_t *base = (uint8_t *)(((uintptr_t)kept_heads + 63) & ~(uintptr_t)63);
    size_t at = 0;
#endif
    int k = 0;
    for (int s = 0; s < S; s++) {
        const int n = t->query_start[s + 1] - t->query_start[s], len = t->seq_lens[s];
        for (int h = 0; h < t->kv_heads; h++) t->heads[s * t->kv_heads + h] = NULL;
        if (n <= 0 || !(chunks_ok && n > CHUNK_MIN_ROWS)) continue;
        const int32_t *table = t->block_tables + (int64_t)s * t->bt_stride;
        for (int b = 0; b <= (len - 1) / t->block_size; b++)
            if (table[b] < 0 || table[b] >= t->num_blocks) return 1 + s;
#if defined(HAVE_BF16_DOT)
        for (int h = 0; h < t->kv_heads; h++, at += chunk_head_bytes(len, D)) t->heads[s * t->kv_heads + h] = base + at;
        for (int tile = (n + TQ - 1) / TQ - 1; tile >= 0; tile--)
            for (int h = 0; h < t->kv_heads; h++) t->items[k++] = (struct attn_item){s, h, tile};
#endif
    }
    for (int s = 0; s < S; s++) { /* latest rows (most keys) first */
        const int n = t->query_start[s + 1] - t->query_start[s];
        if (n <= 0 || t->heads[s * t->kv_heads]) continue;
        for (int tile = (n + TILE_ROWS - 1) / TILE_ROWS - 1; tile >= 0; tile--)
            t->items[k++] = (struct attn_item){s, -1, tile};
    }
    *n_items = k;
    *n_chunk = chunk;
    return 0;
}

/* The experts in place of the MLP, from the normed rows t->x into t->proj, as transformers' bfloat16 block:
 * router logits rounded, softmax and top-k in float32, the k probabilities rounded; each expert runs on the rows
 * that chose it (gathered: a row's products never depend on its neighbours), and a row's output adds each
 * expert's, times its probability, in expert order, every product and sum rounded. Returns 0 or -1 (memory). */
static int moe_mlp(struct layer_task *t) {
    const struct layer_weights *w = t->w;
    const int rows = t->rows, H = t->hidden, I = t->inter, E = w->n_experts, K = w->top_k;
    const size_t need = (size_t)rows * E * (2 + 4) + (size_t)rows * K * (4 + 4 + 2) + (size_t)rows * 2 * 4 +
                        (size_t)rows * (2 * H + 3 * I) * 2 + (size_t)E * 4 + 6 * 64;
    if (grow((void **)&kept_moe, &kept_moe_cap, need)) return -1;
    uint8_t *at = kept_moe;
#define CARVE(type, n) ((type *)(at = (uint8_t *)(((uintptr_t)at + 63) & ~(uintptr_t)63), at += (n) * sizeof(type), at - (n) * sizeof(type)))
    bf16 *logits = CARVE(bf16, (size_t)rows * E);
    float *lf = CARVE(float, (size_t)rows * E), *prob = CARVE(float, (size_t)rows * K), *p = CARVE(float, E);
    int *sel = CARVE(int, (size_t)rows * K), *idx = CARVE(int, rows), *slot = CARVE(int, rows);
    bf16 *wt = CARVE(bf16, (size_t)rows * K), *xe = CARVE(bf16, (size_t)rows * H), *gu = CARVE(bf16, (size_t)rows * 2 * I);
    bf16 *act = CARVE(bf16, (size_t)rows * I), *oe = CARVE(bf16, (size_t)rows * H);
#undef CARVE
    project(t->x, H, rows, w->router, E, H, NULL, logits, E);
    for (int r = 0; r < rows; r++) {
        for (int e = 0; e < E; e++) lf[(size_t)r * E + e] = f32(logits[(size_t)r * E + e]);
        route_row(lf + (size_t)r * E, E, K, w->norm_topk, p, sel + (size_t)r * K, prob + (size_t)r * K);
        for (int k = 0; k < K; k++) wt[(size_t)r * K + k] = round_bf16(prob[(size_t)r * K + k]);
    }
    memset(t->proj, 0, (size_t)rows * H * sizeof(bf16));
    for (int e = 0; e < E; e++) {
        const int n = expert_rows(sel, rows, K, e, idx, slot);
        if (!n) continue;
        for (int j = 0; j < n; j++) memcpy(xe + (size_t)j * H, t->x + (size_t)idx[j] * H, (size_t)H * sizeof(bf16));
        project(xe, H, n, w->experts_gate_up + e * w->expert_gu_stride, 2 * I, H, NULL, gu, 2 * I);
        for (int j = 0; j < n; j++)
            (w->gelu ? gelu_row : silu_row)(gu + (size_t)j * 2 * I, gu + (size_t)j * 2 * I + I, I, act + (size_t)j * I);
        project(act, I, n, w->experts_down + e * w->expert_down_stride, H, I, NULL, oe, H);
        for (int j = 0; j < n; j++) {
            bf16 *y = t->proj + (size_t)idx[j] * H;
            const bf16 c = wt[(size_t)idx[j] * K + slot[j]], *o = oe + (size_t)j * H;
            for (int d = 0; d < H; d++) y[d] = add_bf16(y[d], mul_bf16(o[d], c));
        }
    }
    return 0;
}

/* h [rows, hidden] bfloat16, updated in place. cos/sin [rows, head_dim] bfloat16. kv: this layer's pool
 * [num_blocks, 2, kv_heads, block_size, head_dim] bfloat16 (strides in elements); slots [rows] int64.
 * scratch: at least rows * (2 * hidden + 4 * inter + (q_heads + 2 * kv_heads) * head_dim * 3) * 4 bytes.
 * Runs on `pdserve_native_threads` threads. Returns 0, -1 (no memory), -2 (head_dim over 512), or 1 + the
 * sequence whose block table is out of range. */
int pdserve_llama_layer(bf16 *h, int rows, int hidden, int inter, const struct layer_weights *w, float eps,
                        int q_heads, int kv_heads, int head_dim, const bf16 *cos, const bf16 *sin, bf16 *kv,
                        int64_t s_kv, int64_t s_head, int64_t s_block, int64_t s_tok, int64_t num_blocks,
                        const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                        const int32_t *seq_lens, const int32_t *query_start, int S, int block_size, float scale,
                        void *scratch) {
    if (head_dim > 512) return -2;
    struct layer_task t = {.h = h, .rows = rows, .hidden = hidden, .inter = inter, .q_heads = q_heads,
                           .kv_heads = kv_heads, .head_dim = head_dim, .w = w, .eps = eps, .scale = scale,
                           .cos = cos, .sin = sin, .kv = kv, .s_kv = s_kv, .s_head = s_head, .s_block = s_block,
                           .s_tok = s_tok, .num_blocks = num_blocks, .bt_stride = bt_stride, .slots = slots,
                           .block_tables = block_tables, .seq_lens = seq_lens, .query_start = query_start,
                           .block_size = block_size};
    t.nq = q_heads * head_dim, t.nkv = kv_heads * head_dim, t.nqkv = t.nq + 2 * t.nkv;
    t.x = scratch;                                  /* [rows, hidden] normed input */
    t.qkv = t.x + (size_t)rows * hidden;            /* [rows, nqkv] */
    t.attn = t.qkv + (size_t)rows * t.nqkv;         /* [rows, nq] */
    t.gu = t.attn + (size_t)rows * t.nq;            /* [rows, 2 * inter] */
    t.act = t.gu + (size_t)rows * 2 * inter;        /* [rows, inter] */
    t.proj = t.act + (size_t)rows * inter;          /* [rows, hidden] */
    float *qf = (float *)(t.proj + (size_t)rows * hidden + 16); /* [rows, nq] float32 */
    t.qf = (float *)(((uintptr_t)qf + 63) & ~(uintptr_t)63);
    t.of = t.qf + (size_t)rows * t.nq;
    atomic_init(&t.rc, 0);
    const int ri = row_items(rows);

    run_items(norm1_item, &t, ri);
    project(t.x, hidden, rows, w->qkv, t.nqkv, hidden, w->qkv_bias, t.qkv, t.nqkv);
    run_items(rope_item, &t, ri);
    int n_items = 0, n_chunk = 0;
    int rc = plan_attention(&t, S, &n_items, &n_chunk);
    if (rc) return rc;
    if (n_chunk) run_items(pack_item, &t, S * kv_heads);
    run_items(attn_item, &t, n_items);
    if ((rc = atomic_load(&t.rc))) return rc;
    run_items(round_item, &t, ri);
    project(t.attn, t.nq, rows, w->o, hidden, t.nq, NULL, t.proj, hidden);
    run_items(resid_norm2_item, &t, ri);
    if (w->router) {
        if (moe_mlp(&t)) return -1;
    } else {
        project(t.x, hidden, rows, w->gate_up, 2 * inter, hidden, NULL, t.gu, 2 * inter);
        run_items(silu_item, &t, ri);
        project(t.act, inter, rows, w->down, hidden, inter, NULL, t.proj, hidden);
    }
    run_items(resid_item, &t, ri);
    return 0;
}
#else
int pdserve_llama_layer(bf16 *h, int rows, int hidden, int inter, const struct layer_weights *w, float eps,
                        int q_heads, int kv_heads, int head_dim, const bf16 *cos, const bf16 *sin, bf16 *kv,
                        int64_t s_kv, int64_t s_head, int64_t s_block, int64_t s_tok, int64_t num_blocks,
                        const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                        const int32_t *seq_lens, const int32_t *query_start, int S, int block_size, float scale,
                        void *scratch) {
    (void)h; (void)rows; (void)hidden; (void)inter; (void)w; (void)eps; (void)q_heads; (void)kv_heads;
    (void)head_dim; (void)cos; (void)sin; (void)kv; (void)s_kv; (void)s_head; (void)s_block; (void)s_tok;
    (void)num_blocks; (void)slots; (void)block_tables; (void)bt_stride; (void)seq_lens; (void)query_start;
    (void)S; (void)block_size; (void)scale; (void)scratch;
    return -2; /* built without AVX512-BF16: cpu_decoder.library() never loads it */
}
#endif

/* ---- the float32 layer ---------------------------------------------------------------------------------------
 * The same layer for a float32 model over a float32 pool, so float32 steps are row-invariant too: transformers'
 * float32 forward multiplies with oneDNN/MKL, whose kernels (and so whose summation order) change with the row
 * count, and a prompt chunk's attention went through SDPA. Here every output of a projection is one FMA chain
 * over its inputs in order, starting from zero, whatever the rows, the tile or the instruction set (AVX-512 and
 * AVX2 give the same bits); norms sum 16 lanes of FMAs then a fixed tree; attention is the paged kernel of
 * cpu_attention.c for every row, prompt chunks included, in tiles of TILE_ROWS rows computed as whole-sequence
 * calls compute them. The weights are the model's own `weight_t` ([in, out], CpuLinear's parameter), read in
 * place: no second copy of a float32 model. */
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_F32_LAYER 1
#if defined(__AVX512F__)
#define F32_TILE_OUT 32 /* outputs per register tile: 2 x 16 lanes */
#define F32_TILE_ROWS 8
static inline __mmask16 f32_lanes(int left) { /* lanes j < left */
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}
/* y[r][o0 + j] = x[r] . W[:, o0 + j] (+ bias), j < 32 (masked past n), rows r < ROWS; W [k, n] row-major */
static inline __attribute__((always_inline)) void f32_tile(const float *x, int ldx, const float *w, int n, int k,
                                                           const float *bias, float *y, int ldy, int o0,
                                                           const int ROWS) {
    const __mmask16 m0 = f32_lanes(n - o0), m1 = f32_lanes(n - o0 - 16);
    __m512 acc[2][F32_TILE_ROWS];
    for (int r = 0; r < ROWS; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    const float *wp = w + o0;
    for (int i = 0; i < k; i++) {
        const __m512 w0 = _mm512_maskz_loadu_ps(m0, wp + (size_t)i * n);
        const __m512 w1 = _mm512_maskz_loadu_ps(m1, wp + (size_t)i * n + 16);
        for (int r = 0; r < ROWS; r++) {
            const __m512 xv = _mm512_set1_ps(x[(size_t)r * ldx + i]);
            acc[0][r] = _mm512_fmadd_ps(xv, w0, acc[0][r]);
            acc[1][r] = _mm512_fmadd_ps(xv, w1, acc[1][r]);
        }
    }
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + o0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + o0 + 16) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; r++) {
        _mm512_mask_storeu_ps(y + (size_t)r * ldy + o0, m0, _mm512_add_ps(acc[0][r], b0));
        _mm512_mask_storeu_ps(y + (size_t)r * ldy + o0 + 16, m1, _mm512_add_ps(acc[1][r], b1));
    }
}

/* The same sums for a full tile of 8 x 16 outputs and rows r < ROWS <= 3 (24 accumulators): per input, the tile's
 * weights are 512 contiguous bytes of W's row, so a step streams W in long runs and each load feeds ROWS FMAs */
#define F32_WIDE_OUT 128
#define F32_WIDE_ROWS 3
static inline __attribute__((always_inline)) void f32_wide(const float *x, int ldx, const float *w, int n, int k,
                                                           const float *bias, float *y, int ldy, int o0,
                                                           const int ROWS) {
    __m512 acc[F32_WIDE_ROWS][8];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < 8; v++) acc[r][v] = _mm512_setzero_ps();
    const float *wp = w + o0;
    for (int i = 0; i < k; i++) {
        const float *wi = wp + (size_t)i * n;
        __m512 xv[F32_WIDE_ROWS];
        for (int r = 0; r < ROWS; r++) xv[r] = _mm512_set1_ps(x[(size_t)r * ldx + i]);
        for (int v = 0; v < 8; v++) {
            const __m512 wv = _mm512_loadu_ps(wi + 16 * v);
            for (int r = 0; r < ROWS; r++) acc[r][v] = _mm512_fmadd_ps(xv[r], wv, acc[r][v]);
        }
    }
    for (int v = 0; v < 8; v++) {
        const __m512 b = bias ? _mm512_loadu_ps(bias + o0 + 16 * v) : _mm512_setzero_ps();
        for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(y + (size_t)r * ldy + o0 + 16 * v, _mm512_add_ps(acc[r][v], b));
    }
}
#else
#define F32_TILE_OUT 16 /* 2 x 8 lanes */
#define F32_TILE_ROWS 6
static inline __m256i lanes_below(int left) { /* AVX2 mask: lanes j < left */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline __attribute__((always_inline)) void f32_tile(const float *x, int ldx, const float *w, int n, int k,
                                                           const float *bias, float *y, int ldy, int o0,
                                                           const int ROWS) {
    const __m256i m0 = lanes_below(n - o0), m1 = lanes_below(n - o0 - 8);
    __m256 acc[F32_TILE_ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float *wp = w + o0;
    for (int i = 0; i < k; i++) {
        const __m256 w0 = _mm256_maskload_ps(wp + (size_t)i * n, m0);
        const __m256 w1 = _mm256_maskload_ps(wp + (size_t)i * n + 8, m1);
        for (int r = 0; r < ROWS; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + (size_t)r * ldx + i);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    const __m256 b0 = bias ? _mm256_maskload_ps(bias + o0, m0) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_maskload_ps(bias + o0 + 8, m1) : _mm256_setzero_ps();
    for (int r = 0; r < ROWS; r++) {
        _mm256_maskstore_ps(y + (size_t)r * ldy + o0, m0, _mm256_add_ps(acc[r][0], b0));
        _mm256_maskstore_ps(y + (size_t)r * ldy + o0 + 8, m1, _mm256_add_ps(acc[r][1], b1));
    }
}

/* a full tile of 4 x 8 outputs and rows r < ROWS <= 3 (12 accumulators), as the AVX-512 one */
#define F32_WIDE_OUT 32
#define F32_WIDE_ROWS 3
static inline __attribute__((always_inline)) void f32_wide(const float *x, int ldx, const float *w, int n, int k,
                                                           const float *bias, float *y, int ldy, int o0,
                                                           const int ROWS) {
    __m256 acc[F32_WIDE_ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm256_setzero_ps();
    const float *wp = w + o0;
    for (int i = 0; i < k; i++) {
        const float *wi = wp + (size_t)i * n;
        __m256 xv[F32_WIDE_ROWS];
        for (int r = 0; r < ROWS; r++) xv[r] = _mm256_broadcast_ss(x + (size_t)r * ldx + i);
        for (int v = 0; v < 4; v++) {
            const __m256 wv = _mm256_loadu_ps(wi + 8 * v);
            for (int r = 0; r < ROWS; r++) acc[r][v] = _mm256_fmadd_ps(xv[r], wv, acc[r][v]);
        }
    }
    for (int v = 0; v < 4; v++) {
        const __m256 b = bias ? _mm256_loadu_ps(bias + o0 + 8 * v) : _mm256_setzero_ps();
        for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(y + (size_t)r * ldy + o0 + 8 * v, _mm256_add_ps(acc[r][v], b));
    }
}
#endif

#define F32_ITEM_OUT 128 /* outputs per work item of a projection */

/* y = x . W (+ bias) for `rows` rows and outputs [o_begin, o_end): tiles of outputs outermost, passes of up to
 * F32_WIDE_ROWS rows inside, so a tile's weights come from memory once per step and from cache after; outputs
 * past the last full wide tile in narrow (masked) tiles. Every tile sums an output's products the same way. */
static void f32_gemm(const float *x, int ldx, int rows, const float *w, int n, int k, const float *bias, float *y,
                     int ldy, int o_begin, int o_end) {
    for (; o_begin + F32_WIDE_OUT <= o_end; o_begin += F32_WIDE_OUT)
        for (int r0 = 0; r0 < rows; r0 += F32_WIDE_ROWS) {
            const int m = rows - r0 < F32_WIDE_ROWS ? rows - r0 : F32_WIDE_ROWS;
            const float *xr = x + (size_t)r0 * ldx;
            float *yr = y + (size_t)r0 * ldy;
            switch (m) {
            case 1: f32_wide(xr, ldx, w, n, k, bias, yr, ldy, o_begin, 1); break;
            case 2: f32_wide(xr, ldx, w, n, k, bias, yr, ldy, o_begin, 2); break;
            default: f32_wide(xr, ldx, w, n, k, bias, yr, ldy, o_begin, 3); break;
            }
        }
    for (int o0 = o_begin; o0 < o_end; o0 += F32_TILE_OUT)
        for (int r0 = 0; r0 < rows; r0 += F32_TILE_ROWS) {
            const int m = rows - r0 < F32_TILE_ROWS ? rows - r0 : F32_TILE_ROWS;
            const float *xr = x + (size_t)r0 * ldx;
            float *yr = y + (size_t)r0 * ldy;
            switch (m) {
            case 1: f32_tile(xr, ldx, w, n, k, bias, yr, ldy, o0, 1); break;
            case 2: f32_tile(xr, ldx, w, n, k, bias, yr, ldy, o0, 2); break;
            case 3: f32_tile(xr, ldx, w, n, k, bias, yr, ldy, o0, 3); break;
            case 4: f32_tile(xr, ldx, w, n, k, bias, yr, ldy, o0, 4); break;
            case 5: f32_tile(xr, ldx, w, n, k, bias, yr, ldy, o0, 5); break;
#if F32_TILE_ROWS > 6
            case 6: f32_tile(xr, ldx, w, n, k, bias, yr, ldy, o0, 6); break;
            case 7: f32_tile(xr, ldx, w, n, k, bias, yr, ldy, o0, 7); break;
#endif
            default: f32_tile(xr, ldx, w, n, k, bias, yr, ldy, o0, F32_TILE_ROWS); break;
            }
        }
}

struct f32_proj_task {
    const float *x, *w, *bias;
    float *y;
    int ldx, rows, n, k, ldy;
};

static void f32_proj_item(const void *ctx, int i) {
    const struct f32_proj_task *p = ctx;
    const int o1 = (i + 1) * F32_ITEM_OUT < p->n ? (i + 1) * F32_ITEM_OUT : p->n;
    f32_gemm(p->x, p->ldx, p->rows, p->w, p->n, p->k, p->bias, p->y, p->ldy, i * F32_ITEM_OUT, o1);
}

static void f32_project(const float *x, int ldx, int rows, const float *w, int n, int k, const float *bias, float *y,
                        int ldy) {
    const struct f32_proj_task p = {x, w, bias, y, ldx, rows, n, k, ldy};
    run_items(f32_proj_item, &p, (n + F32_ITEM_OUT - 1) / F32_ITEM_OUT);
}

/* transformers' Llama norm in float32: y = w * (x * rsqrt(mean(x^2) + eps)); the sum of squares as 16 lanes of
 * FMAs (lane l: elements l, l + 16, ...) added as a tree (l + 8, + 4, + 2, then the last two) */
static void f32_rms_norm_row(const float *x, const float *w, float eps, int n, float *y) {
    float ss[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) ss[l] = fmaf(x[i + l], x[i + l], ss[l]);
    for (int l = 0; i + l < n; l++) ss[l] = fmaf(x[i + l], x[i + l], ss[l]);
    for (int w2 = 8; w2 >= 2; w2 /= 2)
        for (int l = 0; l < w2; l++) ss[l] += ss[l + w2];
    const float inv = 1.0f / sqrtf((ss[0] + ss[1]) / (float)n + eps);
#pragma omp simd
    for (int j = 0; j < n; j++) y[j] = w[j] * (x[j] * inv);
}

/* dst = x * cos + rotate_half(x) * sin (dst may be x) */
static void f32_rotary(const float *x, const float *cos, const float *sin, int d, float *dst) {
    const int half = d / 2;
    float tmp[512];
    memcpy(tmp, x, (size_t)d * sizeof(float));
#pragma omp simd
    for (int i = 0; i < half; i++) dst[i] = tmp[i] * cos[i] - tmp[i + half] * sin[i];
#pragma omp simd
    for (int i = half; i < d; i++) dst[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

struct f32_layer_weights { /* as struct layer_weights; projections [in, out]; Gemma's norms as 1 + weight, so
                             * one norm serves both: x * inv * (1 + w) is w' * (x * inv) in float32 */
    const float *ln1, *qkv, *qkv_bias, *o, *ln2, *gate_up, *down;
    const float *q_norm, *k_norm;
    const float *sinks;
    const float *post_attn, *post_ffn;
    int window;
    float softcap;
    int gemma_norm;
    int gelu;
    const float *router, *experts_gate_up, *experts_down; /* [hidden, n_experts], each expert [in, out] */
    int64_t expert_gu_stride, expert_down_stride;
    int n_experts, top_k, norm_topk;
};

struct f32_task {
    float *h;
    int rows, hidden, inter, q_heads, kv_heads, head_dim, nq, nkv, nqkv;
    const struct f32_layer_weights *w;
    float eps, scale;
    const float *cos, *sin;
    float *kv;
    int64_t s_kv, s_head, s_block, s_tok, num_blocks, bt_stride;
    const int64_t *slots;
    const int32_t *block_tables, *seq_lens, *query_start;
    int block_size;
    float *x, *qkv, *qf, *of, *gu, *act, *proj;
    struct attn_item *items;
    _Atomic int rc;
};

static void f32_norm1_item(const void *ctx, int i) {
    const struct f32_task *t = ctx;
    FOR_ROWS(t, i, r) f32_rms_norm_row(t->h + (size_t)r * t->hidden, t->w->ln1, t->eps, t->hidden,
                                       t->x + (size_t)r * t->hidden);
}

/* rotary on q (into qf, the attention's query rows) and k (into the row's slot), V copied to its slot */
static void f32_rope_item(const void *ctx, int i) {
    const struct f32_task *t = ctx;
    const int D = t->head_dim;
    FOR_ROWS(t, i, r) {
        const float *row = t->qkv + (size_t)r * t->nqkv;
        const float *c = t->cos + (size_t)r * D, *s = t->sin + (size_t)r * D;
        float normed[512];
        for (int hd = 0; hd < t->q_heads; hd++) {
            const float *q = row + (size_t)hd * D;
            if (t->w->q_norm) f32_rms_norm_row(q, t->w->q_norm, t->eps, D, normed), q = normed;
            f32_rotary(q, c, s, D, t->qf + (size_t)r * t->nq + (size_t)hd * D);
        }
        const int64_t slot = t->slots[r], blk = slot / t->block_size, off = slot % t->block_size;
        for (int g = 0; g < t->kv_heads; g++) {
            float *kdst = t->kv + blk * t->s_block + g * t->s_head + off * t->s_tok;
            const float *k = row + t->nq + (size_t)g * D;
            if (t->w->k_norm) f32_rms_norm_row(k, t->w->k_norm, t->eps, D, normed), k = normed;
            f32_rotary(k, c, s, D, kdst);
            memcpy(kdst + t->s_kv, row + t->nq + t->nkv + (size_t)g * D, (size_t)D * sizeof(float));
        }
    }
}

/* item: TILE_ROWS query rows of one sequence, computed as a call for the sequence ending at its last row */
static void f32_attn_item(const void *ctx, int i) {
    struct f32_task *t = (struct f32_task *)ctx;
    const struct attn_item it = t->items[i];
    const int s = it.seq, q0 = t->query_start[s], n = t->query_start[s + 1] - q0, len = t->seq_lens[s];
    const int a = it.tile * TILE_ROWS, b = a + TILE_ROWS < n ? a + TILE_ROWS : n;
    const int32_t rows[2] = {q0 + a, q0 + b}, seen = len - n + b;
    const int rc = pdserve_paged_attention(t->qf, t->of, t->kv, 0, t->s_kv, t->s_head, t->s_block, t->s_tok,
                                           t->num_blocks, t->block_tables + (int64_t)s * t->bt_stride, t->bt_stride,
                                           &seen, rows, 1, t->q_heads, t->kv_heads, t->head_dim, t->block_size,
                                           t->scale, t->w->window, t->w->softcap, t->w->sinks);
    if (rc) atomic_store(&t->rc, rc == 1 ? 1 + s : rc);
}

static void f32_resid_norm2_item(const void *ctx, int i) {
    const struct f32_task *t = ctx;
    FOR_ROWS(t, i, r) {
        float *hr = t->h + (size_t)r * t->hidden, *p = t->proj + (size_t)r * t->hidden;
        if (t->w->post_attn) f32_rms_norm_row(p, t->w->post_attn, t->eps, t->hidden, p);
#pragma omp simd
        for (int j = 0; j < t->hidden; j++) hr[j] += p[j];
        f32_rms_norm_row(hr, t->w->ln2, t->eps, t->hidden, t->x + (size_t)r * t->hidden);
    }
}

static void f32_silu_item(const void *ctx, int i) {
    const struct f32_task *t = ctx;
    FOR_ROWS(t, i, r) {
        const float *g = t->gu + (size_t)r * 2 * t->inter, *u = g + t->inter;
        float *act = t->act + (size_t)r * t->inter;
        if (t->w->gelu) {
            for (int j = 0; j < t->inter; j++) act[j] = gelu_tanh(g[j]) * u[j];
        } else {
#pragma omp simd
            for (int j = 0; j < t->inter; j++) act[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        }
    }
}

static void f32_resid_item(const void *ctx, int i) {
    const struct f32_task *t = ctx;
    FOR_ROWS(t, i, r) {
        float *hr = t->h + (size_t)r * t->hidden, *p = t->proj + (size_t)r * t->hidden;
        if (t->w->post_ffn) f32_rms_norm_row(p, t->w->post_ffn, t->eps, t->hidden, p);
#pragma omp simd
        for (int j = 0; j < t->hidden; j++) hr[j] += p[j];
    }
}

/* The experts in place of the MLP in float32: transformers' block (router, softmax, top-k, each expert on the
 * rows that chose it, a row's outputs added in expert order), t->x into t->proj. Returns 0 or -1 (memory). */
static int f32_moe_mlp(struct f32_task *t) {
    const struct f32_layer_weights *w = t->w;
    const int rows = t->rows, H = t->hidden, I = t->inter, E = w->n_experts, K = w->top_k;
    const size_t need = ((size_t)rows * E + (size_t)rows * K + E + (size_t)rows * (2 * H + 3 * I)) * 4 +
                        ((size_t)rows * K + 2 * (size_t)rows) * 4 + 8 * 64;
    if (grow((void **)&kept_moe, &kept_moe_cap, need)) return -1;
    uint8_t *at = kept_moe;
#define CARVE(type, n) ((type *)(at = (uint8_t *)(((uintptr_t)at + 63) & ~(uintptr_t)63), at += (n) * sizeof(type), at - (n) * sizeof(type)))
    float *logits = CARVE(float, (size_t)rows * E), *prob = CARVE(float, (size_t)rows * K), *p = CARVE(float, E);
    int *sel = CARVE(int, (size_t)rows * K), *idx = CARVE(int, rows), *slot = CARVE(int, rows);
    float *xe = CARVE(float, (size_t)rows * H), *gu = CARVE(float, (size_t)rows * 2 * I);
    float *act = CARVE(float, (size_t)rows * I), *oe = CARVE(float, (size_t)rows * H);
#undef CARVE
    f32_project(t->x, H, rows, w->router, E, H, NULL, logits, E);
    for (int r = 0; r < rows; r++)
        route_row(logits + (size_t)r * E, E, K, w->norm_topk, p, sel + (size_t)r * K, prob + (size_t)r * K);
    memset(t->proj, 0, (size_t)rows * H * sizeof(float));
    for (int e = 0; e < E; e++) {
        const int n = expert_rows(sel, rows, K, e, idx, slot);
        if (!n) continue;
        for (int j = 0; j < n; j++) memcpy(xe + (size_t)j * H, t->x + (size_t)idx[j] * H, (size_t)H * sizeof(float));
        f32_project(xe, H, n, w->experts_gate_up + e * w->expert_gu_stride, 2 * I, H, NULL, gu, 2 * I);
        for (int j = 0; j < n; j++) {
            const float *g = gu + (size_t)j * 2 * I, *u = g + I;
            float *a = act + (size_t)j * I;
            if (w->gelu) {
                for (int d = 0; d < I; d++) a[d] = gelu_tanh(g[d]) * u[d];
            } else {
#pragma omp simd
                for (int d = 0; d < I; d++) a[d] = g[d] / (1.0f + expf(-g[d])) * u[d];
            }
        }
        f32_project(act, I, n, w->experts_down + e * w->expert_down_stride, H, I, NULL, oe, H);
        for (int j = 0; j < n; j++) {
            float *y = t->proj + (size_t)idx[j] * H;
            const float c = prob[(size_t)idx[j] * K + slot[j]], *o = oe + (size_t)j * H;
            for (int d = 0; d < H; d++) y[d] += o[d] * c;
        }
    }
    return 0;
}

/* h [rows, hidden] float32, updated in place; cos/sin [rows, head_dim] float32; kv: this layer's pool
 * [num_blocks, 2, kv_heads, block_size, head_dim] float32; slots [rows] int64. scratch: at least
 * pdserve_f32_scratch_bytes(...) bytes. Returns 0, -1 (no memory), -2 (head_dim over 512), or 1 + the sequence
 * whose block table is out of range. */
int pdserve_llama_layer_f32(float *h, int rows, int hidden, int inter, const struct f32_layer_weights *w, float eps,
                            int q_heads, int kv_heads, int head_dim, const float *cos, const float *sin, float *kv,
                            int64_t s_kv, int64_t s_head, int64_t s_block, int64_t s_tok, int64_t num_blocks,
                            const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                            const int32_t *seq_lens, const int32_t *query_start, int S, int block_size, float scale,
                            void *scratch) {
    if (head_dim > 512) return -2;
    struct f32_task t = {.h = h, .rows = rows, .hidden = hidden, .inter = inter, .q_heads = q_heads,
                         .kv_heads = kv_heads, .head_dim = head_dim, .w = w, .eps = eps, .scale = scale,
                         .cos = cos, .sin = sin, .kv = kv, .s_kv = s_kv, .s_head = s_head, .s_block = s_block,
                         .s_tok = s_tok, .num_blocks = num_blocks, .bt_stride = bt_stride, .slots = slots,
                         .block_tables = block_tables, .seq_lens = seq_lens, .query_start = query_start,
                         .block_size = block_size};
    t.nq = q_heads * head_dim, t.nkv = kv_heads * head_dim, t.nqkv = t.nq + 2 * t.nkv;
    t.x = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63); /* [rows, hidden] normed input */
    t.qkv = t.x + (size_t)rows * hidden;                          /* [rows, nqkv] */
    t.qf = t.qkv + (size_t)rows * t.nqkv;                         /* [rows, nq] rotated queries */
    t.of = t.qf + (size_t)rows * t.nq;                            /* [rows, nq] attention output */
    t.gu = t.of + (size_t)rows * t.nq;                            /* [rows, 2 * inter] */
    t.act = t.gu + (size_t)rows * 2 * inter;                      /* [rows, inter] */
    t.proj = t.act + (size_t)rows * inter;                        /* [rows, hidden] */
    atomic_init(&t.rc, 0);
    size_t n_items = 0;
    for (int s = 0; s < S; s++) {
        const int n = query_start[s + 1] - query_start[s];
        if (n > 0) n_items += (size_t)(n + TILE_ROWS - 1) / TILE_ROWS;
    }
    if (grow((void **)&kept_items, &kept_items_cap, (n_items + 1) * sizeof(struct attn_item))) return -1;
    t.items = kept_items;
    int k = 0;
    for (int s = 0; s < S; s++) { /* latest rows (most keys) first */
        const int n = query_start[s + 1] - query_start[s];
        for (int tile = (n + TILE_ROWS - 1) / TILE_ROWS - 1; tile >= 0; tile--)
            t.items[k++] = (struct attn_item){s, -1, tile};
    }
    const int ri = row_items(rows);
    run_items(f32_norm1_item, &t, ri);
    f32_project(t.x, hidden, rows, w->qkv, t.nqkv, hidden, w->qkv_bias, t.qkv, t.nqkv);
    run_items(f32_rope_item, &t, ri);
    run_items(f32_attn_item, &t, k);
    int rc = atomic_load(&t.rc);
    if (rc) return rc;
    f32_project(t.of, t.nq, rows, w->o, hidden, t.nq, NULL, t.proj, hidden);
    run_items(f32_resid_norm2_item, &t, ri);
    if (w->router) {
        if (f32_moe_mlp(&t)) return -1;
    } else {
        f32_project(t.x, hidden, rows, w->gate_up, 2 * inter, hidden, NULL, t.gu, 2 * inter);
        run_items(f32_silu_item, &t, ri);
        f32_project(t.act, inter, rows, w->down, hidden, inter, NULL, t.proj, hidden);
    }
    run_items(f32_resid_item, &t, ri);
    return 0;
}

/* y [rows, n] = x [rows, k] . W [k, n] (+ bias [n]), float32: the head, and tests */
void pdserve_f32_gemm(const float *x, int rows, const float *w, int n, int k, const float *bias, float *y) {
    f32_project(x, k, rows, w, n, k, bias, y, n);
}

/* y [rows, n] = the Llama norm of x [rows, n] by weight w */
void pdserve_f32_rms_norm(const float *x, int rows, const float *w, float eps, int n, float *y) {
    for (int r = 0; r < rows; r++) f32_rms_norm_row(x + (size_t)r * n, w, eps, n, y + (size_t)r * n);
}
#else
#define HAVE_F32_LAYER 0
#endif

int pdserve_f32_layer_available(void) { return HAVE_F32_LAYER; }

/* bytes of scratch pdserve_llama_layer_f32 needs for `rows` rows */
int64_t pdserve_f32_scratch_bytes(int rows, int hidden, int inter, int q_heads, int kv_heads, int head_dim) {
    const int64_t nq = (int64_t)q_heads * head_dim, nqkv = nq + 2LL * kv_heads * head_dim;
    return (int64_t)rows * (2LL * hidden + nqkv + 2 * nq + 3LL * inter) * 4 + 64;
}
