"""Paged attention: causal attention of a ragged batch of queries over a paged KV pool (block tables).

One function serves decode (1 query per sequence), speculative verification (k+1 queries per
sequence) and chunked prefill (many queries per sequence) in the same batch.

Contract (S sequences, T query tokens in all):

``q``             [T, q_heads, head_dim] float32 / bfloat16 / float16.
``kv_pool``       [num_blocks, 2, kv_heads, block_size, head_dim] (2 = K, V) of ONE layer: the layout
                  of :class:`pdserve.kvtransfer.layout.KVBlocks` and :mod:`kernels.kv_quant`.
``block_tables``  [S, max_blocks] int32: block i of sequence s holds its cache positions
                  i*block_size .. (i+1)*block_size - 1. Entries past the sequence's blocks are ignored.
``seq_lens``      [S] int32: tokens in sequence s's cache, INCLUDING this step's new tokens (their K/V
                  must already be written, see :func:`write_kv`).
``query_start``   [S+1] int32, non-decreasing, query_start[0] = 0, query_start[S] = T: the queries of
                  sequence s are q[query_start[s]:query_start[s+1]] and they are its LAST tokens, so
                  query i of n sits at absolute position seq_lens[s] - n + i (n <= seq_lens[s]).
``scale``         the softmax scale (usually head_dim ** -0.5).

Causal: a query at absolute position i attends to cache positions 0..i. GQA: q_heads is a multiple
of kv_heads and q head h reads kv head h // (q_heads // kv_heads) (Hugging Face's ``repeat_kv``).

What transformers' decoder-only models ask of attention, per layer (all optional, keyword-only):
``sliding_window`` W  a query at position i sees only positions i - W + 1 .. i (Mistral, Gemma's local
                      layers, GPT-OSS): transformers' ``kv_idx > q_idx - sliding_window``. Positions
                      before a query tile's window are never read, so they may hold anything.
``sinks``             [q_heads] float logits, one per query head, that join each softmax's normaliser
                      without a value (GPT-OSS's attention sinks).
``softcap``           scores become softcap * tanh(scores / softcap) after scaling, before the mask
                      (Gemma 2's ``attn_logit_softcapping``).

Returns ``out [T, q_heads, head_dim]`` in q's dtype (the kernel needs q and kv_pool to share it).
Three implementations: the Triton kernel (GPU), the native CPU kernel (`kernels/cpu_attention.c`, built at
first use; decode and verification rows, read in place from the pool) and the torch reference (prompt
chunks on a CPU, and wherever the others cannot run).
Scores, softmax and the weighted sum accumulate in float32 in all of them (the kernel with an
online softmax over KV tiles); with a float32 pool the kernel's dots are IEEE float32 (never TF32),
so the two agree to float32 rounding. With bf16/fp16 pools the kernel multiplies on tensor cores in
that dtype (probabilities rounded to it before P @ V, as flash attention does).

``write_kv(kv_pool, slot_mapping [T] int64, k, v)`` stores this step's keys/values [T, kv_heads,
head_dim] at slot = block * block_size + offset (negative slots are padding and skipped), in place.
"""
from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels import cpu_attention

__all__ = ["paged_attention", "paged_attention_reference", "paged_attention_triton", "write_kv"]


def _check_inputs(q, kv_pool, block_tables, seq_lens, query_start) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, q_heads, head_dim], got shape {tuple(q.shape)}")
    if kv_pool.dim() != 5 or kv_pool.shape[1] != 2:
        raise ValueError(f"kv_pool must be [num_blocks, 2, kv_heads, block_size, head_dim], got {tuple(kv_pool.shape)}")
    t, q_heads, head_dim = q.shape
    _, _, kv_heads, block_size, pool_head_dim = kv_pool.shape
    if pool_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != kv_pool head_dim {pool_head_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got shape {tuple(block_tables.shape)}")
    s = block_tables.shape[0]
    if tuple(seq_lens.shape) != (s,):
        raise ValueError(f"seq_lens must be [{s}] for block_tables {tuple(block_tables.shape)}, got {tuple(seq_lens.shape)}")
    if tuple(query_start.shape) != (s + 1,):
        raise ValueError(f"query_start must be [{s + 1}] for {s} sequences, got {tuple(query_start.shape)}")
    return t, q_heads, head_dim, kv_heads, block_size, s


def _check_values(t, block_size, max_blocks, seq_lens: list[int], query_start: list[int]) -> None:
    # host-side checks of the ragged structure (the reference reads these values anyway)
    if query_start[0] != 0 or query_start[-1] != t:
        raise ValueError(f"query_start must run from 0 to T={t}, got {query_start[0]}..{query_start[-1]}")
    for s, length in enumerate(seq_lens):
        n = query_start[s + 1] - query_start[s]
        if n < 0:
            raise ValueError(f"query_start must be non-decreasing; sequence {s} has {n} queries")
        if n > length:
            raise ValueError(f"sequence {s} has {n} queries but only {length} tokens in cache (seq_lens counts the new ones)")
        if -(-length // block_size) > max_blocks:
            raise ValueError(f"sequence {s} has {length} tokens, more than its {max_blocks} blocks of {block_size} hold")


# --------------------------------------------------------------------------------------------------
# Reference (plain torch): gather each sequence's blocks into dense K/V, then masked softmax attention
# --------------------------------------------------------------------------------------------------


def _window(sliding_window: int | None) -> int | None:
    if sliding_window is None or sliding_window <= 0:
        return None
    return int(sliding_window)


def _first_key(length: int, n: int, window: int | None) -> int:
    """The first cache position any of a sequence's last n queries sees (0 without a window)."""
    return 0 if window is None else max(0, length - n - window + 1)


def _probs(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 scores; with `sinks` (broadcast to scores[..., :1]), each row's sink
    logit joins the denominator and takes its share of the probability to no value (GPT-OSS)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(torch.cat((scores, sinks.expand(*scores.shape[:-1], 1)), dim=-1), dim=-1)[..., :-1]


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    # Gemma 2's logit soft cap: softcap * tanh(scores / softcap), on scaled scores, before the mask
    return scores if softcap is None else torch.tanh(scores / softcap).mul_(softcap)


def paged_attention_reference(q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start: torch.Tensor, scale: float, runs: list[int] | None = None, *,
                              sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """Plain-torch paged attention; same contract as :func:`paged_attention`.

    `runs` (optional, per sequence): the first block of its table when its blocks are consecutive
    (b, b+1, ...), else -1. Where the pool is laid out head-major (``BlockPool``), such a sequence's
    K and V are read as a view of the pool instead of gathered (a copy of its whole KV).
    With a sliding window only the blocks that hold a query's window are read.
    """
    t, q_heads, head_dim, kv_heads, block_size, s = _check_inputs(q, kv_pool, block_tables, seq_lens, query_start)
    lens = seq_lens.tolist()
    starts = query_start.tolist()
    _check_values(t, block_size, block_tables.shape[1], lens, starts)
    window = _window(sliding_window)
    sink_rows = None if sinks is None else _check_sinks(sinks, q_heads).float().to(q.device)
    group = q_heads // kv_heads
    # [2, kv_heads, num_blocks, block_size, head_dim]: a view (no copy) in which gathering a sequence's
    # blocks along dim 2 yields its K and V already as [kv_heads, tokens, head_dim], in ONE copy of just
    # its blocks (gathering [nb, 2, kvh, bs, D] and then permuting copied the sequence's KV twice)
    kv_by_head = kv_pool.permute(1, 2, 0, 3, 4)
    if runs is None or kv_by_head.stride(2) != block_size * kv_by_head.stride(3):
        runs = [-1] * s  # no hint, or a pool whose blocks are not stored head-major: gather
    if t == s and starts == list(range(s + 1)):  # decode: one query per sequence
        firsts = [_first_key(n, 1, window) for n in lens]
        extra = dict(softcap=softcap, sinks=sink_rows)
        # Sequences of similar length together: padding each group to its own longest gathers and
        # attends far fewer padded tokens than padding all to the batch's longest (about half, for
        # lengths spread evenly), for one gather and two matmuls more per group.
        # A sequence whose blocks are consecutive is read in place, on its own.
        groups = [[i] for i in range(s) if runs[i] >= 0]
        rest = [i for i in range(s) if runs[i] < 0]
        if rest:
            groups += [[rest[j] for j in g] for g in _length_groups([lens[i] - firsts[i] for i in rest])]
        if len(groups) == 1:
            return _decode_reference(q, kv_by_head, block_tables, seq_lens, lens, scale, runs[0], firsts=firsts, **extra)
        out = torch.empty_like(q)
        for g in groups:
            if len(g) == 1:
                i = g[0]
                out[i : i + 1] = _decode_reference(q[i : i + 1], kv_by_head, block_tables[i : i + 1], seq_lens[i : i + 1],
                                                   [lens[i]], scale, runs[i], firsts=[firsts[i]], **extra)
                continue
            idx = torch.tensor(g, device=q.device)
            out[idx] = _decode_reference(q[idx], kv_by_head, block_tables[idx], seq_lens[idx],
                                         [lens[i] for i in g], scale, firsts=[firsts[i] for i in g], **extra)
        return out
    out = torch.empty_like(q)
    for i in range(s):
        q0, q1, length = starts[i], starts[i + 1], lens[i]
        n = q1 - q0
        if n == 0:
            continue
        first = _first_key(length, n, window)
        kv = _sequence_kv(kv_by_head, block_tables[i], length, runs[i], first).float()
        k, v = kv[0], kv[1]
        keys = length - first
        # query j (absolute position length - n + j) sees cache positions first + c for c in [0, keys) with
        # position <= its own and, with a window, > its own - window
        visible = None
        if n > 1:
            kpos = torch.arange(first, length, device=q.device)[None, :]
            qpos = torch.arange(length - n, length, device=q.device)[:, None]
            visible = kpos <= qpos
            if window is not None:
                visible &= kpos > qpos - window
        if n > 1 and softcap is None and sink_rows is None:
            # A prompt chunk or a verification: causal among the new tokens, which sit at the end of the
            # sequence. SDPA (its fused CPU kernel; GQA without copying K/V) instead of materialising
            # scores, which made a long prompt's chunked prefill slower than HF's own forward
            # (docs/PERFORMANCE.md, "Reference attention").
            qh = q[q0:q1].float().transpose(0, 1)[None]  # [1, q_heads, n, D]
            if n == keys and (window is None or window >= length):  # nothing but causality masks a key
                o = F.scaled_dot_product_attention(qh, k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qh, k[None], v[None], attn_mask=visible, scale=scale,
                                                   enable_gqa=True)
            out[q0:q1] = o[0].transpose(0, 1).to(q.dtype)
            continue
        # GQA without copying K/V per query head: the `group` query heads of a KV head become rows of
        # one matmul. Query head h = kvh * group + g reads KV head kvh (as repeat_interleave would).
        qs = q[q0:q1].float().view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, head_dim)
        scores = _cap(torch.matmul(qs, k.transpose(1, 2)).mul_(scale), softcap).view(kv_heads, group, n, keys)
        if visible is not None:
            scores.masked_fill_(~visible, float("-inf"))
        sink = None if sink_rows is None else sink_rows.view(kv_heads, group, 1, 1)
        probs = _probs(scores, sink).view(kv_heads, group * n, keys)
        o = torch.matmul(probs, v).view(kv_heads, group, n, head_dim).permute(2, 0, 1, 3)  # [n, kvh, group, D]
        out[q0:q1] = o.reshape(n, q_heads, head_dim).to(q.dtype)
    return out


def _check_sinks(sinks: torch.Tensor, q_heads: int) -> torch.Tensor:
    if tuple(sinks.shape) != (q_heads,):
        raise ValueError(f"sinks must be [q_heads] = [{q_heads}], got shape {tuple(sinks.shape)}")
    return sinks


def _length_groups(lens: list[int]) -> list[list[int]]:
    """Sequence indices in groups of similar length (ascending), each to be padded to its longest.

    Taking the next longer sequence into a group pads every member to its length; that is done
    while the tokens it pads stay under `_GROUP_COST_TOKENS`, about what one more group's gather
    and matmuls cost on a CPU.
    """
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups = [[order[0]]]
    for i in order[1:]:
        g = groups[-1]
        if len(g) * (lens[i] - lens[g[-1]]) <= _GROUP_COST_TOKENS:
            g.append(i)
        else:
            groups.append([i])
    return groups


_GROUP_COST_TOKENS = 32


def _sequence_kv(kv_by_head: torch.Tensor, table: torch.Tensor, length: int, run: int, first: int = 0) -> torch.Tensor:
    """One sequence's K and V at cache positions first..length-1, `[2, kv_heads, length - first, head_dim]`: a view
    of the pool when its blocks are the consecutive run starting at block `run` (>= 0, head-major pool), else a
    gather of the blocks that hold those positions."""
    _, kv_heads, _, block_size, head_dim = kv_by_head.shape
    lo, nb = first // block_size, -(-length // block_size)
    if run >= 0:
        kv = kv_by_head[:, :, run + lo : run + nb]
    else:
        kv = kv_by_head.index_select(2, table[lo:nb].to(device=kv_by_head.device, dtype=torch.int64))
    return kv.view(2, kv_heads, (nb - lo) * block_size, head_dim)[:, :, first - lo * block_size : length - lo * block_size]


def _decode_reference(q: torch.Tensor, kv_by_head: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      lens: list[int], scale: float, run: int = -1, *, firsts: list[int],
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode (one query per sequence, the last token) for S sequences at once: one gather, two matmuls.

    q [S, q_heads, head_dim], kv_by_head [2, kv_heads, num_blocks, block_size, head_dim] (a view of the
    pool) -> [S, q_heads, head_dim]. Sequence s's query sees cache positions firsts[s]..lens[s]-1 (its whole
    sequence, or its sliding window), so the only mask is for the padding of the gathered blocks to the
    widest: padded keys get probability 0 and padded values are zeroed (stale slots may hold anything, NaN
    included, and 0 * NaN would leak into the output). `sinks` [q_heads] float32 or None.
    """
    s, q_heads, head_dim = q.shape
    _, kv_heads, num_blocks, block_size, _ = kv_by_head.shape
    group = q_heads // kv_heads
    if s == 1:  # no padding: one sequence's K/V, in place where its blocks are consecutive (`run`)
        kv = _sequence_kv(kv_by_head, block_tables[0], lens[0], run, firsts[0])
        qs = q.float().view(kv_heads, group, head_dim)
        scores = _cap(torch.bmm(qs, kv[0].float().transpose(1, 2)).mul_(scale), softcap)
        probs = _probs(scores, None if sinks is None else sinks.view(kv_heads, group, 1))
        return torch.bmm(probs, kv[1].float()).view(1, q_heads, head_dim).to(q.dtype)
    lo = [f // block_size for f in firsts]
    counts = [-(-n // block_size) - b for n, b in zip(lens, lo)]
    nb = max(counts)
    dev = kv_by_head.device
    if any(lo):  # each sequence's blocks from the one holding its first visible position
        cols = torch.tensor(lo, device=dev)[:, None] + torch.arange(nb, device=dev)[None, :]
        past = torch.arange(nb, device=dev)[None, :] >= torch.tensor(counts, device=dev)[:, None]
        blocks = block_tables.to(device=dev, dtype=torch.int64).gather(1, cols.clamp(max=block_tables.shape[1] - 1))
        blocks = blocks.masked_fill(past, 0)  # entries past a sequence's blocks may be anything: read block 0
        width, masked = nb * block_size, True
    else:
        blocks = block_tables[:, :nb].to(device=dev, dtype=torch.int64)
        width = max(lens)
        masked = min(lens) != width or any(firsts)
        if min(counts) != nb:
            blocks = blocks.masked_fill(torch.arange(nb, device=dev)[None, :] >= torch.tensor(counts, device=dev)[:, None], 0)
    kv = kv_by_head.index_select(2, blocks.reshape(-1)).view(2, kv_heads * s, nb * block_size, head_dim)[:, :, :width]
    k, v = kv[0].float(), kv[1].float()  # [kv_heads * S, width, D]
    # GQA as rows: the `group` query heads of a kv head are the rows of one [group, D] @ [D, width] per
    # sequence; bmm over (kv head, sequence) pairs, as 3-D tensors (4-D matmul costs several more ops)
    qs = q.float().view(s, kv_heads, group, head_dim).transpose(0, 1).reshape(kv_heads * s, group, head_dim)
    scores = _cap(torch.bmm(qs, k.transpose(1, 2)).mul_(scale), softcap)  # [kv_heads * S, group, width]
    if masked:
        # key c of sequence s sits at cache position lo[s] * block_size + c
        pos = torch.tensor(lo, device=dev)[:, None] * block_size + torch.arange(width, device=dev)[None, :]
        pad = (pos >= seq_lens.to(dev)[:, None]) | (pos < torch.tensor(firsts, device=dev)[:, None])  # [S, width]
        pad = pad.repeat(kv_heads, 1)  # [kv_heads * S, width], kv head major like k and v
        scores.masked_fill_(pad[:, None, :], float("-inf"))
        v = v.masked_fill(pad[:, :, None], 0.0)
    sink = None if sinks is None else sinks.view(kv_heads, 1, group, 1).expand(kv_heads, s, group, 1).reshape(
        kv_heads * s, group, 1)
    probs = _probs(scores, sink)
    o = torch.bmm(probs, v).view(kv_heads, s, group, head_dim)
    return o.transpose(0, 1).reshape(s, q_heads, head_dim).to(q.dtype)


def write_kv(kv_pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] into kv_pool at slots block * block_size + offset, in place.

    Negative slots (padding) are skipped; k and v are cast to the pool's dtype.
    """
    if kv_pool.dim() != 5 or kv_pool.shape[1] != 2:
        raise ValueError(f"kv_pool must be [num_blocks, 2, kv_heads, block_size, head_dim], got {tuple(kv_pool.shape)}")
    _, _, kv_heads, block_size, head_dim = kv_pool.shape
    t = slot_mapping.shape[0]
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != (t, kv_heads, head_dim):
            raise ValueError(f"{name} must be [{t}, {kv_heads}, {head_dim}] for {t} slots, got {tuple(x.shape)}")
    slots = slot_mapping.to(device=kv_pool.device, dtype=torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, k, v = slots[valid], k[valid], v[valid]
    blocks, offsets = slots // block_size, slots % block_size
    # advanced indices at dims 0 and 3 around slices: the value is [T, 2, kv_heads, head_dim]; K and V
    # in one store (a step writes every layer, so each op here runs n_layers times per step)
    kv_pool[blocks, :, :, offsets] = torch.stack((k, v), dim=1).to(kv_pool.dtype)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------------------------------
# Triton kernel: one program per (query tile of one sequence, kv head), online softmax over KV tiles
# --------------------------------------------------------------------------------------------------
#
# A program's rows are (query, q head of the kv head's GQA group) pairs: BLOCK_Q queries x GROUP_PAD
# heads, so a decode step with GQA still fills a tensor-core tile and K/V are read once per group.
# The grid is (cdiv(T, BLOCK_Q) + S, kv_heads): sequence s owns tiles query_start[s] // BLOCK_Q + s
# onwards (at most that many fit), so a program finds its sequence by bisection over query_start
# without a host-side sync; programs past their sequence's last tile have no keys to visit. A third grid
# axis splits the keys (flash decoding) when the first two would leave the GPU mostly idle: each split
# writes its partial softmax state and a torch merge combines them.
#
# A sliding window starts a tile's key loop at the block of its first query's window (keys before it are
# never loaded: a handoff need not have shipped them); sinks join the softmax state once, after the keys
# (or in the merge, when the keys were split); the soft cap bends the scaled scores before the mask.


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    sinks_ptr, scale, softcap, S, T, Q_HEADS, SPLIT_LEN, WINDOW,
    s_qt, s_qh, s_ot, s_oh, s_block, s_kv, s_head, s_tok, s_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP32_DOTS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

    # the sequence owning tile pid: the last s with query_start[s] // BLOCK_Q + s <= pid
    lo = pid * 0
    hi = lo + S - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    q0 = tl.load(query_start_ptr + seq)
    n = tl.load(query_start_ptr + seq + 1) - q0
    seq_len = tl.load(seq_lens_ptr + seq)
    tile = pid - (q0 // BLOCK_Q + seq)

    rows = tl.arange(0, BLOCK_M)
    q_local = tile * BLOCK_Q + rows // GROUP_PAD  # query index within the sequence
    g = rows % GROUP_PAD
    row_ok = (q_local < n) & (g < GROUP)
    q_pos = seq_len - n + q_local  # absolute position: the queries are the sequence's last tokens
    head = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_tok = (q0 + q_local).to(tl.int64)
    q = tl.load(q_ptr + q_tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOTS:
        q = q.to(tl.float32)

    # keys 0 .. (last query of the tile) inclusive; none when the tile is past the sequence's queries
    kv_end = tl.where(tile * BLOCK_Q < n, seq_len - n + tl.minimum((tile + 1) * BLOCK_Q, n), 0)
    if HAS_WINDOW:  # the first key the tile's first query sees; none before it is read
        win_lo = tl.maximum(seq_len - n + tile * BLOCK_Q - WINDOW + 1, 0)
    else:
        win_lo = 0
    loop_lo = (win_lo // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * s_bt
    head_off = kvh.to(tl.int64) * s_head
    if NUM_SPLITS > 1:
        # split-KV (flash decoding): this program covers keys [split * SPLIT_LEN, (split + 1) * SPLIT_LEN)
        kv_hi = tl.minimum(kv_end, split * SPLIT_LEN + SPLIT_LEN)
        kv_lo = tl.maximum(split * SPLIT_LEN, loop_lo)
    else:
        kv_lo = loop_lo
        kv_hi = kv_end
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = (pos < kv_hi) & (pos >= win_lo)
        phys = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        tok_off = phys * s_block + head_off + (pos % BLOCK_SIZE).to(tl.int64) * s_tok
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + tok_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + s_kv + tok_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOTS:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # not TF32: the reference's float32
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if HAS_SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(scores * (2.0 / softcap)) - 1.0)
        attend = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            attend = attend & (pos[None, :] > q_pos[:, None] - WINDOW)
        scores = tl.where(attend, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing to attend yet: no NaN
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOTS:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if NUM_SPLITS > 1:
        # partial state (running max, normaliser, unnormalised output) per (split, token, q head), merged by
        # _merge_splits; a split with no keys leaves (-inf, 0, 0), which the merge weighs by zero
        part = (split * T + q_tok) * Q_HEADS + head
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        if HAS_SINKS:  # the sink's logit in the normaliser, as one more key with no value
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_fin)
            l_i = l_i * alpha + tl.exp(sink - m_fin)
            acc = acc * alpha[:, None]
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def _tile_sizes(group: int) -> tuple[int, int, int]:
    """(GROUP_PAD, BLOCK_Q, BLOCK_N): rows = BLOCK_Q * GROUP_PAD >= 16 for tensor cores (64 on a GPU)."""
    group_pad = triton.next_power_of_2(group)
    rows = 16 if _interpreting() else 64
    block_q = max(1, rows // group_pad)
    block_n = 16 if _interpreting() else 64
    return group_pad, block_q, block_n


_SM_COUNT: dict[int, int] = {}


def _num_splits(device: torch.device, programs: int, max_context: int, block_n: int) -> int:
    """KV splits so that few long sequences (small-batch decode) still fill the GPU; 1 under the interpreter."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = triton.cdiv(2 * _SM_COUNT[index], programs)  # about two programs per SM
    return max(1, min(want, triton.cdiv(max_context, 8 * block_n), 64))  # each split >= 8 KV tiles


def _merge_splits(part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor, out: torch.Tensor,
                  sinks: torch.Tensor | None = None) -> None:
    # part_m, part_l [splits, T, q_heads], part_acc [splits, T, q_heads, D] -> out [T, q_heads, D]; a sink is
    # one more split: running max its logit, normaliser 1, nothing to add to the output
    if sinks is not None:
        sink = sinks.float().view(1, 1, -1).expand(1, part_m.shape[1], -1)
        part_m = torch.cat((part_m, sink))
        part_l = torch.cat((part_l, torch.ones_like(sink)))
        part_acc = torch.cat((part_acc, part_acc.new_zeros((1, *part_acc.shape[1:]))))
    m = part_m.max(dim=0).values
    w = torch.exp(part_m - m)  # splits without keys: exp(-inf) = 0
    out.copy_((w[..., None] * part_acc).sum(dim=0) / (w * part_l).sum(dim=0)[..., None])


def paged_attention_triton(q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start: torch.Tensor, scale: float, *, num_splits: int | None = None,
                           sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """The Triton kernel; same contract as :func:`paged_attention`.

    One launch over the ragged batch, plus a small torch merge when the keys are split across programs
    (``num_splits`` > 1; None = chosen from the GPU's size, the batch and block_tables' width, so that
    small-batch long-context decode fills the GPU). Checks shapes only: the ragged structure is read on
    the device, never synced to the host.
    """
    t, q_heads, head_dim, kv_heads, block_size, s = _check_inputs(q, kv_pool, block_tables, seq_lens, query_start)
    if q.dtype != kv_pool.dtype:
        raise ValueError(f"q dtype {q.dtype} != kv_pool dtype {kv_pool.dtype}")
    window = _window(sliding_window)
    if sinks is not None:
        sinks = _check_sinks(sinks, q_heads).to(device=q.device, dtype=torch.float32).contiguous()
    out = torch.empty_like(q)
    if t == 0 or s == 0:
        return out
    device = q.device
    group = q_heads // kv_heads
    group_pad, block_q, block_n = _tile_sizes(group)
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv_pool = kv_pool if kv_pool.stride(-1) == 1 else kv_pool.contiguous()
    block_tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    tiles = triton.cdiv(t, block_q) + s
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = _num_splits(q.device, tiles * kv_heads, max_context, block_n)
    num_splits = max(1, int(num_splits))
    split_len = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    if num_splits > 1:
        part_m = torch.full((num_splits, t, q_heads), float("-inf"), dtype=torch.float32, device=device)
        part_l = torch.zeros((num_splits, t, q_heads), dtype=torch.float32, device=device)
        part_acc = torch.zeros((num_splits, t, q_heads, head_dim), dtype=torch.float32, device=device)
    else:
        part_m = part_l = part_acc = out  # placeholders, never touched with NUM_SPLITS = 1
    _paged_attention_kernel[(tiles, kv_heads, num_splits)](
        q, kv_pool, block_tables,
        seq_lens.to(device=device, dtype=torch.int32).contiguous(),
        query_start.to(device=device, dtype=torch.int32).contiguous(),
        out, part_m, part_l, part_acc, out if sinks is None else sinks, float(scale), float(softcap or 1.0), s, t,
        q_heads, split_len, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3), block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        # float32 pools: IEEE float32 dots; bf16/fp16: tensor-core dots with float32 accumulation, except
        # bf16 under the interpreter, whose bf16 tl.dot returns garbage (triton 3.9)
        FP32_DOTS=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreting()),
        NUM_SPLITS=num_splits, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None and num_splits == 1,
        HAS_SOFTCAP=softcap is not None, num_warps=4,
    )
    if num_splits > 1:
        _merge_splits(part_m, part_l, part_acc, out, sinks)
    return out


NATIVE_MAX_ROWS = 16  # a sequence's query rows up to which the native CPU kernel beats the reference's SDPA


def _chunk_kernel_takes(q, kv_pool, seq_lens, long: list[int], *, sliding_window=None, sinks=None,
                        softcap=None) -> bool:
    """Whether the long sequences (prompt chunks) go to the native chunk kernel (`cpu_chunk_attention.c`):
    bfloat16 on an AVX512-BF16 CPU, and full attention — no soft cap, no sinks, no window that hides a key."""
    if softcap is not None or sinks is not None:
        return False
    window = _window(sliding_window)
    if window is not None and max(int(seq_lens[i]) for i in long) > window:
        return False
    return cpu_attention.chunk_supports(q, kv_pool)


def _paged_attention_cpu(q, kv_pool, block_tables, seq_lens, query_start, scale, runs, **extra) -> torch.Tensor:
    """The native CPU kernel for sequences of at most `NATIVE_MAX_ROWS` queries (decode, verification); for
    longer ones (prompt chunks) the native chunk kernel where it takes them (bfloat16, AVX512-BF16, full
    attention), else the reference (SDPA's blocked matmuls); in one ragged batch."""
    starts = query_start.tolist()
    counts = [b - a for a, b in zip(starts, starts[1:])]
    long = [i for i, n in enumerate(counts) if n > NATIVE_MAX_ROWS]
    native_chunks = long and _chunk_kernel_takes(q, kv_pool, seq_lens, long, **extra)
    if long and len(long) == len(counts) and not native_chunks:  # the reference checks its inputs itself
        return paged_attention_reference(q, kv_pool, block_tables, seq_lens, query_start, scale, runs, **extra)
    t, q_heads, _, _, block_size, _ = _check_inputs(q, kv_pool, block_tables, seq_lens, query_start)
    _check_values(t, block_size, block_tables.shape[1], seq_lens.tolist(), starts)
    if extra.get("sinks") is not None:
        _check_sinks(extra["sinks"], q_heads)
    if not long:
        return cpu_attention.paged_attention_cpu(q, kv_pool, block_tables, seq_lens, query_start, scale, **extra)
    out = torch.empty_like(q)
    parts = [([i for i, n in enumerate(counts) if n <= NATIVE_MAX_ROWS], cpu_attention.paged_attention_cpu)]
    if native_chunks:  # one call per prompt chunk
        lens = seq_lens.tolist()
        for i in long:
            out[starts[i] : starts[i + 1]] = cpu_attention.chunk_attention_cpu(q[starts[i] : starts[i + 1]], kv_pool,
                                                                                block_tables[i], lens[i], scale)
    else:
        parts.append((long, paged_attention_reference))
    for part, fn in parts:
        if not sum(counts[i] for i in part):
            continue  # prompt chunks only (their kernel took them all), or no query rows in this part
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in part])
        sub_starts = torch.tensor([0, *itertools.accumulate(counts[i] for i in part)], dtype=torch.int32)
        idx = torch.tensor(part)
        args = (q[rows], kv_pool, block_tables[idx], seq_lens[idx], sub_starts, scale)
        if fn is paged_attention_reference:
            args += (None if runs is None else [runs[i] for i in part],)
        out[rows] = fn(*args, **extra)
    return out


def paged_attention(q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start: torch.Tensor, scale: float, *, impl: str = "auto",
                    runs: list[int] | None = None, sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of ragged queries q [T, q_heads, head_dim] over a paged KV pool -> [T, q_heads, head_dim].

    See the module docstring for shapes and semantics (and the sliding window, sinks and soft cap).
    ``impl``: "triton", "cpu" (the native CPU kernel, `kernels.cpu_attention`, for sequences of up to
    `NATIVE_MAX_ROWS` queries where it is built and takes the pool's dtype; the reference for the rest), "reference", or "auto" (Triton when q is on CUDA or
    TRITON_INTERPRET=1 is set, else "cpu"). ``runs``: an optional hint for the reference (see
    :func:`paged_attention_reference`); the kernels read blocks in place anyway.
    """
    extra = dict(sliding_window=sliding_window, sinks=sinks, softcap=softcap)
    if impl == "auto":
        impl = "triton" if (q.is_cuda or _interpreting()) else "cpu"
    if impl == "triton":
        return paged_attention_triton(q, kv_pool, block_tables, seq_lens, query_start, scale, **extra)
    if impl == "cpu":
        if cpu_attention.supports(q, kv_pool):
            return _paged_attention_cpu(q, kv_pool, block_tables, seq_lens, query_start, scale, runs, **extra)
        impl = "reference"
    if impl == "reference":
        return paged_attention_reference(q, kv_pool, block_tables, seq_lens, query_start, scale, runs, **extra)
    raise ValueError(f"impl must be 'auto', 'triton', 'cpu' or 'reference', got {impl!r}")
