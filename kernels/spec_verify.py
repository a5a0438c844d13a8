"""Fused speculative verification: accept/reject k drafted tokens per request against the target's logits.

One public function, :func:`verify`, with a torch-level contract. Below it sit a fused Triton kernel
(:func:`verify_triton`, one launch over the whole batch) and a plain-torch reference
(:func:`verify_reference`) of the SAME signature; tests compare the two on fresh random inputs and
check statistically that sampled output follows the target distribution exactly.

Contract (B requests, K = max drafted tokens, V = vocabulary):

``target_logits``    [B, K+1, V] float32. Row j is the target's logits for the distribution of draft
                     position j; row ``num_draft_tokens[b]`` gives the bonus distribution.
``draft_token_ids``  [B, K] int64. Entries at positions >= num_draft_tokens[b] are ignored.
``num_draft_tokens`` [B] int32 in [0, K]: ragged k per request.
``draft_probs``      [B, K, V] float32, or None. None = deterministic proposals (n-gram / prompt
                     lookup): q is one-hot on the drafted token. Otherwise q[b, j] is the draft model's
                     processed distribution (see :func:`process_logits`) the draft token was sampled from.
``temperature``      [B] float32. <= 0 means greedy for that request: draft j is accepted iff it equals
                     argmax of the RAW target logits row j (first index on ties); at the first mismatch
                     the output is that argmax; if all are accepted the bonus is argmax of row k.
                     Greedy requests ignore q, top-k, top-p and the randomness.
``min_p``            [B] float32, keyword, optional (None = off everywhere). Keep tokens whose probability is
                     at least min_p times the most likely one's, i.e. whose scaled logit is >= max + log(min_p)
                     (vLLM's min-p, applied after temperature and before top-k / top-p). 0 = off.
``top_k``            [B] int32. Keep tokens whose (temperature-scaled) logit >= the k-th largest
                     (ties kept). 0 or >= V = off.
``top_p``            [B] float32. Keep the most probable tokens whose mass reaches top_p, defined by a
                     THRESHOLD: every token with probability >= the threshold is kept, the threshold
                     being the largest one whose kept mass is >= top_p. At least one token is always
                     kept; >= 1.0 = off. This equals Hugging Face's "smallest sorted prefix" except at
                     exact ties at the boundary (kept here, cut arbitrarily there); the threshold form
                     lets the kernel find it by bisection over the vocabulary, without a sort.
``uniform_accept``   [B, K] float32 in [0, 1): draft j is accepted iff ``u[b, j] * q(x) < p(x)``,
                     i.e. u < min(1, p/q) (q(x) = 1 for deterministic drafts).
``exp_noise``        [B, V] or [B, K+1, V] float32, i.i.d. Exp(1), strictly positive. Sampling is the
                     exponential race ``argmax(dist / E)``: it needs no normalisation, and it makes the
                     reference and the kernel share randomness, so they return IDENTICAL tokens.
                     [B, V] (one noise row per request): the ONE sample per request is drawn with
                     E = exp_noise[b], dist being the residual max(0, p_j - q_j) at the first rejection j
                     (p_j if the residual is all zero) or the bonus distribution p_k when every draft was
                     accepted.
                     [B, K+1, V] (per-position noise, row j for draft position j, row K_b for the bonus):
                     * ``draft_probs is None`` and temperature > 0: the COUPLED rule. Position j's token is
                       the race winner w_j = argmax(p_j / exp_noise[b, j]); draft j is accepted iff it
                       equals w_j, and the first w_j that differs (or w_{K_b}) is the emitted token;
                       uniform_accept is ignored. P(accept x) = p_j(x) = min(1, p/q) for a one-hot q, and
                       on rejection w_j is distributed as p_j without x (the residual), so the output is
                       exactly the target distribution; and when row j holds the noise plain sampling
                       would draw at that position (:func:`pdserve.sampling.position_noise`), the output is
                       token for token what plain sampling emits, whatever k was chosen.
                     * ``draft_probs`` given: standard rejection (u * q < p) as above, the one sample drawn
                       with E = exp_noise[b, j] at the row j where the request stops (first rejection, or
                       K_b for the bonus).
                     * greedy rows ignore it, as always.
                     draft_probs is per call, so one call verifies either point-mass drafts (coupled for
                     sampled rows) or draft-model drafts; a mixed batch is two calls.
                     uniform_accept must be independent of the noise rows it is used with.

Sampled rows use p = process_logits(target row): temperature -> min-p -> top-k -> top-p -> softmax. Logits
processors that depend on the tokens before a position (penalties, a format mask) are the caller's: it passes
rows already processed for each position (`pdserve.processors`); greedy rows then take their argmax.

Returns ``(output_token_ids [B, K+1] int64, num_accepted [B] int32)``: the first num_accepted[b] + 1
entries of row b are the accepted drafts followed by the correction (or bonus) token; the rest are -1.

Both implementations compute the same arithmetic (x / T, exp(x - max) / sum, u * q < p, dist / noise);
they can differ only in float rounding of sums (block order), so a token can differ only when a
decision sits within an ulp of its boundary.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["verify", "verify_reference", "verify_triton", "verify_greedy", "draw_randomness", "process_logits"]


# --------------------------------------------------------------------------------------------------
# The shared definition of a processed distribution (plain torch)
# --------------------------------------------------------------------------------------------------


def _scaled_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   log_min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [N, V] -> temperature-scaled logits with tokens cut by min-p / top-k / top-p set to -inf.

    `log_min_p` [N]: log(min_p), -inf where min-p is off (see `_log_min_p`).

    Greedy rows (temperature <= 0) are scaled by 1 and left uncut; callers treat them separately.
    """
    x = logits.float()
    n, vocab = x.shape
    sampled = temperature > 0
    x = x / torch.where(sampled, temperature.float(), torch.ones_like(temperature, dtype=torch.float32))[:, None]
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)

    if log_min_p is not None:
        m_on = sampled & (log_min_p > float("-inf"))
        if bool(m_on.any()):
            floor = x.max(dim=-1, keepdim=True).values + log_min_p.float()[:, None]
            x = torch.where(m_on[:, None] & (x < floor), neg_inf, x)

    k = top_k.to(torch.int64)
    k_on = sampled & (k > 0) & (k < vocab)
    if bool(k_on.any()):
        # k-th largest value; every token at least as large is kept (ties included)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k.clamp(1, vocab) - 1)[:, None])
        x = torch.where(k_on[:, None] & (x < kth), neg_inf, x)

    p_on = sampled & (top_p < 1.0)
    if bool(p_on.any()):
        m = x.max(dim=-1, keepdim=True).values
        sorted_x = x.sort(dim=-1, descending=True).values
        # unnormalised mass of the i most likely tokens, compared with top_p * total (as the kernel does)
        cum = torch.exp(sorted_x - m).cumsum(dim=-1)
        target = top_p.float()[:, None] * cum[:, -1:]
        first = (cum < target).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
        thresh = sorted_x.gather(1, first)
        x = torch.where(p_on[:, None] & (x < thresh), neg_inf, x)
    return x


def _softmax(x: torch.Tensor) -> torch.Tensor:
    # written out (not torch.softmax) so the arithmetic is the kernel's: exp(x - max) / sum
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def _log_min_p(min_p: torch.Tensor | None, n: int, device) -> torch.Tensor | None:
    """min_p [N] -> log(min_p) [N] float32 (-inf where off), computed once on the host side of both
    implementations so that they compare scaled logits with the very same floor."""
    if min_p is None:
        return None
    if tuple(min_p.shape) != (n,):
        raise ValueError(f"min_p must have shape ({n},), got {tuple(min_p.shape)}")
    return torch.log(min_p.to(device=device, dtype=torch.float32))


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The target/draft distribution: logits [N, V] -> probabilities [N, V] float32.

    temperature [N] float32 (<= 0: greedy, a one-hot on the first argmax of the raw logits),
    min_p [N] float32 or None (0: off), top_k [N] int (0 or >= V: off), top_p [N] float32 (>= 1: off);
    order temperature -> min-p -> top-k -> top-p -> softmax, thresholds as in the module docstring.
    """
    probs = _softmax(_scaled_logits(logits, temperature, top_k, top_p, _log_min_p(min_p, logits.shape[0], logits.device)))
    greedy = temperature <= 0
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.float().argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def draw_randomness(batch: int, k: int, vocab: int, generator: torch.Generator | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The randomness one verify call consumes: (uniform_accept [batch, k] in [0, 1), exp_noise [batch, vocab] ~ Exp(1) > 0)."""
    uniform_accept = torch.rand(batch, k, generator=generator, dtype=torch.float32, device=device)
    u = torch.rand(batch, vocab, generator=generator, dtype=torch.float32, device=device)
    # -log(1 - u) with u in [0, 1) is Exp(1); clamp so the race never divides by zero
    exp_noise = (-torch.log1p(-u)).clamp_min_(torch.finfo(torch.float32).tiny)
    return uniform_accept, exp_noise


def _check_inputs(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p, uniform_accept, exp_noise):
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, K+1, V], got shape {tuple(target_logits.shape)}")
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    expect = {
        "draft_token_ids": (draft_token_ids, (b, k)),
        "num_draft_tokens": (num_draft_tokens, (b,)),
        "temperature": (temperature, (b,)),
        "top_k": (top_k, (b,)),
        "top_p": (top_p, (b,)),
        "uniform_accept": (uniform_accept, (b, k)),
    }
    if exp_noise.dim() == 3:
        expect["exp_noise"] = (exp_noise, (b, k1, vocab))  # per-position noise (the coupled mode)
    else:
        expect["exp_noise"] = (exp_noise, (b, vocab))
    if draft_probs is not None:
        expect["draft_probs"] = (draft_probs, (b, k, vocab))
    for name, (t, shape) in expect.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for target_logits {tuple(target_logits.shape)}, got {tuple(t.shape)}")
    return b, k, vocab


# --------------------------------------------------------------------------------------------------
# Reference (plain torch, vectorised over the batch: the unfused baseline)
# --------------------------------------------------------------------------------------------------


def verify_reference(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
                     uniform_accept, exp_noise, *, min_p=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch speculative verification; same contract as :func:`verify`."""
    b, k, vocab = _check_inputs(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p, uniform_accept, exp_noise)
    log_min_p = _log_min_p(min_p, b, target_logits.device)
    device = target_logits.device
    logits = target_logits.float()
    temperature = temperature.float()
    greedy = temperature <= 0
    n = num_draft_tokens.to(torch.int64)
    rows = torch.arange(b, device=device)

    probs = _softmax(_scaled_logits(
        logits.reshape(b * (k + 1), vocab), temperature.repeat_interleave(k + 1),
        top_k.repeat_interleave(k + 1), top_p.float().repeat_interleave(k + 1),
        None if log_min_p is None else log_min_p.repeat_interleave(k + 1),
    )).view(b, k + 1, vocab)
    raw_argmax = logits.argmax(dim=-1)  # [B, K+1]

    drafts = draft_token_ids.to(torch.int64)
    in_range = torch.arange(k, device=device)[None, :] < n[:, None]
    safe_drafts = torch.where(in_range, drafts, torch.zeros_like(drafts))
    p_x = probs[:, :k].gather(2, safe_drafts[..., None])[..., 0]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.float().gather(2, safe_drafts[..., None])[..., 0]
    accept = torch.where(greedy[:, None], drafts == raw_argmax[:, :k], uniform_accept.float() * q_x < p_x)
    per_position = exp_noise.dim() == 3
    coupled = ~greedy if (per_position and draft_probs is None) else torch.zeros_like(greedy)
    if bool(coupled.any()):
        # the coupled rule: position j's token is the race winner argmax(p_j / E_j); a draft is accepted iff it wins
        winners = (probs / exp_noise.float()).argmax(dim=-1)  # [B, K+1]
        accept = torch.where(coupled[:, None], drafts == winners[:, :k], accept)
    accept = accept & in_range
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B], in [0, n]

    # the one sampled token: residual at the first rejection, or the bonus row when all were accepted
    last = num_accepted  # row index into target_logits
    rejected = last < n
    p_last = probs[rows, last]
    if k == 0:
        q_last = torch.zeros_like(p_last)  # nothing drafted: never a rejection
    elif draft_probs is None:
        row_q = last.clamp(max=k - 1)
        q_last = torch.zeros_like(p_last)
        q_last[rows, safe_drafts[rows, row_q]] = 1.0
    else:
        q_last = draft_probs.float()[rows, last.clamp(max=k - 1)]
    residual = (p_last - q_last).clamp_min(0.0)
    use_residual = rejected & (residual.sum(dim=-1) > 0)
    dist = torch.where(use_residual[:, None], residual, p_last)
    noise_last = exp_noise.float()[rows, last] if per_position else exp_noise.float()  # [B, V]
    sampled_token = (dist / noise_last).argmax(dim=-1)
    if bool(coupled.any()):
        sampled_token = torch.where(coupled, winners[rows, last], sampled_token)
    token = torch.where(greedy, raw_argmax[rows, last], sampled_token)

    out = torch.full((b, k + 1), -1, dtype=torch.int64, device=device)
    pos = torch.arange(k + 1, device=device)[None, :]
    if k > 0:
        out[:, :k] = torch.where(pos[:, :k] < num_accepted[:, None], drafts, out[:, :k])
    out[rows, last] = token
    return out, num_accepted.to(torch.int32)


# --------------------------------------------------------------------------------------------------
# Triton kernel: one program per request, looping over the vocabulary in BLOCK_V chunks
# --------------------------------------------------------------------------------------------------


# Every division below is tl.math.div_rn (IEEE round-to-nearest), as torch divides: the GPU's default
# fp32 '/' is approximate, and the kernel must reach the reference's decisions, not merely close ones.


@triton.jit
def _key_of(x):
    # float32 -> int32 whose signed order is the float order (negative floats: flip the magnitude bits)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _float_of(key):
    # inverse of _key_of (the transform is its own inverse)
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        blk_max = tl.max(x, axis=0)
        blk_idx = tl.argmax(x, axis=0).to(tl.int32) + start
        better = blk_max > best_val  # strict: the first index wins ties, as torch.argmax
        best_idx = tl.where(better, blk_idx, best_idx)
        best_val = tl.where(better, blk_max, best_val)
    return best_idx


@triton.jit
def _row_max_min(row_ptr, temp, V, BLOCK_V: tl.constexpr):
    mx = tl.full([], float("-inf"), tl.float32)
    mn = tl.full([], float("inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.math.div_rn(tl.load(row_ptr + offs, mask=mask, other=0.0), temp)
        mx = tl.maximum(mx, tl.max(tl.where(mask, x, float("-inf")), axis=0))
        mn = tl.minimum(mn, tl.min(tl.where(mask, x, float("inf")), axis=0))
    return mx, mn


@triton.jit
def _count_at_least(row_ptr, temp, thresh, V, BLOCK_V: tl.constexpr):
    cnt = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.math.div_rn(tl.load(row_ptr + offs, mask=mask, other=0.0), temp)
        cnt += tl.sum((mask & (x >= thresh)).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _mass_at_least(row_ptr, temp, mx, thresh, V, BLOCK_V: tl.constexpr):
    # unnormalised probability mass sum(exp(x - max)) over tokens with scaled logit >= thresh
    mass = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.math.div_rn(tl.load(row_ptr + offs, mask=mask, other=0.0), temp)
        keep = mask & (x >= thresh)
        mass += tl.sum(tl.where(keep, tl.exp(tl.where(keep, x, mx) - mx), 0.0), axis=0)
    return mass


@triton.jit
def _row_distribution(row_ptr, temp, log_min_p, top_k, top_p, V, BLOCK_V: tl.constexpr):
    """Row max, keep-threshold (scaled logit) and normaliser of the processed distribution."""
    mx, mn = _row_max_min(row_ptr, temp, V, BLOCK_V)
    # min-p: the floor max + log(min_p) (log_min_p is -inf when off); the k-th largest of the whole
    # row below it cuts nothing more, above it it is the k-th largest of what min-p kept
    floor = tl.maximum(mn, mx + log_min_p)
    thresh = floor
    if (top_k > 0) & (top_k < V):
        # largest t with count(x >= t) >= k is exactly the k-th largest value: bisect on order keys
        lo = _key_of(mn).to(tl.int64)
        hi = _key_of(mx).to(tl.int64)
        while lo < hi:
            mid = lo + ((hi - lo + 1) >> 1)
            ok = _count_at_least(row_ptr, temp, _float_of(mid.to(tl.int32)), V, BLOCK_V) >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        thresh = tl.maximum(floor, _float_of(lo.to(tl.int32)))
    z = _mass_at_least(row_ptr, temp, mx, thresh, V, BLOCK_V)
    if top_p < 1.0:
        # largest t with mass(x >= t) >= top_p * z; it is a logit value, so ties at it are kept
        target = top_p * z
        lo = _key_of(thresh).to(tl.int64)
        hi = _key_of(mx).to(tl.int64)
        while lo < hi:
            mid = lo + ((hi - lo + 1) >> 1)
            ok = _mass_at_least(row_ptr, temp, mx, _float_of(mid.to(tl.int32)), V, BLOCK_V) >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        thresh = _float_of(lo.to(tl.int32))
        z = _mass_at_least(row_ptr, temp, mx, thresh, V, BLOCK_V)
    return mx, thresh, z


@triton.jit
def _race(row_ptr, temp, mx, thresh, z, noise_ptr, q_ptr, draft, use_q, V,
          HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Exponential race over p (and over the residual max(0, p - q) when use_q): argmaxes and residual mass."""
    best_p = tl.full([], float("-inf"), tl.float32)
    idx_p = tl.full([], 0, tl.int32)
    best_r = tl.full([], float("-inf"), tl.float32)
    idx_r = tl.full([], 0, tl.int32)
    res_mass = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.math.div_rn(tl.load(row_ptr + offs, mask=mask, other=0.0), temp)
        keep = mask & (x >= thresh)
        p = tl.where(keep, tl.math.div_rn(tl.exp(tl.where(keep, x, mx) - mx), z), 0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(q_ptr + offs, mask=mask & ((offs * 0 + use_q.to(tl.int32)) != 0), other=0.0)
        else:
            q = tl.where(use_q & (offs == draft), 1.0, 0.0)
        r = tl.maximum(p - q, 0.0)
        noise = tl.load(noise_ptr + offs, mask=mask, other=1.0)
        score_p = tl.where(mask, tl.math.div_rn(p, noise), -1.0)
        score_r = tl.where(mask, tl.math.div_rn(r, noise), -1.0)
        res_mass += tl.sum(r, axis=0)
        bp = tl.max(score_p, axis=0)
        ip = tl.argmax(score_p, axis=0).to(tl.int32) + start
        br = tl.max(score_r, axis=0)
        ir = tl.argmax(score_r, axis=0).to(tl.int32) + start
        better_p = bp > best_p
        idx_p = tl.where(better_p, ip, idx_p)
        best_p = tl.where(better_p, bp, best_p)
        better_r = br > best_r
        idx_r = tl.where(better_r, ir, idx_r)
        best_r = tl.where(better_r, br, best_r)
    return tl.where(use_q & (res_mass > 0.0), idx_r, idx_p)


@triton.jit
def _spec_verify_kernel(
    logits_ptr, draft_ids_ptr, num_draft_ptr, draft_probs_ptr, temp_ptr, log_min_p_ptr, top_k_ptr, top_p_ptr,
    uniform_ptr, noise_ptr, out_ptr, num_accepted_ptr,
    K, V,
    HAS_DRAFT_PROBS: tl.constexpr, PER_POSITION_NOISE: tl.constexpr, COUPLED: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_draft_ptr + b).to(tl.int32)
    temp = tl.load(temp_ptr + b)
    top_k = tl.load(top_k_ptr + b).to(tl.int32)
    top_p = tl.load(top_p_ptr + b)
    log_min_p = tl.load(log_min_p_ptr + b)
    greedy = temp <= 0.0
    safe_temp = tl.where(greedy, 1.0, temp)
    out_row = out_ptr + b * (K + 1)

    j = n * 0
    end = n + 1  # rows still to visit; a rejection at row j sets end = j to stop after it
    num_acc = n * 0
    while j < end:
        row_ptr = logits_ptr + (b * (K + 1) + j) * V
        if PER_POSITION_NOISE:
            noise_row = noise_ptr + (b * (K + 1) + j) * V
        else:
            noise_row = noise_ptr + b * V
        drafting = j < n
        draft = tl.load(draft_ids_ptr + b * K + j, mask=drafting, other=-1)
        tok = n * 0 - 1
        if greedy:
            tok = _row_argmax(row_ptr, V, BLOCK_V)
            accept = drafting & (draft == tok.to(tl.int64))
        else:
            mx, thresh, z = _row_distribution(row_ptr, safe_temp, log_min_p, top_k, top_p, V, BLOCK_V)
            if COUPLED:
                # position j's token is the race winner of p_j (use_q false: no residual); the draft
                # survives iff it is that winner
                tok = _race(row_ptr, safe_temp, mx, thresh, z, noise_row, draft_probs_ptr, draft, j < 0, V,
                            HAS_DRAFT_PROBS, BLOCK_V)
                accept = drafting & (draft == tok.to(tl.int64))
            else:
                safe_draft = tl.where(drafting, draft, 0)
                x_draft = tl.math.div_rn(tl.load(row_ptr + safe_draft), safe_temp)
                p_x = tl.where(x_draft >= thresh, tl.math.div_rn(tl.exp(tl.where(x_draft >= thresh, x_draft, mx) - mx), z), 0.0)
                if HAS_DRAFT_PROBS:
                    q_x = tl.load(draft_probs_ptr + (b * K + j) * V + safe_draft, mask=drafting, other=1.0)
                else:
                    q_x = 1.0
                u = tl.load(uniform_ptr + b * K + j, mask=drafting, other=1.0)
                accept = drafting & (u * q_x < p_x)
                if not accept:
                    tok = _race(row_ptr, safe_temp, mx, thresh, z, noise_row, draft_probs_ptr + (b * K + j) * V,
                                draft, drafting, V, HAS_DRAFT_PROBS, BLOCK_V)
        if accept:
            tl.store(out_row + j, draft)
            num_acc += 1
        else:
            tl.store(out_row + j, tok.to(tl.int64))
            end = j
        j += 1
    tl.store(num_accepted_ptr + b, num_acc)
    offs_k = tl.arange(0, BLOCK_K)
    tl.store(out_row + offs_k, tl.full([BLOCK_K], -1, tl.int64), mask=(offs_k > num_acc) & (offs_k < K + 1))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def verify_triton(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
                  uniform_accept, exp_noise, *, min_p=None, block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused Triton kernel (one launch, grid (B,)); same contract as :func:`verify`."""
    b, k, vocab = _check_inputs(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p, uniform_accept, exp_noise)
    device = target_logits.device
    log_min_p = _log_min_p(min_p, b, device)
    if log_min_p is None:
        log_min_p = torch.full((b,), float("-inf"), device=device)
    out = torch.empty((b, k + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((b,), dtype=torch.int32, device=device)
    if b == 0:
        return out, num_accepted
    if block_v is None:
        # the interpreter pays per block operation, a GPU per register: big blocks there, moderate here
        block_v = min(triton.next_power_of_2(vocab), 8192 if _interpreting() else 2048)
    has_q = draft_probs is not None
    per_position = exp_noise.dim() == 3
    f32 = lambda t: t.to(device=device, dtype=torch.float32).contiguous()  # noqa: E731
    _spec_verify_kernel[(b,)](
        f32(target_logits),
        draft_token_ids.to(device=device, dtype=torch.int64).contiguous(),
        num_draft_tokens.to(device=device, dtype=torch.int32).contiguous(),
        f32(draft_probs) if has_q else exp_noise,  # a placeholder pointer, never read without HAS_DRAFT_PROBS
        f32(temperature),
        f32(log_min_p),
        top_k.to(device=device, dtype=torch.int32).contiguous(),
        f32(top_p),
        f32(uniform_accept),
        f32(exp_noise),
        out, num_accepted,
        k, vocab,
        HAS_DRAFT_PROBS=has_q, PER_POSITION_NOISE=per_position, COUPLED=per_position and not has_q, BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(k + 1),
        num_warps=8 if block_v >= 2048 else 4,
        enable_fp_fusion=False,  # op-by-op rounding, as the torch reference
    )
    return out, num_accepted


def verify_greedy(target_logits: torch.Tensor, draft_token_ids: list[int]) -> list[int]:
    """The greedy rule of :func:`verify` for one request, without its batch tensors.

    ``target_logits`` [k+1, V] (row j: the target's logits after draft[:j]), ``draft_token_ids``
    k ints. Returns the accepted drafts followed by the correction or bonus token: draft j is
    accepted iff it equals the first argmax of row j, as :func:`verify` does for temperature <= 0.
    A greedy row needs no probabilities, randomness or [B, K+1, V] copies — only k+1 argmaxes.
    """
    preds = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(draft_token_ids) and draft_token_ids[n] == preds[n]:
        n += 1
    return [*draft_token_ids[:n], preds[n]]


def verify(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
           uniform_accept, exp_noise, *, min_p=None, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Verify k drafted tokens per request; returns (output_token_ids [B, K+1] int64, num_accepted [B] int32).

    See the module docstring for shapes, dtypes and semantics. ``impl``: "triton", "reference", or
    "auto" (Triton when the tensors are on CUDA or TRITON_INTERPRET=1 is set, else the reference).
    """
    if impl == "auto":
        impl = "triton" if (target_logits.is_cuda or _interpreting()) else "reference"
    if impl == "triton":
        return verify_triton(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
                             uniform_accept, exp_noise, min_p=min_p)
    if impl == "reference":
        return verify_reference(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
                                uniform_accept, exp_noise, min_p=min_p)
    raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
