"""Drafters: cheap proposals of the next k tokens of one request, verified later by the target model.

Every drafter speaks one small, per-request, ``async`` interface (a later drafter is served by
another process over NATS):

* ``propose(request_id, token_ids, k, sampling)`` -> :class:`Draft` — ``token_ids`` is the whole
  sequence so far (prompt + generated). A draft may be shorter than ``k`` (even empty: "nothing
  worth proposing").
* ``feedback(request_id, num_accepted, new_token_ids)`` after verification — ``new_token_ids``
  are the tokens the target committed this step (accepted draft tokens + the correction/bonus
  token), so stateful drafters roll back what was rejected and append what was committed.
* ``release(request_id)`` when the request ends.

Implementations: :class:`NgramDrafter` (prompt lookup, model-free, microseconds per proposal),
:class:`DraftModelDrafter` (a small causal LM sharing the target's tokenizer, with its own
per-request KV cache) and :class:`NoDrafter`; :func:`make_drafter` builds one by name.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from pdserve.basetypes import SamplingParams
from pdserve.runtime import crop_cache  # one definition; re-exported for drafters' callers
from pdserve.sampling import processed_probs

__all__ = [
    "Draft",
    "Drafter",
    "NgramDrafter",
    "DraftModelDrafter",
    "NoDrafter",
    "brute_force_ngram_proposal",
    "TokenizerMismatchError",
    "check_tokenizer_compatible",
    "tokenizer_fingerprint",
    "crop_cache",
    "make_drafter",
]


def is_greedy(sampling: SamplingParams | None) -> bool:
    return sampling is None or sampling.greedy


@dataclass
class Draft:
    """A proposal for the next tokens of one request.

    ``token_ids``: ``len <= k`` proposed tokens. ``probs``: ``[len(token_ids), V]`` float32, the
    processed (temperature / top-k / top-p) draft distribution each token was sampled from, or
    ``None`` for deterministic proposals (n-gram lookup, greedy drafts), which the verifier
    treats as a point mass.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    forced: bool = False  # the request's grammar forced these tokens (no drafter proposed them)

    def __len__(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class Drafter(Protocol):
    """What the decode worker asks of a drafter; `DrafterBase` gives the optional parts their defaults.

    `model_free`: a proposal costs microseconds, so the worker proposes first and lets the speculation controller
    cut the draft to what pays, with the drafter's `confidence` in that very proposal (then `trim`). Otherwise the
    controller chooses k first and the drafter proposes that many. `concurrent`: a batch's proposals may be asked
    for at once (a remote pool answers them in one pass). `stats`: a Prometheus collector of its own, or None.
    `attach`: the worker's NATS connection, for drafters that ask elsewhere."""

    name: str
    model_free: bool
    concurrent: bool
    stats: Any

    async def propose(
        self, request_id: str, token_ids: Sequence[int], k: int, sampling: SamplingParams | None = None
    ) -> Draft: ...

    def confidence(self, request_id: str) -> float | None: ...

    def trim(self, request_id: str, keep: int) -> None: ...

    def feedback(self, request_id: str, num_accepted: int, new_token_ids: Sequence[int]) -> None: ...

    def release(self, request_id: str) -> None: ...

    def attach(self, nc, scope: str, model: str) -> None: ...


class DrafterBase:
    """The optional parts of `Drafter`, for drafters that need none of them."""

    model_free = False
    concurrent = False
    stats = None

    def confidence(self, request_id: str) -> float | None:
        return None

    def trim(self, request_id: str, keep: int) -> None:
        pass

    def attach(self, nc, scope: str, model: str) -> None:
        pass


# --------------------------------------------------------------------------------------------
# No speculation


class NoDrafter(DrafterBase):
    """Proposes nothing: plain decoding through the same interface."""

    name = "none"

    async def propose(self, request_id, token_ids, k, sampling=None) -> Draft:
        return Draft([], None)

    def feedback(self, request_id, num_accepted, new_token_ids) -> None:
        pass

    def release(self, request_id) -> None:
        pass


# --------------------------------------------------------------------------------------------
# N-gram / prompt lookup


class _NgramIndex:
    """Incremental n-gram index of one token sequence.

    ``last_end[n][gram] = e`` means ``tokens[e-n:e] == gram`` is the most recent occurrence of
    ``gram`` that has at least one following token (``e < len(tokens)``). An n-gram is
    registered only once the token after it arrives, so a lookup of the current suffix never
    finds the suffix itself. Appending one token costs O(max_n - min_n + 1) dict writes.
    """

    __slots__ = ("tokens", "min_n", "max_n", "last_end")

    def __init__(self, min_n: int, max_n: int):
        self.tokens: list[int] = []
        self.min_n = min_n
        self.max_n = max_n
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new_tokens: Sequence[int]) -> None:
        toks = self.tokens
        last_end = self.last_end
        for t in new_tokens:
            e = len(toks)  # the n-grams ending at e now have a follower: t
            for n in range(self.min_n, min(self.max_n, e) + 1):
                last_end[n][tuple(toks[e - n : e])] = e
            toks.append(int(t))

    def truncate(self, length: int) -> None:
        """Drop tokens past ``length`` (rare: a rewound sequence); rebuilds the index."""
        kept = self.tokens[:length]
        self.tokens = []
        self.last_end = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self.extend(kept)

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Continuation of the longest (then most recent) earlier match of the current suffix.

        Returns ``(proposal, matched_n)``; ``([], 0)`` when no suffix of length >= min_n recurs.
        When the match runs into the end of the sequence, the proposal continues periodically
        (the sequence "abcab" proposes "cabca…"), which is what a repeating text does next.
        """
        toks = self.tokens
        length = len(toks)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            e = self.last_end[n].get(tuple(toks[length - n :]))
            if e is None:
                continue
            out: list[int] = []
            for i in range(k):
                p = e + i
                out.append(toks[p] if p < length else out[p - length])
            return out, n
        return [], 0


class NgramDrafter(DrafterBase):
    """Prompt-lookup drafting: find the longest recent suffix (``max_n`` down to ``min_n``
    tokens) that occurred earlier in prompt + output and propose what followed it.

    Keeps one incremental index per request; ``propose`` only indexes the tokens that arrived
    since the last call, so a proposal costs microseconds regardless of context length.
    Deterministic: ``Draft.probs`` is ``None`` (a point mass for the verifier).

    Confidence trimming (``min_reach > 0``): how far a continuation can be trusted depends on
    how long the match was (measured on SmolLM2 here: a 2-token match is accepted ~0.3 per
    token, a 6-token match ~0.9). The drafter learns the per-token acceptance ``α_n`` of each
    match length ``n`` from ``feedback`` (shared by all requests) and proposes only the tokens
    whose chance of being reached, ``α_n^i``, is at least ``min_reach``; the controller's ``k``
    stays the upper bound set by cost and load. ``min_reach = 0`` proposes all ``k``.
    """

    name = "ngram"
    model_free = True

    def __init__(self, min_n: int = 2, max_n: int = 8, min_reach: float = 0.25,
                 prior_strength: float = 8.0, decay: float = 0.995, probe_every: int = 8):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramDrafter needs 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        if not 0.0 <= min_reach < 1.0:
            raise ValueError(f"NgramDrafter min_reach must be in [0, 1), got {min_reach}")
        self.min_n = min_n
        self.max_n = max_n
        self.min_reach = min_reach
        self.prior_strength = prior_strength
        self.decay = decay
        self.probe_every = max(int(probe_every), 1)
        self._suppressed: dict[tuple[int, bool], int] = {
            (n, hot): 0 for n in range(min_n, max_n + 1) for hot in (False, True)
        }
        self._index: dict[str, _NgramIndex] = {}
        self.last_match_n: dict[str, int] = {}
        # request -> (matched n, proposed, hot) awaiting feedback
        self._pending: dict[str, tuple[int, int, bool]] = {}
        # requests whose last verified proposal was accepted whole: they are copying text
        # (a quoted function, repeated JSON) and the next continuation is far likelier right
        self._hot: set[str] = set()
        # per (match length, hot): decayed [accepted, tested] draft tokens
        self._match_stats: dict[tuple[int, bool], list[float]] = {
            (n, hot): [0.0, 0.0] for n in range(min_n, max_n + 1) for hot in (False, True)
        }

    def prior_alpha(self, n: int, hot: bool = False) -> float:
        """Acceptance expected of an ``n``-token match before any feedback (longer is surer;
        ``hot``: the request's previous proposal was accepted whole)."""
        # roughly what SmolLM2 showed on the spec_probe workloads: n=2 ~0.3, n>=6 ~0.9
        base = {1: 0.2, 2: 0.3, 3: 0.45, 4: 0.6, 5: 0.7}.get(n, 0.85)
        return min(base + 0.2, 0.9) if hot else base

    def match_alpha(self, n: int, hot: bool = False) -> float:
        """Learned per-token acceptance of continuations after an ``n``-token match."""
        acc, tested = self._match_stats[(n, hot)]
        m = self.prior_strength
        return (acc + m * self.prior_alpha(n, hot)) / (tested + m)

    def _sync(self, request_id: str, token_ids: Sequence[int]) -> _NgramIndex:
        idx = self._index.get(request_id)
        if idx is None:
            idx = self._index[request_id] = _NgramIndex(self.min_n, self.max_n)
        known = len(idx.tokens)
        # Sequences only grow between steps; a shorter one, or one whose last known token
        # changed, means the caller rewound: rebuild rather than propose from stale text.
        if len(token_ids) < known or (known and int(token_ids[known - 1]) != idx.tokens[-1]):
            common = 0
            limit = min(known, len(token_ids))
            while common < limit and int(token_ids[common]) == idx.tokens[common]:
                common += 1
            idx.truncate(common)
            known = common
        if len(token_ids) > known:
            idx.extend(token_ids[known:])
        return idx

    def propose_now(self, request_id: str, token_ids: Sequence[int], k: int) -> Draft:
        """Synchronous form of :meth:`propose` (the work is microseconds; nothing to await)."""
        idx = self._sync(request_id, token_ids)
        if k <= 0:
            return Draft([], None)
        proposal, n = idx.lookup(k)
        return self.adopt(request_id, proposal, n)

    def adopt(self, request_id: str, proposal: list[int], n: int) -> Draft:
        """Trim and track ``proposal``, the continuation of an ``n``-token match, as this drafter's own
        proposal for the request (found by its index, or elsewhere: the draft pool's fleet index): the
        match length's learned acceptance trims it, ``confidence`` / ``trim`` / ``feedback`` then apply."""
        proposal = list(proposal)
        hot = request_id in self._hot
        if proposal and self.min_reach > 0.0:
            alpha = self.match_alpha(n, hot)
            keep, reach = 0, 1.0
            while keep < len(proposal):
                reach *= alpha
                if reach < self.min_reach:
                    break
                keep += 1
            if keep == 0:
                # distrust must stay testable: every `probe_every`-th suppressed match of this
                # length still proposes one token, so a length that became reliable recovers
                self._suppressed[(n, hot)] += 1
                if self._suppressed[(n, hot)] % self.probe_every == 0:
                    keep = 1
            del proposal[keep:]
        self.last_match_n[request_id] = n if proposal else 0
        if proposal:
            self._pending[request_id] = (n, len(proposal), hot)
        return Draft(proposal, None)

    async def propose(self, request_id, token_ids, k, sampling=None) -> Draft:
        return self.propose_now(request_id, token_ids, k)

    def confidence(self, request_id: str) -> float | None:
        """Per-token acceptance expected of the request's last proposal (its match length's
        learned α), or ``None`` when it proposed nothing — a hint for
        ``SpeculationController.choose_k(alpha_hint=...)``."""
        pending = self._pending.get(request_id)
        return None if pending is None else self.match_alpha(pending[0], pending[2])

    def trim(self, request_id: str, keep: int) -> None:
        """The caller verifies only the first ``keep`` tokens of the last proposal."""
        pending = self._pending.get(request_id)
        if pending is not None:
            if keep <= 0:
                del self._pending[request_id]
            else:
                self._pending[request_id] = (pending[0], min(pending[1], keep), pending[2])

    def feedback(self, request_id, num_accepted, new_token_ids) -> None:
        # Committed tokens are indexed on the next propose (which sees the full sequence);
        # nothing speculative was ever indexed, so there is nothing to roll back. Feedback
        # only teaches the per-match-length acceptance.
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        n, proposed, hot = pending
        accepted = max(0, min(int(num_accepted), proposed))
        if accepted == proposed:
            self._hot.add(request_id)
        else:
            self._hot.discard(request_id)
        stats = self._match_stats[(n, hot)]
        stats[0] = stats[0] * self.decay + accepted
        stats[1] = stats[1] * self.decay + accepted + (1 if accepted < proposed else 0)

    def release(self, request_id) -> None:
        self._index.pop(request_id, None)
        self.last_match_n.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._hot.discard(request_id)


def brute_force_ngram_proposal(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Reference for :class:`NgramDrafter` by a plain backwards scan (tests; O(n·len))."""
    toks = [int(t) for t in token_ids]
    length = len(toks)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = toks[length - n :]
        for e in range(length - 1, n - 1, -1):
            if toks[e - n : e] == suffix:
                out: list[int] = []
                for i in range(k):
                    p = e + i
                    out.append(toks[p] if p < length else out[p - length])
                return out
    return []


# --------------------------------------------------------------------------------------------
# Tokenizer compatibility


class TokenizerMismatchError(ValueError):
    """A draft model whose tokenizer is not the target's: its token ids would mean other text."""


def _tok_name(tok: Any) -> str:
    return str(getattr(tok, "name_or_path", None) or type(tok).__name__)


def _special_tokens(tok: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tok, attr, None)
        out[attr] = None if value is None else str(value)
    out["all_special_tokens"] = sorted(str(t) for t in getattr(tok, "all_special_tokens", []) or [])
    return out


def tokenizer_fingerprint(tok: Any) -> str:
    """sha256 (hex, 16 chars) over the full vocabulary (token → id, added tokens included)."""
    vocab = tok.get_vocab()
    payload = json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def check_tokenizer_compatible(target_tok: Any, draft_tok: Any) -> None:
    """Refuse (``TokenizerMismatchError``) a draft tokenizer that is not the target's.

    Compares vocabulary size, special tokens and a fingerprint of the vocabulary; the error
    names both tokenizers and every difference found.
    """
    problems: list[str] = []
    t_len, d_len = len(target_tok), len(draft_tok)
    if t_len != d_len:
        problems.append(f"vocab size {t_len} vs {d_len}")
    t_sp, d_sp = _special_tokens(target_tok), _special_tokens(draft_tok)
    for key in t_sp:
        if t_sp[key] != d_sp[key]:
            problems.append(f"{key} {t_sp[key]!r} vs {d_sp[key]!r}")
    t_fp, d_fp = tokenizer_fingerprint(target_tok), tokenizer_fingerprint(draft_tok)
    if t_fp != d_fp:
        problems.append(f"vocab fingerprint {t_fp} vs {d_fp}")
    if problems:
        raise TokenizerMismatchError(
            f"draft tokenizer {_tok_name(draft_tok)!r} differs from target tokenizer "
            f"{_tok_name(target_tok)!r} (target vs draft: {'; '.join(problems)}); a draft must share "
            "the target's tokenizer exactly"
        )


# --------------------------------------------------------------------------------------------
# Draft model


@dataclass
class _DraftState:
    cache: Any
    cached: list[int] = field(default_factory=list)  # tokens whose K/V the cache holds, in order
    last_context_len: int = -1  # len(token_ids) at the last propose, until its feedback arrives


class DraftModelDrafter(DrafterBase):
    """A small causal LM that shares the target's tokenizer, with its own per-request KV cache.

    Greedy proposals (``Draft.probs is None``) when sampling is greedy; otherwise tokens are
    sampled from the processed draft distribution, returned as ``Draft.probs`` ``[len, V]``.
    The cache is rolled back (``crop``) to the longest prefix it shares with the sequence it is
    asked to continue, so rejected draft positions never leak into later proposals.
    """

    name = "draft"

    def __init__(
        self,
        model: Any,
        *,
        target_tokenizer: Any | None = None,
        draft_tokenizer: Any | None = None,
        seed: int = 0,
        run_in_thread: bool = False,
    ):
        if target_tokenizer is not None and draft_tokenizer is not None:
            check_tokenizer_compatible(target_tokenizer, draft_tokenizer)
        self.model = model.eval()
        self.run_in_thread = run_in_thread
        self._states: dict[str, _DraftState] = {}
        self._gen = torch.Generator().manual_seed(seed)

    @classmethod
    def from_pretrained(
        cls, path: str, target_tokenizer: Any, *, dtype: torch.dtype = torch.float32, **kwargs: Any
    ) -> "DraftModelDrafter":
        """Load a draft from a local checkpoint folder; refuse it if its tokenizer differs."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        draft_tok = AutoTokenizer.from_pretrained(path)
        check_tokenizer_compatible(target_tokenizer, draft_tok)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return cls(model, **kwargs)

    def _state(self, request_id: str) -> _DraftState:
        st = self._states.get(request_id)
        if st is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            for layer in cache.layers:  # sliding-window (and linear) layers: keep what `crop` must roll back
                if hasattr(layer, "activate_past_recording"):
                    layer.activate_past_recording()
            st = self._states[request_id] = _DraftState(cache)
        return st

    @torch.inference_mode()
    def propose_now(
        self, request_id: str, token_ids: Sequence[int], k: int, sampling: SamplingParams | None = None
    ) -> Draft:
        """Synchronous :meth:`propose`: one draft forward per proposed token (plus catch-up)."""
        toks = [int(t) for t in token_ids]
        if k <= 0 or not toks:
            return Draft([], None)
        st = self._state(request_id)
        common = 0
        limit = min(len(st.cached), len(toks) - 1)  # keep >= 1 token to feed for fresh logits
        while common < limit and st.cached[common] == toks[common]:
            common += 1
        crop_cache(st.cache, common)
        st.cached = toks[:common]
        feed = toks[common:]
        st.last_context_len = len(toks)
        greedy = is_greedy(sampling)
        proposal: list[int] = []
        probs_rows: list[torch.Tensor] = []
        for _ in range(k):
            out = self.model(
                input_ids=torch.tensor([feed], dtype=torch.long),
                past_key_values=st.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            st.cached.extend(feed)
            logits = out.logits[0, -1]
            if greedy:
                tok = int(torch.argmax(logits))
            else:
                p = processed_probs(logits.view(1, -1), sampling)[0]
                tok = int(torch.multinomial(p, 1, generator=self._gen))
                probs_rows.append(p)
            proposal.append(tok)
            feed = [tok]
        return Draft(proposal, None if greedy else torch.stack(probs_rows))

    async def propose(self, request_id, token_ids, k, sampling=None) -> Draft:
        if self.run_in_thread:
            return await asyncio.to_thread(self.propose_now, request_id, token_ids, k, sampling)
        return self.propose_now(request_id, token_ids, k, sampling)

    def feedback(self, request_id, num_accepted, new_token_ids) -> None:
        """Roll the cache back to the context plus the accepted draft tokens now, freeing the
        rejected positions early (``propose`` would also re-sync by common prefix)."""
        st = self._states.get(request_id)
        if st is None or st.last_context_len < 0:
            return
        new = [int(t) for t in new_token_ids]
        keep = st.last_context_len
        # the cache holds context + proposal[:-1]; accepted tokens are new[:num_accepted]
        while keep < len(st.cached) and keep - st.last_context_len < min(num_accepted, len(new)):
            if st.cached[keep] != new[keep - st.last_context_len]:
                break
            keep += 1
        crop_cache(st.cache, keep)
        del st.cached[keep:]
        st.last_context_len = -1

    def release(self, request_id) -> None:
        self._states.pop(request_id, None)


# --------------------------------------------------------------------------------------------


def make_drafter(method: str, **kwargs: Any) -> Drafter:
    """Build a drafter by name: ``"ngram"`` (kwargs: min_n, max_n), ``"draft"`` (kwargs: model or
    path + target_tokenizer, ...), ``"none"``."""
    if method == "ngram":
        return NgramDrafter(**kwargs)
    if method == "draft":
        if "path" in kwargs:
            path = kwargs.pop("path")
            return DraftModelDrafter.from_pretrained(path, kwargs.pop("target_tokenizer"), **kwargs)
        if "model" not in kwargs:
            raise ValueError("make_drafter('draft') needs model=... or path=... (with target_tokenizer=...)")
        return DraftModelDrafter(kwargs.pop("model"), **kwargs)
    if method == "none":
        return NoDrafter()
    raise ValueError(f"unknown speculation method {method!r}; expected 'ngram', 'draft' or 'none'")
