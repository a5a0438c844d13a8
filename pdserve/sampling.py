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
    """Logits `[n, vocab]` → the request's sampling distribution `[n, vocab]` (temperature → top-k → top-p)."""
    n = logits.shape[0]
    return process_logits(logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k, dtype=torch.int32),
                          torch.full((n,), params.top_p))


def sample_next(logits: torch.Tensor, params: SamplingParams, position: int, seed: int) -> int:
    """Pick generated token number `position` (0-based) from logits `[vocab]`.

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
    is held back until it is known not to be.
    """

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: set[int], generated: list[int] | None = None):
        self.tokenizer = tokenizer
        self.params = params
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.tokens: list[int] = []
        self.emitted = ""
        self.finish_reason: str | None = None
        for t in generated or []:  # resume (decode continuing after prefill's first token)
            self.push(t)

    def push(self, token: int) -> str:
        """Add one generated token; return the text that can be shown now. Sets finish_reason when done."""
        if self.finish_reason:
            raise RuntimeError("push after finish")
        if token in self.eos:
            self.tokens.append(token)
            self.finish_reason = "stop"
            return self._flush(self._text(exclude_last=True))
        self.tokens.append(token)
        text = self._text()
        for s in self.params.stop:
            idx = text.find(s, max(0, len(self.emitted) - len(s)))
            if idx != -1:
                self.finish_reason = "stop"
                return self._flush(text[:idx])
        if len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
            return self._flush(text)
        safe = len(text.rstrip("\ufffd"))
        hold = 0
        for s in self.params.stop:  # hold back a tail that is a prefix of a stop string
            for n in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - n : safe] == s[:n]:
                    hold = max(hold, n)
                    break
        safe -= hold
        return self._flush(text[:safe])

    def _text(self, exclude_last: bool = False) -> str:
        ids = self.tokens[:-1] if exclude_last else self.tokens
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _flush(self, text: str) -> str:
        if not text.startswith(self.emitted):
            # a re-tokenisation changed earlier text (rare); emit nothing until it settles
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
