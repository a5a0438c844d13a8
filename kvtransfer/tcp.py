"""The direct KV data path: a framed TCP stream from the prefill worker to the decode worker.

NATS only brokers the rendezvous (a one-time transfer token and the receiver's address, in
the `HandoffReply`); the bytes go straight between the two workers. Frame layout, all
big-endian:

    magic "PDKV" | version u8 | kind u8 | layer u16 | crc32 u32 | length u64 | payload

kinds: HELLO (JSON `TransferHeader`), CHUNK (one layer's blocks, raw bytes, crc32 of the
payload), END (JSON: chunk count and bytes), ACK (JSON from the receiver: ok or an error that
names what was wrong). Every read has a bound: a peer that stalls is an error, not a hang.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import struct
import time
import zlib
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict

from pdserve.kvtransfer.layout import KVBlocks, KVLayout, LayoutMismatch

log = logging.getLogger("pdserve.kvtransfer.tcp")

MAGIC = b"PDKV"
FRAME_VERSION = 1
_HDR = struct.Struct("!4sBBHIQ")
HELLO, CHUNK, END, ACK = 1, 2, 3, 4
MAX_CONTROL_FRAME = 1 << 20
MAX_CHUNK = 1 << 31


class TransferError(RuntimeError):
    """A KV transfer that failed: corrupt, truncated, mismatched, refused, stalled or a dead peer."""


class TransferHeader(BaseModel):
    """The HELLO frame: who sends what. Must match the offer the receiver accepted over NATS."""

    model_config = ConfigDict(extra="forbid")
    transfer_token: str
    request_id: str
    sender_id: str
    sender_generation: int
    layout: KVLayout
    num_tokens: int
    num_chunks: int
    total_bytes: int


def _frame(kind: int, payload: bytes | memoryview, layer: int = 0) -> list:
    return [_HDR.pack(MAGIC, FRAME_VERSION, kind, layer, zlib.crc32(payload), len(payload)), payload]


async def _read_frame(reader: asyncio.StreamReader, timeout: float, max_len: int) -> tuple[int, int, bytes]:
    try:
        hdr = await asyncio.wait_for(reader.readexactly(_HDR.size), timeout)
        magic, version, kind, layer, crc, length = _HDR.unpack(hdr)
        if magic != MAGIC:
            raise TransferError(f"not a pdserve KV stream (magic {magic!r})")
        if version != FRAME_VERSION:
            raise TransferError(f"KV frame version {version}, expected {FRAME_VERSION}")
        if length > max_len:
            raise TransferError(f"frame of {length} bytes exceeds the limit of {max_len}")
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
    """A tensor's bytes without a copy when it is contiguous (any dtype, bf16 included)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


async def send_kv(
    addr: str, header: TransferHeader, kv: KVBlocks, *, timeout: float = 30.0, connect_timeout: float = 5.0
) -> dict:
    """Send `kv` to the receiver at "host:port". Returns the receiver's ACK (with its timings).

    Raises TransferError if the receiver refuses it, stalls, or the connection breaks.
    """
    host, _, port = addr.rpartition(":")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), connect_timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise TransferError(f"cannot reach decode data port {addr}: {e or 'timeout'}") from None
    # The receiver may refuse early (bad token, layout, corrupt chunk): watch for its ACK while
    # sending, so a refusal stops the transfer and its reason reaches the caller.
    ack_task = asyncio.create_task(_read_frame(reader, timeout, MAX_CONTROL_FRAME))
    try:
        try:
            writer.writelines(_frame(HELLO, header.model_dump_json().encode()))
            for i, layer in enumerate(kv.layers):
                if ack_task.done():
                    break
                writer.writelines(_frame(CHUNK, tensor_bytes(layer), layer=i))
                await asyncio.wait_for(writer.drain(), timeout)
            else:
                writer.writelines(_frame(END, json.dumps({"chunks": len(kv.layers), "bytes": kv.nbytes}).encode()))
                await asyncio.wait_for(writer.drain(), timeout)
        except asyncio.TimeoutError:
            raise TransferError(f"decode data port {addr} stalled (no progress for {timeout:.1f} s)") from None
        except (ConnectionError, OSError) as e:
            try:  # the receiver may have said why before it hung up
                await asyncio.wait_for(asyncio.shield(ack_task), 1.0)
            except Exception:
                raise TransferError(f"connection to {addr} lost: {e}") from None
        kind, _, payload = await ack_task
        if kind != ACK:
            raise TransferError(f"expected ACK, got frame kind {kind}")
        ack = json.loads(payload)
        if not ack.get("ok"):
            raise TransferError(f"receiver refused KV: {ack.get('error')}")
        return ack
    finally:
        ack_task.cancel()
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except Exception:
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


class KVReceiver:
    """The decode side's data server: accepts KV streams for transfers it agreed to, nothing else."""

    def __init__(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 stall_timeout: float = 10.0):
        self.layout = layout
        self.host, self.port = host, port
        self.advertise_host = advertise_host
        self.stall_timeout = stall_timeout
        self._expected: dict[str, Expected] = {}
        self._server: asyncio.AbstractServer | None = None
        self.bytes_received = 0
        self.active = 0

    @property
    def address(self) -> str:
        return f"{self.advertise_host or self.host}:{self.port}"

    async def start(self) -> "KVReceiver":
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server:
            self._server.close()
            await self._server.wait_closed()
        for token in list(self._expected):
            self.cancel(token, "receiver shutting down")

    def expect(self, request_id: str, sender_id: str, sender_generation: int, layout: KVLayout, num_tokens: int) -> str:
        """Register a transfer accepted over NATS; returns its one-time token. Await `wait(token, timeout)`."""
        self.layout.check_matches(layout)
        token = secrets.token_urlsafe(16)
        fut = asyncio.get_running_loop().create_future()
        self._expected[token] = Expected(request_id, sender_id, sender_generation, layout, num_tokens, fut)
        return token

    async def wait(self, token: str, timeout: float) -> tuple[KVBlocks, dict]:
        """The received KV and stats ({bytes, seconds}); TransferError on failure or after `timeout` s."""
        exp = self._expected.get(token)
        if exp is None:
            raise TransferError(f"unknown transfer token")
        try:
            return await asyncio.wait_for(asyncio.shield(exp.future), timeout)
        except asyncio.TimeoutError:
            raise TransferError(f"KV for request {exp.request_id} did not arrive within {timeout:.1f} s") from None
        finally:
            self._expected.pop(token, None)

    def cancel(self, token: str, reason: str) -> None:
        exp = self._expected.pop(token, None)
        if exp and not exp.future.done():
            exp.future.set_exception(TransferError(reason))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.active += 1
        exp: Expected | None = None
        try:
            try:
                kind, _, payload = await _read_frame(reader, self.stall_timeout, MAX_CONTROL_FRAME)
                if kind != HELLO:
                    raise TransferError(f"expected HELLO, got frame kind {kind}")
                try:
                    header = TransferHeader.model_validate_json(payload)
                except Exception as e:
                    raise TransferError(f"malformed transfer header: {e}") from None
                exp = self._expected.get(header.transfer_token)
                if exp is None:
                    raise TransferError("unknown or expired transfer token")
                self._check_header(exp, header)
                kv, stats = await self._receive_body(reader, header)
            except (TransferError, LayoutMismatch) as e:
                if exp and not exp.future.done():
                    exp.future.set_exception(TransferError(str(e)))
                log.warning("kv transfer refused: %s", e)
                await self._refuse(reader, writer, str(e))
                return
            writer.write(b"".join(_frame(ACK, json.dumps({"ok": True, **stats}).encode())))
            if not exp.future.done():
                exp.future.set_result((kv, stats))
            try:
                await asyncio.wait_for(writer.drain(), self.stall_timeout)
            except Exception:
                pass
        finally:
            self.active -= 1
            writer.close()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reason: str) -> None:
        """Say why, then discard what the sender still has in flight (bounded), so it reads the reason
        instead of a connection reset."""
        try:
            writer.write(b"".join(_frame(ACK, json.dumps({"ok": False, "error": reason}).encode())))
            await asyncio.wait_for(writer.drain(), 1.0)
            deadline = asyncio.get_running_loop().time() + 1.0
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                if not await asyncio.wait_for(reader.read(1 << 20), left):
                    break
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass

    def _check_header(self, exp: Expected, h: TransferHeader) -> None:
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

    async def _receive_body(self, reader: asyncio.StreamReader, h: TransferHeader) -> tuple[KVBlocks, dict]:
        t0 = time.monotonic()
        lay = self.layout
        nb = lay.num_blocks(h.num_tokens)
        layer_bytes = nb * lay.block_bytes
        layers: list[torch.Tensor] = []
        for i in range(h.num_chunks):
            kind, layer, payload = await _read_frame(reader, self.stall_timeout, MAX_CHUNK)
            if kind != CHUNK or layer != i:
                raise TransferError(f"expected chunk for layer {i}, got kind {kind} layer {layer}")
            if len(payload) != layer_bytes:
                raise TransferError(f"layer {i}: {len(payload)} bytes, layout says {layer_bytes}")
            t = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(lay.torch_dtype)
            layers.append(t.view(nb, 2, lay.kv_heads, lay.block_size, lay.head_dim))
            self.bytes_received += len(payload)
        kind, _, payload = await _read_frame(reader, self.stall_timeout, MAX_CONTROL_FRAME)
        if kind != END:
            raise TransferError(f"expected END, got frame kind {kind}")
        seconds = time.monotonic() - t0
        return KVBlocks(lay, h.num_tokens, layers), {"bytes": h.total_bytes, "seconds": seconds}
