"""A real agent framework against a real deployment: LangChain's `ChatOpenAI.bind_tools` drives a two-tool
loop (call, result fed back, next call, result fed back, answer) to completion on the real model.

LangChain runs from a venv of its own under `~/.cache/pdserve/peers/langchain` (`bench/peer.py`'s
`ensure_langchain` makes it on first use); the test skips, saying why, only when that venv cannot be made.
It runs with a working directory outside the repo, whose `operator/` folder would shadow the standard library.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pdserve.local import LocalCluster

pytestmark = [pytest.mark.model, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
SCRIPT = Path(__file__).parent / "agents" / "langchain_tool_loop.py"


def _peer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pdserve_bench_peer", Path(__file__).parent.parent / "bench" / "peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def langchain_python():
    peer = _peer()
    try:
        return peer.ensure_langchain()
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"LangChain's venv under {peer.PEERS} could not be made: {e}")


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    with LocalCluster(str(model_dir), nats=nats_server.creds) as c:
        yield c


def test_langchain_drives_a_two_tool_loop_to_completion(cluster, langchain_python, tmp_path):
    run = subprocess.run([str(langchain_python), str(SCRIPT), cluster.url + "/v1", MODEL], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    calls = out["calls"]
    assert [c["name"] for c in calls] == ["get_weather", "add"], out
    assert isinstance(calls[0]["args"]["city"], str) and calls[0]["args"]["city"]
    assert isinstance(calls[1]["args"]["a"], int) and calls[1]["result"] == calls[1]["args"]["a"] + calls[1]["args"]["b"]
    assert all(c["id"].startswith("call_") for c in calls) and len({c["id"] for c in calls}) == 2
    assert out["final"] and not out["final_calls"] and out["finish_reason"] in ("stop", "length"), out
