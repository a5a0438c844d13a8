"""The sending side of the direct KV data path: a framed TCP stream (or a shared-memory segment it fills) to decode.

NATS only brokers the rendezvous (a one-time transfer token and the receiver's address, in the
`HandoffReply`); the bytes go straight to the receiver (`kvtransfer.tcp_server`), in the frames of
`kvtransfer.frames`. One worker thread does a whole transfer: connect (or take a kept connection),
HELLO, GRANT (shm), layers as they come, END, ACK.

An uncompressed layer goes as one TCHUNK. Both sides checksum it in `PIECE_BYTES` pieces inside the
socket thread, each piece right after the kernel copied it, so the crc reads bytes still in cache
rather than the whole chunk again from memory, as a crc in the frame header would need (the sender
would read the chunk before sending it, the receiver after it arrived). Every write has a bound: a
receiver that stalls is an error, not a hang.

A connection carries one transfer after another: after an ACK that says `keep_s`, the sender keeps it
(`KEPT`) and the receiver's thread waits on it for the next HELLO, so a transfer to a receiver already
talked to skips connect and accept. Every transfer still presents its own one-time token; the HELLO
goes out in one send with the first layers.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import queue
import select
import socket
import threading
import time
from typing import AsyncIterator, Callable, Iterable

import torch

from pdserve.kvtransfer.frames import (
    ACK, CHUNK, CRC_POOL, DEFAULT_CHUNK_BYTES, END, FOLLOWS, FRAME_VERSION, GRANT, HEADER, HELLO, MAGIC,
    MAX_CHUNK, MAX_CONTROL_FRAME, PIECE_BYTES, SHM, TCHUNK, TRAILER, TransferError, TransferHeader, crc32,
    layer_wire_pieces, parse_header,
)
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.kvtransfer.shm import SENDER_MAPS, SHM_DIR, SegmentMapping, reap_if_orphaned
from pdserve.kvtransfer.sockio import IO_POOL, STALLED, io_timeout, recv_exact

log = logging.getLogger("pdserve.kvtransfer.tcp")


class _BlockingSender:
    """The sending socket, driven from worker threads; refusals from the receiver stop it early."""

    def __init__(self, sock: socket.socket, addr: str, timeout: float):
        self.sock, self.addr, self.timeout = sock, addr, timeout
        self.refused = False
        self.sent = 0  # layers sent

    def _peer_spoke(self) -> bool:
        return readable(self.sock)

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
                    small.append(HEADER.pack(MAGIC, FRAME_VERSION, TCHUNK, layer, FOLLOWS if nxt else 0, offset, n))
                    crc = self._send_trailed(small, payload)
                    if crc is None:
                        return
                    small = [TRAILER.pack(crc)]
                    continue
                if crcs:
                    crc = crc_next if crc_next is not None else _crc_of(payload)
                    crc = crc if isinstance(crc, int) else crc.result()
                    # the next frame's crc runs while this one goes out
                    crc_next = _crc_of(nxt[3]) if nxt is not None and nxt[0] != CHUNK else None
                else:
                    crc = getattr(payload, "crc", 0)
                small.append(HEADER.pack(MAGIC, FRAME_VERSION, kind, layer, crc, offset, n))
                if kind == SHM or n == 0:
                    continue
                small.append(payload)
                _send_all(self.sock, small)
                small = []
                self._unchecked += n
            if small:
                _send_all(self.sock, small)
        except STALLED:
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
            crc = crc32(piece, crc)
            self._unchecked += len(piece)
        return crc

    def read_ack(self, want: int = ACK) -> dict:
        """The receiver's next control frame: its ACK, or (`want=GRANT`) the shm segment it lends us.
        A refusal (an ACK that is not ok) raises TransferError with the receiver's reason."""
        try:
            hdr = recv_exact(self.sock, bytearray(HEADER.size))
            kind, layer, crc, _, length = parse_header(hdr, MAX_CONTROL_FRAME)
            payload = recv_exact(self.sock, bytearray(length))
        except STALLED:
            raise TransferError(f"decode data port {self.addr} did not answer within {self.timeout:.1f} s") \
                from None
        except (TransferError, OSError) as e:
            raise _ConnectionLost(f"connection to {self.addr} lost: {e}") from None
        if crc32(payload) != crc:
            raise TransferError(f"corrupt control frame from {self.addr}: crc32 mismatch")
        msg = json.loads(bytes(payload))
        if kind == ACK and not msg.get("ok"):
            raise TransferError(f"receiver refused KV: {msg.get('error')}")
        if kind != want:
            raise TransferError(f"expected {'ACK' if want == ACK else 'GRANT'}, got frame kind {kind}")
        return msg


_REFUSAL_CHECK_BYTES = 4 << 20


_INLINE_CRC_BYTES = 256 << 10  # smaller payloads are checksummed in the sending thread: cheaper than a thread hop


def _crc_of(data) -> int | concurrent.futures.Future:
    """A frame payload's crc32: at once for a small one (HELLO, END, scales: less than a thread hop),
    in `CRC_POOL` for a big one."""
    return crc32(data) if len(data) < _INLINE_CRC_BYTES else CRC_POOL.submit(crc32, data)


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



async def aiter_layers(layers: Iterable[torch.Tensor]) -> AsyncIterator[tuple[int, torch.Tensor]]:
    """Layers at hand as the `(layer_index, tensor)` stream the streaming senders take."""
    for i, t in enumerate(layers):
        yield i, t


async def send_kv(addr: str, header: TransferHeader, kv: KVBlocks, *, timeout: float = 30.0,
                  connect_timeout: float = 5.0, chunk_bytes: int | None = None) -> dict:
    """Send `kv` to the receiver at "host:port". Returns the receiver's ACK (with its timings).

    `header.compression` ("none"/"int8"/"fp8") and `header.transport` ("tcp" or "shm") say how; both must
    be what the receiver agreed to. Raises TransferError if the receiver refuses it, stalls (no progress
    for `timeout` s), or the connection breaks.
    """
    return await send_kv_stream(addr, header, aiter_layers(kv.layers), timeout=timeout, connect_timeout=connect_timeout,
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
    # only hands it layers: a thread hop per layer would add its latency to every layer on a loaded host.
    opened = loop.create_future()  # set once the receiver accepted HELLO (and granted shm)

    def on_open() -> None:
        loop.call_soon_threadsafe(lambda: opened.done() or opened.set_result(None))

    job = loop.run_in_executor(IO_POOL, _send_blocking, addr, header, feed, held, timeout, connect_timeout,
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
            if use_by > now and not readable(sock):
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


def readable(sock: socket.socket) -> bool:
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
        io_timeout(sock, timeout)
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
                # last batch with END. Made before the first is sent, which measures faster than making each
                # between the sends (bench/kv_channel.py).
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


def _write_shm_layer(mm: SegmentMapping, index: int, layer: torch.Tensor,
                     header: TransferHeader) -> list[tuple[int, int, int, memoryview]]:
    n = layer.numel() * layer.element_size()
    offset = header.layout.layer_offsets(header.num_tokens)[index]  # layers differ in size (sliding windows)
    if offset + n > mm.size:
        raise TransferError(f"layer {index} does not fit the shared-memory segment")
    mm.write(offset, layer)
    crc = crc32(memoryview(mm.mm)[offset:offset + n]) if header.shm_verify else 0
    # an SHM frame has no payload: `length` in its header is the layer's size in the segment
    return [(SHM, index, offset, _ShmLen(n, crc))]


class _ShmLen:
    """Stands in for a payload in an SHM frame: a length (and a precomputed crc), no bytes."""

    def __init__(self, n: int, crc: int):
        self.n, self.crc = n, crc

    def __len__(self) -> int:
        return self.n

