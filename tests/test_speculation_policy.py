"""Speculation policy: span classification, latency fit, acceptance shrinkage, choice of k."""
from __future__ import annotations

import json
import random

import pytest

from pdserve.decode.speculation import (
    AcceptanceTracker,
    LatencyModel,
    SpanKind,
    SpanTracker,
    SpeculationController,
    classify_span,
    expected_tokens,
)

# ---------------------------------------------------------------------------------------------
# span classification

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'


@pytest.mark.parametrize(
    "text, kind",
    [
        ("The capital of France is Paris. It is known for", SpanKind.FREE),
        ('{"name":', SpanKind.JSON),
        ('Sure, calling it now: {"name": "search_files", "arguments": {"query": "def f', SpanKind.JSON),
        (TOOL_CALL, SpanKind.JSON),
        ("<tool_call>\n", SpanKind.JSON),
        ('<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>\nThe weather is', SpanKind.FREE),
        ('{"a": [1, 2, {"b": "}"}], "c": "still ', SpanKind.JSON),  # brace inside a string
        ('{"a": 1} and then prose follows here', SpanKind.FREE),
        ("Here you go:\n```python\ndef f(x):\n    return", SpanKind.CODE),
        ("Here you go:\n```python\ndef f(x):\n    return x\n```\nThis returns its argument unchanged.", SpanKind.FREE),
        ("```json\n{\"a\": 1}\n", SpanKind.JSON),
        ("def area(w, h):\n    if w < 0:\n        raise ValueError('w')\n    return", SpanKind.CODE),
        ("I like {curly braces} in my prose, and that is fine.", SpanKind.FREE),
        ("Why do cats purr?\nCats purr when they are content.\nThey also purr when", SpanKind.FREE),
    ],
)
def test_classify_span(text, kind):
    assert classify_span(text) is kind


def test_span_tracker_incremental_equals_whole_text():
    texts = [
        TOOL_CALL + 'is", "units": "metric"}}\n</tool_call>\nIt is 14 degrees in Paris.',
        "Rewritten:\n```python\ndef even(xs):\n    return [x for x in xs if x % 2 == 0]\n```\nDone, it is shorter now.",
        'Result {"ok": true, "items": [{"id": 1}, {"id": 2}]} was returned.\n    indented = 1\n',
    ]
    rng = random.Random(0)
    for text in texts:
        tracker = SpanTracker()
        i = 0
        while i < len(text):
            step = rng.randint(1, 7)
            tracker.feed(text[i : i + step])
            i += step
            assert tracker.kind is classify_span(text[:i]), text[:i]


def test_tool_call_arguments_are_json_throughout():
    call = "\n" + json.dumps({"name": "send_email", "arguments": {"to": "a@b.c", "body": "x {y} [z]\n"}})
    tracker = SpanTracker().feed("Let me send it.\n<tool_call")
    assert tracker.kind is SpanKind.FREE
    tracker.feed(">")
    assert tracker.kind is SpanKind.JSON
    for ch in call:
        tracker.feed(ch)
        assert tracker.kind is SpanKind.JSON
    tracker.feed("\n</tool_call>\nSent.")
    assert tracker.kind is SpanKind.FREE


# ---------------------------------------------------------------------------------------------
# latency model


def test_latency_model_recovers_linear_costs():
    lat = LatencyModel(decay=1.0)
    a, b = 0.040, 0.003  # 40 ms per step + 3 ms per token
    rng = random.Random(1)
    for _ in range(400):
        batch, k = rng.randint(1, 32), rng.randint(0, 8)
        lat.observe_verify(batch, k + 1, a + b * batch * (k + 1) + rng.gauss(0, 0.0005))
    for _ in range(200):
        k = rng.randint(1, 8)
        lat.observe_draft("draft", k, 0.002 + 0.006 * k + rng.gauss(0, 0.0002))
    fa, fb = lat.verify_coefficients()
    assert fa == pytest.approx(a, rel=0.05)
    assert fb == pytest.approx(b, rel=0.03)
    assert lat.verify_seconds(8, 3) == pytest.approx(a + b * 32, rel=0.03)
    da, db = lat.draft_coefficients("draft")
    assert da == pytest.approx(0.002, abs=0.0005)
    assert db == pytest.approx(0.006, rel=0.03)
    assert lat.draft_seconds("draft", 0) == 0.0


def test_latency_model_priors_before_data_and_with_one_x():
    lat = LatencyModel(verify_prior=(0.05, 0.01))
    assert lat.verify_seconds(1, 0) == pytest.approx(0.06)
    assert lat.verify_seconds(1, 3) > lat.verify_seconds(1, 0)
    assert lat.draft_seconds("ngram", 8) < 1e-3  # prompt lookup is nearly free
    # plain decoding only (x = 1 always): the prior keeps the slope identifiable
    for _ in range(50):
        lat.observe_verify(1, 1, 0.1)
    assert lat.verify_seconds(1, 0) == pytest.approx(0.1, rel=0.05)
    assert lat.verify_seconds(1, 4) > lat.verify_seconds(1, 0)


# ---------------------------------------------------------------------------------------------
# acceptance


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(1.0, 5) == pytest.approx(6.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_acceptance_tracker_geometric_mle_and_shrinkage():
    acc = AcceptanceTracker(initial={SpanKind.JSON: 0.5}, prior_strength=4.0, fleet_strength=8.0, decay=1.0, fleet_decay=1.0)
    assert acc.alpha("r1", SpanKind.JSON) == pytest.approx(0.5)  # nothing seen: the prior
    # 3 of 4 accepted then rejected: 3 successes in 4 trials; all 4 accepted: 4 in 4
    acc.observe("r1", SpanKind.JSON, 4, 3)
    acc.observe("r1", SpanKind.JSON, 4, 4)
    fleet = acc.fleet_alpha(SpanKind.JSON)
    assert fleet == pytest.approx((7 + 8 * 0.5) / (8 + 8))
    assert acc.alpha("r1", SpanKind.JSON) == pytest.approx((7 + 4 * fleet) / (8 + 4))
    # the request's estimate lies between its own rate (7/8) and the fleet's
    assert fleet < acc.alpha("r1", SpanKind.JSON) < 7 / 8
    # a fresh request starts at the fleet estimate, other span kinds are unaffected
    assert acc.alpha("r2", SpanKind.JSON) == pytest.approx(fleet)
    assert acc.alpha("r1", SpanKind.FREE) == pytest.approx(acc.initial[SpanKind.FREE])
    # with much data a request's estimate leaves the prior behind
    for _ in range(200):
        acc.observe("r3", SpanKind.JSON, 4, 0)
    assert acc.alpha("r3", SpanKind.JSON) < 0.05
    with pytest.raises(ValueError):
        acc.observe("r1", SpanKind.JSON, 2, 3)


# ---------------------------------------------------------------------------------------------
# controller


def _controller(verify=(0.05, 0.01), **kw) -> SpeculationController:
    lat = LatencyModel(verify_prior=verify)
    return SpeculationController(latency=lat, acceptance=AcceptanceTracker(decay=1.0), **kw)


def test_k_zero_when_nothing_is_accepted():
    ctl = _controller(probe_interval=1000)
    for _ in range(30):
        ctl.observe_step("r", SpanKind.FREE, 4, 0)
    assert ctl.acceptance.alpha("r", SpanKind.FREE) < 0.1
    assert all(ctl.choose_k("r", SpanKind.FREE, 1, 8) == 0 for _ in range(10))


def test_large_k_when_acceptance_high_and_verify_cheap():
    ctl = _controller(verify=(0.05, 0.0005))  # extra tokens nearly free (a GPU, batch 1)
    for _ in range(30):
        ctl.observe_step("r", SpanKind.JSON, 8, 8)
    assert ctl.choose_k("r", SpanKind.JSON, 1, 8) == 8


def test_k_shrinks_under_load():
    ctl = _controller(verify=(0.02, 0.002))
    for _ in range(10):
        ctl.observe_step("r", SpanKind.CODE, 4, 3)
        ctl.observe_step("r", SpanKind.CODE, 4, 4)
    ks = [ctl.choose_k("r", SpanKind.CODE, batch, 8) for batch in (1, 8, 32, 128, 512)]
    assert ks[0] >= 4
    assert ks == sorted(ks, reverse=True)
    assert ks[-1] < ks[0]
    assert ks[-1] == 0


def test_probes_after_backing_off_and_recovers():
    ctl = _controller(probe_k=2, probe_interval=4, max_probe_interval=16)
    for _ in range(20):
        ctl.observe_step("r", SpanKind.CODE, 4, 0)
    ks = [ctl.choose_k("r", SpanKind.CODE, 1, 8) for _ in range(60)]
    probes = [i for i, k in enumerate(ks) if k > 0]
    assert all(ks[i] == 2 for i in probes)
    # deterministic, exponentially spaced, bounded: after 4, 8, 16, 16, ... plain steps
    assert probes == [3, 11, 27, 43, 59]
    assert ctl.stats.probes == len(probes)
    # a probe that finds the text predictable again brings speculation back
    for _ in range(8):
        ctl.observe_step("r", SpanKind.CODE, 2, 2)
    assert ctl.choose_k("r", SpanKind.CODE, 1, 8) > 0
    for _ in range(40):
        ctl.observe_step("r", SpanKind.CODE, 4, 4)
    assert ctl.choose_k("r", SpanKind.CODE, 1, 8) > 2


def test_span_change_uses_that_span_estimate():
    ctl = _controller()
    for _ in range(30):
        ctl.observe_step("r", SpanKind.FREE, 4, 0)
        ctl.observe_step("r", SpanKind.JSON, 4, 4)
    assert ctl.choose_k("r", SpanKind.FREE, 1, 8) == 0
    assert ctl.choose_k("r", SpanKind.JSON, 1, 8) >= 4


def test_stats_are_plain_counters():
    ctl = _controller()
    ctl.choose_k("r", SpanKind.JSON, 1, 4)
    ctl.observe_step("r", SpanKind.JSON, 4, 3)
    ctl.observe_step("r", SpanKind.JSON, 0, 0)  # nothing proposed: nothing counted
    snap = ctl.stats.snapshot()
    assert snap["draft_tokens_total"] == {"json": 4}
    assert snap["accepted_tokens_total"] == {"json": 3}
    assert sum(snap["chosen_k"].values()) == 1
    assert snap["acceptance_ratio_buckets"] == {0.7: 1}
    json.dumps(snap)  # exportable as is
    ctl.release("r")
    assert ctl.acceptance.request_trials("r", SpanKind.JSON) == 0.0


def test_alpha_hint_from_the_drafter_replaces_the_span_estimate():
    ctl = _controller(verify=(0.05, 0.005))
    for _ in range(30):
        ctl.observe_step("r", SpanKind.FREE, 4, 0)
    assert ctl.choose_k("r", SpanKind.FREE, 1, 8) == 0
    # a long n-gram match in the same span: its own track record decides, bounded by max_k
    assert ctl.choose_k("r", SpanKind.FREE, 1, 6, alpha_hint=0.95) == 6
    assert ctl.choose_k("r", SpanKind.FREE, 1, 6, alpha_hint=0.02) == 0
    # under load the same confidence buys fewer tokens
    assert ctl.choose_k("r", SpanKind.FREE, 64, 6, alpha_hint=0.8) < ctl.choose_k("r", SpanKind.FREE, 1, 6, alpha_hint=0.8)
