"""The engines: KV in a block pool or in dense caches, batched steps, one interface for the workers.

* `factory` — `Engine` (the interface prefill and decode call) and `create_engine` (which engine
  serves a model); start here.
* `blocks`  — `BlockPool`: KV blocks of all layers, block tables, refcounts, copy-on-write forks,
  prefix cache by hash chain (LRU), `OutOfBlocks`; `KVBlocks` in and out.
* `hfmodel` — `HFPagedModel`: the checkpoint's own transformers model with pdserve's paged attention
  plugged into transformers' attention interface (per-layer sliding windows, sinks, soft caps);
  `cpustep` makes its steps cheap on the CPU (weight layouts, fused projections and norms). What a
  checkpoint is before it loads, and what cannot serve, is `pdserve.checkpoint` (torch-free).
* `runner`  — `PagedRunner`: prefill (chunked, prefix reuse), `step` over a batch, rollback,
  export/import of KV, the same `KVLayout` as `pdserve.runtime.ModelRunner`.
* `dense`   — `DenseEngine`: one transformers cache per sequence, for debugging (`--engine dense`).
"""
from pdserve.engine.blocks import BlockPool, OutOfBlocks
from pdserve.engine.factory import Engine, EngineUnavailable, create_engine

__all__ = ["BlockPool", "Engine", "EngineUnavailable", "OutOfBlocks", "create_engine"]
