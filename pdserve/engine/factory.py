"""The engine interface the workers drive, and the one function that builds an engine for a model.

Prefill and decode call an engine only through `Engine`; which class stands behind it
(`PagedRunner`, `DenseEngine`) is `create_engine`'s choice, made from the model and the worker's
options, so a new model path plugs in here and nowhere else.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from pdserve.basetypes import KVLayout
    from pdserve.kvtransfer.layout import KVBlocks
    from pdserve.runtime import ModelRunner

ENGINE_KINDS = ("auto", "paged", "dense")
MIN_PAGED_BLOCKS = 16


class EngineUnavailable(ValueError):
    """The engine asked for cannot serve this model (or no such engine exists)."""


@runtime_checkable
class Engine(Protocol):
    """What a worker calls on an engine. Sequences are named by any hashable id (a request id);
    one engine is driven from one compute thread.

    Every call that needs KV space checks it can have all of it first and raises
    `pdserve.engine.OutOfBlocks` otherwise, having changed nothing.

    Layer callbacks (prefill's layer streaming and pre-positioning yield) exist where `layer_hooks` is true:
    `add_layer_hooks`, and `export_layer(seq_id, layer)` (a layer's KV as a handoff carries it).
    """

    layout: KVLayout
    device: torch.device
    vocab_size: int
    layer_hooks: bool  # whether `add_layer_hooks` (and `export_layer`) are offered

    def __contains__(self, seq_id: Hashable) -> bool: ...

    def utilization(self) -> float:
        """Share of the KV capacity in use, 0..1."""
        ...

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens (plus its next one) fits now."""
        ...

    def start(self, seq_id: Hashable, token_ids: list[int], *, reuse_prefix: bool = True) -> int:
        """Open a sequence for `token_ids`; → how many leading tokens the prefix cache already holds
        (always fewer than all). The rest is fed with `step`."""
        ...

    def prefill(self, seq_id: Hashable, token_ids: list[int]) -> torch.Tensor:
        """Open a sequence and compute all of `token_ids`; → the last position's logits `[vocab]` float32."""
        ...

    def step(self, batch: list[tuple[Hashable, list[int]]], *,
             last_only: bool | list[bool] = False) -> list[torch.Tensor]:
        """One forward over a batch of (sequence, new token ids); → per sequence its logits `[n, vocab]`
        float32 (n = 1 where `last_only`, else one row per new token)."""
        ...

    def num_tokens(self, seq_id: Hashable) -> int: ...

    def rollback(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of the sequence (rejected speculation)."""
        ...

    def free(self, seq_id: Hashable, *, evict_first_from: int | None = None) -> None:
        """End a sequence; its full blocks from block `evict_first_from` on are evicted first (if cached)."""
        ...

    def import_kv(self, seq_id: Hashable, kv: KVBlocks, token_ids: list[int] | None = None) -> None:
        """Open a sequence holding `kv` (checked against `layout`); `token_ids` let it join the prefix cache."""
        ...

    def export_kv(self, seq_id: Hashable) -> KVBlocks:
        """Every block of every layer; a handoff carries its `for_handoff()` part (sliding windows trimmed)."""
        ...

    def holds(self, h: bytes) -> bool:
        """Whether the prefix cache holds the full block with hash-chain address `h` (`basetypes.block_hash`)."""
        ...

    def cached_hashes(self, limit: int | None = None) -> list[bytes]:
        """Addresses of cached full blocks, most recently used first, at most `limit`."""
        ...

    def native_rows(self) -> int:
        """Most rows of a step that runs on the native CPU decoder (`engine.native`); 0 where none does."""
        ...

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Start `child` as a copy of `parent` (n > 1 choices): copy-on-write blocks where the engine has them."""
        ...

    def step_layouts(self) -> tuple[str, ...]:
        """The weight layouts a step calibration (`engine.calibrate`) may choose between; ("t",) for one."""
        ...

    def set_step_plan(self, plan: tuple[str, ...]) -> None:
        """Take a calibration's plan: a layout (of `step_layouts()`) per row count, index = rows."""
        ...

    def release_unplanned_layouts(self) -> None:
        """Drop the weight copies the plan never uses."""
        ...

    def add_layer_hooks(self, before=None, after=None) -> None:
        """Callbacks around every layer of every step (`before(i)`, `after(i)`); only where `layer_hooks`."""
        ...


def create_engine(runner: ModelRunner, *, kv_capacity_bytes: int, kind: str = "auto", prefix_cache: bool = True,
                  small_step_weights: bool = True) -> Engine:
    """The engine for `runner`'s model, on its device and dtype, with `kv_capacity_bytes` of KV.

    `kind`: "paged" or "auto" (block pool, batched ragged steps, prefix cache: every model, through its
    transformers implementation with paged attention), "dense" (one cache and one forward per sequence,
    for debugging; full-attention models only). `prefix_cache=False` publishes no blocks to the paged
    engine's prefix cache (decode never looks prompts up); `small_step_weights` keeps the paged model's
    extra CPU weight layouts for small steps (decode's steps, not prefill's). The engine's KV layout is
    the runner's, or EngineUnavailable/LayoutMismatch (or `checkpoint.UnsupportedModel`) says why not.
    """
    if kind not in ENGINE_KINDS:
        raise EngineUnavailable(f"unknown engine {kind!r}; expected one of {', '.join(ENGINE_KINDS)}")
    layout = runner.layout
    if kind != "dense":
        from pdserve.engine.runner import PagedRunner

        blocks = max(MIN_PAGED_BLOCKS, kv_capacity_bytes // (layout.block_bytes * layout.num_layers))
        engine = PagedRunner(runner.model_dir, dtype=runner.dtype, device=runner.device, block_size=layout.block_size,
                             num_blocks=blocks, prefix_cache=prefix_cache, small_step_weights=small_step_weights)
        layout.check_matches(engine.layout, what="paged engine")
        return engine
    if layout.layer_windows:
        raise EngineUnavailable(f"the dense engine (for debugging) takes full-attention models; "
                                f"{runner.model_dir.name} has sliding-window layers")
    from pdserve.engine.dense import DenseEngine

    return DenseEngine(runner, kv_capacity_bytes)
