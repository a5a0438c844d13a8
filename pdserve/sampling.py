"""Sampling a request's tokens, and its token → text stream (incremental detokenisation, stop strings).

The parameters themselves (`SamplingParams`) are a plain type in `pdserve.basetypes`.

Sampling is deterministic per (seed, position): the random draw for generated token i is a
function of (seed, i) alone, so a request gives the same text whichever worker — prefill for the
first token, decode for the rest — draws it.

The noise of a position is counter-based (`kernels/cpu_sampling.c`: element j of it is a hash of the
position's key and j, then -log(1 - u)), made natively where the kernel builds and with torch where it
does not (the same bits: `exp_noise_torch` repeats the kernel's log op for op). A row whose distribution is the
temperature-scaled softmax alone — no top-k, top-p or min-p — is drawn natively in one pass
(`sample_rows`); the rest go through `spec_verify.process_logits` and the race in torch.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from pdserve.basetypes import SamplingParams
from pdserve.kernels import cpu_sampling
from pdserve.kernels.spec_verify import process_logits

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def position_key(seed: int, position: int, stream: str = "") -> int:
    """The 63-bit key of the draws at generated position `position` of a request seeded `seed`; `stream`
    names an independent stream at the same position ("" = the token's noise)."""
    digest = hashlib.blake2b(f"{seed}:{position}{':' + stream if stream else ''}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def position_generator(seed: int, position: int, stream: str = "") -> torch.Generator:
    """A torch generator for further draws at a position (`position_key`'s stream)."""
    return torch.Generator().manual_seed(position_key(seed, position, stream))


def _signed(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def _srl(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


# `cpu_sampling.c`'s log constants (musl's logf): each exactly a float32
_LG1, _LG2, _LG3, _LG4, _LN2_LO, _LN2_HI = (torch.tensor(float.fromhex(h), dtype=torch.float32) for h in (
    "0x1.555554p-1", "0x1.999c26p-2", "0x1.23d3dcp-2", "0x1.f13c4cp-3", "0x1.2fefa2p-17", "0x1.62e3p-1"))


def _log_positive(x: torch.Tensor) -> torch.Tensor:
    """`cpu_sampling.c`'s `log_positive`, op for op in float32 (each torch op rounds once, as each C one does)."""
    ix = x.view(torch.int32) + (0x3F800000 - 0x3F3504F3)
    k = ((ix >> 23) - 0x7F).to(torch.float32)
    f = ((ix & 0x007FFFFF) + 0x3F3504F3).view(torch.float32) - 1.0
    s = f / (f + 2.0)
    z = s * s
    w = z * z
    t1 = w * (_LG2 + w * _LG4)
    t2 = z * (_LG1 + w * _LG3)
    hfsq = (f * 0.5) * f
    return s * (hfsq + (t2 + t1)) + k * _LN2_LO - hfsq + f + k * _LN2_HI


def exp_noise_torch(key: int, n: int) -> torch.Tensor:
    """`cpu_sampling.c`'s noise with torch lanes, bit for bit (wrapping int64 multiplication is two's complement;
    the log is the kernel's, op for op): the fallback where the kernel is not built, and its reference in tests."""
    z = torch.arange(1, n + 1, dtype=torch.int64) * _signed(_GOLDEN) + _signed(key)
    z = (z ^ _srl(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ _srl(z, 31)
    one_minus_u = (16777216 - _srl(z, 40)).to(torch.float32) * (1.0 / 16777216.0)
    return (-_log_positive(one_minus_u)).clamp_min_(torch.finfo(torch.float32).tiny)


def position_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise `[vocab]` for generated position `position`: the one source of randomness per token."""
    key = position_key(seed, position)
    return cpu_sampling.exp_noise(key, vocab) if cpu_sampling.library() is not None else exp_noise_torch(key, vocab)


def _plain(params: SamplingParams) -> bool:
    """Whether a sampled row's distribution is the temperature-scaled softmax alone (no cut)."""
    return params.temperature > 0 and not params.min_p and not params.top_k and params.top_p >= 1.0


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                seeds: Sequence[int]) -> list[int]:
    """Sampled (temperature > 0) rows `logits [rows, vocab]`, each at its own generated position under its own
    seed → one token each: the race argmax(p / E), p the row's processed distribution. Rows with no cut go
    natively in one pass where the kernel builds; the rest, and every row without it, through torch."""
    rows, vocab = logits.shape
    out: list[int | None] = [None] * rows
    native = [i for i in range(rows) if _plain(params[i])] if cpu_sampling.library() is not None else []
    if native:
        try:
            x = logits if len(native) == rows else logits[native]
            drawn = cpu_sampling.race(x, torch.tensor([params[i].temperature for i in native]),
                                      [position_key(seeds[i], positions[i]) for i in native])
            for i, t in zip(native, drawn):
                out[i] = t
        except ValueError:  # a row without a finite logit: torch draws them all, as it would have
            pass
    rest = [i for i in range(rows) if out[i] is None]
    if rest:
        sp = [params[i] for i in rest]
        min_p = torch.tensor([p.min_p for p in sp]) if any(p.min_p for p in sp) else None
        probs = process_logits(logits[rest], torch.tensor([p.temperature for p in sp]),
                               torch.tensor([p.top_k for p in sp], dtype=torch.int32),
                               torch.tensor([p.top_p for p in sp]), min_p)
        noise = torch.stack([position_noise(seeds[i], positions[i], vocab) for i in rest])
        for i, t in zip(rest, (probs / noise).argmax(dim=-1).tolist()):
            out[i] = t
    return out


def verification_randomness(seed: int, start: int, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What verifying k drafts from generated position `start` consumes: (uniform_accept `[1, k]`,
    per-position noise `[1, k+1, vocab]`). Row j of the noise is `position_noise(seed, start + j)`,
    the draw plain sampling makes there; the uniforms come from an independent stream."""
    noise = torch.stack([position_noise(seed, start + j, vocab) for j in range(k + 1)])
    u = torch.rand(1, k, generator=position_generator(seed, start, "accept"))
    return u, noise.unsqueeze(0)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits `[n, vocab]` → the request's sampling distribution `[n, vocab]` (temperature → min-p → top-k → top-p)."""
    n = logits.shape[0]
    return process_logits(logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k, dtype=torch.int32),
                          torch.full((n,), params.top_p), torch.full((n,), params.min_p) if params.min_p else None)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed` (n > 1): choice 0 keeps the request's
    seed, so n = 1 samples as it always did, and each choice replays on its own."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/choice/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_next(logits: torch.Tensor, params: SamplingParams, position: int, seed: int) -> int:
    """Pick generated token number `position` (0-based) from logits `[vocab]` (already through the
    request's history-dependent processors, `pdserve.processors`, where it has any).

    Sampling is the exponential race argmax(p / E) with E ~ Exp(1) drawn from (seed, position):
    exactly a draw from p, and the same draw whichever path (plain or speculative) reaches the
    position — which is what lets speculative sampling reproduce plain sampling token for token.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    return sample_rows(logits.view(1, -1), [params], [position], [seed])[0]


class TextStream:
    """Generated token ids → text deltas, with stop strings and stop tokens.

    Text that could still become a stop string, or that ends in an incomplete UTF-8 sequence,
    is held back until it is known not to be. `stop_token_ids` (and EOS unless `ignore_eos`) end
    the stream without adding their text; stop strings count only after `min_tokens` tokens (as
    vLLM's). Special tokens' text is left out with `skip_special_tokens`.

    Incremental: each token decodes only a small window of the latest tokens, as vLLM's and
    transformers' incremental detokenizers do. Tokens before `prefix` give the window its left
    context (a SentencePiece word start decodes differently at a sequence's start); text of
    tokens before `read` is settled. A window settles once its text ends in a whole character;
    the text of the tokens so far is then `settled + window text past the prefix's`, equal to
    decoding them all at once, and only a bounded tail of it is kept (what stop strings can
    still reach), so a token costs O(window + longest stop string), not O(output).
    """

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: set[int], generated: list[int] | None = None):
        self.tokenizer = tokenizer
        self.params = params
        self.eos = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._prefix = self._read = 0  # window start; first token whose text is not settled
        self._reach = max((len(s) for s in params.stop), default=0)
        # Local coordinates: the output text is T, of which chars [0, base) are dropped; `_settled` is
        # T[base:len(settled text)], `_emitted` is T[base:emitted], `_emitted_len` the whole length.
        self._base = 0
        self._settled = ""
        self._settled_len = 0
        self._emitted = ""
        self._emitted_len = 0
        for t in generated or []:  # resume (decode continuing after prefill's first token)
            self.push(t)

    def push(self, token: int) -> str:
        """Add one generated token; return the text that can be shown now. Sets finish_reason when done."""
        if self.finish_reason:
            raise RuntimeError("push after finish")
        self.tokens.append(token)
        if token in self.eos:
            self.finish_reason = "stop"
            return self._flush(self._text(exclude_last=True))
        text = self._text()  # T[base:]
        e = self._emitted_len - self._base
        if len(self.tokens) > self.params.min_tokens:
            for s in self.params.stop:
                idx = text.find(s, max(0, e - len(s)))
                if idx != -1:
                    self.finish_reason = "stop"
                    return self._flush(text[:idx])
        if len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
            return self._flush(text)
        safe = len(text.rstrip("\ufffd"))
        hold = 0
        if len(self.tokens) > self.params.min_tokens:
            for s in self.params.stop:  # hold back a tail that is a prefix of a stop string
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if text[safe - n : safe] == s[:n]:
                        hold = max(hold, n)
                        break
        return self._flush(text[: safe - hold])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _text(self, exclude_last: bool = False) -> str:
        """The output text from `base` on, of all tokens (but the last with `exclude_last`); settles the window."""
        end = len(self.tokens) - exclude_last
        if end <= self._read:
            return self._settled  # nothing past the settled text
        before = self._decode(self.tokens[self._prefix : self._read])
        window = self._decode(self.tokens[self._prefix : end])
        tail = window[len(before) :]
        if len(window) > len(before) and not window.endswith("\ufffd") and not exclude_last:
            self._settled += tail
            self._settled_len += len(tail)
            self._prefix, self._read = self._read, end
            return self._settled
        return self._settled + tail

    def _flush(self, text: str) -> str:
        """Emit `text` (output text from `base` on) past what was emitted, unless it no longer starts with it."""
        e = self._emitted_len - self._base
        if len(text) < e or text[:e] != self._emitted:
            # a re-tokenisation changed earlier text (rare); emit nothing until it settles
            return ""
        delta = text[e:]
        self._emitted += delta
        self._emitted_len += len(delta)
        # keep only what stop strings can still reach: the last `reach` emitted chars, never past the settled text
        drop = min(self._emitted_len - self._reach, self._settled_len) - self._base
        if drop > 0:
            self._base += drop
            self._settled = self._settled[drop:]
            self._emitted = self._emitted[drop:]
        return delta

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
