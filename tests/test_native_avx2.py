"""The AVX2 + FMA build of the native decoder (`PDSERVE_NATIVE_MARCH=x86-64-v3`), on any CPU that has AVX2.

That build is what a CPU without AVX512-BF16 serves bfloat16 with (Zen 3 and older, client CPUs), and a CPU
that has more builds it when asked, so these tests run on both kinds. Its attention is one kernel whatever a
step holds (a prompt's rows in tiles of the decode kernel, each row computed as a one-row step computes it),
and its GEMV sums every output in input order whatever the row count, so a prompt's logits are the same bits
however it reaches the engine: in one step, in chunks, behind a cached prefix, or beside other sequences in a
batch. Each check runs in a child process, since the kernels a process loads are chosen once, at its first step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.kernels.native_build import _lacking

pytestmark = pytest.mark.skipif(
    os.uname().machine != "x86_64" or bool(_lacking("x86-64-v3")), reason="needs an x86-64 CPU with AVX2 + FMA")

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from pdserve.engine.runner import PagedRunner
    from pdserve.kernels import cpu_decoder

    out = {"isa": cpu_decoder.isa()}
    # the GEMV against a float32 matmul of the same bfloat16 numbers, rows 1..9 (both of its paths)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 576, generator=g).to(torch.bfloat16)
    b = torch.randn(200, generator=g).to(torch.bfloat16)
    packed = cpu_decoder.pack(w.t().contiguous())
    worst = 0.0
    for rows in range(1, 10):
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        ref = x.float() @ w.float().t() + b.float()
        got = cpu_decoder.gemv(x, packed, 200, b).float()
        worst = max(worst, float(((got - ref).abs() / ref.abs().clamp_min(1.0)).max()))
        if rows > 1:  # each row as a one-row call computes it, bit for bit
            one = torch.cat([cpu_decoder.gemv(x[i:i + 1], packed, 200, b) for i in range(rows)])
            out.setdefault("rows_differ", 0)
            out["rows_differ"] += int(not torch.equal(one, cpu_decoder.gemv(x, packed, 200, b)))
    out["gemv_rel_err"] = worst

    r = PagedRunner(sys.argv[1], dtype=torch.bfloat16, num_blocks=256)
    out["native_rows"] = r.native_rows()
    prompt = [(7919 * i + 11) % r.vocab_size for i in range(150)]
    alone = r.prefill("alone", prompt, reuse_prefix=False)
    chunked = r.prefill("chunked", prompt, chunk_size=17, reuse_prefix=False)
    cached = r.prefill("cached", prompt)  # its leading blocks found in the prefix cache
    out["chunked_equal"] = torch.equal(alone, chunked)
    out["cached_equal"] = torch.equal(alone, cached)
    (one,) = r.step([("alone", [42])])
    r.prefill("other", prompt[:90], reuse_prefix=False)
    batch = r.step([("other", [7]), ("chunked", [42]), ("cached", [42])])
    out["batch_equal"] = all(torch.equal(one, lg) for lg in batch[1:])

    # float32: the GEMM's products saved for the parent (which computes them on its own build), and the same paths
    g = torch.Generator().manual_seed(1)
    w32, b32 = torch.randn(576, 200, generator=g), torch.randn(200, generator=g)
    torch.save([cpu_decoder.gemm_f32(torch.randn(rows, 576, generator=g), w32, b32) for rows in range(1, 10)],
               sys.argv[2])
    r = PagedRunner(sys.argv[1], dtype=torch.float32, num_blocks=256)
    out["native_rows32"] = r.native_rows()
    alone = r.prefill("alone", prompt, reuse_prefix=False)
    out["chunked_equal32"] = torch.equal(alone, r.prefill("chunked", prompt, chunk_size=17, reuse_prefix=False))
    out["cached_equal32"] = torch.equal(alone, r.prefill("cached", prompt))
    (one,) = r.step([("alone", [42])])
    r.prefill("other", prompt[:90], reuse_prefix=False)
    batch = r.step([("other", [7]), ("chunked", [42]), ("cached", [42])])
    out["batch_equal32"] = all(torch.equal(one, lg) for lg in batch[1:])
    print(json.dumps(out))
""")


def test_the_avx2_build_serves_bfloat16_and_float32_and_a_prompt_gets_the_same_logits_on_every_path(model_dir,
                                                                                                    tmp_path):
    env = dict(os.environ, PDSERVE_NATIVE_MARCH="x86-64-v3", PDSERVE_NATIVE_DECODE="1", PDSERVE_CPU_ATTENTION="1")
    products = tmp_path / "gemm_f32.pt"
    r = subprocess.run([sys.executable, "-P", "-c", CHILD, str(model_dir), str(products)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["isa"] == "avx2-fma"
    assert got["native_rows"] > 0, "the native decoder did not take the model's steps"
    assert got["gemv_rel_err"] < 2e-2, got  # one bfloat16 rounding of the output, relative to its scale
    assert got["rows_differ"] == 0, "a row's GEMV result depended on the rows beside it"
    assert got["chunked_equal"], "the prompt's last logits changed when it was computed in chunks of 17"
    assert got["cached_equal"], "the prompt's last logits changed when its prefix came from the cache"
    assert got["batch_equal"], "a decode row's logits changed inside a batch"
    assert got["native_rows32"] > 0, "the native float32 layer did not take the model's steps"
    assert got["chunked_equal32"] and got["cached_equal32"] and got["batch_equal32"], got
    # the float32 GEMM is one FMA chain per output on either build: the AVX2 products are this build's, bit for bit
    import torch

    from pdserve.kernels import cpu_decoder

    if cpu_decoder.float32_available():
        g = torch.Generator().manual_seed(1)
        w32, b32 = torch.randn(576, 200, generator=g), torch.randn(200, generator=g)
        mine = [cpu_decoder.gemm_f32(torch.randn(rows, 576, generator=g), w32, b32) for rows in range(1, 10)]
        assert all(torch.equal(a, b) for a, b in zip(torch.load(products), mine))


def test_a_forced_level_this_cpu_lacks_is_refused_and_torch_serves(monkeypatch, caplog, tmp_path):
    """`/proc/cpuinfo`'s flags stand in for a CPU without AVX-512 (this one may have it): a build for
    x86-64-v4 there would load and die of SIGILL at its first step, so it is not built at all."""
    from pdserve.kernels import cpu_attention, native_build

    monkeypatch.setenv("PDSERVE_NATIVE_MARCH", "x86-64-v4")
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: "fpu sse4_2 popcnt ssse3 avx2 fma f16c bmi2 movbe")
    with caplog.at_level("WARNING", logger="pdserve.kernels.native_build"):
        assert cpu_attention.build_library(cpu_attention.SOURCE, "PDSERVE_TEST_SWITCH") is None
    assert "avx512f" in caplog.text and "x86-64-v4" in caplog.text
    assert not list(tmp_path.rglob("*.so"))
