/* Sampling's randomness and its plain draw on the CPU: one pass per vocabulary row instead of a dozen torch ops.
 *
 * A sampled token is the exponential race argmax(p / E) (`pdserve.sampling`, `kernels/spec_verify.py`): p the
 * processed distribution of the row, E i.i.d. Exp(1) noise that is a function of (seed, position) alone, so the
 * same token comes out whichever worker and whichever path (plain, speculative) draws that position. Made with
 * torch, the noise of one row takes a seeded generator, a uniform per vocabulary entry and a log; with the
 * softmax before it, sampling was a large part of a batched decode step (docs/PERFORMANCE.md, "Sampling").
 *
 * The noise here is counter-based: E[i] = -log(1 - u), u the top 24 bits of splitmix64's output function applied
 * to key + (i + 1) * golden ratio, times 2^-24 (1 - u is exact in float32); key is the position's 64-bit key
 * (`pdserve.sampling.position_key`). Any element is computed on its own, in any order, on any number of lanes, and
 * the same bits come out everywhere: the integer part is exact, and the log is written out in float32 operations
 * (`log_positive`) that `pdserve.sampling.exp_noise_torch`, the fallback without a compiler, repeats op for op.
 *
 * `pdserve_sample_race` draws rows whose distribution is the temperature-scaled softmax alone (no top-k, top-p or
 * min-p: `pdserve.sampling` sends only those here) with the arithmetic of `spec_verify.process_logits`: y = x / T,
 * e = exp(y - max y), p = e / sum e, then argmax(p / E), first index on ties, as torch's argmax. What it can differ
 * in from torch is the order of the one sum and the last bit of exp and log, so a token differs only where two
 * candidates' p / E sit within a few ulps of each other.
 *
 * Built by kernels/cpu_attention.build_library (plain C: any CPU, vectorised by the compiler where it can).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#if defined(PDSERVE_LIBMVEC)
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

#define GOLDEN 0x9E3779B97F4A7C15ull

/* log(x) for a positive normal float32, in plain float32 operations (no library call, no fused multiply-add:
 * -std=c11 keeps the compiler from contracting them), so every lane, the scalar tail and torch's replica of it
 * (`pdserve.sampling.exp_noise_torch`) round alike, bit for bit. x = 2^k * m with m in [sqrt(2)/2, sqrt(2)),
 * f = m - 1, log(m) = log(1 + f) = 2 atanh(f / (2 + f)) by its series to s^9; under one ulp (musl's logf and
 * its constants, each exactly a float32). */
static inline float log_positive(float x) {
    union { float f; int32_t i; } v = {x};
    const int32_t ix = v.i + (0x3f800000 - 0x3f3504f3);
    const float k = (float)((ix >> 23) - 0x7f);
    v.i = (ix & 0x007fffff) + 0x3f3504f3;
    const float f = v.f - 1.0f, s = f / (2.0f + f), z = s * s, w = z * z;
    const float t1 = w * (0x1.999c26p-2f + w * 0x1.f13c4cp-3f);
    const float t2 = z * (0x1.555554p-1f + w * 0x1.23d3dcp-2f);
    const float hfsq = 0.5f * f * f;
    return s * (hfsq + (t2 + t1)) + k * 0x1.2fefa2p-17f - hfsq + f + k * 0x1.62e3p-1f;
}

static inline float exp_noise_at(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * GOLDEN;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float one_minus_u = (float)(16777216u - (uint32_t)(z >> 40)) * (1.0f / 16777216.0f); /* exact, >= 2^-24 */
    const float e = -log_positive(one_minus_u);
    return e > FLT_MIN ? e : FLT_MIN; /* u = 0 gives 0: the race must never divide by it */
}

/* out[i] = the Exp(1) noise of element i < n under `key` */
void pdserve_exp_noise(uint64_t key, int n, float *out) {
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = exp_noise_at(key, (uint64_t)i);
}

/* For each of `rows` rows of logits (row r at x + r * ld, `vocab` wide, float32): the race winner of the row's
 * temperature-scaled softmax (temperature[r] > 0) against the noise of keys[r], into out[r]. scratch: vocab
 * floats. Returns 0, or 1 + the first row whose scaled logits have no finite maximum (nothing was drawn for it
 * or after it: the caller draws those with torch). */
int pdserve_sample_race(const float *x, int64_t ld, int rows, int vocab, const float *temperature,
                        const uint64_t *keys, float *scratch, int64_t *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * ld;
        const float t = temperature[r];
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int i = 0; i < vocab; i++) {
            const float y = xr[i] / t;
            scratch[i] = y;
            m = y > m ? y : m;
        }
        if (!isfinite(m)) return 1 + r;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < vocab; i++) {
            const float e = expf(scratch[i] - m);
            scratch[i] = e;
            s += e;
        }
        const uint64_t key = keys[r];
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int i = 0; i < vocab; i++) {
            const float v = (scratch[i] / s) / exp_noise_at(key, (uint64_t)i);
            scratch[i] = v;
            top = v > top ? v : top;
        }
        int best = 0;
        while (best < vocab - 1 && scratch[best] != top) best++; /* the first index holding the maximum */
        out[r] = best;
    }
    return 0;
}
