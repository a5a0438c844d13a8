"""PagedRunner: a transformers model over a BlockPool — chunked prefill with prefix reuse, batched ragged steps, rollback.

A sequence lives in the pool as a block table plus its token ids. `prefill` reuses the longest
cached prefix of whole blocks and computes only the rest, in chunks; `step` runs one forward for
a whole batch in which each sequence brings 1 token (decode), k+1 (speculative verification) or
a prompt chunk; `rollback` drops rejected tokens. KV enters and leaves as `KVBlocks` with the
model's `KVLayout` (per layer: full or sliding-window attention), what the channel moves.
The model is the checkpoint's own transformers implementation (`hfmodel.HFPagedModel`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from pdserve.basetypes import DEFAULT_BLOCK_SIZE, KVLayout, dtype_name
from pdserve.engine.blocks import BlockPool, OutOfBlocks
from pdserve.engine.hfmodel import HFPagedModel, PagedBatch
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.modelstore import model_fingerprint

__all__ = ["PagedRunner", "OutOfBlocks"]


class PagedRunner:
    """One model and one KV block pool on one device. Not thread-safe: call it from one compute thread.

    `num_blocks` sizes the pool: each block holds `block_size` tokens of every layer
    (`layout.block_bytes * num_layers` bytes). `attention_impl` is passed to
    `paged_attention` ("cpu" on the CPU: the native kernel where it builds, else the reference; "auto" elsewhere). `prefix_cache=False`
    publishes no blocks to the prefix cache (decode, which never looks prompts up): freed blocks
    are then truly free, which keeps the pool's free space in long runs. `small_step_weights=False` leaves
    out the extra CPU weight layouts for steps of 2-12 rows (see `cpustep.CpuLinear`): prefill has no use for them.
    `native_layers=False` keeps transformers' forward where the native decoder would serve (a reference).
    Raises `checkpoint.UnsupportedModel` (naming the architecture and what is missing) for a checkpoint it
    cannot serve.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int = 512,
        attention_impl: str | None = None,
        prefix_cache: bool = True,
        small_step_weights: bool = True,
        native_layers: bool = True,
    ):
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        impl = attention_impl or ("cpu" if self.device.type == "cpu" else "auto")
        model = HFPagedModel.from_pretrained(self.model_dir, dtype=dtype, device=self.device, attention_impl=impl,
                                             small_step_weights=small_step_weights, native_layers=native_layers)
        shape = dict(num_layers=len(model.layers), kv_heads=model.kv_heads, head_dim=model.head_dim,
                     layer_windows=model.layer_windows)
        self.max_context, self.vocab_size = model.max_context, model.vocab_size
        self.model = model
        self.layout = KVLayout(model_fingerprint=model_fingerprint(self.model_dir), dtype=dtype_name(dtype),
                               block_size=block_size, **shape)
        self.pool = BlockPool(self.layout, num_blocks, device=self.device)
        self.prefix_cache = prefix_cache
        # Token ids whose K/V the pool holds, per sequence; None where they are unknown (a KV
        # import without its tokens), which only means its blocks are not offered to the prefix cache.
        self._tokens: dict[object, list[int] | None] = {}

    # -- sequences -------------------------------------------------------------------------

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._tokens

    def num_tokens(self, seq_id) -> int:
        return self.pool.num_tokens(seq_id)

    def native_rows(self) -> int:
        """Most rows of a step that runs on the native CPU decoder (`engine.native`), one call per layer; 0
        where there is none (float32, no AVX512-BF16, a GPU). Past it a step takes transformers' forward."""
        native = self.model.native
        return native.max_rows if native is not None and native.supports(self.pool.kv, 1) else 0

    def utilization(self) -> float:
        """Share of the pool's blocks in use (0-1)."""
        return self.pool.utilization()

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` (plus its next token) fits in the free blocks now."""
        return self.pool.num_free >= self.layout.num_blocks(num_tokens + 1)

    def start(self, seq_id, token_ids: list[int], *, reuse_prefix: bool = True) -> int:
        """Open a sequence for `token_ids`, reusing the longest cached prefix of whole blocks (unless not `reuse_prefix`).

        Returns how many leading tokens are already in the cache (a multiple of block_size,
        always < len(token_ids) so the last token is computed and gives logits); feed the rest
        with `step`, in chunks if wanted. Raises OutOfBlocks (nothing changed).
        """
        if not token_ids:
            raise ValueError(f"sequence {seq_id!r}: empty prompt")
        if seq_id in self._tokens:
            raise KeyError(f"sequence {seq_id!r} already exists")
        self._check_context(seq_id, len(token_ids))
        blocks, cached = self.pool.match_prefix(token_ids) if reuse_prefix else ([], 0)
        if cached == len(token_ids):  # recompute the last block: its last token's logits are needed
            blocks, cached = blocks[:-1], cached - self.layout.block_size
        self.pool.allocate(seq_id, cached, prefix_blocks=blocks)
        self._tokens[seq_id] = list(token_ids[:cached])
        return cached

    @torch.inference_mode()
    def prefill(self, seq_id, token_ids: list[int], chunk_size: int | None = None, *, reuse_prefix: bool = True) -> Tensor:
        """Prompt → logits of its last position `[vocab]` (float32); the KV stays in the pool under `seq_id`.

        Reuses a cached prefix (`start`) and computes the rest in chunks of `chunk_size` tokens
        (all at once if None). On OutOfBlocks the sequence is freed and the error re-raised.
        """
        cached = self.start(seq_id, token_ids, reuse_prefix=reuse_prefix)
        rest = token_ids[cached:]
        chunk = chunk_size or len(rest)
        try:
            for i in range(0, len(rest), chunk):
                (logits,) = self.step([(seq_id, rest[i : i + chunk])], last_only=True)
        except BaseException:
            self.free(seq_id)
            raise
        return logits[-1]

    @torch.inference_mode()
    def step(self, batch: list[tuple[object, list[int]]], *, last_only: bool | list[bool] = False) -> list[Tensor]:
        """One forward for a ragged batch: each (seq_id, new_token_ids) appends its tokens to that sequence.

        Returns, per sequence in order, logits `[n_i, vocab]` float32 for its n_i new tokens
        (`[1, vocab]` for the last one only where `last_only`, a flag for all or one per
        sequence — a prompt chunk needs only its last row, a verification all k+1): row j
        predicts the token after new_token_ids[j]. If the pool cannot hold the new tokens (OutOfBlocks) or the forward
        fails, the error is raised and every sequence is left as it was.
        """
        if not batch:
            return []
        seq_ids = [sid for sid, _ in batch]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {seq_ids}")
        starts: list[int] = []
        slots: list[Tensor] = []
        try:
            for sid, new in batch:
                if sid not in self._tokens:
                    raise KeyError(f"unknown sequence {sid!r}")
                if not new:
                    raise ValueError(f"sequence {sid!r}: a step brings at least one token")
                start = self.pool.num_tokens(sid)
                self._check_context(sid, start + len(new))
                slots.append(self.pool.append_slots(sid, len(new)))
                starts.append(start)
        except BaseException:
            for (sid, _), start in zip(batch, starts):
                self.pool.truncate(sid, start)
            raise

        lens = [len(new) for _, new in batch]
        seq_lens = [s + n for s, n in zip(starts, lens)]
        tables = [self.pool.block_table(sid) for sid in seq_ids]
        runs = [t[0] if t[-1] - t[0] == len(t) - 1 and t == list(range(t[0], t[-1] + 1)) else -1 for t in tables]
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros((len(batch), max_blocks), dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        query_start = torch.zeros(len(batch) + 1, dtype=torch.int32)
        query_start[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        input_ids = torch.tensor([t for _, new in batch for t in new], dtype=torch.int64)
        flags = last_only if isinstance(last_only, list) else [last_only] * len(batch)
        if len(flags) != len(batch):
            raise ValueError(f"last_only has {len(flags)} flags for {len(batch)} sequences")
        rows = [1 if flag else n for flag, n in zip(flags, lens)]
        ends = query_start[1:].tolist()
        logits_index = torch.cat([torch.arange(e - r, e) for e, r in zip(ends, rows)])
        dev = self.device
        meta = PagedBatch(
            slot_mapping=torch.cat(slots).to(dev),
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start=query_start.to(dev),
            runs=runs,
        )
        try:
            logits = self.model(input_ids.to(dev), positions.to(dev), self.pool.kv, meta, logits_index.to(dev))
        except BaseException:
            # The forward did not complete: the sequences must not claim tokens whose K/V may be
            # half written. (Slots written past the old length are garbage nobody reads.)
            for sid, start in zip(seq_ids, starts):
                self.pool.truncate(sid, start)
            raise

        for sid, new in batch:
            toks = self._tokens[sid]
            if toks is not None:
                toks.extend(new)
                if self.prefix_cache:
                    self.pool.register_prefix(sid, toks)
        return list(logits.split(rows))

    layer_hooks = True  # both forwards (transformers' and the native decoder's) call them

    def step_layouts(self) -> tuple[str, ...]:
        return self.model.step_layouts()

    def set_step_plan(self, plan: tuple[str, ...]) -> None:
        self.model.set_step_plan(plan)

    def release_unplanned_layouts(self) -> None:
        self.model.release_unplanned_layouts()

    def add_layer_hooks(self, before=None, after=None) -> None:
        self.model.add_layer_hooks(before=before, after=after)

    def fork(self, parent, child) -> None:
        """Start `child` as a copy of `parent` sharing its KV blocks (copy-on-write), e.g. for n > 1 samples."""
        if child in self._tokens:
            raise KeyError(f"sequence {child!r} already exists")
        self.pool.fork(parent, child)
        toks = self._tokens[parent]
        self._tokens[child] = list(toks) if toks is not None else None

    def rollback(self, seq_id, num_tokens: int) -> None:
        """Cut a sequence back to its first `num_tokens` tokens (drop rejected speculative tokens); frees whole blocks past the end."""
        self.pool.truncate(seq_id, num_tokens)
        toks = self._tokens[seq_id]
        if toks is not None:
            del toks[num_tokens:]

    def free(self, seq_id, *, evict_first_from: int | None = None) -> None:
        """Release a sequence; its full blocks stay in the prefix cache until the pool needs them
        (those from block `evict_first_from` on are evicted before anything else: speculative KV)."""
        self.pool.free(seq_id, evict_first_from=evict_first_from)
        del self._tokens[seq_id]

    def holds(self, h: bytes) -> bool:
        """Whether the prefix cache holds the block at hash-chain address `h`."""
        return self.pool.holds(h)

    def cached_hashes(self, limit: int | None = None) -> list[bytes]:
        """Addresses of the cached full blocks, most recently used first (what a worker announces)."""
        return self.pool.cached_hashes(limit)

    # -- KV in and out as blocks -----------------------------------------------------------

    def export_kv(self, seq_id) -> KVBlocks:
        """A copy of a sequence's KV as `KVBlocks` (on the CPU), every block of every layer; a handoff carries
        its `for_handoff()` part."""
        return self.pool.export_blocks(seq_id)

    def export_layer(self, seq_id, layer: int) -> torch.Tensor:
        """A copy of one layer's KV as a handoff carries it (a sliding-window layer's last blocks), on the CPU."""
        return self.pool.export_layer(seq_id, layer, for_handoff=True)

    def import_kv(self, seq_id, kv: KVBlocks, token_ids: list[int] | None = None) -> None:
        """Create a sequence from a received KV (refused with LayoutMismatch if its layout differs).

        With `token_ids` (the tokens the KV holds) its full blocks join the prefix cache.
        """
        if seq_id in self._tokens:
            raise KeyError(f"sequence {seq_id!r} already exists")
        if token_ids is not None and len(token_ids) != kv.num_tokens:
            raise ValueError(f"sequence {seq_id!r}: {len(token_ids)} token ids for a KV of {kv.num_tokens} tokens")
        self._check_context(seq_id, kv.num_tokens)
        self.pool.import_blocks(seq_id, kv)
        self._tokens[seq_id] = list(token_ids) if token_ids is not None else None
        if token_ids is not None and self.prefix_cache:
            self.pool.register_prefix(seq_id, self._tokens[seq_id])

    # -- internals -------------------------------------------------------------------------

    def _check_context(self, seq_id, n: int) -> None:
        if n > self.max_context:
            raise ValueError(f"sequence {seq_id!r}: {n} tokens exceed the model's context of {self.max_context}")
