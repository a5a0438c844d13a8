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

Returns ``out [T, q_heads, head_dim]`` in q's dtype. Scores, softmax and the weighted sum are computed
in float32 in both implementations (the kernel with an online softmax), so they agree to float32
rounding.

``write_kv(kv_pool, slot_mapping [T] int64, k, v)`` stores this step's keys/values [T, kv_heads,
head_dim] at slot = block * block_size + offset (negative slots are padding and skipped), in place.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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


def paged_attention_reference(q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain-torch paged attention; same contract as :func:`paged_attention`."""
    t, q_heads, head_dim, kv_heads, block_size, s = _check_inputs(q, kv_pool, block_tables, seq_lens, query_start)
    lens = seq_lens.tolist()
    starts = query_start.tolist()
    _check_values(t, block_size, block_tables.shape[1], lens, starts)
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    for i in range(s):
        q0, q1, length = starts[i], starts[i + 1], lens[i]
        n = q1 - q0
        if n == 0:
            continue
        blocks = block_tables[i, : -(-length // block_size)].to(device=kv_pool.device, dtype=torch.int64)
        # [nb, 2, kvh, bs, D] -> [2, kvh, nb*bs, D], cut to the sequence's tokens
        kv = kv_pool[blocks].permute(1, 2, 0, 3, 4).reshape(2, kv_heads, -1, head_dim)[:, :, :length].float()
        k = kv[0].repeat_interleave(group, dim=0)  # [q_heads, L, D]
        v = kv[1].repeat_interleave(group, dim=0)
        qs = q[q0:q1].float().transpose(0, 1)  # [q_heads, n, D]
        scores = torch.matmul(qs, k.transpose(1, 2)) * scale  # [q_heads, n, L]
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[q0:q1] = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1).to(q.dtype)
    return out


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
    # advanced indices at dims 0 and 3 around a slice: the result (and the value) is [T, kv_heads, head_dim]
    kv_pool[blocks, 0, :, offsets] = k.to(kv_pool.dtype)
    kv_pool[blocks, 1, :, offsets] = v.to(kv_pool.dtype)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def paged_attention_triton(q, kv_pool, block_tables, seq_lens, query_start, scale):
    """The Triton kernel; same contract as :func:`paged_attention`."""
    raise NotImplementedError("the paged attention Triton kernel is not written yet; use impl='reference'")


def paged_attention(q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start: torch.Tensor, scale: float, *, impl: str = "auto") -> torch.Tensor:
    """Causal attention of ragged queries q [T, q_heads, head_dim] over a paged KV pool -> [T, q_heads, head_dim].

    See the module docstring for shapes and semantics. ``impl``: "triton", "reference", or "auto"
    (Triton when q is on CUDA or TRITON_INTERPRET=1 is set, else the reference).
    """
    if impl == "auto":
        impl = "reference"  # until the Triton kernel lands: then Triton on CUDA or under the interpreter
    if impl == "triton":
        return paged_attention_triton(q, kv_pool, block_tables, seq_lens, query_start, scale)
    if impl == "reference":
        return paged_attention_reference(q, kv_pool, block_tables, seq_lens, query_start, scale)
    raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
