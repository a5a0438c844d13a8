"""The block-structured KV payload that crosses between workers.

A KV cache here is a list of blocks of `block_size` tokens. One layer's KV is a tensor
`[num_blocks, 2, kv_heads, block_size, head_dim]` (2 = keys, values); the last block is
padded with zeros past `num_tokens`. Everything that moves, caches, compresses or pages KV
works on these blocks. Their description, `KVLayout`, is a plain type in `pdserve.basetypes`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.basetypes import KVLayout


@dataclass
class KVBlocks:
    """Block-structured KV of one sequence: per layer `[nb, 2, kv_heads, block_size, head_dim]`.

    A layer holds all `layout.num_blocks(num_tokens)` blocks, or (a sliding-window layer in a handoff)
    only the last `nb` of them, at least `layout.layer_blocks(layer, num_tokens)`.
    """

    layout: KVLayout
    num_tokens: int
    layers: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def first_block(self, layer: int) -> int:
        """The index, among the sequence's blocks, of the first block layer `layer` holds."""
        return self.layout.num_blocks(self.num_tokens) - self.layers[layer].shape[0]

    def for_handoff(self) -> "KVBlocks":
        """The blocks a handoff carries (`KVLayout.layer_blocks` of each layer): views, no copy."""
        n = self.num_tokens
        return KVBlocks(self.layout, n, [t[t.shape[0] - self.layout.layer_blocks(i, n):]
                                         for i, t in enumerate(self.layers)])

    @staticmethod
    def layer_from_dense(keys: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
        """One layer's dense KV `[kv_heads, seq, head_dim]` ×2 → blocks `[nb, 2, kv_heads, block_size, head_dim]`."""
        heads, seq, dim = keys.shape
        nb = -(-seq // block_size)
        out = keys.new_zeros((nb, 2, heads, block_size, dim))
        if nb == 0:
            return out
        kv = torch.stack((keys, values))  # [2, H, S, D]
        padded = kv.new_zeros((2, heads, nb * block_size, dim))
        padded[:, :, :seq] = kv
        # [2, H, nb, bs, D] -> [nb, 2, H, bs, D]
        out.copy_(padded.view(2, heads, nb, block_size, dim).permute(2, 0, 1, 3, 4))
        return out

    @staticmethod
    def layer_to_dense(blocks: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `[nb, 2, kv_heads, block_size, head_dim]` → (keys, values) each `[kv_heads, num_tokens, head_dim]`."""
        nb, two, heads, bs, dim = blocks.shape
        dense = blocks.permute(1, 2, 0, 3, 4).reshape(2, heads, nb * bs, dim)[:, :, :num_tokens]
        return dense[0], dense[1]
