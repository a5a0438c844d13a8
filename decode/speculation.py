"""Adaptive speculation length: how many draft tokens each request should propose this step.

The policy maximises expected committed tokens per second for a request:

    rate(k) = E[tokens | α, k] / (draft_seconds(method, k) + verify_seconds(batch, k)),
    E[tokens | α, k] = (1 - α^(k+1)) / (1 - α)            (k = 0: plain decoding, E = 1)

where α is the per-token acceptance rate (geometric model: each draft token is accepted with
probability α given all before it were). Its parts:

* :class:`SpanTracker` / :func:`classify_span` — is generation inside JSON / a tool call, code,
  or free text? Acceptance differs a lot between them, so α is tracked per span kind.
* :class:`LatencyModel` — online fit of verify and draft costs (seconds) from observations.
* :class:`AcceptanceTracker` — per-request, per-span acceptance, shrunk toward a fleet prior.
* :class:`SpeculationController` — ``choose_k`` / ``observe_step`` plus a deterministic probe
  schedule after backing off, and plain-data counters (:class:`SpeculationStats`) that the
  decode worker exports as Prometheus metrics.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

__all__ = [
    "SpanKind",
    "SpanTracker",
    "classify_span",
    "LatencyModel",
    "AcceptanceTracker",
    "SpeculationController",
    "SpeculationStats",
    "expected_tokens",
]


class SpanKind(str, Enum):
    JSON = "json"
    CODE = "code"
    FREE = "free"


# --------------------------------------------------------------------------------------------
# Span classification

_CODE_LINE = re.compile(
    r"^(\s{4,}|\t)\S"  # indented block
    r"|^\s*(def|class|return|import|from|if|elif|else|for|while|try|except|with|async|await|"
    r"const|let|var|function|fn|pub|struct|impl|#include|public|private|static|package|func)\b"
    r"|[;{}]\s*$|\)\s*:\s*$|^\s*[}\])]"
    r"|^\s*[A-Za-z_][\w.\[\]]*\s*(=|\+=|-=|:=)\s*\S"
)
_TAGS = ("<tool_call>", "</tool_call>")
_TAG_MAX = max(len(t) for t in _TAGS)
_JSON_FENCE_LANGS = {"json", "jsonc", "json5", "jsonl"}


class SpanTracker:
    """Incremental span classifier for one request; :meth:`feed` costs O(len(delta)).

    Tracks, character by character: code fences (```` ```lang ````), ``<tool_call>`` tags,
    JSON nesting (braces/brackets, outside strings, with escapes) and whether the last few
    complete lines looked like code. Priority: JSON (inside a JSON value, a tool call or a
    ```` ```json ```` fence) > code (inside any other fence, or code-like recent lines) > free.
    """

    __slots__ = (
        "_ticks", "_in_fence", "_fence_lang", "_reading_lang", "_tag_tail", "_in_tool_call",
        "_stack", "_in_string", "_escape", "_line", "_recent_code", "_at_line_start_ticks",
    )

    def __init__(self) -> None:
        self._ticks = 0  # run length of consecutive backticks
        self._at_line_start_ticks = True
        self._in_fence = False
        self._fence_lang = ""
        self._reading_lang = False
        self._tag_tail = ""
        self._in_tool_call = False
        self._stack: list[str] = []  # open JSON brackets
        self._in_string = False
        self._escape = False
        self._line: list[str] = []
        self._recent_code: list[bool] = []  # code-likeness of the last few complete lines

    # -- state machine -------------------------------------------------------------------
    def feed(self, delta: str) -> "SpanTracker":
        for ch in delta:
            self._feed_char(ch)
        return self

    def _feed_char(self, ch: str) -> None:
        # tool-call tags (also recognised inside JSON strings: a model may open one anywhere)
        self._tag_tail = (self._tag_tail + ch)[-_TAG_MAX:]
        if ch == ">":
            if self._tag_tail.endswith("<tool_call>"):
                self._in_tool_call = True
                self._stack.clear()
                self._in_string = False
            elif self._tag_tail.endswith("</tool_call>"):
                self._in_tool_call = False
                self._stack.clear()
                self._in_string = False

        # code fences: three backticks toggle; the info string up to newline is the language
        if ch == "`" and not self._in_string:
            self._ticks += 1
            if self._ticks == 3:
                self._ticks = 0
                self._recent_code.clear()  # lines inside a fence say nothing about after it
                if self._in_fence:
                    self._in_fence = False
                    self._fence_lang = ""
                    self._reading_lang = False
                else:
                    self._in_fence = True
                    self._fence_lang = ""
                    self._reading_lang = True
                    self._stack.clear()
            self._line.append(ch)
            return
        self._ticks = 0
        if self._reading_lang:
            if ch == "\n":
                self._reading_lang = False
                self._fence_lang = self._fence_lang.strip().lower()
            else:
                self._fence_lang += ch
                return

        json_fence = self._in_fence and self._fence_lang in _JSON_FENCE_LANGS
        if not self._in_fence or json_fence:
            self._feed_json(ch)

        if ch == "\n":
            line = "".join(self._line)
            self._line.clear()
            if line.strip():
                self._recent_code.append(bool(_CODE_LINE.search(line)))
                if len(self._recent_code) > 3:
                    self._recent_code.pop(0)
        else:
            if len(self._line) < 400:  # only a line's start and end matter; bound the cost
                self._line.append(ch)

    def _feed_json(self, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            elif ch == "\n" and not self._in_tool_call:
                # JSON strings never hold raw newlines: this was prose with a stray brace
                self._in_string = False
                self._stack.clear()
            return
        if ch == '"' and (self._stack or self._in_tool_call):
            self._in_string = True
        elif ch == "{":
            self._stack.append("}")
        elif ch == "[" and (self._stack or self._in_tool_call):
            self._stack.append("]")
        elif ch in "}]" and self._stack:
            # pop to the matching opener (tolerates a model's unbalanced output)
            if ch in self._stack:
                while self._stack and self._stack.pop() != ch:
                    pass

    # -- result ----------------------------------------------------------------------------
    @property
    def kind(self) -> SpanKind:
        if self._stack or self._in_tool_call or self._in_string:
            return SpanKind.JSON
        if self._in_fence:
            return SpanKind.JSON if self._fence_lang in _JSON_FENCE_LANGS else SpanKind.CODE
        if self._recent_code and sum(self._recent_code) * 2 > len(self._recent_code):
            # a prose line now in progress ends a code-like run early
            current = "".join(self._line)
            if current.strip() and len(current) > 40 and not _CODE_LINE.search(current):
                return SpanKind.FREE
            return SpanKind.CODE
        return SpanKind.FREE

    @property
    def json_depth(self) -> int:
        return len(self._stack)


def classify_span(text_tail: str) -> SpanKind:
    """Span kind at the end of ``text_tail`` (generated text so far, or its recent tail)."""
    return SpanTracker().feed(text_tail).kind


# --------------------------------------------------------------------------------------------
# Latency model


class _DecayedLinearFit:
    """Least squares y ≈ a + b·x over exponentially decayed observations, regularised by
    pseudo-observations on the prior line so it is defined (and sensible) before data and
    when all data share one x."""

    def __init__(self, a0: float, b0: float, prior_x: tuple[float, ...], prior_weight: float, decay: float):
        self.a0, self.b0 = a0, b0
        self.decay = decay
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0
        self.count = 0
        self._prior_weight = prior_weight
        w = prior_weight / len(prior_x)
        self._prior = []
        for x in prior_x:
            y = a0 + b0 * x
            self._prior.append((w, w * x, w * x * x, w * y, w * x * y))

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.n = self.n * d + 1.0
        self.sx = self.sx * d + x
        self.sxx = self.sxx * d + x * x
        self.sy = self.sy * d + y
        self.sxy = self.sxy * d + x * y
        self.count += 1

    def coefficients(self) -> tuple[float, float]:
        n, sx, sxx, sy, sxy = self.n, self.sx, self.sxx, self.sy, self.sxy
        # the prior fades as data arrives (its weight shrinks like 1/observations)
        fade = 1.0 / (1.0 + self.count / max(self._prior_weight, 1e-9))
        for pn, psx, psxx, psy, psxy in self._prior:
            n += fade * pn; sx += fade * psx; sxx += fade * psxx; sy += fade * psy; sxy += fade * psxy  # noqa: E702
        det = n * sxx - sx * sx
        if det <= 1e-12:
            return self.a0, self.b0
        b = (n * sxy - sx * sy) / det
        a = (sy - b * sx) / n
        if b < 0.0:  # more tokens never cost less; fall back to the mean cost
            b, a = 0.0, sy / n
        return max(a, 0.0), b

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


class LatencyModel:
    """Online cost model (seconds).

    * verify: one target forward over ``batch`` sequences of ``k + 1`` tokens (k = 0 is a plain
      decode step). With ``step_costs`` (rows → seconds, measured on this machine: e.g.
      ``pdserve.engine.calibrate.StepProfile.cost``) ``verify_seconds(batch, k) = s · step_costs(batch · (k + 1))``,
      the measured shape scaled by ``s``, a decayed geometric mean of observed / predicted (load, context
      length); without, the linear fit ``a + b · batch · (k + 1)``.
    * draft: ``draft_seconds(method, k) ≈ c_m + d_m · k`` per drafting method (per request).

    Priors (used before data, faded by it): verify ``verify_prior = (a, b)``; draft per method
    from ``draft_priors`` (n-gram ≈ free; a draft model ≈ a quarter of a target token per
    token). ``decay`` weights recent observations (load and hardware drift).
    """

    DEFAULT_DRAFT_PRIORS = {"ngram": (2e-5, 1e-6), "none": (0.0, 0.0), "draft": (0.0, 0.02), "remote": (0.005, 0.02)}

    def __init__(
        self,
        verify_prior: tuple[float, float] = (0.06, 0.015),
        draft_priors: dict[str, tuple[float, float]] | None = None,
        decay: float = 0.98,
        prior_weight: float = 4.0,
        step_costs: Callable[[int], float] | None = None,
    ):
        self.decay = decay
        self.step_costs = step_costs
        self._log_scale = 0.0  # log of observed / measured step cost, decayed
        self.prior_weight = prior_weight
        self._verify = _DecayedLinearFit(*verify_prior, prior_x=(1.0, 8.0), prior_weight=prior_weight, decay=decay)
        self._draft_priors = dict(self.DEFAULT_DRAFT_PRIORS)
        if draft_priors:
            self._draft_priors.update(draft_priors)
        self._draft: dict[str, _DecayedLinearFit] = {}

    def observe_verify(self, batch_size: int, tokens_per_seq: int, seconds: float) -> None:
        """One target forward: ``batch_size`` sequences × ``tokens_per_seq`` (= k + 1) tokens."""
        self._verify.observe(float(batch_size * tokens_per_seq), float(seconds))
        if self.step_costs is not None and seconds > 0:
            ratio = seconds / max(self.step_costs(batch_size * tokens_per_seq), 1e-12)
            self._log_scale = self.decay * self._log_scale + (1.0 - self.decay) * math.log(ratio)

    def observe_draft(self, method: str, k: int, seconds: float) -> None:
        """One request's proposal of ``k`` tokens by ``method`` took ``seconds``."""
        self._draft_fit(method).observe(float(k), float(seconds))

    def _draft_fit(self, method: str) -> _DecayedLinearFit:
        fit = self._draft.get(method)
        if fit is None:
            a0, b0 = self._draft_priors.get(method, self._draft_priors["draft"])
            fit = self._draft[method] = _DecayedLinearFit(a0, b0, (1.0, 4.0), self.prior_weight, self.decay)
        return fit

    def verify_seconds(self, batch_size: int, k: int) -> float:
        rows = batch_size * (k + 1)
        if self.step_costs is not None:
            return max(math.exp(self._log_scale) * self.step_costs(rows), 1e-9)
        return max(self._verify.predict(float(rows)), 1e-9)

    def draft_seconds(self, method: str, k: int) -> float:
        if k <= 0:
            return 0.0
        return max(self._draft_fit(method).predict(float(k)), 0.0)

    def verify_coefficients(self) -> tuple[float, float]:
        """(fixed seconds per step, seconds per token) of the verify fit."""
        return self._verify.coefficients()

    def draft_coefficients(self, method: str) -> tuple[float, float]:
        return self._draft_fit(method).coefficients()


# --------------------------------------------------------------------------------------------
# Acceptance


def expected_tokens(alpha: float, k: int) -> float:
    """E[committed tokens per step] = (1 − α^(k+1)) / (1 − α): accepted drafts + one target token."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class _Counts:
    accepted: float = 0.0  # accepted draft tokens
    trials: float = 0.0  # draft tokens that were tested (accepted + first rejection)


class AcceptanceTracker:
    """Per-token acceptance α per (request, span kind), shrunk toward a fleet-wide prior.

    A step that proposed ``n`` tokens and had ``a`` accepted tested ``a + (a < n)`` tokens with
    ``a`` successes — the maximum-likelihood estimator of the geometric acceptance model.
    Request estimate: ``(acc_r + m·α_fleet) / (trials_r + m)`` with ``m = prior_strength``; the
    fleet estimate is itself shrunk toward ``initial`` by ``fleet_strength`` pseudo-trials.
    Counts decay by ``decay`` per observation so estimates follow a changing text.
    """

    DEFAULT_INITIAL = {SpanKind.JSON: 0.5, SpanKind.CODE: 0.4, SpanKind.FREE: 0.2}

    def __init__(
        self,
        initial: dict[SpanKind, float] | None = None,
        prior_strength: float = 4.0,
        fleet_strength: float = 8.0,
        decay: float = 0.9,
        fleet_decay: float = 0.999,
    ):
        self.initial = dict(self.DEFAULT_INITIAL)
        if initial:
            self.initial.update({SpanKind(k): v for k, v in initial.items()})
        self.prior_strength = prior_strength
        self.fleet_strength = fleet_strength
        self.decay = decay
        self.fleet_decay = fleet_decay
        self._fleet: dict[SpanKind, _Counts] = {k: _Counts() for k in SpanKind}
        self._req: dict[str, dict[SpanKind, _Counts]] = {}

    def observe(self, request_id: str, span: SpanKind, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(
                f"request {request_id}: num_accepted={num_accepted} outside [0, num_draft={num_draft}]"
            )
        span = SpanKind(span)
        trials = num_accepted + (1 if num_accepted < num_draft else 0)
        c = self._req.setdefault(request_id, {}).setdefault(span, _Counts())
        c.accepted = c.accepted * self.decay + num_accepted
        c.trials = c.trials * self.decay + trials
        f = self._fleet[span]
        f.accepted = f.accepted * self.fleet_decay + num_accepted
        f.trials = f.trials * self.fleet_decay + trials

    def fleet_alpha(self, span: SpanKind) -> float:
        f = self._fleet[SpanKind(span)]
        m = self.fleet_strength
        return (f.accepted + m * self.initial[SpanKind(span)]) / (f.trials + m)

    def alpha(self, request_id: str, span: SpanKind) -> float:
        span = SpanKind(span)
        prior = self.fleet_alpha(span)
        c = self._req.get(request_id, {}).get(span)
        if c is None:
            return prior
        m = self.prior_strength
        return (c.accepted + m * prior) / (c.trials + m)

    def request_trials(self, request_id: str, span: SpanKind) -> float:
        c = self._req.get(request_id, {}).get(SpanKind(span))
        return 0.0 if c is None else c.trials

    def release(self, request_id: str) -> None:
        self._req.pop(request_id, None)


# --------------------------------------------------------------------------------------------
# Controller


@dataclass
class SpeculationStats:
    """Plain counters for the worker's Prometheus export (``pdserve_spec_*``).

    ``draft_tokens`` / ``accepted_tokens``: totals by span kind (counters). ``chosen_k``:
    how often each k was chosen (a histogram's buckets). ``acceptance_ratio_buckets``: per
    verified step, accepted/proposed bucketed to tenths (0.0 … 1.0) (a histogram).
    ``steps`` / ``probes``: decisions taken and how many were probes.
    """

    draft_tokens: Counter = field(default_factory=Counter)
    accepted_tokens: Counter = field(default_factory=Counter)
    chosen_k: Counter = field(default_factory=Counter)
    acceptance_ratio_buckets: Counter = field(default_factory=Counter)
    steps: int = 0
    probes: int = 0

    def snapshot(self) -> dict:
        return {
            "draft_tokens_total": {str(SpanKind(k).value): v for k, v in self.draft_tokens.items()},
            "accepted_tokens_total": {str(SpanKind(k).value): v for k, v in self.accepted_tokens.items()},
            "chosen_k": dict(sorted(self.chosen_k.items())),
            "acceptance_ratio_buckets": dict(sorted(self.acceptance_ratio_buckets.items())),
            "steps_total": self.steps,
            "probes_total": self.probes,
        }


@dataclass
class _ReqPolicy:
    zero_streak: int = 0  # consecutive steps at k = 0 (per span)
    backoff: int = 0  # how many probes failed since the last success
    span: SpanKind | None = None


class SpeculationController:
    """Chooses each request's speculation length from acceptance, latency and load.

    ``choose_k`` maximises ``E[tokens | α, k] / (draft(k) + verify(batch, k))`` over
    ``k ∈ [0, max_k]`` and returns 0 when nothing beats plain decoding. After backing off to 0,
    a request probes with ``probe_k`` tokens after ``probe_interval·2^b`` plain steps (b = failed
    probes so far, capped by ``max_probe_interval``) — deterministic, bounded — so a span that
    became predictable is noticed. A change of span kind re-evaluates immediately.
    """

    def __init__(
        self,
        latency: LatencyModel | None = None,
        acceptance: AcceptanceTracker | None = None,
        method: str = "ngram",
        probe_k: int = 2,
        probe_interval: int = 4,
        max_probe_interval: int = 64,
        min_gain: float = 1.02,
    ):
        self.latency = latency or LatencyModel()
        self.acceptance = acceptance or AcceptanceTracker()
        self.method = method
        self.probe_k = probe_k
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.min_gain = min_gain
        self.stats = SpeculationStats()
        self._req: dict[str, _ReqPolicy] = {}

    def rate(self, alpha: float, k: int, batch_size: int) -> float:
        """Expected committed tokens per second for one request at speculation length k."""
        cost = self.latency.draft_seconds(self.method, k) + self.latency.verify_seconds(batch_size, k)
        return expected_tokens(alpha, k) / cost

    def best_k(self, alpha: float, batch_size: int, max_k: int) -> int:
        """argmax_k rate (ties to the smaller k); 0 unless it beats plain by ``min_gain``."""
        base = self.rate(alpha, 0, batch_size)
        best_k, best = 0, base * self.min_gain
        for k in range(1, max(max_k, 0) + 1):
            r = self.rate(alpha, k, batch_size)
            if r > best * (1 + 1e-9):
                best_k, best = k, r
        return best_k

    def choose_k(
        self, request_id: str, span_kind: SpanKind, batch_size: int, max_k: int, alpha_hint: float | None = None
    ) -> int:
        """Speculation length for one request this step, in ``[0, max_k]``.

        ``alpha_hint``: a drafter's own per-token acceptance estimate for the proposal it has
        already made (model-free drafters propose first, for free: e.g. n-gram acceptance by
        match length). It replaces the span estimate, and no probe is scheduled — the
        proposal in hand is the evidence; ``max_k`` is then the proposal's length.
        """
        span = SpanKind(span_kind)
        pol = self._req.setdefault(request_id, _ReqPolicy())
        if pol.span is not span:
            pol.span, pol.zero_streak = span, 0
        if alpha_hint is not None:
            k = self.best_k(min(max(alpha_hint, 0.0), 1.0), max(batch_size, 1), max_k)
            self.stats.steps += 1
            self.stats.chosen_k[k] += 1
            return k
        alpha = self.acceptance.alpha(request_id, span)
        k = self.best_k(alpha, max(batch_size, 1), max_k)
        probe = False
        if k == 0 and max_k > 0:
            pol.zero_streak += 1
            interval = min(self.probe_interval * (2 ** pol.backoff), self.max_probe_interval)
            if pol.zero_streak >= interval:
                k, probe = min(self.probe_k, max_k), True
                pol.zero_streak = 0
                pol.backoff += 1
        else:
            pol.zero_streak = 0
            if k > 0:
                pol.backoff = 0
        self.stats.steps += 1
        self.stats.probes += int(probe)
        self.stats.chosen_k[k] += 1
        return k

    def observe_step(
        self, request_id: str, span_kind: SpanKind, num_draft: int, num_accepted: int
    ) -> None:
        """Feed back one verified step of one request (num_draft = tokens actually proposed)."""
        if num_draft <= 0:
            return
        span = SpanKind(span_kind)
        self.acceptance.observe(request_id, span, num_draft, num_accepted)
        self.stats.draft_tokens[span] += num_draft
        self.stats.accepted_tokens[span] += num_accepted
        self.stats.acceptance_ratio_buckets[round(math.floor(10 * num_accepted / num_draft) / 10, 1)] += 1

    def observe_verify(self, batch_size: int, tokens_per_seq: int, seconds: float) -> None:
        self.latency.observe_verify(batch_size, tokens_per_seq, seconds)

    def observe_draft(self, k: int, seconds: float, method: str | None = None) -> None:
        self.latency.observe_draft(method or self.method, k, seconds)

    def release(self, request_id: str) -> None:
        self._req.pop(request_id, None)
        self.acceptance.release(request_id)
