"""The decode side's data server for the direct KV data path: TCP streams, and the shared-memory segments it grants.

Each connection is served by blocking `recv_into` in a worker thread, straight into the preallocated
layer tensors of an `Assembly`; a TCHUNK's crc is taken piece by piece as the pieces land (see
`kvtransfer.tcp_send`). The event loop is told each outcome and never waited for. After a transfer that
succeeded the connection is kept for the sender's next one.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import zlib
from typing import Callable

from pdserve.basetypes import KVLayout, LayoutMismatch
from pdserve.config import KVReceiveConfig
from pdserve.kvtransfer.frames import (
    ACK, CHUNK, END, FOLLOWS, GRANT, HEADER, HELLO, MAX_CHUNK, MAX_CONTROL_FRAME, PIECE_BYTES, SHM, TCHUNK, TRAILER,
    ZCHUNK, TransferError, TransferHeader, crc32, frame, parse_header,
)
from pdserve.kvtransfer.receiver import Assembly, Receiver, TokenRefused
from pdserve.kvtransfer.shm import SHM_DIR, Lease, ShmPool, sweep_stale_segments
from pdserve.kvtransfer.sockio import IO_POOL, STALLED, io_timeout, recv_exact

log = logging.getLogger("pdserve.kvtransfer.tcp")

# Kept connections (see KVReceiver._serve and tcp_send.KEPT): how long a receiver keeps an idle one, and how
# many connections it keeps open at most (each holds a worker thread)
# (decode passes its --kv-keep-idle-s and --kv-max-kept)
KEEP_IDLE_S, MAX_KEPT = KVReceiveConfig().keep_idle_s, KVReceiveConfig().max_kept


def _tell(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """Run `fn(*args)` on the event loop, from a worker thread, without waiting (a closed loop: dropped)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


class KVReceiver(Receiver):
    """The decode side's data server: accepts KV streams for transfers it agreed to, nothing else.

    Each connection is served by blocking `recv_into` in a worker thread, straight into the
    preallocated layer tensors; a socket timeout of `stall_timeout` bounds every read. A connection is
    kept for the sender's next transfer (`keep_idle_s` idle at most; at most `max_kept` connections open;
    `keep_idle_s=0` keeps none). Shared-memory transfers land in segments of the receiver's own pool
    (`kvtransfer.shm`), kept mapped between transfers; at most `shm_pool_bytes` of idle segments are kept
    (default: $PDSERVE_SHM_POOL_BYTES or 2 GiB). The agreed transfers themselves are `Receiver`'s.
    """

    def __init__(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 advertise_port: int | None = None, stall_timeout: float = 10.0, shm_pool_bytes: int | None = None, keep_idle_s: float = KEEP_IDLE_S,
                 max_kept: int = MAX_KEPT):
        super().__init__(layout, stall_timeout)
        self.host, self.port = host, port
        self.advertise_host, self.advertise_port = advertise_host, advertise_port
        self.keep_idle_s, self.max_kept = keep_idle_s, max_kept
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._conns: set[socket.socket] = set()
        self._tasks: set[asyncio.Task] = set()
        self.active = 0  # connections open (each holds one worker thread, in a transfer or kept between two)
        self.shm_pool = ShmPool(SHM_DIR, **({} if shm_pool_bytes is None else {"max_idle_bytes": shm_pool_bytes}))

    @property
    def address(self) -> str:
        return f"{self.advertise_host or self.host}:{self.advertise_port or self.port}"

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
        self.cancel_all("receiver shutting down")
        self.shm_pool.close()

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
        io_timeout(sock, self.stall_timeout)
        try:
            await loop.run_in_executor(IO_POOL, self._serve, sock, loop)
        finally:
            self.active -= 1
            self._conns.discard(sock)
            sock.close()

    def _serve(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """A connection's transfers, one after another, each from HELLO to ACK in this one worker thread.

        The event loop is told each outcome and never waited for: on a busy host a hop between the loop and a
        worker thread costs a sizeable share of a transfer's own time on the wire. After a transfer that
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
        hdr = bytearray(HEADER.size)
        try:
            io_timeout(sock, self.keep_idle_s)
            try:
                recv_exact(sock, hdr)
            finally:
                io_timeout(sock, self.stall_timeout)
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
            exp, asm = self.begin_from_thread(header, "tcp", loop)
            self._receive_body(sock, asm, leases)
            kv, stats = asm.finish()
        except Exception as e:  # a refusal (TransferError, LayoutMismatch) or our own bug: say so, never hang
            reason = str(e) if isinstance(e, (TransferError, LayoutMismatch)) else f"receiver error: {e!r}"
            for lease in leases:
                lease.discard()  # the sender may still write into it: never reused
            if token is not None and not isinstance(e, TokenRefused):  # a refused token's transfer is not ours
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
        _tell(loop, self.deliver, exp, kv, stats, asm.bytes_on_wire)
        return keep

    def _read_header(self, sock: socket.socket, max_len: int, hdr=None) -> tuple[int, int, int, int, int]:
        """The next frame's header, parsed; `hdr` when its bytes were already read (with what came before)."""
        if hdr is not None:
            return parse_header(hdr, max_len)
        try:
            return parse_header(recv_exact(sock, bytearray(HEADER.size)), max_len)
        except STALLED:
            raise TransferError(f"peer stalled: nothing for {self.stall_timeout:.1f} s") from None
        except OSError as e:
            raise TransferError(f"connection lost: {e}") from None

    def _read_into(self, sock: socket.socket, mv, then=None) -> memoryview:
        try:
            return recv_exact(sock, mv, then)
        except STALLED:
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
            hdr, payload = frame(GRANT, json.dumps({"segment": lease.name, "bytes": lease.nbytes,
                                                      "warm": lease.warm}).encode())
            sock.sendall(hdr + payload)
        except OSError as e:
            lease.discard()
            raise TransferError(f"connection lost: {e}") from None
        return lease

    def _pooled(self, nbytes: int) -> Lease | None:
        """Warm memory from the segment pool for a TCP transfer to land in, or None (private memory).

        A layer of 32 MiB or more is past glibc's mmap threshold: every transfer maps it fresh and pays a
        page fault and a zeroed page per 4 KiB on its first write, which costs more CPU than receiving into
        memory that already exists (bench/kv_channel.py compares direct and raw TCP). Pooled segments are written once
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
        tail = bytearray(TRAILER.size + HEADER.size)  # a TCHUNK's trailer, and the next header if it FOLLOWS
        trailer_only = memoryview(tail)[:TRAILER.size]
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
                    got = crc32(self._read_into(sock, dst[off:off + PIECE_BYTES]), got)
                # the last piece, the trailer and (when it follows at once) the next header: one read
                follows = crc & FOLLOWS
                got = crc32(self._read_into(sock, dst[last:length], tail if follows else trailer_only), got)
                (crc,) = TRAILER.unpack_from(tail)
                if follows:
                    pending = bytes(tail[TRAILER.size:])
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
                if asm.header.shm_verify and crc32(memoryview(view.numpy())) != crc:
                    raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
                asm.adopt(layer, view)
                continue
            if kind == ZCHUNK:
                payload = self._read_into(sock, bytearray(length))
                if crc32(payload) != crc:
                    raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
                asm.inflate(layer, offset, payload)
                continue
            mv = self._read_into(sock, asm.target(kind, layer, offset, length))  # CHUNK or SCALES
            if crc32(mv) != crc:
                raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
            asm.commit(kind, layer, length)

    def _send_ack(self, sock: socket.socket, ack: dict) -> bool:
        try:
            hdr, payload = frame(ACK, json.dumps(ack).encode())
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
