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
