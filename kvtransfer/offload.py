"""The offload tier: KV blocks kept in the JetStream object store, addressed by a hash chain of their token prefix.

Any worker can fetch what any other stored: a prefill worker that finds the longest stored prefix
of a prompt prefills only the rest (prefix reuse); a decode worker that lost a transfer can fetch
instead of recomputing. Objects live in a memory-storage bucket with a TTL, so nothing outlives
its usefulness even when the worker that stored it is gone.

Addressing (as vLLM's prefix cache and LMCache do, and as the workers' own prefix caches do —
`basetypes.prefix_hashes`): block i of a prompt (tokens `[i*bs, (i+1)*bs)`) is named by
`h_i = sha256(h_{i-1} || tokens of block i)`, so equal prefixes
share names and one block can serve every prompt that starts the same way. Only full blocks are
stored. One object per block holds that block for every layer, as `kvtransfer.frames` frames: a
HELLO-kind JSON frame (layout, block index, hash) then one CHUNK per layer, each with its crc32.
The layout is checked on fetch (a block stored by another model or shape is refused with the
fields that differ) and every chunk's checksum is checked (a corrupt object is an error, never KV).
"""
from __future__ import annotations

import asyncio
import json
import logging

import torch

from pdserve.basetypes import KVLayout, prefix_hashes
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.kvtransfer.frames import CHUNK, HELLO, MAX_CHUNK, TransferError, crc32, frame, split_frames, tensor_bytes
from pdserve.kvtransfer.natsdata import ensure_bucket
from pdserve.kvtransfer.protocol import Buckets

log = logging.getLogger("pdserve.kvtransfer.offload")

DEFAULT_PREFIX_TTL_S = 3600.0


class PrefixCorrupt(TransferError):
    """A stored prefix block whose bytes do not match their checksum (or are not a block at all)."""


def block_hashes(token_ids: list[int], block_size: int) -> list[str]:
    """Object names of the full blocks of `token_ids`: element i names the prefix of (i+1) blocks, by the
    hash chain the prefix caches and the router use (`basetypes.prefix_hashes`)."""
    return [h.hex()[:40] for h in prefix_hashes(token_ids, block_size)]


class KVPrefixStore:
    """put/get KV prefixes in the object store bucket `bucket` (memory storage, objects expire after `ttl_s`)."""

    def __init__(self, nc, layout: KVLayout, *, bucket: str = Buckets.prefix("default"),
                 ttl_s: float = DEFAULT_PREFIX_TTL_S, timeout: float = 5.0):
        self.nc, self.layout, self.bucket, self.ttl_s, self.timeout = nc, layout, bucket, ttl_s, timeout
        self._store = None

    async def _bucket(self):
        if self._store is None:
            self._store = await ensure_bucket(self.nc.jetstream(), self.bucket, self.ttl_s)
        return self._store

    @staticmethod
    def _name(h: str) -> str:
        return f"prefix-{h}"

    async def put_prefix(self, token_ids: list[int], kv: KVBlocks) -> int:
        """Store the full blocks of `kv` (the KV of `token_ids`, per layer `[nb, 2, H, bs, D]`). → blocks stored.

        Blocks already in the store are not written again.
        """
        self.layout.check_matches(kv.layout, what="prefix store")
        bs = self.layout.block_size
        n = min(len(token_ids), kv.num_tokens) // bs
        store = await self._bucket()
        stored = 0
        for i, h in enumerate(block_hashes(token_ids[:n * bs], bs)):
            name = self._name(h)
            try:
                await asyncio.wait_for(store.get_info(name), self.timeout)
                continue  # another request already stored this prefix block
            except TransferError:
                raise
            except Exception:
                pass
            meta = json.dumps({"layout": self.layout.model_dump(), "block": i, "hash": h}).encode()
            parts = frame(HELLO, meta)
            for li, layer in enumerate(kv.layers):
                parts += frame(CHUNK, tensor_bytes(layer[i]), li)
            await asyncio.wait_for(store.put(name, b"".join(bytes(p) for p in parts)), self.timeout)
            stored += 1
        return stored

    async def get_longest_prefix(self, token_ids: list[int]) -> tuple[KVBlocks, int] | None:
        """The longest stored prefix of `token_ids` → (KVBlocks of it, its token count), or None.

        Raises LayoutMismatch if a stored block was written for another layout, PrefixCorrupt if a
        block's bytes fail their checksum.
        """
        bs = self.layout.block_size
        store = await self._bucket()
        blocks: list[list[torch.Tensor]] = []  # [block][layer] -> [2, H, bs, D]
        for i, h in enumerate(block_hashes(token_ids, bs)):
            try:
                res = await asyncio.wait_for(store.get(self._name(h)), self.timeout)
            except asyncio.TimeoutError:
                # an object whose chunks expired before its metadata never completes: a miss, not a hang
                log.warning("prefix block %d (%s) unreadable within %.1f s; treating as absent", i, h, self.timeout)
                break
            except Exception:
                break  # not stored (or expired): the prefix ends here
            blocks.append(self._decode(res.data, i, h))
        if not blocks:
            return None
        layers = [torch.stack([b[li] for b in blocks]) for li in range(self.layout.num_layers)]
        return KVBlocks(self.layout, len(blocks) * bs, layers), len(blocks) * bs

    def _decode(self, data: bytes, index: int, h: str) -> list[torch.Tensor]:
        lay = self.layout
        shape = (2, lay.kv_heads, lay.block_size, lay.head_dim)
        out: list[torch.Tensor] = []
        try:
            frames = list(split_frames(data, MAX_CHUNK))
        except TransferError as e:
            raise PrefixCorrupt(f"prefix block {index} ({h}) is damaged: {e}") from None
        if not frames or frames[0][0] != HELLO:
            raise PrefixCorrupt(f"prefix block {index} ({h}) is not a KV block")
        for kind, layer, crc, _, payload in frames:
            if crc32(payload) != crc:
                raise PrefixCorrupt(f"prefix block {index} ({h}), layer {layer}: checksum mismatch")
            if kind == HELLO:
                meta = json.loads(bytes(payload))
                lay.check_matches(KVLayout(**meta["layout"]), what=f"stored prefix block {index}")
                if meta.get("hash") != h:
                    raise PrefixCorrupt(f"prefix block {index}: object holds block {meta.get('hash')}, expected {h}")
                continue
            if kind != CHUNK or layer != len(out) or len(payload) != lay.block_bytes:
                raise PrefixCorrupt(f"prefix block {index} ({h}): unexpected frame for layer {layer}")
            out.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(lay.torch_dtype).view(shape))
        if len(out) != lay.num_layers:
            raise PrefixCorrupt(f"prefix block {index} ({h}) has {len(out)} layers, expected {lay.num_layers}")
        return out

    async def delete_prefix(self, token_ids: list[int]) -> int:
        """Remove the stored blocks of `token_ids`' prefix. → blocks removed."""
        store = await self._bucket()
        n = 0
        for h in block_hashes(token_ids, self.layout.block_size):
            try:
                await store.delete(self._name(h))
                n += 1
            except Exception:
                pass
        return n
