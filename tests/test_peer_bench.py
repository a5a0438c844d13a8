"""bench/peer.py's own plumbing: one system is measured only once the other is entirely gone.

Real processes (a shell whose child ignores SIGTERM for a while, as vLLM's engine-core and compile
workers outlive its API server), real signals, the real /proc/stat.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from pathlib import Path

import pytest


def _peer():
    spec = importlib.util.spec_from_file_location("pdserve_bench_peer_plumbing",
                                                  Path(__file__).parent.parent / "bench" / "peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peer = _peer()


def _server_with_a_lingering_child(linger_s: float) -> subprocess.Popen:
    # the main process exits at once on SIGTERM; its child ignores SIGTERM and lives `linger_s` longer
    script = f"(trap '' TERM; sleep {linger_s}) & trap 'exit 0' TERM; while :; do sleep 0.1; done"
    return subprocess.Popen(["bash", "-c", script], start_new_session=True)


def test_stop_waits_for_every_process_of_the_servers_session():
    proc = _server_with_a_lingering_child(2.0)
    time.sleep(0.5)  # both are up
    t0 = time.monotonic()
    peer.stop(proc, grace=20)
    waited = time.monotonic() - t0
    assert proc.poll() is not None
    assert not peer._group_alive(proc.pid), "a process of the server's session outlived stop()"
    assert waited >= 1.0, f"stop() returned after {waited:.2f} s, before the lingering child could have ended"


def test_stop_kills_what_outlives_the_grace_period():
    proc = _server_with_a_lingering_child(60.0)
    time.sleep(0.5)
    t0 = time.monotonic()
    peer.stop(proc, grace=1.0)
    assert not peer._group_alive(proc.pid)
    assert time.monotonic() - t0 < 30


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc/stat")
def test_cpu_busy_sees_a_core_kept_busy():
    spinner = subprocess.Popen(["python3", "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        busy = peer._cpu_busy(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    # one spinning process keeps one core of this machine's os.cpu_count() busy
    assert busy >= 0.8 / os.cpu_count(), busy


def _row(c, tok_s, ttft, itl, errored=0, first_error=None):
    return {"concurrency": c, "output_tok_s": tok_s, "ttft_p50_ms": ttft, "itl_p50_ms": itl, "errored": errored,
            "first_error": first_error}


def test_rounds_combine_into_medians_per_level_and_keep_every_error():
    nan = float("nan")
    rounds = [
        [_row(1, 40.0, 300.0, 16.0), _row(16, 90.0, 7000.0, 40.0)],
        [_row(1, 44.0, 350.0, 17.0), _row(16, 70.0, 6000.0, 45.0, errored=2, first_error="boom")],
        [_row(1, 30.0, 320.0, 15.0), _row(16, nan, nan, nan)],  # a level with no successful request
    ]
    one, sixteen = peer.combine(rounds)
    assert (one["concurrency"], one["rounds"]) == (1, 3)
    assert one["output_tok_s"] == 40.0 and one["ttft_p50_ms"] == 320.0 and one["itl_p50_ms"] == 16.0
    assert (one["output_tok_s_min"], one["output_tok_s_max"]) == (30.0, 44.0)
    assert one["errored"] == 0 and one["first_error"] is None
    # NaN drops out of the median (an even count then averages the middle two), not into it
    assert sixteen["output_tok_s"] == 80.0 and sixteen["ttft_p50_ms"] == 6500.0
    assert (sixteen["output_tok_s_min"], sixteen["output_tok_s_max"]) == (70.0, 90.0)
    assert sixteen["errored"] == 2 and sixteen["first_error"] == "boom"


def test_one_round_combines_to_itself():
    (row,) = peer.combine([[_row(4, 66.5, 1092.0, 33.8)]])
    assert (row["output_tok_s"], row["ttft_p50_ms"], row["itl_p50_ms"]) == (66.5, 1092.0, 33.8)
    assert row["output_tok_s_min"] == row["output_tok_s_max"] == 66.5
