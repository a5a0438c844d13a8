"""The direct KV data path: a framed TCP stream (or a shared-memory segment it announces) from prefill to decode.

NATS only brokers the rendezvous (a one-time transfer token and the receiver's address, in
the `HandoffReply`); the bytes go straight between the two workers. Frame layout, all
big-endian (frame version 3, which added ZCHUNK and GRANT; a version-2 shm sender wrote its own segment):

    magic "PDKV" | version u8 | kind u8 | layer u16 | crc32 u32 | offset u64 | length u64 | payload

kinds: HELLO (JSON `TransferHeader`), CHUNK (`length` bytes of one layer's wire bytes starting at
`offset`, crc32 of the payload), TCHUNK (a CHUNK whose crc32 follows the payload as a u32 trailer; its
header's crc field holds flags, FOLLOWS: the next frame's header comes right after the trailer, so the
receiver reads both with the payload's end; what the TCP sender sends, see below), SCALES (float32
scales `[num_blocks * block_size, 2, kv_heads]` of a compressed layer: one per (token, K/V, head), see
`to_token_groups`), ZCHUNK (a CHUNK of a compressed layer's int8/fp8 bytes, deflated: u64 uncompressed
length, then raw deflate of the bytes at `offset`; crc32 of the frame payload as sent; see `_deflate`),
GRANT (JSON from the receiver after a shm HELLO: the pooled shared-memory segment to write into, see
`kvtransfer.shm`), SHM (no payload: layer
`layer` lies in the granted segment at `offset`, `length` bytes; crc32 of those bytes, or 0 when the
header says `shm_verify=false`), END (JSON: chunk count and bytes), ACK (JSON from the receiver: ok
or an error that names what was wrong). Kind 7 is natsdata's OBJECT.

Layers may arrive in any order (layer streaming sends each as prefill computes it); within a layer
chunks arrive in offset order. An uncompressed layer goes as one TCHUNK. Both sides checksum it in
`PIECE_BYTES` pieces inside the socket thread, each piece right after the kernel copied it, so the crc
reads bytes still in cache: a crc32 over cold memory costs ~0.11 CPU s/GiB here (memory bound), over
bytes in L2 ~0.03. With a header crc the sender must read the whole chunk before sending it, and the
receiver after it arrived, both from memory. The receiver reads payloads straight into preallocated
tensors (`recv_into`). Every read and write has a bound: a peer that stalls is an error, not a hang.

A connection carries one transfer after another: after an ACK that says `keep_s`, the sender keeps it
(`KEPT`) and the receiver's thread waits on it for the next HELLO, so a transfer to a receiver already
talked to skips connect and accept (on loopback these were ~1 ms of a 16 MiB transfer's ~6). Every
transfer still presents its own one-time token; the HELLO goes out in one send with the first layers.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import queue
import secrets
import select
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterable, Literal

import torch
from pydantic import BaseModel, ConfigDict

from pdserve.kvtransfer.layout import KVBlocks, KVLayout, LayoutMismatch
from pdserve.kvtransfer.shm import (
    POOL_PREFIX, SENDER_MAPS, Lease, ShmPool, _Mapping, reap_if_orphaned, sweep_orphans,
)

log = logging.getLogger("pdserve.kvtransfer.tcp")

MAGIC = b"PDKV"
FRAME_VERSION = 3
_HDR = struct.Struct("!4sBBHIQQ")
HELLO, CHUNK, END, ACK, SCALES, SHM = 1, 2, 3, 4, 5, 6
ZCHUNK, GRANT, TCHUNK = 8, 9, 10
_ZLEN = struct.Struct("!Q")
_TRAILER = struct.Struct("!I")
FOLLOWS = 1  # TCHUNK header flag (in its crc field): the next frame's header follows the trailer at once
PIECE_BYTES = 512 << 10  # a TCHUNK's crc runs per piece of this size, on bytes still in L2 (1.25 MiB per core)
MAX_CONTROL_FRAME = 1 << 20
MAX_CHUNK = 1 << 31
DEFAULT_CHUNK_BYTES = 4 << 20  # compressed layers: deflate of chunk i runs beside chunk i+1's
# Kept connections (see KVReceiver._serve and KEPT): how long a receiver keeps an idle one, and how many
# connections it keeps open at most (each holds a worker thread)
KEEP_IDLE_S = float(os.environ.get("PDSERVE_KV_KEEP_IDLE_S", 30.0))
MAX_KEPT = int(os.environ.get("PDSERVE_KV_MAX_KEPT", 16))
SHM_DIR = os.environ.get("PDSERVE_SHM_DIR", "/dev/shm")
SHM_PREFIX = "pdkv-"

Compression = Literal["none", "int8", "fp8"]
COMPRESSIONS = ("none", "int8", "fp8")


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
    sender_generation: int
    layout: KVLayout
    num_tokens: int
    num_chunks: int
    total_bytes: int
    compression: Compression = "none"
    transport: Literal["tcp", "shm", "nats", "objstore"] = "tcp"
    shm_verify: bool = False  # crc32 over shared-memory layers (memory is not a wire; off by default)


# --- frames -----------------------------------------------------------------------------------


def _frame(kind: int, payload: bytes | memoryview, layer: int = 0, offset: int = 0, crc: int | None = None,
           flags: int = 0) -> list:
    """[header bytes, payload] of one frame; crc32 of the payload unless given. A TCHUNK is
    [header (its crc field holds `flags`), payload, crc32 trailer]."""
    if crc is None:
        crc = _crc(payload)
    if kind == TCHUNK:
        return [_HDR.pack(MAGIC, FRAME_VERSION, kind, layer, flags, offset, len(payload)), payload, _TRAILER.pack(crc)]
    return [_HDR.pack(MAGIC, FRAME_VERSION, kind, layer, crc, offset, len(payload)), payload]


def _parse_header(hdr: bytes | memoryview, max_len: int) -> tuple[int, int, int, int, int]:
    """-> (kind, layer, crc, offset, length); TransferError on a foreign or oversized frame."""
    magic, version, kind, layer, crc, offset, length = _HDR.unpack(hdr)
    if magic != MAGIC:
        raise TransferError(f"not a pdserve KV stream (magic {bytes(magic)!r})")
    if version != FRAME_VERSION:
        raise TransferError(f"KV frame version {version}, expected {FRAME_VERSION}")
    if kind != SHM and length > max_len:
        raise TransferError(f"frame of {length} bytes exceeds the limit of {max_len}")
    return kind, layer, crc, offset, length


async def _read_frame(reader: asyncio.StreamReader, timeout: float, max_len: int) -> tuple[int, int, bytes]:
    """One whole frame from an asyncio stream (control frames: ACKs). -> (kind, layer, payload)."""
    try:
        hdr = await asyncio.wait_for(reader.readexactly(_HDR.size), timeout)
        kind, layer, crc, _, length = _parse_header(hdr, max_len)
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


try:  # ISA-L's crc32 is the same function as zlib's (same values on the wire), about 3x faster
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - isal is optional
    _fast_crc32 = zlib.crc32


def _crc(mv, value: int = 0) -> int:
    return _fast_crc32(mv, value)  # both release the GIL on large buffers


try:  # ISA-L's deflate: same format as zlib's, several times faster at level 1
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - isal is optional
    _zlib = zlib


def _deflate(raw: memoryview) -> bytes | None:
    """ZCHUNK payload of quantised bytes (u64 length + raw deflate, level 1), or None if it saves nothing.

    int8 KV from a real model is far from uniform (most values sit near zero): deflate's Huffman stage
    takes ~20% off it, which is what puts int8 at >= 2x fewer bytes than bf16 once the scales are paid.
    """
    z = _zlib.compress(raw, 1, -15)
    return _ZLEN.pack(len(raw)) + z if len(z) + _ZLEN.size < len(raw) else None


# Blocking socket work runs in _POOL (one thread per live transfer side); the header checksums of compressed
# frames (and the deflate of int8 chunks) run in _CRC_POOL, which never blocks on anything, so a busy _POOL
# cannot starve them.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="pdkv-io")
_CRC_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdkv-crc")


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
    zs = _CRC_POOL.map(_deflate, raws) if compression != "none" else [None] * len(raws)
    for off, raw, z in zip(offsets, raws, zs):
        pieces.append((CHUNK, index, off, raw) if z is None else (ZCHUNK, index, off, memoryview(z)))
    if n == 0:
        pieces.append((CHUNK, index, 0, data))
    return pieces


def to_token_groups(layer: torch.Tensor) -> torch.Tensor:
    """`[nb, 2, H, bs, D]` → `[nb*bs, 2, H, 1, D]`: one quantisation group (one scale) per (token, K/V, head).

    kv_quant's group is one block tile; fed single-token "blocks", its scales follow each token's own
    range. Whole 16-token tiles let one outlier token flatten its neighbours: on SmolLM2-135M greedy
    agreement fell below 99%; per token it stays above (tests/test_kvtransfer_accuracy.py), for 4 bytes
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


class Assembly:
    """The receiving end of one transfer, transport-independent: preallocated layer tensors that frames fill.

    A transport asks `target(kind, layer, offset, length)` for the memoryview to write a payload into
    (TCP: `recv_into` it; NATS: copy the message into it), then calls `commit(...)` once the bytes are
    there and their crc32 checked; a complete layer is unpacked (if compressed) and reported through
    `on_layer(index, tensor)`. `finish()` checks nothing is missing.
    """

    def __init__(self, layout: KVLayout, header: TransferHeader,
                 on_layer: Callable[[int, torch.Tensor], None] | None = None):
        self.layout, self.header, self.on_layer = layout, header, on_layer
        L = layout.num_layers
        # per layer (a sliding-window layer carries only its window's blocks)
        self.nb = [layout.layer_blocks(i, header.num_tokens) for i in range(L)]
        self.shape = [(nb, 2, layout.kv_heads, layout.block_size, layout.head_dim) for nb in self.nb]
        self.compression = header.compression
        self.wire_bytes = [wire_layer_bytes(layout, header.num_tokens, self.compression, i) for i in range(L)]
        self.layers: list[torch.Tensor | None] = [None] * L
        self._buf: list[torch.Tensor | None] = [None] * L  # wire buffers being filled
        self._mv: list[memoryview | None] = [None] * L  # their bytes
        self._scales: list[torch.Tensor | None] = [None] * L
        self.filled = [0] * L  # bytes committed (checksum verified)
        self.next_offset = [0] * L  # bytes handed out to be written (a chunk may be in flight)
        self.complete = [False] * L
        self.bytes_on_wire = 0
        self.t0 = time.monotonic()
        self.lease: Lease | None = None  # pooled memory to land uncompressed layers in (see KVReceiver._pooled)
        self._leased: tuple[torch.Tensor, ...] | None = None  # each layer's view of the lease, and its bytes
        self._leased_mv: memoryview | None = None

    def _wire_buf(self, layer: int) -> torch.Tensor:
        if self._buf[layer] is None:
            if self.compression == "none" and self.lease is not None:
                off = self.layout.layer_offsets(self.header.num_tokens)
                if self._leased is None:  # every layer's view of the lease at once
                    whole = self.lease.view(0, off[-1])
                    self._leased = tuple(whole[a:b].view(self.layout.torch_dtype).view(shape)
                                         for a, b, shape in zip(off, off[1:], self.shape))
                    self._leased_mv = tensor_bytes(whole)
                self._buf[layer] = self._leased[layer]
                self._mv[layer] = self._leased_mv[off[layer]:off[layer + 1]]
                return self._buf[layer]
            elif self.compression == "none":
                self._buf[layer] = torch.empty(self.shape[layer], dtype=self.layout.torch_dtype)
            else:
                self._buf[layer] = torch.empty(self.wire_bytes[layer], dtype=torch.uint8)
            self._mv[layer] = tensor_bytes(self._buf[layer])
        return self._buf[layer]

    def target(self, kind: int, layer: int, offset: int, length: int) -> memoryview:
        if not 0 <= layer < self.layout.num_layers:
            raise TransferError(f"chunk for layer {layer}; the layout has {self.layout.num_layers}")
        if self.complete[layer]:
            raise TransferError(f"layer {layer} sent twice")
        if kind == SCALES:
            if self.compression == "none":
                raise TransferError(f"layer {layer}: scales frame in an uncompressed transfer")
            groups = self.nb[layer] * self.layout.block_size
            want = groups * 2 * self.layout.kv_heads * 4
            if length != want or offset != 0:
                raise TransferError(f"layer {layer}: scales of {length} bytes, expected {want}")
            self._scales[layer] = torch.empty(groups, 2, self.layout.kv_heads, dtype=torch.float32)
            return tensor_bytes(self._scales[layer])
        if kind != CHUNK:
            raise TransferError(f"expected chunk for layer {layer}, got frame kind {kind}")
        if offset != self.next_offset[layer]:
            raise TransferError(f"layer {layer}: chunk at offset {offset}, expected {self.next_offset[layer]}")
        if offset + length > self.wire_bytes[layer]:
            raise TransferError(f"layer {layer}: {offset + length} bytes, layout says {self.wire_bytes[layer]}")
        self.next_offset[layer] = offset + length
        if self._mv[layer] is None:
            self._wire_buf(layer)
        return self._mv[layer][offset:offset + length]

    def accept(self, kind: int, layer: int, offset: int, payload) -> None:
        """A whole frame payload (crc already checked) from a transport that holds it in memory (NATS)."""
        if kind == ZCHUNK:
            self.inflate(layer, offset, payload)
        else:
            self.target(kind, layer, offset, len(payload))[:] = payload
            self.commit(kind, layer, len(payload))

    def inflate(self, layer: int, offset: int, payload) -> None:
        """A ZCHUNK (crc already checked): inflate it into the layer's wire buffer at `offset`, then commit."""
        if self.compression == "none":
            raise TransferError(f"layer {layer}: deflated chunk in an uncompressed transfer")
        if len(payload) < _ZLEN.size:
            raise TransferError(f"layer {layer}: deflated chunk of {len(payload)} bytes has no length")
        (raw,) = _ZLEN.unpack_from(payload)
        dst = self.target(CHUNK, layer, offset, raw)  # checks order and bounds before inflating anything
        d = _zlib.decompressobj(-15)
        try:
            out = d.decompress(memoryview(payload)[_ZLEN.size:], raw)
        except Exception as e:
            raise TransferError(f"corrupt deflated chunk (layer {layer}): {e}") from None
        if len(out) != raw or not d.eof or d.unconsumed_tail or d.unused_data:
            raise TransferError(f"corrupt deflated chunk (layer {layer}): inflates to {len(out)}"
                                f"{'' if d.eof else '+'} bytes, header says {raw}")
        dst[:] = out
        self.commit(CHUNK, layer, raw, wire_length=len(payload))

    def commit(self, kind: int, layer: int, length: int, wire_length: int | None = None) -> None:
        self.bytes_on_wire += length if wire_length is None else wire_length
        if kind == CHUNK:
            self.filled[layer] += length
        if self.filled[layer] == self.wire_bytes[layer] and not self.complete[layer]:
            if self.compression != "none" and self._scales[layer] is None:
                return  # bytes complete, scales still to come
            self._finish_layer(layer, self._wire_buf(layer) if self.wire_bytes[layer] else
                               torch.empty(self.shape[layer], dtype=self.layout.torch_dtype))

    def adopt(self, layer: int, tensor: torch.Tensor) -> None:
        """A layer that arrived whole (shared memory): take the tensor as it is, no copy."""
        if not 0 <= layer < self.layout.num_layers or self.complete[layer]:
            raise TransferError(f"unexpected or repeated layer {layer}")
        self.bytes_on_wire += tensor.numel() * tensor.element_size()
        self.filled[layer] = self.next_offset[layer] = self.wire_bytes[layer]
        self._finish_layer(layer, tensor.view(self.layout.torch_dtype).view(self.shape[layer]))

    def _finish_layer(self, layer: int, wire: torch.Tensor) -> None:
        if self.compression == "none":
            out = wire
        else:
            from pdserve.kernels.kv_quant import unpack

            lay = self.layout
            groups = torch.empty(self.nb[layer] * lay.block_size, 2, lay.kv_heads, 1, lay.head_dim, dtype=lay.torch_dtype)
            unpack(wire, self._scales[layer], groups, torch.arange(groups.shape[0]), self.compression,
                   impl="triton" if groups.is_cuda else "reference")
            out = from_token_groups(groups, lay.block_size)
            self._scales[layer] = None
        self._buf[layer] = self._mv[layer] = None
        self.layers[layer] = out
        self.complete[layer] = True
        if self.on_layer is not None:
            self.on_layer(layer, out)

    def finish(self) -> tuple[KVBlocks, dict]:
        self._leased = self._leased_mv = None  # the layers hold the lease's memory from here
        missing = [i for i, c in enumerate(self.complete) if not c]
        if missing:
            raise TransferError(f"END before layers {missing[:8]}{'…' if len(missing) > 8 else ''} arrived")
        seconds = time.monotonic() - self.t0
        stats = {"bytes": self.header.total_bytes, "wire_bytes": self.bytes_on_wire, "seconds": seconds,
                 "compression": self.compression, "transport": self.header.transport}
        return KVBlocks(self.layout, self.header.num_tokens, list(self.layers)), stats


# --- shared memory ------------------------------------------------------------------------


def shm_path(token: str) -> str:
    """The segment of a transfer is named by its one-time token, so either side can remove it."""
    safe = "".join(c for c in token if c.isalnum() or c in "-_")
    if safe != token or not token:
        raise TransferError("malformed transfer token")
    return os.path.join(SHM_DIR, SHM_PREFIX + token)


def unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def sweep_stale_segments(max_age_s: float = 600.0) -> int:
    """Remove per-transfer segments older than `max_age_s` (both sides of a transfer died), and pool
    segments whose owner died (see `kvtransfer.shm`). Returns the count."""
    n = sweep_orphans(SHM_DIR)
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return n
    now = time.time()
    for name in names:
        if name.startswith(SHM_PREFIX) and not name.startswith(POOL_PREFIX):
            p = os.path.join(SHM_DIR, name)
            try:
                if now - os.stat(p).st_mtime > max_age_s and unlink_quietly(p):
                    n += 1
            except OSError:
                pass
    return n


_HOST_ID: str | None = None


def host_id() -> str:
    """Who shares memory with whom: boot id + the shm directory's identity (pods on one node that mount
    the same /dev/shm volume agree; a pod with a private /dev/shm does not)."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        except OSError:
            boot = socket.gethostname()
        try:
            st = os.stat(SHM_DIR)
            _HOST_ID = f"{boot}:{st.st_dev}:{st.st_ino}"
        except OSError:
            _HOST_ID = f"{boot}:noshm:{os.getpid()}"
    return _HOST_ID


# --- sender -------------------------------------------------------------------------------


class _BlockingSender:
    """The sending socket, driven from worker threads; refusals from the receiver stop it early."""

    def __init__(self, sock: socket.socket, addr: str, timeout: float):
        self.sock, self.addr, self.timeout = sock, addr, timeout
        self.refused = False
        self.sent = 0  # layers sent

    def _peer_spoke(self) -> bool:
        return _readable(self.sock)

    def send_frames(self, frames: Iterable[tuple[int, int, int, memoryview]], crcs: bool = True) -> None:
        """Send frames, each header with (the start of) its payload in one `sendmsg`. A CHUNK goes as a
        TCHUNK, checksummed piece by piece as it is sent (see the module doc); the header crc of any other
        frame is computed in a worker thread while the frame before it goes out. Payload-less headers (SHM)
        and trailers are coalesced with the next send. `frames` may be any iterable; it is read one frame
        ahead (to flag FOLLOWS, and to start the next header crc)."""
        small: list = []  # headers and trailers waiting to go out with the next payload (or at the end)
        self._unchecked = 1 << 62  # bytes sent since we last looked for a refusal: look at once
        frames = iter(frames)
        nxt = next(frames, None)
        crc_next: int | concurrent.futures.Future | None = None  # the next frame's header crc, if under way
        try:
            while nxt is not None:
                (kind, layer, offset, payload), nxt = nxt, next(frames, None)
                if self._refused_now():
                    return
                n = len(payload)
                if kind == CHUNK:  # the next frame's header goes out with this one's trailer: say so
                    small.append(_HDR.pack(MAGIC, FRAME_VERSION, TCHUNK, layer, FOLLOWS if nxt else 0, offset, n))
                    crc = self._send_trailed(small, payload)
                    if crc is None:
                        return
                    small = [_TRAILER.pack(crc)]
                    continue
                if crcs:
                    crc = crc_next if crc_next is not None else _crc_of(payload)
                    crc = crc if isinstance(crc, int) else crc.result()
                    # the next frame's crc runs while this one goes out
                    crc_next = _crc_of(nxt[3]) if nxt is not None and nxt[0] != CHUNK else None
                else:
                    crc = getattr(payload, "crc", 0)
                small.append(_HDR.pack(MAGIC, FRAME_VERSION, kind, layer, crc, offset, n))
                if kind == SHM or n == 0:
                    continue
                small.append(payload)
                _send_all(self.sock, small)
                small = []
                self._unchecked += n
            if small:
                _send_all(self.sock, small)
        except _STALLED:
            raise TransferError(f"decode data port {self.addr} stalled "
                                f"(no progress for {self.timeout:.1f} s)") from None
        except OSError:
            self.refused = True  # it hung up: its ACK (if any) says why

    def _refused_now(self) -> bool:
        """Has the receiver refused (its ACK waits to be read)? Looked at every `_REFUSAL_CHECK_BYTES`."""
        if self._unchecked >= _REFUSAL_CHECK_BYTES:
            self._unchecked = 0
            if self._peer_spoke():
                self.refused = True
        return self.refused

    def _send_trailed(self, small: list, payload) -> int | None:
        """A TCHUNK's payload after `small` (its header and whatever waited), piece by piece; the crc of
        each piece is taken right after the kernel copied it (still in cache). → crc32, or None if the
        receiver refused meanwhile."""
        mv = memoryview(payload).cast("B")
        crc = 0
        if not len(mv):
            _send_all(self.sock, small)
            return crc
        for off in range(0, len(mv), PIECE_BYTES):
            piece = mv[off:off + PIECE_BYTES]
            if off == 0:
                _send_all(self.sock, small + [piece])
            else:
                if self._refused_now():
                    return None
                self.sock.sendall(piece)
            crc = _crc(piece, crc)
            self._unchecked += len(piece)
        return crc

    def read_ack(self, want: int = ACK) -> dict:
        """The receiver's next control frame: its ACK, or (`want=GRANT`) the shm segment it lends us.
        A refusal (an ACK that is not ok) raises TransferError with the receiver's reason."""
        try:
            hdr = _recv_exact(self.sock, bytearray(_HDR.size))
            kind, layer, crc, _, length = _parse_header(hdr, MAX_CONTROL_FRAME)
            payload = _recv_exact(self.sock, bytearray(length))
        except _STALLED:
            raise TransferError(f"decode data port {self.addr} did not answer within {self.timeout:.1f} s") \
                from None
        except (TransferError, OSError) as e:
            raise _ConnectionLost(f"connection to {self.addr} lost: {e}") from None
        if _crc(payload) != crc:
            raise TransferError(f"corrupt control frame from {self.addr}: crc32 mismatch")
        msg = json.loads(bytes(payload))
        if kind == ACK and not msg.get("ok"):
            raise TransferError(f"receiver refused KV: {msg.get('error')}")
        if kind != want:
            raise TransferError(f"expected {'ACK' if want == ACK else 'GRANT'}, got frame kind {kind}")
        return msg


_REFUSAL_CHECK_BYTES = 4 << 20


_INLINE_CRC_BYTES = 256 << 10  # smaller payloads are checksummed in the sending thread (~8 us at most)


def _crc_of(data) -> int | concurrent.futures.Future:
    """A frame payload's crc32: at once for a small one (HELLO, END, scales: less than a thread hop),
    in `_CRC_POOL` for a big one."""
    return _crc(data) if len(data) < _INLINE_CRC_BYTES else _CRC_POOL.submit(_crc, data)


def _send_all(sock: socket.socket, bufs: list) -> None:
    """`sendall` of several buffers with `sendmsg` (one syscall for a header and its payload)."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


def _io_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound every send and receive on a blocking socket by `seconds` without progress (SO_SNDTIMEO /
    SO_RCVTIMEO), so a stalled peer is an error. Not `settimeout`: that makes the socket non-blocking
    under the hood, MSG_WAITALL then returns whatever has arrived, and each read becomes poll + recv
    for every ~64 KiB. Here a read of a 256 KiB piece sleeps in the kernel until the piece is there."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


# a blocking socket with SO_RCVTIMEO/SO_SNDTIMEO reports a timeout as EAGAIN (BlockingIOError)
_STALLED = (socket.timeout, BlockingIOError)


def _recv_exact(sock: socket.socket, buf, then=None) -> memoryview:
    """Fill `buf` (then `then`, if given, in the same reads) from the socket: blocking, with the socket's
    timeout per read. TransferError on EOF. → `buf`."""
    mv = memoryview(buf).cast("B")
    if then is not None:
        bufs = [mv, memoryview(then).cast("B")]
        want = left = len(bufs[0]) + len(bufs[1])
        while True:
            n = sock.recvmsg_into(bufs, 0, socket.MSG_WAITALL)[0]  # all of it, unless a signal or a timeout
            left -= n
            if not left:
                return mv
            if n == 0:
                raise TransferError(f"stream truncated: got {want - left} of {want} bytes")
            while n >= len(bufs[0]):
                n -= len(bufs.pop(0))
            bufs[0] = bufs[0][n:]
    got, want = 0, len(mv)
    while got < want:
        n = sock.recv_into(mv[got:], want - got, socket.MSG_WAITALL)
        if n == 0:
            raise TransferError(f"stream truncated: got {got} of {want} bytes")
        got += n
    return mv


async def _aiter(layers: Iterable[torch.Tensor]) -> AsyncIterator[tuple[int, torch.Tensor]]:
    for i, t in enumerate(layers):
        yield i, t


async def send_kv(addr: str, header: TransferHeader, kv: KVBlocks, *, timeout: float = 30.0,
                  connect_timeout: float = 5.0, chunk_bytes: int | None = None) -> dict:
    """Send `kv` to the receiver at "host:port". Returns the receiver's ACK (with its timings).

    `header.compression` ("none"/"int8"/"fp8") and `header.transport` ("tcp" or "shm") say how; both must
    be what the receiver agreed to. Raises TransferError if the receiver refuses it, stalls (no progress
    for `timeout` s), or the connection breaks.
    """
    return await send_kv_stream(addr, header, _aiter(kv.layers), timeout=timeout, connect_timeout=connect_timeout,
                                chunk_bytes=chunk_bytes, _all_at_once=list(enumerate(kv.layers)))


async def send_kv_stream(addr: str, header: TransferHeader, layers: AsyncIterator[tuple[int, torch.Tensor]], *,
                         timeout: float = 30.0, connect_timeout: float = 5.0,
                         chunk_bytes: int | None = None, _all_at_once: list | None = None) -> dict:
    """Layer streaming: open the transfer now and send each `(layer_index, [nb, 2, H, bs, D] tensor)` as the
    iterator yields it (e.g. from prefill's per-layer hooks), so the wire overlaps the compute.

    Every layer of the header's layout must come exactly once, in any order. Returns the ACK.
    `chunk_bytes` splits layers into frames: by default an uncompressed layer is one frame (its crc is
    taken piece by piece as it goes out) and a compressed one goes in `DEFAULT_CHUNK_BYTES` chunks.
    """
    if chunk_bytes is None:
        chunk_bytes = MAX_CHUNK if header.compression == "none" else DEFAULT_CHUNK_BYTES
    loop = asyncio.get_running_loop()
    feed: queue.SimpleQueue = queue.SimpleQueue()
    held: list[socket.socket] = []  # the thread's socket, so an abandoned transfer can be woken and closed
    if _all_at_once is not None:
        for item in _all_at_once:
            feed.put(item)
        feed.put(None)
    # One worker-thread job does the whole transfer (connect, HELLO, GRANT, layers, END, ACK); this side
    # only hands it layers. A thread hop per layer cost ~0.5 ms each on a loaded 2-core host.
    opened = loop.create_future()  # set once the receiver accepted HELLO (and granted shm)

    def on_open() -> None:
        loop.call_soon_threadsafe(lambda: opened.done() or opened.set_result(None))

    job = loop.run_in_executor(_POOL, _send_blocking, addr, header, feed, held, timeout, connect_timeout,
                               chunk_bytes, on_open)
    try:
        if _all_at_once is None:
            # the connection stands before the first layer is taken: an unreachable receiver fails now, and
            # a sender that dies mid-stream leaves a broken connection, not silence
            await asyncio.wait({opened, job}, return_when=asyncio.FIRST_COMPLETED)
            async for index, layer in layers:
                if job.done():  # refused or broken: its result says why
                    break
                feed.put((index, layer))
            feed.put(None)
        return await job
    except BaseException:
        # the layers' producer failed or we were cancelled: the receiver must see a broken stream, now
        feed.put(_ABORT)
        for sock in held:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        job.add_done_callback(lambda f: f.cancelled() or f.exception())  # its error is not news
        raise


_ABORT = object()


class _ConnectionLost(TransferError):
    """The connection broke (reset, EOF) without an answer from the receiver."""


class KeptConnections:
    """Connections to decode data ports that the receiver keeps open between transfers (its ACK says
    `keep_s`). A transfer takes one instead of connecting: no connect, no accept, and the receiver's
    thread already waits for the HELLO.

    Bounded: `per_addr` idle connections per address and `total` in all (the oldest closed first), each
    used only within half of the receiver's `keep_s`, so the receiver does not close it under us. A taken
    connection that has become readable (the receiver closed it, or shut down) is closed, not used.
    """

    def __init__(self, per_addr: int = 4, total: int = 64):
        self.per_addr, self.total = per_addr, total
        self._lock = threading.Lock()
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}  # addr -> [(sock, use-by)], newest last

    def take(self, addr: str) -> socket.socket | None:
        now = time.monotonic()
        while True:
            with self._lock:
                kept = self._idle.get(addr)
                if not kept:
                    return None
                sock, use_by = kept.pop()
                if not kept:
                    del self._idle[addr]
            if use_by > now and not _readable(sock):
                return sock
            sock.close()

    def put(self, addr: str, sock: socket.socket, keep_s: float) -> None:
        closing = []
        with self._lock:
            self._idle.setdefault(addr, []).append((sock, time.monotonic() + keep_s / 2))
            kept = self._idle[addr]
            while len(kept) > self.per_addr:
                closing.append(kept.pop(0)[0])
            while sum(len(v) for v in self._idle.values()) > self.total:
                oldest = min(self._idle, key=lambda a: self._idle[a][0][1])
                closing.append(self._idle[oldest].pop(0)[0])
                if not self._idle[oldest]:
                    del self._idle[oldest]
        for c in closing:
            c.close()

    def idle(self, addr: str | None = None) -> int:
        with self._lock:
            return sum(len(v) for a, v in self._idle.items() if addr is None or a == addr)

    def clear(self) -> None:
        with self._lock:
            socks = [c for v in self._idle.values() for c, _ in v]
            self._idle.clear()
        for c in socks:
            c.close()


def _readable(sock: socket.socket) -> bool:
    """Whether the peer has sent something (or closed, or broke the connection), without waiting. On an idle
    kept connection that means it is done for; mid-send, that the receiver refused. `poll`, not `select`:
    select cannot watch a descriptor numbered 1024 or more, which a busy worker reaches."""
    p = select.poll()
    try:
        p.register(sock, select.POLLIN)
    except (OSError, ValueError):  # closed
        return True
    return bool(p.poll(0))


KEPT = KeptConnections()


def _send_blocking(addr: str, header: TransferHeader, feed: queue.SimpleQueue, held: list, timeout: float,
                   connect_timeout: float, chunk_bytes: int, on_open: Callable[[], None]) -> dict:
    """The sending side of one transfer, in a worker thread: layers come from `feed` until None.

    A kept connection (`KEPT`) is used when there is one. If it turns out broken before the receiver said
    anything (it closed it as we took it), the transfer starts again once on a new connection: the layers
    already taken from `feed` are replayed. That is safe: a live receiver that read the HELLO answers (an
    ACK or a refusal) rather than dropping the connection, so it took none of it; one that died is not
    reached again (a clear "cannot reach" error), and one restarted since refuses the token."""
    taken: list = []  # (index, layer) items taken from feed, for a replay
    sock = KEPT.take(addr)
    while True:
        reused = sock is not None
        if sock is None:
            host, _, port = addr.rpartition(":")
            try:
                sock = socket.create_connection((host.strip("[]"), int(port)), timeout=connect_timeout)
            except OSError as e:
                raise TransferError(f"cannot reach decode data port {addr}: {e or 'timeout'}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        held.append(sock)
        _io_timeout(sock, timeout)
        try:
            return _send_on(sock, addr, header, feed, taken, timeout, chunk_bytes, on_open)
        except _ConnectionLost:
            if not reused:
                raise
            log.info("kept connection to %s was closed; sending on a new one", addr)
            sock = None


def _send_on(sock: socket.socket, addr: str, header: TransferHeader, feed: queue.SimpleQueue, taken: list,
             timeout: float, chunk_bytes: int, on_open: Callable[[], None]) -> dict:
    """One attempt of a transfer on a connected socket; the socket is kept (`KEPT`) or closed after it."""
    tx = _BlockingSender(sock, addr, timeout)
    grant: dict | None = None
    mm = None  # the granted segment's mapping (shm)
    ack: dict | None = None
    try:
        hello = [(HELLO, 0, 0, memoryview(header.model_dump_json().encode()))]
        if header.transport == "shm" or feed.empty():
            tx.send_frames(hello)
            hello = []
        # else: the HELLO goes out in one send with the first layers (the receiver reads it while they arrive)
        if header.transport == "shm" and not tx.refused:
            grant = tx.read_ack(GRANT)
            try:
                mm = SENDER_MAPS.acquire(SHM_DIR, grant["segment"], header.total_bytes, bool(grant.get("warm")))
            except (OSError, ValueError, KeyError) as e:
                raise TransferError(f"cannot map the shared-memory segment decode granted: {e!r}") from None
        on_open()
        replay = list(taken)
        done = ended = False
        while not done and not tx.refused:
            if replay:  # what an attempt on a kept connection that was closed had taken (None: the end)
                batch, replay = replay, []
            else:
                batch = [feed.get()]
                while not feed.empty():  # whatever else is ready goes in the same pipeline
                    batch.append(feed.get())
                if _ABORT in batch:
                    raise TransferError("sender abandoned the transfer")
                taken += batch
            if None in batch:
                batch, done = batch[:batch.index(None)], True
            if mm is not None:
                frames, written = [], 0
                for k, (index, layer) in enumerate(batch, 1):
                    frames += _write_shm_layer(mm, index, layer, header)
                    written += len(frames[-1][3])
                    if written >= _SHM_FLUSH_BYTES or k == len(batch):  # tell decode what is there
                        tx.send_frames(frames, crcs=False)
                        tx.sent += len(frames)
                        frames, written = [], 0
                    if tx.refused:
                        break
            elif batch or hello:
                # all frames of the batch in one call (the int8 deflate of a batch runs on both cores), the
                # last batch with END. Made before the first is sent: made as they went, between the sends,
                # they cost more (16 MiB, 150 interleaved pairs: slower in 108; p10 9.76 ms against 8.76)
                frames = [p for index, layer in batch
                          for p in layer_wire_pieces(index, layer, header.compression, chunk_bytes)]
                tx.sent += len(batch)
                end = [_end_frame(tx.sent, header)] if done else []
                ended = done
                tx.send_frames(itertools.chain(hello, frames, end))
                hello = []
        if not tx.refused and not ended:
            tx.send_frames(hello + [_end_frame(tx.sent, header)])
        ack = tx.read_ack()
        return ack
    finally:
        keep_s = ack.get("keep_s") if ack is not None else None
        if isinstance(keep_s, (int, float)) and keep_s > 0 and not tx.refused:
            KEPT.put(addr, sock, float(keep_s))
        else:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if mm is not None:
            SENDER_MAPS.release(mm, ack is not None)  # kept for the segment's next grant, dropped after a failure
        if grant is not None and ack is None:
            try:  # a receiver that died mid-transfer leaves its segment: nobody holds its lock any more
                reap_if_orphaned(SHM_DIR, grant["segment"])
            except (OSError, ValueError, KeyError):
                pass


def _end_frame(layers: int, header: TransferHeader) -> tuple[int, int, int, memoryview]:
    return END, 0, 0, memoryview(json.dumps({"chunks": layers, "bytes": header.total_bytes}).encode())


_SHM_FLUSH_BYTES = 4 << 20  # layers at hand together: their SHM frames go in one send per this many bytes


def _write_shm_layer(mm: _Mapping, index: int, layer: torch.Tensor,
                     header: TransferHeader) -> list[tuple[int, int, int, memoryview]]:
    n = layer.numel() * layer.element_size()
    offset = header.layout.layer_offsets(header.num_tokens)[index]  # layers differ in size (sliding windows)
    if offset + n > mm.size:
        raise TransferError(f"layer {index} does not fit the shared-memory segment")
    mm.write(offset, layer)
    crc = _crc(memoryview(mm.mm)[offset:offset + n]) if header.shm_verify else 0
    # an SHM frame has no payload: `length` in its header is the layer's size in the segment
    return [(SHM, index, offset, _ShmLen(n, crc))]


class _ShmLen:
    """Stands in for a payload in an SHM frame: a length (and a precomputed crc), no bytes."""

    def __init__(self, n: int, crc: int):
        self.n, self.crc = n, crc

    def __len__(self) -> int:
        return self.n


# --- receiver -----------------------------------------------------------------------------


def _tell(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """Run `fn(*args)` on the event loop, from a worker thread, without waiting (a closed loop: dropped)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


@dataclass
class Expected:
    """A transfer the receiver agreed to over NATS and now waits for on its data port."""

    request_id: str
    sender_id: str
    sender_generation: int
    layout: KVLayout
    num_tokens: int
    future: asyncio.Future
    created: float = field(default_factory=time.monotonic)
    transport: str = "tcp"
    compression: str = "none"
    layer_queue: asyncio.Queue | None = None  # set by `layers()`: complete layers as they arrive
    cleanup: list = field(default_factory=list)  # callables run when the transfer ends, however it ends


class KVReceiver:
    """The decode side's data server: accepts KV streams for transfers it agreed to, nothing else.

    Each connection is served by blocking `recv_into` in a worker thread, straight into the
    preallocated layer tensors; a socket timeout of `stall_timeout` bounds every read. A connection is
    kept for the sender's next transfer (`keep_idle_s` idle at most; at most `max_kept` connections open;
    `keep_idle_s=0` keeps none). Shared-memory
    transfers land in segments of the receiver's own pool (`kvtransfer.shm`), kept mapped between
    transfers; at most `shm_pool_bytes` of idle segments are kept (default: $PDSERVE_SHM_POOL_BYTES or 2 GiB).
    """

    def __init__(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 stall_timeout: float = 10.0, shm_pool_bytes: int | None = None, keep_idle_s: float = KEEP_IDLE_S,
                 max_kept: int = MAX_KEPT):
        self.layout = layout
        self.host, self.port = host, port
        self.advertise_host = advertise_host
        self.stall_timeout = stall_timeout
        self.keep_idle_s, self.max_kept = keep_idle_s, max_kept
        self._expected: dict[str, Expected] = {}
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conns: set[socket.socket] = set()
        self._tasks: set[asyncio.Task] = set()
        self.bytes_received = 0
        self.active = 0  # connections open (each holds one worker thread, in a transfer or kept between two)
        self.shm_pool = ShmPool(SHM_DIR, **({} if shm_pool_bytes is None else {"max_idle_bytes": shm_pool_bytes}))

    @property
    def address(self) -> str:
        return f"{self.advertise_host or self.host}:{self.port}"

    async def start(self) -> "KVReceiver":
        sweep_stale_segments()
        fam = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(128)
        s.setblocking(False)
        self._listener = s
        self.port = s.getsockname()[1]
        self._accept_task = asyncio.create_task(self._accept_loop())
        return self

    async def close(self) -> None:
        if self._accept_task:
            self._accept_task.cancel()
        if self._listener:
            self._listener.close()
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes the worker thread blocked on it
            except OSError:
                pass
        for t in list(self._tasks):
            try:
                await asyncio.wait_for(asyncio.shield(t), 2.0)
            except BaseException:
                pass
        for token in list(self._expected):
            self.cancel(token, "receiver shutting down")
        self.shm_pool.close()

    def expect(self, request_id: str, sender_id: str, sender_generation: int, layout: KVLayout, num_tokens: int,
               *, transport: str = "tcp", compression: str = "none") -> str:
        """Register a transfer accepted over NATS; returns its one-time token. Await `wait(token, timeout)`."""
        self.layout.check_matches(layout)
        if compression not in COMPRESSIONS:
            raise TransferError(f"unknown KV compression {compression!r}; known: {', '.join(COMPRESSIONS)}")
        token = secrets.token_urlsafe(16)
        fut = asyncio.get_running_loop().create_future()
        exp = Expected(request_id, sender_id, sender_generation, layout, num_tokens, fut,
                       transport=transport, compression=compression)
        self._expected[token] = exp
        return token

    async def wait(self, token: str, timeout: float) -> tuple[KVBlocks, dict]:
        """The received KV and stats ({bytes, wire_bytes, seconds}); TransferError on failure or after `timeout` s."""
        exp = self._expected.get(token)
        if exp is None:
            raise TransferError("unknown transfer token")
        try:
            return await asyncio.wait_for(asyncio.shield(exp.future), timeout)
        except asyncio.TimeoutError:
            self.fail(token, f"KV for request {exp.request_id} did not arrive within {timeout:.1f} s")
            raise TransferError(f"KV for request {exp.request_id} did not arrive within {timeout:.1f} s") from None
        finally:
            self._expected.pop(token, None)
            self._run_cleanup(exp)

    async def layers(self, token: str, timeout: float) -> AsyncIterator[tuple[int, torch.Tensor]]:
        """Layer streaming, receiving side: yields `(layer_index, tensor)` as each layer completes.

        `timeout` bounds the wait for each next layer (s). Ends after the last layer; the whole
        transfer's result (and its stats) stays available to `wait(token, ...)`.
        """
        exp = self._expected.get(token)
        if exp is None:
            raise TransferError("unknown transfer token")
        if exp.layer_queue is None:
            exp.layer_queue = asyncio.Queue()
        for _ in range(exp.layout.num_layers):
            getter = asyncio.ensure_future(exp.layer_queue.get())
            done, _ = await asyncio.wait({getter, exp.future}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
                continue
            getter.cancel()
            if exp.future.done() and exp.future.exception() is not None:
                raise exp.future.exception()
            if exp.future.done():  # finished: drain what is queued
                while not exp.layer_queue.empty():
                    yield exp.layer_queue.get_nowait()
                return
            self.fail(token, f"no layer of request {exp.request_id} within {timeout:.1f} s")
            raise TransferError(f"no layer of request {exp.request_id} within {timeout:.1f} s")

    def cancel(self, token: str, reason: str) -> None:
        exp = self._expected.pop(token, None)
        if exp and not exp.future.done():
            exp.future.set_exception(TransferError(reason))
            exp.future.exception()  # retrieved: nobody may be waiting any more
        if exp:
            self._run_cleanup(exp)

    def fail(self, token: str, reason: str) -> None:
        """Fail a transfer (the future raises TransferError(reason)); keeps it registered for `wait`."""
        exp = self._expected.get(token)
        if exp and not exp.future.done():
            exp.future.set_exception(TransferError(reason))
            exp.future.exception()
        if exp:
            self._run_cleanup(exp)

    @staticmethod
    def _run_cleanup(exp: Expected | None) -> None:
        if exp is None:
            return
        while exp.cleanup:
            try:
                exp.cleanup.pop()()
            except Exception:
                log.exception("transfer cleanup failed")

    # -- shared by every transport ------------------------------------------------------------

    def begin(self, header: TransferHeader, transport: str) -> tuple[Expected, Assembly]:
        """Validate a HELLO against the agreed transfer; → (its Expected, an Assembly to fill).
        On the event loop; a header that does not match fails the transfer."""
        try:
            return self._begin(header, transport, asyncio.get_running_loop())
        except (TransferError, LayoutMismatch) as e:
            if header.transfer_token in self._expected:
                self.fail(header.transfer_token, str(e))
            raise

    def _begin(self, header: TransferHeader, transport: str,
               loop: asyncio.AbstractEventLoop) -> tuple[Expected, Assembly]:
        """`begin` without failing the transfer: safe in a worker thread (it only reads loop state)."""
        exp = self._expected.get(header.transfer_token)
        if exp is None:
            raise TransferError("unknown or expired transfer token")
        if exp.future.done():
            raise TransferError("transfer token already used")
        self._check_header(exp, header, transport)

        def on_layer(i: int, t: torch.Tensor) -> None:
            if exp.layer_queue is not None:
                loop.call_soon_threadsafe(exp.layer_queue.put_nowait, (i, t))

        asm = Assembly(self.layout, header, on_layer)
        return exp, asm

    def complete(self, exp: Expected, asm: Assembly) -> dict:
        """On the event loop: the transfer arrived whole; its waiter gets the KV. → its stats."""
        kv, stats = asm.finish()
        self._completed(exp, kv, stats, asm.bytes_on_wire)
        return stats

    def _completed(self, exp: Expected, kv: KVBlocks, stats: dict, wire_bytes: int) -> None:
        self.bytes_received += wire_bytes
        if not exp.future.done():
            exp.future.set_result((kv, stats))
        self._run_cleanup(exp)

    def _check_header(self, exp: Expected, h: TransferHeader, transport: str) -> None:
        if h.request_id != exp.request_id:
            raise TransferError(f"transfer token belongs to request {exp.request_id}, stream says {h.request_id}")
        if h.sender_id != exp.sender_id or h.sender_generation != exp.sender_generation:
            raise TransferError(
                f"stale or foreign sender: expected {exp.sender_id} gen {exp.sender_generation}, "
                f"got {h.sender_id} gen {h.sender_generation}"
            )
        self.layout.check_matches(h.layout)
        if h.num_tokens != exp.num_tokens:
            raise TransferError(f"token count: offer said {exp.num_tokens}, stream says {h.num_tokens}")
        if h.num_chunks != self.layout.num_layers:
            raise TransferError(f"chunk count {h.num_chunks} != layers {self.layout.num_layers}")
        if h.total_bytes != self.layout.payload_bytes(h.num_tokens):
            raise TransferError(f"size {h.total_bytes} B != layout's {self.layout.payload_bytes(h.num_tokens)} B")
        if h.compression != exp.compression:
            raise TransferError(f"compression {h.compression!r}, agreed {exp.compression!r}")
        if h.transport != exp.transport or transport not in (h.transport, "tcp" if h.transport == "shm" else None):
            raise TransferError(f"transport {h.transport!r} over {transport}, agreed {exp.transport!r}")
        if h.transport == "shm" and h.compression != "none":
            raise TransferError("shared memory carries uncompressed KV only")

    # -- TCP / shm -----------------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except asyncio.CancelledError:
                return
            except OSError:
                if self._listener.fileno() < 0:
                    return
                continue
            t = asyncio.create_task(self._handle(conn))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _handle(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self.active += 1
        self._conns.add(sock)
        _io_timeout(sock, self.stall_timeout)
        try:
            await loop.run_in_executor(_POOL, self._serve, sock, loop)
        finally:
            self.active -= 1
            self._conns.discard(sock)
            sock.close()

    def _serve(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """A connection's transfers, one after another, each from HELLO to ACK in this one worker thread.

        The event loop is told each outcome and never waited for: each hop between the loop and a worker cost
        0.1-0.5 ms on a busy 2-core host, and a 16 MiB transfer takes ~6 ms on the wire. After a transfer that
        succeeded the connection is kept (the ACK says for how long, `keep_s`) while at most `max_kept`
        connections are open: the sender's next transfer to this receiver skips connect and accept, and finds
        this thread already waiting for its HELLO. An idle kept connection is closed after `keep_idle_s`."""
        hdr = None  # the first HELLO's header: _serve_one reads it
        while self._serve_one(sock, loop, hdr):
            hdr = self._next_hello(sock)
            if hdr is None:
                return  # idle past keep_idle_s, or the sender (or close()) ended it

    def _next_hello(self, sock: socket.socket) -> bytearray | None:
        """The next transfer's frame header on a kept connection, or None when it ends idle."""
        hdr = bytearray(_HDR.size)
        try:
            _io_timeout(sock, self.keep_idle_s)
            try:
                _recv_exact(sock, hdr)
            finally:
                _io_timeout(sock, self.stall_timeout)
        except (TransferError, OSError):  # EOF, idle timeout, shutdown
            return None
        return hdr

    def _serve_one(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, hdr: bytearray | None) -> bool:
        """One transfer on this connection (`hdr`: its HELLO's frame header, if already read). → keep the
        connection for another (the transfer succeeded and the kept connections are within bounds)."""
        token = None
        leases: list[Lease] = []  # the shm segment granted to this transfer, if any
        try:
            hello = self._read_control(sock, HELLO, hdr)
            try:
                header = TransferHeader.model_validate_json(hello)
            except Exception as e:
                raise TransferError(f"malformed transfer header: {e}") from None
            token = header.transfer_token
            exp, asm = self._begin(header, "tcp", loop)
            self._receive_body(sock, asm, leases)
            kv, stats = asm.finish()
        except Exception as e:  # a refusal (TransferError, LayoutMismatch) or our own bug: say so, never hang
            reason = str(e) if isinstance(e, (TransferError, LayoutMismatch)) else f"receiver error: {e!r}"
            for lease in leases:
                lease.discard()  # the sender may still write into it: never reused
            if token is not None:
                _tell(loop, self.fail, token, reason)
            log.warning("kv transfer refused: %s", reason)
            self._refuse(sock, reason)
            return False
        for lease in leases:
            lease.succeeded()  # back to the pool once decode has let go of the layers
        keep = self.keep_idle_s > 0 and self.active <= self.max_kept and self._listener is not None \
            and self._listener.fileno() >= 0
        ack = {"ok": True, **stats}
        if keep:
            ack["keep_s"] = self.keep_idle_s
        # the ACK first: one send, where waking the loop first would have it take the GIL from us
        keep = self._send_ack(sock, ack) and keep
        _tell(loop, self._completed, exp, kv, stats, asm.bytes_on_wire)
        return keep

    def _read_header(self, sock: socket.socket, max_len: int, hdr=None) -> tuple[int, int, int, int, int]:
        """The next frame's header, parsed; `hdr` when its bytes were already read (with what came before)."""
        if hdr is not None:
            return _parse_header(hdr, max_len)
        try:
            return _parse_header(_recv_exact(sock, bytearray(_HDR.size)), max_len)
        except _STALLED:
            raise TransferError(f"peer stalled: nothing for {self.stall_timeout:.1f} s") from None
        except OSError as e:
            raise TransferError(f"connection lost: {e}") from None

    def _read_into(self, sock: socket.socket, mv, then=None) -> memoryview:
        try:
            return _recv_exact(sock, mv, then)
        except _STALLED:
            raise TransferError(f"peer stalled: nothing for {self.stall_timeout:.1f} s") from None
        except OSError as e:
            raise TransferError(f"connection lost: {e}") from None

    def _read_control(self, sock: socket.socket, want: int, hdr: bytearray | None = None) -> bytes:
        kind, layer, crc, _, length = self._read_header(sock, MAX_CONTROL_FRAME, hdr)
        payload = bytes(self._read_into(sock, bytearray(length)))
        if zlib.crc32(payload) != crc:
            raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
        if kind != want:
            raise TransferError(f"expected {'HELLO' if want == HELLO else 'END'}, got frame kind {kind}")
        return payload

    def _grant(self, sock: socket.socket, header: TransferHeader) -> Lease:
        """Lease a pool segment for a shm transfer and name it to the sender (GRANT frame)."""
        try:
            lease = self.shm_pool.lease(header.total_bytes)
        except (OSError, RuntimeError) as e:
            raise TransferError(f"no shared memory for {header.total_bytes} B of KV: {e}") from None
        try:
            hdr, payload = _frame(GRANT, json.dumps({"segment": lease.name, "bytes": lease.nbytes,
                                                      "warm": lease.warm}).encode())
            sock.sendall(hdr + payload)
        except OSError as e:
            lease.discard()
            raise TransferError(f"connection lost: {e}") from None
        return lease

    def _pooled(self, nbytes: int) -> Lease | None:
        """Warm memory from the segment pool for a TCP transfer to land in, or None (private memory).

        A layer of 32 MiB or more is past glibc's mmap threshold: every transfer maps it fresh and pays a
        page fault and a zeroed page per 4 KiB on its first write (at 1 GiB of KV: direct TCP 1.42 CPU
        s/GiB against raw TCP's 0.71 into memory that already exists). Pooled segments are written once
        and reused, returned when decode frees the KV, as for shm. A new segment is only made while the
        tmpfs has room for it: a full tmpfs would fail the receive, not the allocation."""
        try:
            if not self.shm_pool.has_idle(nbytes):
                st = os.statvfs(SHM_DIR)
                if st.f_bavail * st.f_frsize < 2 * nbytes + (256 << 20):
                    return None
            return self.shm_pool.lease(nbytes)
        except (OSError, RuntimeError):
            return None

    def _receive_body(self, sock: socket.socket, asm: Assembly, leases: list) -> None:
        """Frames until END, each payload received in place; a TCHUNK's crc is taken piece by piece as the
        pieces land (still in cache). A shm transfer first gets its segment (GRANT), appended to `leases`
        for the caller to settle."""
        lease = None
        if asm.header.transport == "shm":
            lease = self._grant(sock, asm.header)
            leases.append(lease)
        elif asm.compression == "none" and asm.header.total_bytes:
            asm.lease = self._pooled(asm.header.total_bytes)
            if asm.lease is not None:
                leases.append(asm.lease)
        tail = bytearray(_TRAILER.size + _HDR.size)  # a TCHUNK's trailer, and the next header if it FOLLOWS
        trailer_only = memoryview(tail)[:_TRAILER.size]
        pending = None  # the next frame's header, read with the trailer before it
        while True:
            kind, layer, crc, offset, length = self._read_header(sock, MAX_CHUNK, pending)
            pending = None
            if kind == END:
                payload = bytes(self._read_into(sock, bytearray(length)))
                if zlib.crc32(payload) != crc:
                    raise TransferError("corrupt END frame")
                return
            if kind == TCHUNK:
                dst = asm.target(CHUNK, layer, offset, length)
                got = 0
                last = (length - 1) // PIECE_BYTES * PIECE_BYTES if length else 0
                for off in range(0, last, PIECE_BYTES):
                    got = _crc(self._read_into(sock, dst[off:off + PIECE_BYTES]), got)
                # the last piece, the trailer and (when it follows at once) the next header: one read
                follows = crc & FOLLOWS
                got = _crc(self._read_into(sock, dst[last:length], tail if follows else trailer_only), got)
                (crc,) = _TRAILER.unpack_from(tail)
                if follows:
                    pending = bytes(tail[_TRAILER.size:])
                if got != crc:
                    raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
                asm.commit(CHUNK, layer, length)
                continue
            if kind == SHM:
                if lease is None:
                    raise TransferError("shared-memory frame in a TCP transfer")
                if offset + length > lease.nbytes:
                    raise TransferError(f"layer {layer} lies outside the shared-memory segment")
                view = lease.view(offset, length)
                if asm.header.shm_verify and _crc(memoryview(view.numpy())) != crc:
                    raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
                asm.adopt(layer, view)
                continue
            if kind == ZCHUNK:
                payload = self._read_into(sock, bytearray(length))
                if _crc(payload) != crc:
                    raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
                asm.inflate(layer, offset, payload)
                continue
            mv = self._read_into(sock, asm.target(kind, layer, offset, length))  # CHUNK or SCALES
            if _crc(mv) != crc:
                raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
            asm.commit(kind, layer, length)

    def _send_ack(self, sock: socket.socket, ack: dict) -> bool:
        try:
            hdr, payload = _frame(ACK, json.dumps(ack).encode())
            sock.sendall(hdr + payload)
            return True
        except OSError:
            return False

    def _refuse(self, sock: socket.socket, reason: str) -> None:
        """Say why, then discard what the sender still has in flight (bounded), so it reads the reason
        instead of a connection reset."""
        self._send_ack(sock, {"ok": False, "error": reason})
        deadline = time.monotonic() + 1.0
        try:
            sock.settimeout(0.2)
            buf = bytearray(1 << 20)
            while time.monotonic() < deadline:
                try:
                    if not sock.recv_into(buf):
                        break
                except socket.timeout:
                    continue
        except OSError:
            pass
