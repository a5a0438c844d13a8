"""Test helper: KV payloads of random values with a real layout (no model needed)."""
from __future__ import annotations

import torch

from pdserve.basetypes import KVLayout
from pdserve.kvtransfer.layout import KVBlocks


def random_kv(layout: KVLayout, num_tokens: int, seed: int) -> KVBlocks:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(layout.num_layers):
        k = torch.randn(layout.kv_heads, num_tokens, layout.head_dim, generator=g).to(layout.torch_dtype)
        v = torch.randn(layout.kv_heads, num_tokens, layout.head_dim, generator=g).to(layout.torch_dtype)
        layers.append(KVBlocks.layer_from_dense(k, v, layout.block_size))
    return KVBlocks(layout, num_tokens, layers)
