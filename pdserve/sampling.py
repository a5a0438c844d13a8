"""Sampling a request's tokens, and its token → text stream (incremental detokenisation, stop strings).

The parameters themselves (`SamplingParams`) are a plain type in `pdserve.basetypes`.

Sampling is deterministic per (seed, position): the random draw for generated token i comes
from a generator seeded with (seed, i), so a request gives the same text whichever worker —
prefill for the first token, decode for the rest — draws it.
"""
from __future__ import annotations

import hashlib

import torch

from pdserve.basetypes import SamplingParams
from pdserve.kernels.spec_verify import draw_randomness, process_logits


def position_generator(seed: int, position: int, stream: str = "") -> torch.Generator:
    """The generator for the draws at generated position `position` of a request seeded `seed`.

    `stream` names an independent stream at the same position ("" = the token's noise).
    """
    digest = hashlib.blake2b(f"{seed}:{position}{':' + stream if stream else ''}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def position_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise `[vocab]` for generated position `position`: the one source of randomness per token."""
    return draw_randomness(1, 0, vocab, generator=position_generator(seed, position))[1][0]


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
    probs = processed_probs(logits.view(1, -1), params)[0]
    return int(torch.argmax(probs / position_noise(seed, position, probs.numel())))


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
