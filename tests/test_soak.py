"""The short chaos soak (bench/soak.py, the same code as `--minutes`): a 2 prefill + 2 decode deployment under
mixed load while every fault kind is injected once — SIGKILL and SIGTERM of a worker (restarted), a NATS
restart, a worker frozen past the heartbeat bound, a KV transfer corrupted, truncated, delayed and cut on
its data path. Fails on any broken invariant: a wrong or lost answer, a failure that is not a clean error
within its bound, capacity not back within its bound, a leak (see bench/soak.py's docstring for each).

Short on purpose: the faults follow each other at once (a restart is most of the time), so the run is its
cluster's start, the references, and one recovery per fault kind. The seed is printed; PDSERVE_SOAK_SEED=N
repeats a run's fault order, targets and load.
"""
from __future__ import annotations

import os

import pytest

from bench.soak import FAULT_KINDS, print_report, soak

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(1200)]
SEED = int(os.environ.get("PDSERVE_SOAK_SEED", "17"))


def test_short_soak_keeps_every_invariant(model_dir):
    print(f"\nsoak seed {SEED} (repeat with PDSERVE_SOAK_SEED={SEED})")
    report = soak(0, seed=SEED, model=str(model_dir), concurrency=2, gap_s=(0.2, 1.0))
    print_report(report)
    assert set(report["faults"]) == set(FAULT_KINDS), report["faults"]  # every kind fired, on the data path too
    assert report["wrong"] == 0 and report["lost"] == 0, report["violations"]  # each names its request and why
    assert report["correct"] > 0 and report["failed_cleanly"] + report["correct"] == report["requests_sent"], report
    assert not report["violations"], report["violations"]
