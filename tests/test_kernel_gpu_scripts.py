"""The prepared GPU scripts still run: the benchmark's CPU smoke mode, and a compile of every kernel for sm_90."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], env_updates: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_updates}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_gpu_bench_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    proc = _run(["bench/gpu_kernels.py", "--smoke", "--out", str(out)], {"TRITON_INTERPRET": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["info"]["smoke"]
    assert all(r["requests_differing"] == 0 for r in result["verify_checks"])
    assert all(r["payload_bytes_differing"] == 0 and r["values_differing"] == 0 for r in result["kv_checks"])
    assert {r["per_position_noise"] for r in result["verify_checks"]} == {False, True}
    assert result["attention_checks"] and all(r["ok"] for r in result["attention_checks"])
    assert {r["dtype"] for r in result["attention_checks"]} == {"torch.float32", "torch.bfloat16"}
    assert {r["kind"] for r in result["attention_bench"]} == {"decode", "spec"}
    assert all(r["kernel_ms"] > 0 and r["reference_ms"] > 0 for r in result["attention_bench"])
    assert {r["mode"] for r in result["verify_bench"]} >= {"greedy", "sampled+top-p", "coupled"}
    assert all(r["fused_ms"] > 0 and r["reference_ms"] > 0 for r in result["verify_bench"])
    assert all(r["pack_triton_GBps"] > 0 for r in result["kv_bench"])
    assert "fused verify vs unfused torch reference" in proc.stdout
    assert "paged attention kernel vs torch reference" in proc.stdout


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("this triton wheel has no CUDA backend")
    proc = _run(["bench/compile_kernels.py", "--arch", "90"], {"TRITON_INTERPRET": "0"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    # spec_verify: 2 draft kinds x 2 noise shapes; paged attention: 4 + 1 split-KV + 2 window/sinks/softcap;
    # kv pack/unpack: 12
    assert proc.stdout.count("ok ") == 23, proc.stdout


@pytest.mark.slow
@pytest.mark.model
def test_gpu_engine_smoke(tmp_path):
    """bench/gpu_engine.py (the device check's engine part) on the CPU with a few tokens, in float32 (where greedy
    equality with transformers is exact but for ties): greedy equal to transformers, the same answer along the other
    paths, a step time and a roofline printed."""
    out = tmp_path / "engine.json"
    proc = _run(["-P", "bench/gpu_engine.py", "--smoke", "--dtype", "float32", "--out", str(out)], {}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["greedy"] and all(g["equal"] for g in result["greedy"])
    assert result["paths"] and all(all(p.values()) for p in result["paths"])
    assert [s["batch"] for s in result["steps"]] == [1, 4]
    assert all(s["step_ms"] > 0 and s["roofline_ms"] > 0 for s in result["steps"])
