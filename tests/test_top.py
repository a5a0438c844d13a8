"""`pdserve top`'s arithmetic and screen, from synthetic reads (the live deployment: tests/test_prometheus.py)."""
from __future__ import annotations

import math

import pytest

from pdserve.top import Sample, frame, quantile


def test_quantile_is_prometheus_histogram_quantile():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)  # rank 20 in (0.1, 0.5]
    assert quantile(0.25, buckets) == pytest.approx(0.1 * 10 / 10)  # rank 10: the top of the first bucket
    assert quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    # past the last finite bound: that bound (as Prometheus answers)
    assert quantile(0.99, [(0.1, 1.0), (math.inf, 10.0)]) == pytest.approx(0.1)
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None and quantile(0.5, []) is None


def _sample(at: float, tokens: float, ok: float, ttft: list[tuple[str, float]], workers: list[dict]) -> Sample:
    s = Sample(at, model="m", workers=workers)
    s.values[("pdserve_completion_tokens_total", ())] = tokens
    s.values[("pdserve_requests_total", (("endpoint", "chat"), ("status", "200")))] = ok
    s.values[("pdserve_requests_total", (("endpoint", "chat"), ("status", "503")))] = 1.0
    for le, n in ttft:
        s.values[("pdserve_time_to_first_token_seconds_bucket", (("le", le),))] = n
    s.values[("pdserve_workers", (("role", "prefill"),))] = 2
    s.values[("pdserve_workers", (("role", "decode"),))] = 1
    return s


WORKER = {"worker_id": "decode-0", "role": "decode", "queue_depth": 0, "running": 3, "waiting": 1,
          "kv_utilization": 0.42, "ttft_seconds": 0.0, "itl_seconds": 0.021, "tokens_per_second": 45.0,
          "spec_acceptance_rate": 0.3, "transfer_backlog_handoffs": 2, "draining": True}


def test_frame_shows_rates_over_the_interval_and_the_window_percentiles():
    prev = _sample(10.0, 100, 4, [("0.1", 4), ("1.0", 4), ("+Inf", 4)], [])
    cur = _sample(12.0, 200, 8, [("0.1", 4), ("1.0", 8), ("+Inf", 8)], [WORKER])
    text = frame(prev, cur, "http://front", color=False)
    assert "requests   2.00/s ok   0.00/s errors" in text  # 4 more 200s in 2 s; the 503 count did not move
    assert "output    50.0 tok/s" in text
    assert "TTFT last  p50   550 ms" in text  # the 4 requests of the window all fell in (0.1, 1.0]
    assert "P:D 2.00" in text
    row = next(line for line in text.splitlines() if line.startswith("decode-0")).split()
    assert row[1:7] == ["decode", "draining", "-", "3", "1", "42%"] and row[-1] == "2"
    assert "\x1b[" not in text


def test_frame_without_requests_in_the_window_shows_percentiles_since_start():
    s = _sample(10.0, 100, 4, [("0.1", 4), ("1.0", 4), ("+Inf", 4)], [])
    later = _sample(11.0, 100, 4, [("0.1", 4), ("1.0", 4), ("+Inf", 4)], [])
    text = frame(s, later, "http://front", color=True)
    assert "TTFT \x1b[2mall" in text and "(no workers registered)" in text
