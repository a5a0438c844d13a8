"""Paged attention: the torch reference against dense causal SDPA, the Triton kernel (interpreter) against the reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.paged_attention import paged_attention, paged_attention_reference, paged_attention_triton, write_kv


def make_batch(seed: int, *, kinds=("decode", "spec", "prefill"), num_seqs=5, q_heads=4, kv_heads=2, head_dim=16,
               block_size=4, spare_blocks=3, dtype=torch.float32):
    """A ragged batch over a pool whose blocks are handed out in shuffled order.

    Returns (q, kv_pool, block_tables, seq_lens, query_start, dense) where dense[s] = (k, v) is sequence
    s's KV as [kv_heads, L, head_dim], the ground truth the pool was filled from (through write_kv).
    """
    g = torch.Generator().manual_seed(seed)
    lens, nqs = [], []
    for s in range(num_seqs):
        kind = kinds[s % len(kinds)]
        length = int(torch.randint(1, 6 * block_size, (1,), generator=g))  # partial last blocks, often
        n = {"decode": 1, "spec": min(length, 3), "prefill": int(torch.randint(1, length + 1, (1,), generator=g))}[kind]
        lens.append(length)
        nqs.append(n)
    blocks_needed = [-(-length // block_size) for length in lens]
    max_blocks = max(blocks_needed) + 1  # a spare column: entries past a sequence's blocks are ignored
    num_blocks = sum(blocks_needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)  # non-contiguous, unordered block tables
    kv_pool = torch.randn(num_blocks, 2, kv_heads, block_size, head_dim, generator=g).to(dtype)  # garbage in unused slots
    block_tables = torch.full((num_seqs, max_blocks), 0, dtype=torch.int32)
    block_tables[:, -1] = perm[-1]  # the spare column points at a real block full of garbage
    dense = []
    used = 0
    for s, (length, nb) in enumerate(zip(lens, blocks_needed)):
        table = perm[used:used + nb]
        used += nb
        block_tables[s, :nb] = table.to(torch.int32)
        k = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(length)
        slots = table.to(torch.int64)[pos // block_size] * block_size + pos % block_size
        write_kv(kv_pool, slots, k, v)
        dense.append((k.transpose(0, 1), v.transpose(0, 1)))
    q = torch.randn(sum(nqs), q_heads, head_dim, generator=g).to(dtype)
    query_start = torch.tensor([0] + nqs, dtype=torch.int32).cumsum(0).to(torch.int32)
    return q, kv_pool, block_tables, torch.tensor(lens, dtype=torch.int32), query_start, dense


def dense_attention(q, dense, seq_lens, query_start, scale, *, window=None, sinks=None, softcap=None):
    """Ground truth: each sequence's dense KV with an explicit causal mask for its last-n queries — SDPA, or
    with a sliding window, sinks or a soft cap, transformers' eager formulation of them (Gemma 2's capped
    scores, GPT-OSS's sink column concatenated to the scores and dropped after the softmax)."""
    out = torch.empty_like(q, dtype=torch.float32)
    for s, (k, v) in enumerate(dense):
        q0, q1, length = int(query_start[s]), int(query_start[s + 1]), int(seq_lens[s])
        n = q1 - q0
        group = q.shape[1] // k.shape[0]
        qs = q[q0:q1].float().transpose(0, 1)[None]  # [1, q_heads, n, D]
        ks = k.float().repeat_interleave(group, dim=0)[None]
        vs = v.float().repeat_interleave(group, dim=0)[None]
        kpos, qpos = torch.arange(length)[None, :], torch.arange(length - n, length)[:, None]
        mask = kpos <= qpos  # True = attend
        if window is None and sinks is None and softcap is None:
            out[q0:q1] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)[0].transpose(0, 1)
            continue
        if window is not None:
            mask &= kpos > qpos - window
        scores = qs @ ks.transpose(-1, -2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().view(1, -1, 1, 1).expand(1, -1, n, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :length]
        out[q0:q1] = (probs @ vs)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_reference_equals_dense_causal_sdpa(seed, q_heads, kv_heads):
    q, kv_pool, bt, lens, qs, dense = make_batch(seed, q_heads=q_heads, kv_heads=kv_heads, num_seqs=6)
    scale = 16 ** -0.5
    ref = paged_attention_reference(q, kv_pool, bt, lens, qs, scale)
    torch.testing.assert_close(ref, dense_attention(q, dense, lens, qs, scale), rtol=1e-5, atol=1e-5)


def test_reference_chunked_prefill_equals_one_shot_prefill():
    # a 13-token prompt prefilled in chunks of 5, 5, 3 (each chunk sees the cache so far) == all at once
    q, kv_pool, bt, lens, qs, dense = make_batch(7, kinds=("prefill",), num_seqs=1)
    length = int(lens[0])
    full_q = torch.randn(length, 4, 16, generator=torch.Generator().manual_seed(3))
    one_shot = paged_attention_reference(full_q, kv_pool, bt, lens, torch.tensor([0, length], dtype=torch.int32), 0.25)
    pieces, done = [], 0
    for chunk in (5, 5, 3, length):
        end = min(done + chunk, length)
        if end <= done:
            break
        pieces.append(paged_attention_reference(full_q[done:end], kv_pool, bt, torch.tensor([end], dtype=torch.int32),
                                                torch.tensor([0, end - done], dtype=torch.int32), 0.25))
        done = end
    torch.testing.assert_close(torch.cat(pieces), one_shot, rtol=1e-6, atol=1e-6)


def decode_batch(seed: int, lens: list[int], *, q_heads=6, kv_heads=2, head_dim=16, block_size=4, stale=float("nan")):
    """One query per sequence (decode) over a pool whose unused slots and table padding are hostile:
    slots past each sequence's tokens hold `stale` (NaN: what a 0-probability key must not leak) and
    table entries past its blocks point nowhere (-1, or past the pool)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in lens]
    num_blocks = sum(nbs) + 2
    perm = torch.randperm(num_blocks, generator=g)
    kv_pool = torch.full((num_blocks, 2, kv_heads, block_size, head_dim), stale)
    nowhere = [-1, num_blocks + 7]
    block_tables = torch.tensor([[nowhere[s % 2]] * (max(nbs) + 1) for s in range(len(lens))], dtype=torch.int32)
    dense, used = [], 0
    for s, (length, nb) in enumerate(zip(lens, nbs)):
        table = perm[used:used + nb]
        used += nb
        block_tables[s, :nb] = table.to(torch.int32)
        k = torch.randn(length, kv_heads, head_dim, generator=g)
        v = torch.randn(length, kv_heads, head_dim, generator=g)
        pos = torch.arange(length)
        write_kv(kv_pool, table[pos // block_size] * block_size + pos % block_size, k, v)
        dense.append((k.transpose(0, 1), v.transpose(0, 1)))
    q = torch.randn(len(lens), q_heads, head_dim, generator=g)
    query_start = torch.arange(len(lens) + 1, dtype=torch.int32)
    return q, kv_pool, block_tables, torch.tensor(lens, dtype=torch.int32), query_start, dense


@pytest.mark.parametrize("lens", [
    [1], [13], [16],                  # batch 1: a partial block, a full one
    [9, 9, 9],                        # equal lengths: no padding
    [5, 12, 1, 16, 7],                # ragged: padded to the longest, stale slots in between
    [3, 200, 4],                      # ragged, still padded
    [2, 3, 1000],                     # too ragged to pad: the per-sequence loop
], ids=str)
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (6, 2), (5, 1)])
def test_reference_decode_equals_dense_sdpa_despite_stale_slots(lens, q_heads, kv_heads):
    q, kv_pool, bt, seq_lens, qs, dense = decode_batch(len(lens) + sum(lens), lens, q_heads=q_heads, kv_heads=kv_heads)
    ref = paged_attention_reference(q, kv_pool, bt, seq_lens, qs, 0.25)
    torch.testing.assert_close(ref, dense_attention(q, dense, seq_lens, qs, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_reference_decode_batch_equals_each_sequence_alone(seed):
    # the batched decode (padded, masked) against the same sequences one by one and against the general
    # path (a decode row next to a 2-token verification row takes the per-sequence loop)
    lens = [int(n) for n in torch.randint(1, 40, (6,), generator=torch.Generator().manual_seed(seed))]
    q, kv_pool, bt, seq_lens, qs, _ = decode_batch(seed, lens, stale=1e4)
    batched = paged_attention_reference(q, kv_pool, bt, seq_lens, qs, 0.25)
    for s in range(len(lens)):
        alone = paged_attention_reference(q[s:s + 1], kv_pool, bt[s:s + 1], seq_lens[s:s + 1], qs[:2], 0.25)
        torch.testing.assert_close(batched[s:s + 1], alone, rtol=1e-6, atol=1e-6)
        extra = torch.randn(1, *q.shape[1:])
        mixed = paged_attention_reference(torch.cat([extra, q[s:s + 1]]), kv_pool, bt[s:s + 1], seq_lens[s:s + 1],
                                          torch.tensor([0, 2], dtype=torch.int32), 0.25)
        torch.testing.assert_close(batched[s], mixed[1], rtol=1e-6, atol=1e-6)


def test_reference_decode_low_precision_pool():
    q, kv_pool, bt, seq_lens, qs, dense = decode_batch(4, [5, 12, 9], stale=0.0)
    ref = paged_attention_reference(q.bfloat16(), kv_pool.bfloat16(), bt, seq_lens, qs, 0.25)
    assert ref.dtype == torch.bfloat16
    torch.testing.assert_close(ref.float(), dense_attention(q, dense, seq_lens, qs, 0.25), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reference_low_precision_pool(dtype):
    q, kv_pool, bt, lens, qs, dense = make_batch(11, dtype=dtype)
    ref = paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25)
    assert ref.dtype == dtype
    torch.testing.assert_close(ref.float(), dense_attention(q, dense, lens, qs, 0.25), rtol=1e-2, atol=1e-2)


def test_write_kv_places_tokens_and_skips_padding():
    pool = torch.zeros(4, 2, 2, 3, 5)
    k = torch.randn(3, 2, 5)
    v = torch.randn(3, 2, 5)
    write_kv(pool, torch.tensor([7, -1, 2]), k, v)  # block 2 offset 1; padding; block 0 offset 2
    torch.testing.assert_close(pool[2, 0, :, 1], k[0])
    torch.testing.assert_close(pool[2, 1, :, 1], v[0])
    torch.testing.assert_close(pool[0, 0, :, 2], k[2])
    torch.testing.assert_close(pool[0, 1, :, 2], v[2])
    assert int((pool != 0).sum()) == 4 * 2 * 5


def test_write_kv_prefill_run_of_slots_across_blocks():
    pool = torch.zeros(3, 2, 2, 4, 5)
    k, v = torch.randn(6, 2, 5), torch.randn(6, 2, 5)
    slots = torch.tensor([10, 11, 0, 1, 2, 3])  # the end of block 2, then all of block 0
    write_kv(pool, slots, k, v)
    for i, slot in enumerate(slots.tolist()):
        torch.testing.assert_close(pool[slot // 4, 0, :, slot % 4], k[i])
        torch.testing.assert_close(pool[slot // 4, 1, :, slot % 4], v[i])
    assert int((pool != 0).sum()) == 6 * 2 * 2 * 5


def test_rejects_bad_shapes_and_ragged_structure():
    q, kv_pool, bt, lens, qs, _ = make_batch(0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention_reference(q[:, :3], kv_pool, bt, lens, qs, 1.0)
    bad = qs.clone()
    bad[-1] += 1
    with pytest.raises(ValueError, match="query_start"):
        paged_attention_reference(q, kv_pool, bt, lens, bad, 1.0)
    short = lens.clone()
    short[1] = 0
    with pytest.raises(ValueError, match="queries but only"):
        paged_attention_reference(q, kv_pool, bt, short, qs, 1.0)
    with pytest.raises(ValueError, match="impl"):
        paged_attention(q, kv_pool, bt, lens, qs, 1.0, impl="cuda")


# --------------------------------------------------------------------------------------------------
# The Triton kernel (interpreter, small sizes) against the reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,q_heads,kv_heads,head_dim,block_size", [
    (0, 4, 4, 16, 4),    # MHA, many small blocks (a KV tile spans several blocks)
    (1, 4, 2, 16, 4),    # GQA 2
    (2, 6, 1, 16, 8),    # GQA 6: a group that is not a power of two (padded rows)
    (3, 8, 2, 12, 32),   # head_dim not a power of two; blocks larger than a KV tile
])
def test_triton_matches_reference(seed, q_heads, kv_heads, head_dim, block_size):
    q, kv_pool, bt, lens, qs, _ = make_batch(seed, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                             block_size=block_size, num_seqs=4)
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q, kv_pool, bt, lens, qs, scale)
    tri = paged_attention_triton(q, kv_pool, bt, lens, qs, scale)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


def test_triton_long_prefill_spans_query_tiles_and_empty_sequences():
    # one sequence with more queries than a query tile, a sequence with no queries this step, two decodes
    q, kv_pool, bt, lens, qs, _ = make_batch(5, kinds=("prefill", "decode"), num_seqs=3, q_heads=2, kv_heads=2)
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([40, 9, 17], dtype=torch.int32)
    nqs = [37, 0, 1]
    block_size = kv_pool.shape[3]
    max_blocks = -(-40 // block_size)
    num_blocks = 3 * max_blocks
    kv_pool = torch.randn(num_blocks, 2, 2, block_size, 16, generator=g)
    bt = torch.randperm(num_blocks, generator=g).view(3, max_blocks).to(torch.int32)
    q = torch.randn(sum(nqs), 2, 16, generator=g)
    qs = torch.tensor([0, 37, 37, 38], dtype=torch.int32)
    ref = paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25)
    tri = paged_attention(q, kv_pool, bt, lens, qs, 0.25)  # auto: Triton under the interpreter
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


def test_triton_low_precision_pool():
    q, kv_pool, bt, lens, qs, _ = make_batch(9, num_seqs=3, dtype=torch.bfloat16)
    ref = paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25)
    tri = paged_attention_triton(q, kv_pool, bt, lens, qs, 0.25)
    assert tri.dtype == torch.bfloat16
    torch.testing.assert_close(tri.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_triton_split_kv_matches_reference(num_splits):
    # flash-decoding splits (chosen automatically on a GPU for small batches): some splits of short
    # sequences hold no keys at all and must weigh nothing in the merge
    q, kv_pool, bt, lens, qs, _ = make_batch(13, q_heads=4, kv_heads=2, num_seqs=4, block_size=8)  # up to 48 tokens
    ref = paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25)
    tri = paged_attention_triton(q, kv_pool, bt, lens, qs, 0.25, num_splits=num_splits)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_reference_reads_consecutive_blocks_in_place(seed, kind):
    # A head-major pool (BlockPool's physical layout): sequences whose blocks are consecutive are read as
    # views of the pool when `runs` says so, the others gathered; stale slots hold NaN. Both must equal
    # dense attention, and the hint must not change the result.
    g = torch.Generator().manual_seed(seed)
    kv_heads, q_heads, head_dim, block_size = 2, 6, 16, 4
    lens = [int(n) for n in torch.randint(1, 60, (5,), generator=g)]
    nbs = [-(-n // block_size) for n in lens]
    num_blocks = 2 * sum(nbs) + 9
    storage = torch.full((2, kv_heads, num_blocks, block_size, head_dim), float("nan"))
    kv_pool = storage.permute(2, 0, 1, 3, 4)  # [num_blocks, 2, kv_heads, block_size, head_dim], head-major in memory
    free = list(range(num_blocks))
    tables, runs, dense = [], [], []
    for s, nb in enumerate(nbs):
        if s % 2 == 0:  # a consecutive run from the front, one block of gap after it
            table = free[:nb]
            del free[:nb + 1]
            runs.append(table[0])
        else:  # scattered: every other block from the back, backwards
            table = free[::-1][: 2 * nb : 2]
            for b in table:
                free.remove(b)
            runs.append(-1)
        assert runs[-1] < 0 or table == list(range(table[0], table[0] + nb))
        tables.append(table)
    block_tables = torch.full((len(lens), max(nbs) + 1), -1, dtype=torch.int32)
    for s, (length, table) in enumerate(zip(lens, tables)):
        block_tables[s, :len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(length, kv_heads, head_dim, generator=g)
        v = torch.randn(length, kv_heads, head_dim, generator=g)
        pos = torch.arange(length)
        write_kv(kv_pool, torch.tensor(table)[pos // block_size] * block_size + pos % block_size, k, v)
        dense.append((k.transpose(0, 1), v.transpose(0, 1)))
    n_q = [1] * len(lens) if kind == "decode" else [1, min(3, lens[1]), lens[2], 1, min(2, lens[4])]
    query_start = torch.tensor([0] + torch.tensor(n_q).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(query_start[-1]), q_heads, head_dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    hinted = paged_attention_reference(q, kv_pool, block_tables, seq_lens, query_start, 0.25, runs)
    plain = paged_attention_reference(q, kv_pool, block_tables, seq_lens, query_start, 0.25)
    torch.testing.assert_close(hinted, dense_attention(q, dense, seq_lens, query_start, 0.25), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hinted, plain, rtol=1e-6, atol=1e-6)
    assert not hinted.isnan().any()


# --------------------------------------------------------------------------------------------------
# What transformers' models ask of attention beyond causal: sliding windows, sinks, soft caps
# --------------------------------------------------------------------------------------------------

FEATURES = {
    "window": dict(window=5),
    "window-1": dict(window=1),  # each query sees only itself
    "sinks": dict(sinks=True),
    "softcap": dict(softcap=2.0),  # small against these scores: the cap bends most of them
    "window+sinks": dict(window=7, sinks=True),  # GPT-OSS's sliding layers
    "all": dict(window=6, sinks=True, softcap=3.0),
}


def feature_kwargs(spec: dict, q_heads: int, seed: int) -> tuple[dict, dict]:
    """(kwargs for the kernels, kwargs for the dense oracle) of one FEATURES entry."""
    sinks = torch.randn(q_heads, generator=torch.Generator().manual_seed(seed)) * 2 if spec.get("sinks") else None
    window, softcap = spec.get("window"), spec.get("softcap")
    return (dict(sliding_window=window, sinks=sinks, softcap=softcap), dict(window=window, sinks=sinks, softcap=softcap))


def poison_outside_windows(kv_pool, bt, lens, qs, window):
    """NaN in every cache slot no query of this step may see (before its sequence's first query's window):
    what a handoff that ships only the window leaves in the receiver's blocks."""
    block_size = kv_pool.shape[3]
    for s, length in enumerate(lens.tolist()):
        n = int(qs[s + 1] - qs[s])
        for p in range(max(0, length - n - window + 1)):
            kv_pool[int(bt[s, p // block_size]), :, :, p % block_size] = float("nan")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("feature", FEATURES, ids=str)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (6, 1)])
def test_reference_features_equal_dense_oracle(seed, feature, q_heads, kv_heads):
    q, kv_pool, bt, lens, qs, dense = make_batch(seed, q_heads=q_heads, kv_heads=kv_heads, num_seqs=6)
    kw, oracle_kw = feature_kwargs(FEATURES[feature], q_heads, seed)
    if kw["sliding_window"]:
        poison_outside_windows(kv_pool, bt, lens, qs, kw["sliding_window"])
    ref = paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25, **kw)
    torch.testing.assert_close(ref, dense_attention(q, dense, lens, qs, 0.25, **oracle_kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [[1], [13], [9, 9, 9], [5, 12, 1, 16, 7], [3, 40, 4]], ids=str)
@pytest.mark.parametrize("feature", FEATURES, ids=str)
def test_reference_decode_features_despite_stale_slots(lens, feature):
    # the batched decode path (groups of similar length, each sequence's window gathered from its own block)
    q, kv_pool, bt, seq_lens, qs, dense = decode_batch(len(lens), lens, q_heads=6, kv_heads=2)
    kw, oracle_kw = feature_kwargs(FEATURES[feature], 6, len(lens))
    if kw["sliding_window"]:
        poison_outside_windows(kv_pool, bt, seq_lens, qs, kw["sliding_window"])
    ref = paged_attention_reference(q, kv_pool, bt, seq_lens, qs, 0.25, **kw)
    torch.testing.assert_close(ref, dense_attention(q, dense, seq_lens, qs, 0.25, **oracle_kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("feature", FEATURES, ids=str)
def test_triton_features_match_reference(feature):
    q, kv_pool, bt, lens, qs, dense = make_batch(21, q_heads=6, kv_heads=2, head_dim=16, block_size=4, num_seqs=4)
    kw, oracle_kw = feature_kwargs(FEATURES[feature], 6, 21)
    if kw["sliding_window"]:
        poison_outside_windows(kv_pool, bt, lens, qs, kw["sliding_window"])
    tri = paged_attention_triton(q, kv_pool, bt, lens, qs, 0.25, **kw)
    torch.testing.assert_close(tri, dense_attention(q, dense, lens, qs, 0.25, **oracle_kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_triton_split_kv_with_window_and_sinks_matches_reference(num_splits):
    # splits wholly before a window hold no keys; the sinks join in the merge
    q, kv_pool, bt, lens, qs, _ = make_batch(13, q_heads=4, kv_heads=2, num_seqs=4, block_size=8)
    kw, _ = feature_kwargs(FEATURES["all"], 4, 13)
    ref = paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25, **kw)
    tri = paged_attention_triton(q, kv_pool, bt, lens, qs, 0.25, num_splits=num_splits, **kw)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


def test_a_window_wider_than_the_context_changes_nothing():
    q, kv_pool, bt, lens, qs, _ = make_batch(3, num_seqs=5)
    plain = paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25)
    wide = paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25, sliding_window=10_000)
    torch.testing.assert_close(wide, plain, rtol=1e-6, atol=1e-6)
    narrow = paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25, sliding_window=2)
    assert not torch.allclose(narrow, plain)  # and the window does reach the kernels


def test_sinks_of_the_wrong_shape_are_refused():
    q, kv_pool, bt, lens, qs, _ = make_batch(3, num_seqs=2, q_heads=4)
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention_reference(q, kv_pool, bt, lens, qs, 0.25, sinks=torch.zeros(2))
