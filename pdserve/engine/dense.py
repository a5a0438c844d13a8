"""The dense engine: one transformers `DynamicCache` and one forward per sequence per step.

For debugging only (`--engine dense`): every model runs on the paged engine. The workers drive it
through the same `Engine` interface as `PagedRunner`.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from pdserve.engine.blocks import OutOfBlocks
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.runtime import ModelRunner, crop_cache


class DenseEngine:
    """The engine interface (`pdserve.engine.Engine`) over a `ModelRunner`: one dense
    `DynamicCache` per sequence, one forward per sequence per step.

    Full-attention models only: a sliding-window layer's handoff holds only its window, which a dense
    cache cannot take. The decode loop drives either engine through the same calls.
    """

    layer_hooks = False  # transformers' dense forward, one sequence at a time: no layer callbacks

    def __init__(self, runner: ModelRunner, capacity_bytes: int):
        self.runner = runner
        self.layout = runner.layout
        self.device = runner.device
        self.vocab_size = runner.vocab_size
        self.capacity_bytes = capacity_bytes
        self._caches: dict[object, DynamicCache] = {}
        self._reserved: dict[object, int] = {}

    def _token_bytes(self) -> int:
        return self.layout.block_bytes * self.layout.num_layers // self.layout.block_size

    def utilization(self) -> float:
        return min(1.0, sum(self._reserved.values()) / self.capacity_bytes)

    def can_admit(self, num_tokens: int) -> bool:
        return sum(self._reserved.values()) + num_tokens * self._token_bytes() <= self.capacity_bytes

    def import_kv(self, seq_id, kv: KVBlocks, token_ids: list[int] | None = None) -> None:
        self._caches[seq_id] = self.runner.blocks_to_cache(kv)
        self._reserved[seq_id] = kv.num_tokens * self._token_bytes()

    def start(self, seq_id, token_ids: list[int], *, reuse_prefix: bool = True) -> int:
        """Open an empty sequence (a dense engine has no prefix cache: 0 tokens are ever cached)."""
        if seq_id in self._caches:
            raise KeyError(f"sequence {seq_id!r} already exists")
        if not self.can_admit(len(token_ids)):
            raise OutOfBlocks(f"sequence {seq_id!r}", len(token_ids), 0)
        self._caches[seq_id] = self.runner.new_cache()
        self._reserved[seq_id] = 0
        return 0

    def export_kv(self, seq_id) -> KVBlocks:
        return self.runner.cache_to_blocks(self._caches[seq_id])

    def holds(self, h: bytes) -> bool:
        return False

    def cached_hashes(self, limit: int | None = None) -> list[bytes]:
        return []

    def prefill(self, seq_id, token_ids: list[int]) -> torch.Tensor:
        logits, self._caches[seq_id] = self.runner.prefill(token_ids)
        self._reserved[seq_id] = len(token_ids) * self._token_bytes()
        return logits

    def step(self, batch: list[tuple[object, list[int]]], *, last_only: bool | list[bool] = False) -> list[torch.Tensor]:
        flags = last_only if isinstance(last_only, list) else [last_only] * len(batch)
        out = []
        for (seq_id, ids), last in zip(batch, flags):
            out.append(self.runner.forward(ids, self._caches[seq_id], last_only=last))
            self._reserved[seq_id] = self._caches[seq_id].get_seq_length() * self._token_bytes()
        return out

    def num_tokens(self, seq_id) -> int:
        return self._caches[seq_id].get_seq_length()

    def rollback(self, seq_id, num_tokens: int) -> None:
        crop_cache(self._caches[seq_id], num_tokens)

    def free(self, seq_id, *, evict_first_from: int | None = None) -> None:
        self._caches.pop(seq_id, None)
        self._reserved.pop(seq_id, None)

    def native_rows(self) -> int:
        return 0  # every step is transformers' forward

    def fork(self, parent, child) -> None:
        """A copy of `parent`'s cache: a dense engine shares no blocks."""
        if child in self._caches:
            raise KeyError(f"sequence {child!r} already exists")
        self.import_kv(child, self.export_kv(parent))

    def step_layouts(self) -> tuple[str, ...]:
        return ("t",)

    def set_step_plan(self, plan: tuple[str, ...]) -> None:
        if set(plan) - {"t"}:
            raise ValueError(f"unknown weight layout(s) {sorted(set(plan) - {'t'})}; the dense engine offers ('t',)")

    def release_unplanned_layouts(self) -> None:
        pass

    def add_layer_hooks(self, before=None, after=None) -> None:
        raise NotImplementedError("the dense engine has no layer callbacks (layer_hooks is False)")

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._caches
