"""The receiving end of KV transfers, whatever transport brings them: agreed transfers, and layers being assembled.

Decode agrees to a transfer over NATS (`Receiver.expect` → a one-time token), then some transport
(`kvtransfer.tcp_server` for TCP and shared memory, `kvtransfer.natsdata` for NATS messages and the
object store) presents a HELLO for it (`begin`: checked against what was agreed), fills an `Assembly`
with frames, and hands it back whole (`complete`); the waiter (`wait`, or `layers` while they arrive)
gets the KV.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from pdserve.basetypes import COMPRESSIONS, KVLayout, LayoutMismatch
from pdserve.kvtransfer.frames import (
    CHUNK, SCALES, ZCHUNK, TransferError, TransferHeader, from_token_groups, inflate, inflated_length,
    tensor_bytes, wire_layer_bytes,
)
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.kvtransfer.shm import Lease

log = logging.getLogger("pdserve.kvtransfer.receiver")


class TokenRefused(TransferError):
    """A HELLO whose token names no transfer this receiver waits for (unknown, over, or already presented):
    the connection is refused, and no agreed transfer is touched by it."""


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
        self.lease: Lease | None = None  # pooled memory for uncompressed layers (tcp_server.KVReceiver._pooled)
        self._leased: tuple[torch.Tensor, ...] | None = None  # each layer's view of the lease, and its bytes
        self._leased_mv: memoryview | None = None

    def _wire_buf(self, layer: int) -> torch.Tensor:
        if self._buf[layer] is None:
            if self.compression == "none" and self.lease is not None:
                off = self.layout.layer_offsets(self.header.num_tokens)  # layers differ in size (sliding windows)
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
        raw = inflated_length(payload, layer)
        dst = self.target(CHUNK, layer, offset, raw)  # checks order and bounds before inflating anything
        dst[:] = inflate(payload, raw, layer)
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


@dataclass
class Expected:
    """A transfer the receiver agreed to over NATS and now waits for on some transport."""

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
    claimed: bool = False  # a sender presented the token in a HELLO: it admits no second one


class Receiver:
    """The decode side's register of KV transfers it agreed to over NATS, for every transport.

    `expect` registers one and returns its one-time token; a transport validates the sender's HELLO
    against it (`begin`), fills the `Assembly` it gets, and hands that back whole (`complete`) or fails
    the transfer (`fail`); the waiter gets the KV from `wait` (or layer by layer from `layers`).
    `stall_timeout` (s) is how long a transport lets a started transfer go silent.
    """

    def __init__(self, layout: KVLayout, stall_timeout: float = 10.0):
        self.layout = layout
        self.stall_timeout = stall_timeout
        self._expected: dict[str, Expected] = {}
        self._claims = threading.Lock()  # transports check HELLOs on worker threads: one claim per token
        self.bytes_received = 0

    def expected(self, token: str) -> Expected:
        """The agreed transfer of `token`; KeyError if there is none (never agreed, or over)."""
        return self._expected[token]

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

    def cancel_all(self, reason: str) -> None:
        for token in list(self._expected):
            self.cancel(token, reason)

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
            return self.begin_from_thread(header, transport, asyncio.get_running_loop())
        except (TransferError, LayoutMismatch) as e:
            if not isinstance(e, TokenRefused) and header.transfer_token in self._expected:
                self.fail(header.transfer_token, str(e))
            raise

    def begin_from_thread(self, header: TransferHeader, transport: str,
                          loop: asyncio.AbstractEventLoop) -> tuple[Expected, Assembly]:
        """`begin` without failing the transfer: safe in a worker thread (it only reads loop state); the
        thread tells the loop the outcome (`fail`, `deliver`). A token is admitted once: TokenRefused for
        one that is unknown or was already presented (the transfer it names is left alone)."""
        with self._claims:
            exp = self._expected.get(header.transfer_token)
            if exp is None:
                raise TokenRefused("unknown or expired transfer token")
            if exp.claimed or exp.future.done():
                raise TokenRefused("transfer token already used")
            exp.claimed = True  # one-time: a replay, or a second connection racing this one, is refused
        self._check_header(exp, header, transport)

        def on_layer(i: int, t: torch.Tensor) -> None:
            if exp.layer_queue is not None:
                loop.call_soon_threadsafe(exp.layer_queue.put_nowait, (i, t))

        asm = Assembly(self.layout, header, on_layer)
        return exp, asm

    def complete(self, exp: Expected, asm: Assembly) -> dict:
        """On the event loop: the transfer arrived whole; its waiter gets the KV. → its stats."""
        kv, stats = asm.finish()
        self.deliver(exp, kv, stats, asm.bytes_on_wire)
        return stats

    def deliver(self, exp: Expected, kv: KVBlocks, stats: dict, wire_bytes: int) -> None:
        """On the event loop: the waiter of `exp` gets `kv` and `stats`; `wire_bytes` count as received."""
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

