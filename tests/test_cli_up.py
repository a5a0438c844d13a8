"""`pdserve up --demo`, the README's first command, as a user runs it: it starts, answers, and Ctrl-C
stops every process it started."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pdserve.natsserver import free_port

pytestmark = pytest.mark.model


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie awaiting its parent's wait() is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_pdserve_up_demo_answers_and_ctrl_c_stops_everything(model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--demo", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, pids = [], []
    deadline = time.monotonic() + 240
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"pid (\d+)", line)
            if m:
                pids.append(int(m.group(1)))
            if line.startswith("demo: ->") or time.monotonic() > deadline:
                break
        out = "".join(lines)
        assert "Paris" in out, out
        assert f"http://127.0.0.1:{port}/v1" in out
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        assert "password" not in out.lower().replace("user/password auth", "")  # no secret printed
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "stopping" in rest
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "pdserve up left worker processes behind"
