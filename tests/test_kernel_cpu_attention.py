"""The native CPU paged attention (`kernels/cpu_attention.c`) against the torch reference.

Built here with the machine's C compiler, as the engine builds it; every case compares it with
`paged_attention_reference` on the same pool, relative to the output's scale (float32 arithmetic in a
different order: machines and BLAS builds differ in the last bits, never in more).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.kernels import cpu_attention
from pdserve.kernels.paged_attention import paged_attention, paged_attention_reference

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler here: the reference serves")


def batch(seed, lens, nqs, *, dtype=torch.float32, kv_heads=2, q_heads=6, head_dim=64, block_size=4, head_major=True):
    """Sequences of `lens` tokens with their last `nqs` as queries, over a pool whose blocks are shuffled."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // block_size) for n in lens) + 2
    if head_major:  # the engine's physical layout, seen through its logical view
        pool = torch.randn(2, kv_heads, nb, block_size, head_dim, generator=g).to(dtype).permute(2, 0, 1, 3, 4)
    else:
        pool = torch.randn(nb, 2, kv_heads, block_size, head_dim, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(-(-n // block_size) for n in lens) + 1
    tables = torch.full((len(lens), width), perm[-1], dtype=torch.int32)  # spare entries point at garbage
    used = 0
    for s, n in enumerate(lens):
        k = -(-n // block_size)
        tables[s, :k] = torch.tensor(perm[used:used + k], dtype=torch.int32)
        used += k
    q = torch.randn(sum(nqs), q_heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(nqs), 0).tolist()], dtype=torch.int32)
    return q, pool, tables, torch.tensor(lens, dtype=torch.int32), starts


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 48, 20], ids=lambda d: f"d{d}")  # vector paths and the generic one
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "block-major"])
def test_the_native_kernel_computes_the_reference(dtype, head_dim, head_major):
    # decode, verification and prefill rows in one ragged batch; a partial last block; a 1-token sequence
    lens, nqs = [37, 9, 1, 60, 16], [1, 4, 1, 23, 16]
    q, pool, tables, seq_lens, starts = batch(1, lens, nqs, dtype=dtype, head_dim=head_dim, head_major=head_major)
    got = paged_attention(q, pool, tables, seq_lens, starts, head_dim ** -0.5, impl="cpu")
    want = paged_attention_reference(q, pool, tables, seq_lens, starts, head_dim ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("extra", [{"sliding_window": 5}, {"softcap": 2.0}, {"sinks": True},
                                   {"sliding_window": 7, "softcap": 30.0, "sinks": True}],
                         ids=["window", "softcap", "sinks", "all"])
def test_the_native_kernel_keeps_windows_soft_caps_and_sinks(extra):
    lens, nqs = [40, 13, 25], [1, 6, 25]
    q, pool, tables, seq_lens, starts = batch(2, lens, nqs)
    kw = dict(extra)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(3))
    got = paged_attention(q, pool, tables, seq_lens, starts, 0.125, impl="cpu", **kw)
    want = paged_attention_reference(q, pool, tables, seq_lens, starts, 0.125, **kw)
    assert rel(got, want) < 1e-5


def test_a_verification_row_is_bit_for_bit_the_one_row_step_at_its_position():
    """Row j of a k+1-row verification computes exactly what a one-row step at that position does: the kernel
    treats every query row alike, so speculation cannot change a token through attention's rounding."""
    q, pool, tables, seq_lens, starts = batch(4, [50], [6], dtype=torch.bfloat16)
    rows = paged_attention(q, pool, tables, seq_lens, starts, 0.125, impl="cpu")
    for j in range(6):
        one = paged_attention(q[j:j + 1], pool, tables, torch.tensor([50 - 5 + j], dtype=torch.int32),
                              torch.tensor([0, 1], dtype=torch.int32), 0.125, impl="cpu")
        assert torch.equal(rows[j], one[0])


def test_a_block_table_naming_a_block_outside_the_pool_is_refused_not_read():
    q, pool, tables, seq_lens, starts = batch(5, [12, 9], [1, 1])
    tables[1, 0] = pool.shape[0]  # one past the last block
    with pytest.raises(IndexError, match="sequence 1"):
        paged_attention(q, pool, tables, seq_lens, starts, 0.125, impl="cpu")
    tables[1, 0] = -1
    with pytest.raises(IndexError, match="sequence 1"):
        paged_attention(q, pool, tables, seq_lens, starts, 0.125, impl="cpu")


def test_a_float16_pool_goes_to_the_reference():
    q, pool, tables, seq_lens, starts = batch(6, [10], [2], dtype=torch.float16)
    assert not cpu_attention.supports(q, pool)
    got = paged_attention(q, pool, tables, seq_lens, starts, 0.125, impl="cpu")
    assert torch.equal(got, paged_attention_reference(q, pool, tables, seq_lens, starts, 0.125))


def test_switched_off_or_without_a_compiler_the_reference_serves(tmp_path):
    """PDSERVE_CPU_ATTENTION=0, or a compiler that fails: not available, no error (a fresh process each)."""
    code = ("from pdserve.kernels import cpu_attention as c; import sys; print(c.available())")
    for env in ({"PDSERVE_CPU_ATTENTION": "0"}, {"CC": "/bin/false", "PDSERVE_CACHE": str(tmp_path)}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env}, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "False", (env, out.stdout, out.stderr)
    assert not list(tmp_path.glob("kernels/*.so"))  # nothing half-built left behind


def test_a_batch_mixing_steps_and_prompt_chunks_splits_between_the_kernel_and_the_reference():
    """Sequences of more than NATIVE_MAX_ROWS queries (prompt chunks) take the reference's SDPA, the rest the
    native kernel, rows back in their places."""
    from pdserve.kernels.paged_attention import NATIVE_MAX_ROWS

    lens, nqs = [30, 40, 9, 70], [1, NATIVE_MAX_ROWS + 9, 3, NATIVE_MAX_ROWS + 1]
    q, pool, tables, seq_lens, starts = batch(7, lens, nqs)
    got = paged_attention(q, pool, tables, seq_lens, starts, 0.125, impl="cpu")
    assert rel(got, paged_attention_reference(q, pool, tables, seq_lens, starts, 0.125)) < 1e-5
    # the chunks' rows are the reference's exactly, the steps' rows the kernel's exactly
    ref_long = paged_attention_reference(q[1:26], pool, tables[1:2], seq_lens[1:2], torch.tensor([0, 25], dtype=torch.int32), 0.125)
    assert torch.equal(got[1:26], ref_long)
    one = cpu_attention.paged_attention_cpu(q[:1], pool, tables[:1], seq_lens[:1], torch.tensor([0, 1], dtype=torch.int32), 0.125)
    assert torch.equal(got[:1], one)


# -- prompt chunks: the native chunk kernel (`cpu_chunk_attention.c`, bfloat16 with AVX512-BF16) ----------

def _chunk_kernel_here() -> bool:
    return cpu_attention.chunk_supports(torch.zeros(1, 1, 64, dtype=torch.bfloat16),
                                        torch.zeros(1, 2, 1, 4, 64, dtype=torch.bfloat16))


chunk_kernel = pytest.mark.skipif(not _chunk_kernel_here(), reason="no AVX512-BF16 here: SDPA serves prompt chunks")


@chunk_kernel
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 9, 3), (128, 4, 4), (32, 8, 1), (256, 4, 2)],
                         ids=["d64-gqa3", "d128-mha", "d32-mqa", "d256-gqa2"])
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "block-major"])
def test_prompt_chunks_take_the_chunk_kernel_and_compute_the_reference(head_dim, q_heads, kv_heads, head_major):
    # a whole prompt, a chunk after a cached prefix, a ragged last tile, decode and verification rows beside
    lens, nqs = [40, 300, 9, 91, 57], [40, 37, 1, 64, 4]
    q, pool, tables, seq_lens, starts = batch(11, lens, nqs, dtype=torch.bfloat16, kv_heads=kv_heads, q_heads=q_heads,
                                              head_dim=head_dim, head_major=head_major)
    got = paged_attention(q, pool, tables, seq_lens, starts, head_dim ** -0.5, impl="cpu")
    want = paged_attention_reference(q, pool, tables, seq_lens, starts, head_dim ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    # both round float32 results to bfloat16: at most one unit in the last place apart
    assert rel(got, want) < 8e-3
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-3).float().mean() > 0.999
    # the chunk rows are the chunk kernel's, the short rows the step kernel's, each in its place
    chunk = cpu_attention.chunk_attention_cpu(q[40:77], pool, tables[1], 300, head_dim ** -0.5)
    assert torch.equal(got[40:77], chunk)
    one = cpu_attention.paged_attention_cpu(q[77:78], pool, tables[2:3], seq_lens[2:3],
                                            torch.tensor([0, 1], dtype=torch.int32), head_dim ** -0.5)
    assert torch.equal(got[77:78], one)


@chunk_kernel
def test_a_chunk_row_sees_exactly_the_keys_at_or_before_its_position():
    """Causality inside the kernel's tiles: changing the keys and values after a query's position changes
    nothing in its row, changing one at its position changes it."""
    q, pool, tables, seq_lens, starts = batch(12, [70], [70], dtype=torch.bfloat16, block_size=16)
    before = cpu_attention.chunk_attention_cpu(q, pool, tables[0], 70, 0.125)
    block, slot = int(tables[0, 33 // 16]), 33 % 16  # position 33
    pool[block, :, :, slot] += 3.0
    after = cpu_attention.chunk_attention_cpu(q, pool, tables[0], 70, 0.125)
    assert torch.equal(after[:33], before[:33])
    assert not torch.equal(after[33], before[33])


@chunk_kernel
@pytest.mark.parametrize("case", ["window", "softcap", "sinks", "float32", "head_dim-48"])
def test_chunks_the_chunk_kernel_does_not_take_go_to_the_reference(case):
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    head_dim = 48 if case == "head_dim-48" else 64
    q, pool, tables, seq_lens, starts = batch(13, [60], [40], dtype=dtype, head_dim=head_dim)
    kw = {"window": {"sliding_window": 30}, "softcap": {"softcap": 20.0},
          "sinks": {"sinks": torch.randn(q.shape[1], generator=torch.Generator().manual_seed(3))}}.get(case, {})
    got = paged_attention(q, pool, tables, seq_lens, starts, 0.125, impl="cpu", **kw)
    assert torch.equal(got, paged_attention_reference(q, pool, tables, seq_lens, starts, 0.125, **kw))
    # a window no prompt reaches hides nothing: the chunk kernel takes it
    if case == "window":
        wide = paged_attention(q, pool, tables, seq_lens, starts, 0.125, impl="cpu", sliding_window=60)
        assert torch.equal(wide, cpu_attention.chunk_attention_cpu(q, pool, tables[0], 60, 0.125))


@chunk_kernel
def test_a_chunk_whose_block_table_leaves_the_pool_is_refused_not_read():
    q, pool, tables, seq_lens, starts = batch(14, [40], [40], dtype=torch.bfloat16)
    tables[0, 3] = pool.shape[0]
    with pytest.raises(IndexError, match="outside the pool"):
        paged_attention(q, pool, tables, seq_lens, starts, 0.125, impl="cpu")
