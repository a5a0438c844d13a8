"""The KV layout descriptor and the block-structured KV payload that crosses between workers.

A KV cache here is a list of blocks of `block_size` tokens. One layer's KV is a tensor
`[num_blocks, 2, kv_heads, block_size, head_dim]` (2 = keys, values); the last block is
padded with zeros past `num_tokens`. Everything that moves, caches, compresses or pages KV
works on these blocks. The `KVLayout` names what a receiver must agree with before it
accepts a single byte: same model (fingerprint), same shape, same dtype, same block size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class LayoutMismatch(ValueError):
    """A handoff whose KV layout differs from what the receiver serves. Names every field that differs."""


class KVLayout(BaseModel):
    """What a KV payload is: identical on both sides of a handoff, or the handoff is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_fingerprint: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # one of _DTYPES
    block_size: int  # tokens per block

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.kv_heads * self.block_size * self.head_dim * self.torch_dtype.itemsize

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def payload_bytes(self, num_tokens: int) -> int:
        return self.num_layers * self.num_blocks(num_tokens) * self.block_bytes

    def check_matches(self, other: "KVLayout", *, what: str = "handoff") -> None:
        """Raise LayoutMismatch naming each field where `other` (incoming) differs from self (expected)."""
        diffs = [
            f"{name}: expected {getattr(self, name)!r}, got {getattr(other, name)!r}"
            for name in type(self).model_fields
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise LayoutMismatch(f"{what} refused, KV layout differs: " + "; ".join(diffs))


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; supported: {', '.join(_DTYPES)}")


@dataclass
class KVBlocks:
    """Block-structured KV of one sequence: per layer `[num_blocks, 2, kv_heads, block_size, head_dim]`."""

    layout: KVLayout
    num_tokens: int
    layers: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

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
