"""The KV frame format: how a transfer's bytes are framed on any transport, and the wire form of one layer.

Every KV transport (direct TCP, shared memory, NATS messages, the object store, the offload tier)
speaks these frames. Frame layout, all big-endian, frame version 3:

    magic "PDKV" | version u8 | kind u8 | layer u16 | crc32 u32 | offset u64 | length u64 | payload

kinds: HELLO (JSON `TransferHeader`), CHUNK (`length` bytes of one layer's wire bytes starting at
`offset`, crc32 of the payload), TCHUNK (a CHUNK whose crc32 follows the payload as a u32 trailer; its
header's crc field holds flags, FOLLOWS: the next frame's header comes right after the trailer, so the
receiver reads both with the payload's end; what the TCP sender sends, see `kvtransfer.tcp_send`),
SCALES (float32 scales `[num_blocks * block_size, 2, kv_heads]` of a compressed layer: one per (token,
K/V, head), see `to_token_groups`), OBJECT (JSON {"bucket", "name"} of an object in the JetStream
object store holding a transfer's frames, see `kvtransfer.natsdata`), ZCHUNK (a CHUNK of a compressed
layer's int8/fp8 bytes, deflated: u64 uncompressed length, then raw deflate of the bytes at `offset`;
crc32 of the frame payload as sent; see `deflate`), GRANT (JSON from the receiver after a shm HELLO:
the pooled shared-memory segment to write into, see `kvtransfer.shm`), SHM (no payload: layer `layer`
lies in the granted segment at `offset`, `length` bytes; crc32 of those bytes, or 0 when the header
says `shm_verify=false`), END (JSON: chunk count and bytes), ACK (JSON from the receiver: ok or an
error that names what was wrong).

Layers may arrive in any order (layer streaming sends each as prefill computes it); within a layer
chunks arrive in offset order.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import struct
import zlib
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt

from pdserve.basetypes import Compression, KVLayout

try:  # ISA-L's crc32 is the same function as zlib's (same values on the wire), and faster
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - isal is optional
    _fast_crc32 = zlib.crc32

try:  # ISA-L's deflate: same format as zlib's, and faster at level 1
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - isal is optional
    _zlib = zlib

MAGIC = b"PDKV"
FRAME_VERSION = 3
HEADER = struct.Struct("!4sBBHIQQ")
HELLO, CHUNK, END, ACK, SCALES, SHM = 1, 2, 3, 4, 5, 6
OBJECT, ZCHUNK, GRANT, TCHUNK = 7, 8, 9, 10
ZLEN = struct.Struct("!Q")
TRAILER = struct.Struct("!I")
FOLLOWS = 1  # TCHUNK header flag (in its crc field): the next frame's header follows the trailer at once
PIECE_BYTES = 512 << 10  # a TCHUNK's crc runs per piece of this size: small enough to stay in a core's L2 cache
MAX_CONTROL_FRAME = 1 << 20
MAX_CHUNK = 1 << 31
DEFAULT_CHUNK_BYTES = 4 << 20  # compressed layers: deflate of chunk i runs beside chunk i+1's


# Checksums of big frames and the deflate of int8 chunks run here, beside the thread that sends; it never
# blocks on anything, so busy I/O threads cannot starve it.
CRC_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdkv-crc")


class TransferError(RuntimeError):
    """A KV transfer that failed: corrupt, truncated, mismatched, refused, stalled or a dead peer."""


class TransferHeader(BaseModel):
    """The HELLO frame: who sends what. Must match the offer the receiver accepted over NATS.

    `num_chunks` is the layer count and `total_bytes` the uncompressed KV bytes (the layout's
    `payload_bytes`), whatever the wire carries; `compression` and `transport` must equal what the
    receiver agreed to in its `HandoffReply`.
    """

    model_config = ConfigDict(extra="forbid")
    transfer_token: str
    request_id: str
    sender_id: str
    sender_generation: NonNegativeInt
    layout: KVLayout
    num_tokens: PositiveInt  # a transfer of no tokens has nothing to carry (and no buffer to carry it in)
    num_chunks: NonNegativeInt
    total_bytes: NonNegativeInt
    compression: Compression = "none"
    transport: Literal["tcp", "shm", "nats", "objstore"] = "tcp"
    shm_verify: bool = False  # crc32 over shared-memory layers (memory is not a wire; off by default)


# --- frames -----------------------------------------------------------------------------------


def frame(kind: int, payload: bytes | memoryview, layer: int = 0, offset: int = 0, crc: int | None = None,
          flags: int = 0) -> list:
    """[header bytes, payload] of one frame; crc32 of the payload unless given. A TCHUNK is
    [header (its crc field holds `flags`), payload, crc32 trailer]."""
    if crc is None:
        crc = crc32(payload)
    if kind == TCHUNK:
        return [HEADER.pack(MAGIC, FRAME_VERSION, kind, layer, flags, offset, len(payload)), payload, TRAILER.pack(crc)]
    return [HEADER.pack(MAGIC, FRAME_VERSION, kind, layer, crc, offset, len(payload)), payload]


def parse_header(hdr: bytes | memoryview, max_len: int) -> tuple[int, int, int, int, int]:
    """-> (kind, layer, crc, offset, length); TransferError on a foreign or oversized frame."""
    magic, version, kind, layer, crc, offset, length = HEADER.unpack(hdr)
    if magic != MAGIC:
        raise TransferError(f"not a pdserve KV stream (magic {bytes(magic)!r})")
    if version != FRAME_VERSION:
        raise TransferError(f"KV frame version {version}, expected {FRAME_VERSION}")
    if kind != SHM and length > max_len:
        raise TransferError(f"frame of {length} bytes exceeds the limit of {max_len}")
    return kind, layer, crc, offset, length


async def read_frame(reader: asyncio.StreamReader, timeout: float, max_len: int) -> tuple[int, int, bytes]:
    """One whole frame from an asyncio stream (control frames: ACKs). -> (kind, layer, payload)."""
    try:
        hdr = await asyncio.wait_for(reader.readexactly(HEADER.size), timeout)
        kind, layer, crc, _, length = parse_header(hdr, max_len)
        payload = await asyncio.wait_for(reader.readexactly(length), timeout)
    except asyncio.IncompleteReadError as e:
        raise TransferError(f"stream truncated: got {len(e.partial)} of {e.expected} bytes") from None
    except asyncio.TimeoutError:
        raise TransferError(f"peer stalled: nothing for {timeout:.1f} s") from None
    except (ConnectionError, OSError) as e:
        raise TransferError(f"connection lost: {e}") from None
    if zlib.crc32(payload) != crc:
        raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
    return kind, layer, payload


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes without a copy when it is contiguous (any dtype, bf16 included)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def crc32(mv, value: int = 0) -> int:
    """crc32 of a buffer (continuing from `value`); releases the GIL on large buffers."""
    return _fast_crc32(mv, value)


def deflate(raw: memoryview) -> bytes | None:
    """ZCHUNK payload of quantised bytes (u64 length + raw deflate, level 1), or None if it saves nothing.

    int8 KV from a real model is far from uniform (most values sit near zero), so deflate's Huffman
    stage shrinks it further; what it cannot shrink goes as a plain CHUNK.
    """
    z = _zlib.compress(raw, 1, -15)
    return ZLEN.pack(len(raw)) + z if len(z) + ZLEN.size < len(raw) else None


def inflated_length(payload, layer: int) -> int:
    """The uncompressed length a ZCHUNK payload announces."""
    if len(payload) < ZLEN.size:
        raise TransferError(f"layer {layer}: deflated chunk of {len(payload)} bytes has no length")
    (raw,) = ZLEN.unpack_from(payload)
    return raw


def inflate(payload, raw: int, layer: int) -> bytes:
    """The `raw` bytes a ZCHUNK payload (crc already checked) deflated; TransferError unless it holds exactly them."""
    d = _zlib.decompressobj(-15)
    try:
        out = d.decompress(memoryview(payload)[ZLEN.size:], raw)
    except Exception as e:
        raise TransferError(f"corrupt deflated chunk (layer {layer}): {e}") from None
    if len(out) != raw or not d.eof or d.unconsumed_tail or d.unused_data:
        raise TransferError(f"corrupt deflated chunk (layer {layer}): inflates to {len(out)}"
                            f"{'' if d.eof else '+'} bytes, header says {raw}")
    return out


def split_frames(data: bytes | memoryview, max_len: int):
    """Frames in a byte string (a NATS message, a stored object): yields (kind, layer, crc, offset, payload view)."""
    mv = memoryview(data)
    pos = 0
    while pos < len(mv):
        if len(mv) - pos < HEADER.size:
            raise TransferError("stream truncated: partial frame header")
        kind, layer, crc, offset, length = parse_header(mv[pos:pos + HEADER.size], max_len)
        pos += HEADER.size
        if len(mv) - pos < length:
            raise TransferError(f"stream truncated: got {len(mv) - pos} of {length} bytes")
        yield kind, layer, crc, offset, mv[pos:pos + length]
        pos += length


# --- the wire form of one layer (shared by every transport) ---------------------------------


def layer_wire_pieces(index: int, layer: torch.Tensor, compression: str = "none",
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[int, int, int, memoryview]]:
    """One layer `[nb, 2, kv_heads, block_size, head_dim]` → [(kind, layer, offset, bytes)] frames to send.

    `compression` "int8"/"fp8" quantises with `kernels.kv_quant.pack` (one scale per (token, K/V, head),
    sent first as a SCALES frame), then deflates each chunk of the quantised bytes (ZCHUNK; a chunk that
    does not shrink goes as a plain CHUNK). "none" sends the tensor's own bytes without a copy. The
    tensor must be on the CPU here; a device path would hand device buffers to its own transport instead.
    """
    if compression == "none":
        data = tensor_bytes(layer)
        pieces = []
    else:
        from pdserve.kernels.kv_quant import pack

        per_token = to_token_groups(layer)
        payload, scales = pack(per_token, torch.arange(per_token.shape[0]), compression,
                               impl="triton" if layer.is_cuda else "reference")
        data = tensor_bytes(payload)
        pieces = [(SCALES, index, 0, tensor_bytes(scales))]
    n = len(data)
    offsets = range(0, n, chunk_bytes)
    raws = [data[off:off + chunk_bytes] for off in offsets]
    # the deflate of chunk i runs beside chunk i+1's (isal releases the GIL): both cores
    zs = CRC_POOL.map(deflate, raws) if compression != "none" else [None] * len(raws)
    for off, raw, z in zip(offsets, raws, zs):
        pieces.append((CHUNK, index, off, raw) if z is None else (ZCHUNK, index, off, memoryview(z)))
    if n == 0:
        pieces.append((CHUNK, index, 0, data))
    return pieces


def to_token_groups(layer: torch.Tensor) -> torch.Tensor:
    """`[nb, 2, H, bs, D]` → `[nb*bs, 2, H, 1, D]`: one quantisation group (one scale) per (token, K/V, head).

    kv_quant's group is one block tile; fed single-token "blocks", its scales follow each token's own
    range. In a whole 16-token tile one outlier token flattens its neighbours' precision; per token,
    greedy agreement stays within the bound tests/test_kvtransfer_accuracy.py holds it to, for 4 bytes
    of scale per head_dim values.
    """
    nb, two, heads, bs, dim = layer.shape
    return layer.permute(0, 3, 1, 2, 4).reshape(nb * bs, two, heads, 1, dim).contiguous()


def from_token_groups(groups: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of `to_token_groups`: `[nb*bs, 2, H, 1, D]` → `[nb, 2, H, bs, D]`."""
    n, two, heads, _, dim = groups.shape
    return groups.view(n // block_size, block_size, two, heads, dim).permute(0, 2, 3, 1, 4).contiguous()


def wire_layer_bytes(layout: KVLayout, num_tokens: int, compression: str, layer: int) -> int:
    """Bytes of layer `layer` on the wire (payload only; int8/fp8 add scales in a SCALES frame): its blocks a
    handoff carries (`KVLayout.layer_blocks`)."""
    nb = layout.layer_blocks(layer, num_tokens)
    if compression == "none":
        return nb * layout.block_bytes
    return nb * 2 * layout.kv_heads * layout.block_size * layout.head_dim

