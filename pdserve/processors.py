"""History-dependent logits processing for one sequence: penalties, min_tokens, the grammar's mask; and logprobs.

A token's distribution under these options depends on the tokens before it, so each position is
processed with its own history. Speculative verification scores k drafts in one forward; row j of
its logits is processed as if drafts[:j] had been accepted (`SequenceProcessor.process`), which is
exactly what plain decoding would see at that position when they are — so drafts are verified
against the very distribution plain decoding samples from, and greedy or seeded output does not
depend on whether, or how far, a request speculated.

What is applied, in vLLM's order, to the raw logits (float32) of a position:

1. `min_tokens`: EOS (unless `ignore_eos`) and `stop_token_ids` are cut (-inf) while fewer than
   `min_tokens` tokens were generated (transformers' `MinNewTokensLengthLogitsProcessor`).
2. a grammar (`guided`: JSON mode, a JSON schema, a regex, a grammar, a tool-call format): every
   token the grammar does not allow next is cut (`pdserve.grammar`); once the grammar is complete
   only EOS remains, whatever min_tokens says.
3. `repetition_penalty` r on every token of the prompt or the output: a logit x becomes x / r if
   x > 0, else x * r (transformers' `RepetitionPenaltyLogitsProcessor`); then
   `frequency_penalty` f and `presence_penalty` p on output tokens: x - f * count - p * (count > 0)
   (OpenAI's definition, as vLLM applies it). A penalty that would take a logit past float32 — r as small
   as 5e-324, which float32 rounds to 0, so x / r is inf and a cut token's -inf * r is NaN — is bounded
   instead: r is at least float32's smallest normal, and a logit at most `LOGIT_CEILING`, which any
   temperature sampling keeps (`GREEDY_BELOW`) still divides finitely. A cut token stays cut.

Greedy takes the argmax of the result; sampling continues with temperature, min-p, top-k, top-p
(`pdserve.kernels.spec_verify.process_logits`).

Logprobs are the raw model's (log-softmax of the logits before any processing), as vLLM v1
returns them by default (`logprobs_mode="raw_logprobs"`).
"""
from __future__ import annotations

import torch

from pdserve.basetypes import GREEDY_BELOW, SamplingParams
from pdserve.grammar import GrammarState, GrammarVocab, apply_masks


_F32 = torch.finfo(torch.float32)
LOGIT_CEILING = _F32.max * GREEDY_BELOW / 2  # a processed logit's bound: divided by any sampled temperature, finite


class SequenceProcessor:
    """One sequence's processing state: what it was prompted with and has generated so far.

    `vocab`: the logits' width (the model's vocabulary, which may exceed the tokenizer's);
    `eos_token_ids`: the model's end tokens; `grammar`: the request's grammar state, when it has one.
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], generated: list[int], vocab: int,
                 eos_token_ids: set[int], grammar: GrammarState | None = None):
        self.params = params
        self.vocab = vocab
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self._stop_ids = torch.tensor(sorted(t for t in stops if t < vocab), dtype=torch.long)
        self._penalties = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                           or params.frequency_penalty != 0.0)
        self.generated = 0
        if self._penalties:
            self.counts = torch.zeros(vocab)  # output token counts
            self.seen = torch.zeros(vocab, dtype=torch.bool)  # prompt or output tokens (repetition penalty)
            if prompt_ids:
                self.seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        if params.guided is not None and grammar is None:
            raise ValueError("a guided request needs its GrammarState")
        self.grammar = grammar
        self.advance(generated)

    def _stop_mask(self) -> torch.Tensor:
        m = torch.zeros(1, self.vocab, dtype=torch.bool)
        m[0, self._stop_ids] = True
        return m

    def _only_stops(self, masks: torch.Tensor) -> torch.Tensor:
        """Per row `[n]` bool: the bitmasks `[n, words]` allow stop tokens only (the grammar is complete)."""
        return ((masks & ~self.grammar.vocab.stop_bits) == 0).all(dim=1)

    def advance(self, tokens: list[int]) -> None:
        """Count tokens that were generated (committed)."""
        if self.grammar is not None:
            self.grammar.advance(tokens)
        for t in tokens:
            self.generated += 1
            if self._penalties and 0 <= t < self.vocab:
                self.counts[t] += 1
                self.seen[t] = True

    def process(self, logits: torch.Tensor, drafts: list[int] = ()) -> torch.Tensor:
        """Raw logits `[n, vocab]` (row j: the position after drafts[:j]) → processed logits `[n, vocab]`
        float32, a new tensor. n ≤ len(drafts) + 1."""
        n = logits.shape[0]
        out = logits.float().clone()
        drafts = list(drafts)[: n - 1]
        masks = self.grammar.masks(drafts, n) if self.grammar is not None else None
        if self.generated < self.params.min_tokens and len(self._stop_ids):
            cut = torch.arange(n) < self.params.min_tokens - self.generated
            if masks is not None:  # a complete grammar leaves only EOS, whatever min_tokens says
                cut &= ~self._only_stops(masks)
            out[cut[:, None] & self._stop_mask()] = float("-inf")
        if masks is not None:
            apply_masks(out, masks)
        if self._penalties:
            counts = self.counts.expand(n, -1).clone()
            for j, d in enumerate(drafts):
                if 0 <= d < self.vocab:
                    counts[j + 1 :, d] += 1
            out = apply_penalties(out, self.seen[None] | (counts > 0), counts, self.params)
        return out


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Repetition, frequency and presence penalties. logits `[n, V]` float32, seen `[n, V]` bool (prompt
    or output), counts `[n, V]` float (output occurrences) → `[n, V]`."""
    r = params.repetition_penalty
    if r != 1.0:
        r = max(r, _F32.tiny)  # float32 rounds a smaller r to 0 (x / 0 = inf, -inf * 0 = NaN)
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (counts > 0).float()
    return logits.clamp(max=LOGIT_CEILING)  # -inf (a cut token) stays


def make_processor(params: SamplingParams, prompt_ids: list[int], generated: list[int], vocab: int, tokenizer,
                   eos_token_ids: set[int]) -> SequenceProcessor | None:
    """The processor a request needs, or None when its distributions depend on nothing but the
    logits (then plain sampling applies as is, at no cost)."""
    if not params.history_dependent:
        return None
    grammar = None
    if params.guided is not None:
        grammar = GrammarState(GrammarVocab.of(tokenizer, vocab, eos_token_ids), params.guided)
    return SequenceProcessor(params, prompt_ids, generated, vocab, eos_token_ids, grammar=grammar)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[dict]:
    """Raw logprobs of chosen tokens: logits `[n, V]` (row j chose tokens[j]) → per token
    {logprob, top_ids, top_logprobs} (the fields of `kvtransfer.protocol.TokenLogprob`), `top`
    alternatives each, most likely first."""
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    if not top:
        return [{"logprob": c} for c in chosen]
    vals, idx = lp.topk(top, dim=-1)
    return [{"logprob": c, "top_ids": i, "top_logprobs": v} for c, i, v in zip(chosen, idx.tolist(), vals.tolist())]
