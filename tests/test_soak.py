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

from bench.soak import FAULT_KINDS, Answer, Job, Tally, histogram_quantile, print_report, soak

SEED = int(os.environ.get("PDSERVE_SOAK_SEED", "17"))


def test_a_failure_is_laid_to_the_faults_its_life_met_and_only_migrated_ones_make_it_a_violation():
    t = Tally()
    t.windows = [("sigkill", 10.0, 20.0), ("kv_cut", 30.0, 31.0), ("sigstop", 40.0, 50.0)]
    job = Job("greedy:x", "/v1/completions", {})
    for sent, ended in ((12.0, 15.0), (19.0, 32.0), (22.0, 25.0), (45.0, 60.0)):
        t.record(job, False, Answer("failed_clean", "503 unavailable", seconds=ended - sent, ended_at=ended))
    t.record(job, True, Answer("correct", seconds=1.0, ended_at=16.0))  # a success is nobody's failure
    assert t.failures_by_fault() == {"sigkill": 1, "kv_cut+sigkill": 1, "none": 1, "sigstop": 1}
    # the one that met only a kill and the one that met only a freeze: migration should have hidden them
    assert len(t.violations) == 2 and all("which migration covers" in v for v in t.violations), t.violations


def test_histogram_quantile_interpolates_as_prometheus_does():
    inf = float("inf")
    buckets = [(1.0, 0), (2.0, 4), (4.0, 8), (inf, 10)]
    assert histogram_quantile(0.5, buckets) == 2.5  # rank 5 of 10: a quarter into (2, 4]
    assert histogram_quantile(0.99, buckets) == 4.0  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, [(1.0, 0), (inf, 0)]) != histogram_quantile(0.5, [(1.0, 0), (inf, 0)])  # nan


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_short_soak_keeps_every_invariant(model_dir):
    print(f"\nsoak seed {SEED} (repeat with PDSERVE_SOAK_SEED={SEED})")
    report = soak(0, seed=SEED, model=str(model_dir), concurrency=2, gap_s=(0.2, 1.0))
    print_report(report)
    assert set(report["faults"]) == set(FAULT_KINDS), report["faults"]  # every kind fired, on the data path too
    assert report["wrong"] == 0 and report["lost"] == 0, report["violations"]  # each names its request and why
    assert report["correct"] > 0 and report["failed_cleanly"] + report["correct"] == report["requests_sent"], report
    assert not report["violations"], report["violations"]
