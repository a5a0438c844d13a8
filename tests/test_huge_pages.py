"""The engine commands put torch's large host allocations (weights, KV pool) on transparent huge pages.

Each case runs `pdserve.cli.main` in a fresh interpreter, as a pod or `pdserve up` does, with the
command's module swapped for a probe that imports torch, allocates 64 MB through it and reports how much of
the process's anonymous memory sits on huge pages (`/proc/self/smaps_rollup`). Linux only, and only where the
kernel lets a process ask for them (THP mode `madvise` or `always`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text() or not Path("/proc/self/smaps_rollup").exists(),
    reason="this kernel gives no transparent huge pages")

PROBE = textwrap.dedent("""
    import os, re
    import torch

    def main(argv):
        t = torch.ones(16 << 20)  # 64 MB of float32, touched
        assert float(t[-1]) == 1.0
        rollup = open("/proc/self/smaps_rollup").read()
        kb = int(re.search(r"AnonHugePages:\\s+(\\d+) kB", rollup).group(1))
        print("ENV", os.environ.get("THP_MEM_ALLOC_ENABLE"), "HUGE_KB", kb)
        return 0
""")


def _probe(tmp_path: Path, command: str, env_value: str | None) -> tuple[str | None, int]:
    (tmp_path / "thp_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    code = ("import sys; from pdserve import cli; "
            f"cli.SUBCOMMANDS[{command!r}] = ('thp_probe:main', 'probe'); sys.exit(cli.main([{command!r}]))")
    r = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("ENV"))
    _, value, _, kb = line.split()
    return (None if value == "None" else value), int(kb)


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_an_engine_worker_gets_its_tensors_on_huge_pages(tmp_path, command):
    value, kb = _probe(tmp_path, command, None)
    assert value == "1"
    assert kb >= 2048, f"{command}: 64 MB allocated through torch, {kb} kB of it on huge pages"


def test_the_front_keeps_small_pages_and_a_user_can_switch_them_off(tmp_path):
    value, kb = _probe(tmp_path, "front", None)  # holds no weights: nothing to gain
    assert value is None and kb == 0
    value, kb = _probe(tmp_path, "decode", "0")  # the user's word stands
    assert value == "0" and kb == 0
