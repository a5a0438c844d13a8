"""The paged engine: a block pool for KV, a paged-attention model runner, batched (continuous) steps.

* `blocks`  — `BlockPool`: KV blocks of all layers, block tables, refcounts, copy-on-write forks,
  prefix cache by hash chain (LRU), `OutOfBlocks`; `KVBlocks` in and out.
* `model`   — our Llama forward over a ragged batch (`Transformer`, `ModelArgs`, `PagedBatch`),
  attention through `pdserve.kernels.paged_attention`.
* `runner`  — `PagedRunner`: prefill (chunked, prefix reuse), `step` over a batch, rollback,
  export/import of KV, the same `KVLayout` as `pdserve.runtime.ModelRunner`.
"""
from pdserve.engine.blocks import BlockPool, OutOfBlocks

__all__ = ["BlockPool", "OutOfBlocks"]
