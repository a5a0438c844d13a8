"""The KV layout descriptor and the block-structured KV payload that crosses between workers.

A KV cache here is a list of blocks of `block_size` tokens. One layer's KV is a tensor
`[num_blocks, 2, kv_heads, block_size, head_dim]` (2 = keys, values); the last block is
padded with zeros past `num_tokens`. Everything that moves, caches, compresses or pages KV
works on these blocks. The `KVLayout` names what a receiver must agree with before it
accepts a single byte: same model (fingerprint), same shape, same dtype, same block size, and
per layer the same attention (full, or a sliding window of how many tokens).

A sliding-window layer's next query sees only the last `window - 1` cached tokens, so a handoff
carries only the blocks that hold them (`KVLayout.layer_blocks`, `KVBlocks.for_handoff`); the
receiver places them at the end of the sequence's blocks and never reads the ones before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, model_validator

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
    kv_heads: int  # every layer's (one pool holds all layers)
    head_dim: int  # every layer's, keys and values alike
    dtype: str  # one of _DTYPES
    block_size: int  # tokens per block
    # per layer: its sliding window in tokens (a query at position i sees positions i - window + 1 .. i), or
    # 0 for full attention; () when every layer is full (the one way to say so: layouts compare equal)
    layer_windows: tuple[int, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _all_full_is_empty(cls, data):
        if isinstance(data, dict) and data.get("layer_windows") and not any(data["layer_windows"]):
            data = {**data, "layer_windows": ()}
        return data

    @model_validator(mode="after")
    def _one_window_per_layer(self) -> "KVLayout":
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ValueError(f"layer_windows must be >= 0 (0 = full attention), got {self.layer_windows}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.kv_heads * self.block_size * self.head_dim * self.torch_dtype.itemsize

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def attention(self, layer: int) -> str:
        """Layer `layer`'s attention in words: "full" or "sliding window of N"."""
        w = self.window(layer)
        return f"sliding window of {w}" if w else "full"

    def layer_blocks(self, layer: int, num_tokens: int) -> int:
        """How many blocks of layer `layer` a handoff of `num_tokens` carries: all of them for full attention;
        for a sliding window, the last ones, from the block holding the first position the next query sees."""
        nb = self.num_blocks(num_tokens)
        w = self.window(layer)
        if not w:
            return nb
        return nb - max(0, num_tokens - w + 1) // self.block_size

    def payload_bytes(self, num_tokens: int) -> int:
        """Bytes of a handoff of `num_tokens` (each layer's `layer_blocks`)."""
        return sum(self.layer_blocks(i, num_tokens) for i in range(self.num_layers)) * self.block_bytes

    def layer_offsets(self, num_tokens: int) -> list[int]:
        """Where each layer starts in a handoff's payload of `num_tokens`, in bytes (layers in order, then the
        total): `num_layers + 1` offsets."""
        out = [0]
        for i in range(self.num_layers):
            out.append(out[-1] + self.layer_blocks(i, num_tokens) * self.block_bytes)
        return out

    def check_matches(self, other: "KVLayout", *, what: str = "handoff") -> None:
        """Raise LayoutMismatch naming each field where `other` (incoming) differs from self (expected)."""
        diffs = [
            f"{name}: expected {getattr(self, name)!r}, got {getattr(other, name)!r}"
            for name in type(self).model_fields
            if name != "layer_windows" and getattr(self, name) != getattr(other, name)
        ]
        if self.layer_windows != other.layer_windows and self.num_layers == other.num_layers:
            layers = [i for i in range(self.num_layers) if self.window(i) != other.window(i)]
            diffs.append(f"attention of {len(layers)} layer(s): " + ", ".join(
                f"layer {i} expected {self.attention(i)}, got {other.attention(i)}" for i in layers[:4])
                + (", ..." if len(layers) > 4 else ""))
        if diffs:
            raise LayoutMismatch(f"{what} refused, KV layout differs: " + "; ".join(diffs))


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; supported: {', '.join(_DTYPES)}")


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
