"""The paged engine: a block pool for KV, a paged-attention model runner, batched (continuous) steps."""
