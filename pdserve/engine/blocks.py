"""The KV block pool: one fixed tensor of KV blocks for all layers, shared by every running sequence.

The pool owns `kv` `[num_layers, num_blocks, 2, kv_heads, block_size, head_dim]` (2 = keys,
values; `kv[layer]` is the per-layer pool the attention kernel reads). A sequence is a block
table (list of block ids) plus a length in tokens; token t of a sequence lives in slot
`table[t // block_size] * block_size + t % block_size`.

Blocks are reference counted: `fork` shares a parent's blocks with a child (copy-on-write: a
shared, partially filled last block is copied on the first write into it), and prefix caching
shares full blocks between sequences whose prompts begin alike. A full block is addressed by a
hash chain over token ids, `h_i = sha256(h_{i-1} || tokens of block i)`, so a block matches only
if everything before it matches too; partially filled blocks are never shared by hash. A cached
block whose last user freed it keeps its KV and its hash (refcount 0, in LRU order) until the
pool needs the space; allocation takes truly free blocks first, then evicts the least recently
freed cached block.

Physically the pool is head-major, `[num_layers, 2, kv_heads, num_blocks, block_size, head_dim]`,
and `kv` is a permuted view of it in the logical order above. So the keys (or values) of one head
in blocks b, b+1, ..., b+n-1 are one strided run of n * block_size rows: attention reads a
sequence whose blocks are consecutive straight from the pool, without gathering them (a copy of
its whole KV per layer per step, which cost as much as the attention itself). The allocator
works for that: a new sequence starts in the largest free run (in its middle when the run
follows another sequence's growing tail) and a growing sequence takes the block after its last
one when it is free. Contiguity is a speed-up, never a requirement: any table works.

Every operation that needs blocks checks that it can have them all before it changes anything,
and raises `OutOfBlocks` otherwise — the scheduler's signal to preempt or queue, never a crash
and never a half-grown sequence.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

# The address scheme is shared: routers compute the same chain to find cached prefixes.
from pdserve.basetypes import ROOT_HASH, KVLayout, block_hash
from pdserve.kvtransfer.layout import KVBlocks


_FREE_RUN = re.compile(rb"\x01+")


class OutOfBlocks(RuntimeError):
    """The pool cannot supply the blocks an operation needs. Nothing was changed."""

    def __init__(self, what: str, needed: int, available: int):
        super().__init__(f"{what}: needs {needed} free KV block(s), pool has {available}")
        self.needed = needed
        self.available = available


@dataclass
class _Seq:
    table: list[int] = field(default_factory=list)  # block ids
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)  # hash chain of the leading full blocks registered so far


class BlockPool:
    """A fixed pool of KV blocks with block tables, refcounts, copy-on-write forks and a prefix cache.

    Not thread-safe: one compute thread drives it (the same one that runs the model).
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = num_blocks
        storage = torch.zeros(
            (layout.num_layers, 2, layout.kv_heads, num_blocks, layout.block_size, layout.head_dim),
            dtype=layout.torch_dtype,
            device=device,
        )
        self.kv = storage.permute(0, 3, 1, 2, 4, 5)  # [L, num_blocks, 2, kv_heads, block_size, head_dim]
        self.refcount = [0] * num_blocks
        self._is_free = bytearray(b"\x01") * num_blocks  # 1: refcount 0 and no cached content
        self._n_free = num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # refcount 0, cached by hash; oldest first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._seqs: dict[object, _Seq] = {}

    # -- queries ---------------------------------------------------------------------------

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).table)

    def num_tokens(self, seq_id) -> int:
        return self._seq(seq_id).num_tokens

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free ones plus unreferenced cached ones (evictable)."""
        return self._n_free + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold reusable prefix KV."""
        return len(self._lru)

    def utilization(self) -> float:
        """Fraction of blocks referenced by a live sequence (cached-but-unreferenced blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def slots(self, seq_id, start: int, end: int) -> torch.Tensor:
        """Slot ids `[end - start]` int64 of token positions start..end-1 of a sequence."""
        s = self._seq(seq_id)
        if not 0 <= start <= end <= s.num_tokens:
            raise IndexError(f"sequence {seq_id!r}: slots {start}..{end} outside its {s.num_tokens} tokens")
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(s.table, dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # -- sequences -------------------------------------------------------------------------

    def allocate(self, seq_id, num_tokens: int, prefix_blocks: list[int] = ()) -> None:
        """Create a sequence of `num_tokens` tokens whose first blocks are `prefix_blocks` (from `match_prefix`).

        The prefix blocks are shared (refcount + 1), the rest are new blocks. Raises OutOfBlocks
        (nothing changed) if the pool cannot supply them, KeyError if `seq_id` exists.
        """
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} already has blocks")
        prefix_blocks = list(prefix_blocks)
        if len(prefix_blocks) * self.block_size > num_tokens:
            raise ValueError(f"{len(prefix_blocks)} prefix blocks hold more than {num_tokens} tokens")
        needed = self.layout.num_blocks(num_tokens) - len(prefix_blocks)
        reviving = sum(1 for b in prefix_blocks if self.refcount[b] == 0)
        self._check(f"allocate {seq_id!r} ({num_tokens} tokens)", needed, reserved=reviving)
        for b in prefix_blocks:
            self._incref(b)
        s = _Seq(table=prefix_blocks + self._take_run(needed, after=prefix_blocks[-1] if prefix_blocks else None),
                 num_tokens=num_tokens)
        s.hashes = [self._hash_of[b] for b in prefix_blocks]
        self._seqs[seq_id] = s

    def blocks_needed(self, seq_id, n: int) -> int:
        """Free blocks `append_slots(seq_id, n)` would take (new blocks, plus one if it must copy a shared last block)."""
        s = self._seq(seq_id)
        if n <= 0:
            return 0
        cow = s.num_tokens % self.block_size != 0 and self.refcount[s.table[-1]] > 1
        return self.layout.num_blocks(s.num_tokens + n) - len(s.table) + int(cow)

    def append_slots(self, seq_id, n: int) -> torch.Tensor:
        """Grow a sequence by `n` tokens; returns their slot ids `[n]` int64 (where to write their K/V).

        Allocates blocks as needed; if the last block is shared and partially filled it is
        copied first (copy-on-write) so the write cannot change another sequence's KV. Raises
        OutOfBlocks (nothing changed) if the pool cannot supply the blocks.
        """
        s = self._seq(seq_id)
        if n < 0:
            raise ValueError(f"append_slots: n must be >= 0, got {n}")
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        self._check(f"append {n} token(s) to {seq_id!r}", self.blocks_needed(seq_id, n))
        if s.num_tokens % self.block_size:  # the next token goes into the partially filled last block
            last = s.table[-1]
            if self.refcount[last] > 1:
                fresh = self._take()
                self.kv[:, fresh].copy_(self.kv[:, last])
                self._decref(last)
                s.table[-1] = fresh
            elif last in self._hash_of:
                # Only this sequence holds it, but its content is about to change (after a
                # truncate): it must no longer answer for its old hash.
                self._unhash(last)
        grow = self.layout.num_blocks(s.num_tokens + n) - len(s.table)
        if grow > 0:
            s.table.extend(self._take_run(grow, after=s.table[-1] if s.table else None))
        start = s.num_tokens
        s.num_tokens += n
        return self.slots(seq_id, start, s.num_tokens)

    def fork(self, parent, child) -> None:
        """Make `child` a copy of `parent` that shares all its blocks (copy-on-write)."""
        p = self._seq(parent)
        if child in self._seqs:
            raise KeyError(f"sequence {child!r} already has blocks")
        for b in p.table:
            self._incref(b)
        self._seqs[child] = _Seq(table=list(p.table), num_tokens=p.num_tokens, hashes=list(p.hashes))

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Shorten a sequence to `num_tokens` tokens (speculative rollback); whole blocks past the end are released."""
        s = self._seq(seq_id)
        if not 0 <= num_tokens <= s.num_tokens:
            raise ValueError(f"truncate {seq_id!r} to {num_tokens}: it has {s.num_tokens} tokens")
        keep = self.layout.num_blocks(num_tokens)
        for b in s.table[keep:]:
            self._decref(b)
        del s.table[keep:]
        del s.hashes[num_tokens // self.block_size :]
        s.num_tokens = num_tokens

    def free(self, seq_id, *, evict_first_from: int | None = None) -> None:
        """Release a sequence's blocks; blocks that carry a prefix hash stay cached (LRU) until needed.

        `evict_first_from`: blocks from this index of the table on that become unreferenced go to
        the cold end of the LRU (evicted before anything else) — for speculative content such as
        pre-positioned KV, which must never push out KV that real requests used.
        """
        s = self._seq(seq_id)
        del self._seqs[seq_id]
        # Release the tail first so that, among one sequence's blocks, the deepest prefix block
        # is evicted first and the root (the most shareable) last.
        for i in range(len(s.table) - 1, -1, -1):
            b = s.table[i]
            self._decref(b)
            if evict_first_from is not None and i >= evict_first_from and b in self._lru:
                self._lru.move_to_end(b, last=False)

    def cached_hashes(self, limit: int | None = None) -> list[bytes]:
        """Addresses of the blocks the prefix cache holds: in-use ones first, then unreferenced ones newest first."""
        live = [h for b, h in self._hash_of.items() if self.refcount[b] > 0]
        idle = [self._hash_of[b] for b in reversed(self._lru)]
        out = live + idle
        return out if limit is None else out[:limit]

    def holds(self, h: bytes) -> bool:
        """Whether the prefix cache holds a block at address `h`."""
        return h in self._by_hash

    # -- prefix cache ----------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], int]:
        """The longest cached prefix of whole blocks of `token_ids`: (block ids, number of tokens they hold).

        The blocks are not referenced by this call; pass them to `allocate` before anything
        else allocates (which could evict unreferenced ones).
        """
        blocks: list[int] = []
        h = ROOT_HASH
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            h = block_hash(h, token_ids[i * bs : (i + 1) * bs])
            b = self._by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
        for b in blocks:  # a hit is a use: refresh recency of the unreferenced ones
            if b in self._lru:
                self._lru.move_to_end(b)
        return blocks, len(blocks) * bs

    def register_prefix(self, seq_id, token_ids: list[int]) -> None:
        """Publish the full blocks of a sequence (whose K/V for `token_ids` are written) to the prefix cache.

        `token_ids` are the sequence's tokens from position 0 (at most its length). Idempotent;
        blocks already registered are skipped. If an identical block is already cached under the
        same hash, the existing one keeps the address (this one stays private).
        """
        s = self._seq(seq_id)
        n_full = min(len(token_ids), s.num_tokens) // self.block_size
        bs = self.block_size
        for i in range(len(s.hashes), n_full):
            parent = s.hashes[-1] if s.hashes else ROOT_HASH
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            s.hashes.append(h)
            b = s.table[i]
            if h not in self._by_hash and b not in self._hash_of:
                self._by_hash[h] = b
                self._hash_of[b] = h

    # -- KV in and out ---------------------------------------------------------------------

    def export_layer(self, seq_id, layer: int, *, for_handoff: bool = False) -> torch.Tensor:
        """A copy of one layer of a sequence's KV `[nb, 2, kv_heads, block_size, head_dim]` on the CPU
        (zeros past its length in the last block); with `for_handoff`, only the blocks a handoff carries
        (`KVLayout.layer_blocks`: a sliding-window layer's last ones)."""
        s = self._seq(seq_id)
        table = s.table[len(s.table) - self.layout.layer_blocks(layer, s.num_tokens):] if for_handoff else s.table
        idx = torch.tensor(table, dtype=torch.int64, device=self.kv.device)
        # one layer at a time: index_select over the whole permuted [L, ...] view copies the entire pool first,
        # whatever the prompt (docs/PERFORMANCE.md, "KV export")
        data = self.kv[layer].index_select(0, idx)
        tail = s.num_tokens % self.block_size
        if tail:
            data[-1, :, :, tail:] = 0
        return data.cpu()

    def export_blocks(self, seq_id) -> KVBlocks:
        """A copy of a sequence's KV as `KVBlocks` (zeros past its length in the last block)."""
        layers = [self.export_layer(seq_id, i) for i in range(self.layout.num_layers)]
        return KVBlocks(self.layout, self._seq(seq_id).num_tokens, layers)

    def import_blocks(self, seq_id, kv: KVBlocks) -> None:
        """Create a sequence holding the KV of `kv` (refused with LayoutMismatch if its layout differs).

        A layer that holds only its last blocks (a sliding window's, in a handoff) fills the sequence's last
        blocks; its earlier ones keep whatever they held, which its attention never reads."""
        self.layout.check_matches(kv.layout)
        if len(kv.layers) != self.layout.num_layers:
            raise ValueError(f"KV has {len(kv.layers)} layers, pool has {self.layout.num_layers}")
        nb = self.layout.num_blocks(kv.num_tokens)
        for i, t in enumerate(kv.layers):
            need = self.layout.layer_blocks(i, kv.num_tokens)
            if not need <= t.shape[0] <= nb:
                raise ValueError(f"layer {i} ({self.layout.attention(i)}) has {t.shape[0]} blocks; {kv.num_tokens} "
                                 f"tokens need {need}" + (f" to {nb}" if need != nb else ""))
        self.allocate(seq_id, kv.num_tokens)
        table = self._seqs[seq_id].table
        for i, t in enumerate(kv.layers):
            idx = torch.tensor(table[nb - t.shape[0]:], dtype=torch.int64, device=self.kv.device)
            self.kv[i].index_copy_(0, idx, t.to(self.kv.device, self.kv.dtype))

    # -- internals -------------------------------------------------------------------------

    def _seq(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _check(self, what: str, needed: int, reserved: int = 0) -> None:
        available = self.num_free - reserved
        if needed > available:
            raise OutOfBlocks(what, needed, available)

    def _take(self) -> int:
        """A block with refcount 1: a free one, else the least recently used cached one (its hash dropped)."""
        return self._take_run(1)[0]

    def _take_run(self, n: int, after: int | None = None) -> list[int]:
        """n blocks with refcount 1, consecutive where the free space allows (see the module docstring).

        Continues from block `after` + 1 when that is free; otherwise starts where `_place` says.
        Truly free blocks first, then the least recently used cached ones (their hashes dropped).
        """
        out: list[int] = []
        nxt = None if after is None else after + 1
        while len(out) < n:
            if self._n_free:
                b = nxt if nxt is not None and nxt < self.num_blocks and self._is_free[nxt] else self._place(n - len(out))
                self._is_free[b] = 0
                self._n_free -= 1
            else:
                b, _ = self._lru.popitem(last=False)
                self._unhash(b)
            self.refcount[b] = 1
            out.append(b)
            nxt = b + 1
        return out

    def _place(self, n: int) -> int:
        """Where a run of n new blocks should start: in the largest run of free blocks, leaving half of
        the room past n to the sequence whose last block sits just before the run (it grows into it)."""
        start, end = max(((m.start(), m.end()) for m in _FREE_RUN.finditer(self._is_free)), key=lambda r: r[1] - r[0])
        if start > 0 and self.refcount[start - 1] > 0 and any(s.table and s.table[-1] == start - 1 for s in self._seqs.values()):
            start += max(0, (end - start - n) // 2)
        return start

    def _unhash(self, b: int) -> None:
        h = self._hash_of.pop(b)
        del self._by_hash[h]

    def _incref(self, b: int) -> None:
        if self.refcount[b] == 0:
            del self._lru[b]  # only hashed blocks are shared while unreferenced
        self.refcount[b] += 1

    def _decref(self, b: int) -> None:
        self.refcount[b] -= 1
        assert self.refcount[b] >= 0, f"block {b} released more often than referenced"
        if self.refcount[b] == 0:
            if b in self._hash_of:
                self._lru[b] = None
            else:
                self._is_free[b] = 1
                self._n_free += 1
