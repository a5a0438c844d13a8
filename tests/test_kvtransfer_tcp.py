"""The direct KV data path over real loopback TCP: intact transfers, and every way one can go wrong.

No model here: KV payloads are random tensors with a real layout, so these run in seconds.
(Over ~600 lines: one case per way a direct transfer fails, each short; they share one fixture set.)
"""
from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from kvhelpers import random_kv
from pdserve.basetypes import KVLayout, LayoutMismatch
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.kvtransfer import sockio, tcp_send
from pdserve.kvtransfer.frames import (
    CHUNK, END, FOLLOWS, HELLO, PIECE_BYTES, TCHUNK, ZCHUNK, TransferError, TransferHeader, frame, layer_wire_pieces,
    read_frame,
)
from pdserve.kvtransfer.tcp_send import KEPT, KeptConnections, send_kv, send_kv_stream
from pdserve.kvtransfer.tcp_server import KVReceiver

LAYOUT = KVLayout(model_fingerprint="f00d", num_layers=3, kv_heads=2, head_dim=8, dtype="float32", block_size=4)


def make_kv(num_tokens: int = 10, layout: KVLayout = LAYOUT) -> KVBlocks:
    return random_kv(layout, num_tokens, seed=num_tokens)


def header(token: str, kv: KVBlocks, **over) -> TransferHeader:
    fields = dict(transfer_token=token, request_id="r1", sender_id="prefill-a", sender_generation=7,
                  layout=kv.layout, num_tokens=kv.num_tokens, num_chunks=len(kv.layers), total_bytes=kv.nbytes)
    fields.update(over)
    return TransferHeader(**fields)


def run(coro):
    return asyncio.run(coro)


def test_blocks_round_trip_dense():
    k = torch.randn(2, 13, 8)
    v = torch.randn(2, 13, 8)
    blocks = KVBlocks.layer_from_dense(k, v, 4)
    assert blocks.shape == (4, 2, 2, 4, 8)
    k2, v2 = KVBlocks.layer_to_dense(blocks, 13)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.count_nonzero(blocks[-1, :, :, 1:]) == 0  # padding past the last token is zero


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_intact_transfer_is_bit_exact(dtype):
    layout = LAYOUT.model_copy(update={"dtype": dtype})
    kv = make_kv(10, layout)

    async def go():
        rx = await KVReceiver(layout).start()
        token = rx.expect("r1", "prefill-a", 7, layout, 10)
        ack, (got, stats) = await asyncio.gather(send_kv(rx.address, header(token, kv), kv), rx.wait(token, 5))
        await rx.close()
        return ack, got, stats

    ack, got, stats = run(go())
    assert ack["ok"] and stats["bytes"] == kv.nbytes == layout.payload_bytes(10)
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, got.layers))


def test_layout_mismatch_is_refused_naming_the_field():
    rx_layout = LAYOUT.model_copy(update={"dtype": "bfloat16", "block_size": 8})
    with pytest.raises(LayoutMismatch, match=r"dtype: expected 'bfloat16', got 'float32'.*block_size"):
        rx_layout.check_matches(LAYOUT)


def _send_raw(addr: str, frames: list[bytes], read_ack: bool = True, timeout: float = 5):
    async def go():
        host, _, port = addr.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        for f in frames:
            writer.write(f)
        await writer.drain()
        ack = None
        if read_ack:
            try:
                _, _, payload = await read_frame(reader, timeout, 1 << 20)
                ack = json.loads(payload)
            except TransferError:
                ack = None
        writer.close()
        return ack
    return go()


def _frames_for(kv: KVBlocks, hdr: TransferHeader, kind: int = CHUNK, flags: int = 0) -> list[bytes]:
    """HELLO, one frame per layer (CHUNK: crc in the header; TCHUNK: crc in a trailer, `flags` in its
    header), END."""
    out = [b"".join(frame(HELLO, hdr.model_dump_json().encode()))]
    for i, layer in enumerate(kv.layers):
        raw = layer.contiguous().view(torch.uint8).numpy().tobytes()
        out.append(b"".join(bytes(x) for x in frame(kind, raw, i, flags=flags)))
    out.append(b"".join(frame(END, b"{}")))
    return out


def _expect_failure(mutate, match: str, stall_timeout: float = 5.0, wait_timeout: float = 5.0,
                    kind: int = CHUNK, kv: KVBlocks | None = None, flags: int = 0):
    kv = kv or make_kv()

    async def go():
        rx = await KVReceiver(LAYOUT, stall_timeout=stall_timeout).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens)
        frames = _frames_for(kv, header(token, kv), kind, flags)
        frames, hdr_over = mutate(frames, token)
        sender = asyncio.create_task(_send_raw(rx.address, frames))
        with pytest.raises(TransferError, match=match):
            await rx.wait(token, wait_timeout)
        ack = await sender
        await rx.close()
        assert not rx._expected, "a failed transfer must not stay registered"
        return ack

    return run(go())


@pytest.mark.parametrize("kind,where,flags", [(CHUNK, -1, 0), (TCHUNK, 40, 0), (TCHUNK, -1, 0), (TCHUNK, -1, FOLLOWS)],
                         ids=["chunk", "trailed-chunk-payload", "trailed-chunk-trailer", "trailer-then-next-header"])
def test_corrupt_chunk_is_refused(kind, where, flags):
    """FOLLOWS: the receiver reads the trailer and the next frame's header in one read."""
    def corrupt(frames, token):
        bad = bytearray(frames[2])
        bad[where] ^= 0xFF  # flip bits in layer 1's payload (or in a TCHUNK's crc trailer)
        frames[2] = bytes(bad)
        return frames, None

    ack = _expect_failure(corrupt, "corrupt chunk \\(layer 1\\)", kind=kind, flags=flags)
    assert ack == {"ok": False, "error": "corrupt chunk (layer 1): crc32 mismatch"}


def test_a_header_announced_to_follow_a_trailer_is_checked_like_any_other():
    """A TCHUNK flagged FOLLOWS whose next header is garbage (or that never comes) is refused, not trusted."""
    def garble(frames, token):
        frames[3] = b"JUNK" + frames[3][4:]  # layer 2's header, read together with layer 1's trailer
        return frames, None

    ack = _expect_failure(garble, "not a pdserve KV stream", kind=TCHUNK, flags=FOLLOWS)
    assert ack["ok"] is False

    def stop(frames, token):
        return frames[:3], None  # layer 1 says a header follows; then nothing, the connection held open

    async def go():
        kv = make_kv()
        rx = await KVReceiver(LAYOUT, stall_timeout=0.5).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens)
        frames, _ = stop(_frames_for(kv, header(token, kv), TCHUNK, FOLLOWS), token)
        host, _, port = rx.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"".join(frames))
        await writer.drain()
        with pytest.raises(TransferError, match="peer stalled"):
            await rx.wait(token, 5)
        writer.close()
        await rx.close()

    run(go())


def test_trailed_chunk_corrupt_in_a_later_piece_is_refused():
    """A layer several checksum pieces long (the receiver checks it piece by piece as it lands): one
    flipped byte in the third piece fails the layer, the pieces before it notwithstanding."""
    big = LAYOUT.model_copy(update={"kv_heads": 8, "head_dim": 64})  # 64 KiB per 16 tokens of fp32
    kv = random_kv(big, 40 * 16, seed=3)
    assert kv.layers[1].numel() * 4 > 2 * PIECE_BYTES

    async def go():
        rx = await KVReceiver(big).start()
        token = rx.expect("r1", "prefill-a", 7, big, kv.num_tokens)
        frames = _frames_for(kv, header(token, kv), TCHUNK)
        bad = bytearray(frames[2])
        bad[32 + 2 * PIECE_BYTES + 5] ^= 0x01
        frames[2] = bytes(bad)
        sender = asyncio.create_task(_send_raw(rx.address, frames))
        with pytest.raises(TransferError, match="corrupt chunk \\(layer 1\\)"):
            await rx.wait(token, 5)
        assert (await sender)["ok"] is False
        # the real sender's frames of the same KV (TCHUNKs, piece by piece) arrive bit-exact
        token = rx.expect("r2", "prefill-a", 7, big, kv.num_tokens)
        ack, (got, _) = await asyncio.gather(send_kv(rx.address, header(token, kv, request_id="r2"), kv),
                                             rx.wait(token, 5))
        await rx.close()
        assert ack["ok"] and all(torch.equal(a, b) for a, b in zip(kv.layers, got.layers))

    run(go())


@pytest.mark.parametrize("kind", [CHUNK, TCHUNK], ids=["chunk", "trailed-chunk"])
def test_truncated_stream_is_refused(kind):
    def truncate(frames, token):
        frames[2] = frames[2][: len(frames[2]) // 2]
        return frames[:3], None  # then the sender closes the connection

    async def _noop():
        return None

    kv = make_kv()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens)
        frames, _ = truncate(_frames_for(kv, header(token, kv), kind), token)
        await _send_raw(rx.address, frames, read_ack=False)
        with pytest.raises(TransferError, match="stream truncated"):
            await rx.wait(token, 5)
        await rx.close()

    run(go())


def test_stalled_peer_fails_within_its_bound():
    def stall(frames, token):
        return frames[:2], None  # HELLO and one chunk, then silence (connection left open)

    kv = make_kv()

    async def go():
        rx = await KVReceiver(LAYOUT, stall_timeout=0.5).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens)
        frames = _frames_for(kv, header(token, kv))[:2]
        host, _, port = rx.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"".join(frames))
        await writer.drain()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TransferError, match="peer stalled"):
            await rx.wait(token, 5)
        elapsed = loop.time() - t0
        writer.close()
        await rx.close()
        return elapsed

    assert run(go()) < 4.0  # the stall bound (0.5 s) fired, not the outer wait (5 s)


def test_stale_generation_is_refused():
    kv = make_kv()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens)
        with pytest.raises(TransferError, match="stale or foreign sender.*gen 7.*gen 6"):
            await asyncio.gather(send_kv(rx.address, header(token, kv, sender_generation=6), kv), rx.wait(token, 5))
        await rx.close()

    run(go())


def test_unknown_token_and_garbage_are_refused_without_harm():
    kv = make_kv()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        with pytest.raises(TransferError, match="unknown or expired transfer token"):
            await send_kv(rx.address, header("not-a-token", kv), kv)
        host, _, port = rx.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 16)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        # a real transfer still works afterwards
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens)
        ack, _ = await asyncio.gather(send_kv(rx.address, header(token, kv), kv), rx.wait(token, 5))
        await rx.close()
        return data, ack

    data, ack = run(go())
    assert b"not a pdserve KV stream" in data
    assert ack["ok"]


def test_dead_receiver_is_a_clear_error():
    kv = make_kv()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        addr = rx.address
        await rx.close()
        with pytest.raises(TransferError, match="cannot reach decode data port"):
            await send_kv(addr, header("t", kv), kv, connect_timeout=1)

    run(go())


def test_header_size_must_match_layout():
    kv = make_kv()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens)
        with pytest.raises(TransferError, match="size"):
            await asyncio.gather(send_kv(rx.address, header(token, kv, total_bytes=kv.nbytes + 1), kv),
                                 rx.wait(token, 5))
        await rx.close()

    run(go())


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_layers_split_into_many_chunks_arrive_intact(compression):
    """Chunks far smaller than a layer (crc of one overlapping the receipt of the next) reassemble exactly."""
    layout = LAYOUT.model_copy(update={"dtype": "bfloat16"})
    kv = make_kv(37, layout)

    async def go():
        rx = await KVReceiver(layout).start()
        token = rx.expect("r1", "prefill-a", 7, layout, kv.num_tokens, compression=compression)
        hdr = header(token, kv, compression=compression)
        ack, (got, stats) = await asyncio.gather(send_kv(rx.address, hdr, kv, chunk_bytes=100), rx.wait(token, 5))
        await rx.close()
        return ack, got, stats

    ack, got, stats = run(go())
    layer_bytes = kv.layers[0].numel() * (2 if compression == "none" else 1)
    assert ack["ok"] and stats["wire_bytes"] >= layer_bytes * len(kv.layers)
    for a, b in zip(kv.layers, got.layers):
        if compression == "none":
            assert torch.equal(a, b)
        else:
            assert (a.float() - b.float()).abs().max() <= a.float().abs().max() / 100


@pytest.mark.parametrize("lie", ["longer", "shorter", "garbage", "uncompressed transfer"])
def test_deflated_chunk_that_does_not_inflate_to_its_length_is_refused(lie):
    """A ZCHUNK whose crc is right but whose deflate stream disagrees with its stated length (a bug, or a
    peer trying to make the receiver inflate more than the layout holds) fails the transfer, never hangs."""
    kv = KVBlocks(LAYOUT, 10, [torch.zeros_like(t) for t in make_kv().layers])  # zeros: deflate surely pays
    compression = "none" if lie == "uncompressed transfer" else "int8"

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens, compression=compression)
        frames = [b"".join(frame(HELLO, header(token, kv, compression=compression).model_dump_json().encode()))]
        for i, layer in enumerate(kv.layers):
            for kind, li, off, payload in layer_wire_pieces(i, layer, "int8"):
                payload = bytes(payload)
                if kind == ZCHUNK and li == 1:
                    raw = int.from_bytes(payload[:8], "big")
                    if lie == "longer":
                        payload = (raw + 1).to_bytes(8, "big") + payload[8:]
                    elif lie == "shorter":
                        payload = (raw - 1).to_bytes(8, "big") + payload[8:]
                    elif lie == "garbage":
                        payload = payload[:8] + b"\xff" * (len(payload) - 8)
                if compression == "none" and kind != ZCHUNK:
                    continue
                frames.append(b"".join(bytes(x) for x in frame(kind, payload, li, off)))
        frames.append(b"".join(frame(END, b"{}")))
        sender = asyncio.create_task(_send_raw(rx.address, frames))
        # a stated length past the layer is refused before anything is inflated
        with pytest.raises(TransferError, match="deflated chunk|layout says"):
            await rx.wait(token, 5)
        ack = await sender
        await rx.close()
        assert not rx._expected
        return ack

    ack = run(go())
    assert ack is not None and not ack["ok"] and ("deflated chunk" in ack["error"] or "layout says" in ack["error"])


def test_int8_deflates_compressible_chunks_and_sends_the_rest_plain():
    layer = make_kv().layers[0]
    noisy = [k for k, *_ in layer_wire_pieces(0, layer, "int8")]
    quiet = [k for k, *_ in layer_wire_pieces(0, torch.zeros_like(layer), "int8")]
    assert ZCHUNK in quiet and CHUNK not in quiet
    assert all(k != ZCHUNK for k in [k for k, *_ in layer_wire_pieces(0, layer, "none")])
    assert len(noisy) == len(quiet)  # same frames either way: one SCALES, then the chunks


def test_tcp_transfers_land_in_pooled_memory_reused_once_the_kv_is_freed():
    """Uncompressed TCP KV is received into the receiver's warm segment pool (no page faults after the
    first transfer): a segment goes back when decode frees the KV, never while a view of it lives."""
    import gc

    a, b, c = (make_kv(37 + i) for i in range(3))

    async def go():
        rx = await KVReceiver(LAYOUT).start()

        async def one(kv, rid):
            token = rx.expect(rid, "prefill-a", 7, LAYOUT, kv.num_tokens)
            _, (got, _) = await asyncio.gather(send_kv(rx.address, header(token, kv, request_id=rid), kv),
                                               rx.wait(token, 5))
            return got

        got_a = await one(a, "ra")
        got_b = await one(b, "rb")  # a's KV still alive: b gets a segment of its own
        assert rx.shm_pool.created == 2
        assert all(torch.equal(x, y) for x, y in zip(a.layers, got_a.layers)), "b overwrote a's live KV"
        del got_a, got_b
        gc.collect()
        got_c = await one(c, "rc")  # reuses a freed segment
        assert rx.shm_pool.created == 2
        assert all(torch.equal(x, y) for x, y in zip(c.layers, got_c.layers))
        await rx.close()
        return got_c

    got_c = run(go())
    assert all(torch.equal(x, y) for x, y in zip(c.layers, got_c.layers)), "the KV outlives the receiver"


# --- kept connections -----------------------------------------------------------------------------


async def _transfer(rx: KVReceiver, kv: KVBlocks, rid: str, stream_delay: float | None = None):
    """One transfer to `rx`: all layers at once, or (stream_delay) one layer per `stream_delay` s."""
    token = rx.expect(rid, "prefill-a", 7, LAYOUT, kv.num_tokens)
    hdr = header(token, kv, request_id=rid)
    if stream_delay is None:
        sending = send_kv(rx.address, hdr, kv)
    else:
        async def layers():
            for i, t in enumerate(kv.layers):
                await asyncio.sleep(stream_delay)
                yield i, t
        sending = send_kv_stream(rx.address, hdr, layers())
    ack, (got, _) = await asyncio.gather(sending, rx.wait(token, 5))
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, got.layers)), f"{rid} not bit-exact"
    return ack


def test_the_connection_is_kept_for_the_next_transfer():
    """After a transfer the receiver said it keeps (`keep_s` in its ACK), the next one to the same
    receiver goes over the same connection; a receiver that keeps none (max_kept=0) is not kept."""
    KEPT.clear()
    kv = make_kv()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        ack = await _transfer(rx, kv, "r1")
        assert ack["keep_s"] == rx.keep_idle_s and KEPT.idle(rx.address) == 1 and rx.active == 1
        kept = KEPT._idle[rx.address][0][0]
        for rid in ("r2", "r3"):
            await _transfer(rx, kv, rid)
            assert KEPT.idle(rx.address) == 1 and KEPT._idle[rx.address][0][0] is kept and rx.active == 1
        await rx.close()

        rx = await KVReceiver(LAYOUT, max_kept=0).start()
        ack = await _transfer(rx, kv, "r4")
        assert "keep_s" not in ack and KEPT.idle(rx.address) == 0
        for _ in range(50):  # the receiver's thread lets go of the connection once the ACK is out
            if rx.active == 0:
                break
            await asyncio.sleep(0.02)
        assert rx.active == 0
        await rx.close()

    run(go())


@pytest.mark.parametrize("stream_delay", [None, 0.01], ids=["all-at-once", "streamed"])
def test_a_kept_connection_the_receiver_closed_is_replaced(monkeypatch, caplog, stream_delay):
    """The receiver closes a connection idle past its `keep_idle_s` (the sender uses one only within half
    of that). One the receiver closed otherwise is seen at once (it reads EOF) and replaced. And if the
    sender missed it (the close crossed its HELLO: here the liveness check is blinded), the transfer fails
    on the dead connection before the receiver said anything, so it starts again once on a new one, the
    layers it had taken replayed. Bit-exact every time."""
    import socket

    KEPT.clear()
    kv = make_kv()

    async def receiver_hangs_up(rx: KVReceiver) -> None:
        for c in list(rx._conns):
            c.shutdown(socket.SHUT_RDWR)
        for _ in range(100):
            if rx.active == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the receiver kept the connection")

    async def go():
        rx = await KVReceiver(LAYOUT, keep_idle_s=0.2).start()
        await _transfer(rx, kv, "r1", stream_delay)
        for _ in range(500):  # past keep_idle_s the receiver closes the idle connection (bounded wait)
            if rx.active == 0:
                break
            await asyncio.sleep(0.02)
        assert rx.active == 0, "the receiver closed the idle connection"
        await _transfer(rx, kv, "r2", stream_delay)
        await rx.close()

        rx = await KVReceiver(LAYOUT).start()
        with caplog.at_level("INFO", logger="pdserve.kvtransfer.tcp"):
            await _transfer(rx, kv, "r3", stream_delay)
            await receiver_hangs_up(rx)
            assert KEPT.idle(rx.address) == 1
            await _transfer(rx, kv, "r4", stream_delay)  # the closed connection is seen and dropped
            assert "sending on a new one" not in caplog.text
            await receiver_hangs_up(rx)
            monkeypatch.setattr(tcp_send, "readable", lambda sock: False)
            await _transfer(rx, kv, "r5", stream_delay)  # sent on the dead one first, then again
            assert "sending on a new one" in caplog.text
        await rx.close()

    run(go())


def test_kept_connections_are_bounded():
    import socket

    pool = KeptConnections(per_addr=2, total=3)
    pairs = [socket.socketpair() for _ in range(6)]
    for s, _ in pairs[:3]:
        pool.put("a:1", s, 60)
    assert pool.idle("a:1") == 2 and pairs[0][0].fileno() == -1, "the oldest beyond per_addr is closed"
    pool.put("b:1", pairs[3][0], 60)
    pool.put("b:1", pairs[4][0], 60)
    assert pool.idle() == 3 and pairs[1][0].fileno() == -1, "the oldest overall beyond total is closed"
    assert pool.take("b:1") is pairs[4][0], "newest first"
    pairs[3][1].close()  # the peer of b's remaining connection hangs up
    assert pool.take("b:1") is None and pairs[3][0].fileno() == -1
    pool.put("c:1", pairs[5][0], 0.0)  # use-by already past
    assert pool.take("c:1") is None and pairs[5][0].fileno() == -1
    pool.clear()
    assert pool.idle() == 0 and pairs[2][0].fileno() == -1
    for s, t in pairs:
        s.close()
        t.close()


def test_a_piece_and_what_follows_it_arrive_whole_across_partial_reads():
    """`_recv_exact(sock, piece, then)` fills both buffers whatever the reads return: here the first read
    ends early (the socket's timeout passes with part of the bytes in), the rest comes after."""
    import socket
    import threading
    import time

    a, b = socket.socketpair()
    sockio.io_timeout(b, 0.2)
    data = bytes(range(256)) * 40  # 10 KiB: a piece of 10,000 bytes, then 240 more
    piece, then = bytearray(10_000), bytearray(240)

    def dribble():
        a.sendall(data[:3000])
        time.sleep(0.35)  # past the reader's timeout: its read returns the 3000 bytes it has
        a.sendall(data[3000:10_100])
        time.sleep(0.05)
        a.sendall(data[10_100:])

    t = threading.Thread(target=dribble)
    t.start()
    sockio.recv_exact(b, piece, then)
    t.join()
    assert bytes(piece) == data[:10_000] and bytes(then) == data[10_000:]
    a.sendall(data[:5000])
    a.close()
    with pytest.raises(TransferError, match="stream truncated: got 5000 of 10240 bytes"):
        sockio.recv_exact(b, piece, then)
    b.close()


def test_a_kept_connection_on_a_high_descriptor_is_still_used():
    """A busy worker's sockets get descriptors past 1024, which `select` cannot watch: the liveness check
    (and the sender's look for a refusal, the same check) must still see a live connection as live and a
    closed one as closed."""
    import os
    import resource
    import socket

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1500:
        pytest.skip("needs more than 1500 open files")
    a, b = socket.socketpair()
    high = socket.socket(fileno=os.dup2(a.fileno(), 1500))
    a.close()
    pool = KeptConnections()
    pool.put("a:1", high, 60)
    assert pool.take("a:1") is high, "a live connection on fd 1500 was dropped"
    b.close()
    pool.put("a:1", high, 60)
    assert pool.take("a:1") is None and high.fileno() == -1, "a closed one on fd 1500 was kept"


def test_the_data_port_admits_a_transfer_only_with_its_one_time_token():
    """No token, a wrong one, one for another transfer, and the token of a transfer already delivered
    (a replay): each connection is refused with the reason and closed, nothing is delivered by it, and
    the legitimate transfer, agreed before them all, still arrives whole."""
    kv = make_kv()

    async def refused(frames: list[bytes]) -> tuple[dict, bytes]:
        host, _, port = rx.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        for f in frames:
            writer.write(f)
        await writer.drain()
        _, _, payload = await read_frame(reader, 5, 1 << 20)
        rest = await asyncio.wait_for(reader.read(), 5)  # the receiver closes: EOF, not a wedge
        writer.close()
        return json.loads(payload), rest

    async def go():
        nonlocal rx
        rx = await KVReceiver(LAYOUT).start()
        mine = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens)
        other = rx.expect("r2", "prefill-a", 7, LAYOUT, kv.num_tokens)
        untoken = json.loads(header(mine, kv).model_dump_json())
        del untoken["transfer_token"]
        no_token = [b"".join(frame(HELLO, json.dumps(untoken).encode()))] + _frames_for(kv, header(mine, kv))[1:]
        wrong = _frames_for(kv, header("A" * 22, kv))
        foreign = _frames_for(kv, header(other, kv))  # r2's token on a stream that says r1
        got = {name: await refused(frames) for name, frames in
               (("none", no_token), ("wrong", wrong), ("foreign", foreign))}
        assert rx.bytes_received == 0
        ack, (blocks, _) = await asyncio.gather(send_kv(rx.address, header(mine, kv), kv), rx.wait(mine, 5))
        received = rx.bytes_received
        got["replay"] = await refused(_frames_for(kv, header(mine, kv)))
        assert rx.bytes_received == received  # the replay delivered nothing
        with pytest.raises(TransferError, match="belongs to request r2"):
            await rx.wait(other, 5)  # a token shown with a stream not its own is spent
        await rx.close()
        return got, ack, blocks

    rx = None
    got, ack, blocks = run(go())
    assert ack["ok"] and all(torch.equal(a, b) for a, b in zip(kv.layers, blocks.layers))
    for name, match in (("none", "malformed transfer header.*transfer_token"),
                        ("wrong", "unknown or expired transfer token"),
                        ("foreign", "transfer token belongs to request r2, stream says r1"),
                        ("replay", "unknown or expired transfer token|already used")):
        reply, rest = got[name]
        assert reply["ok"] is False and re.search(match, reply["error"], re.S), (name, reply)
        assert rest == b"", name


def test_a_token_is_admitted_once_even_while_its_transfer_is_in_flight():
    """A second HELLO with a token whose transfer is still arriving is refused as already used, and the
    transfer in flight is not failed by it."""
    kv = make_kv()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens)
        frames = _frames_for(kv, header(token, kv))
        host, _, port = rx.address.rpartition(":")
        r1, w1 = await asyncio.open_connection(host, int(port))
        layers = rx.layers(token, 5)
        landed = asyncio.ensure_future(layers.__anext__())
        await asyncio.sleep(0)  # one turn of the loop: `landed` starts listening before any layer is sent
        w1.write(frames[0] + frames[1])  # HELLO and the first layer: claimed, not finished
        await w1.drain()
        first, _ = await landed  # the first layer landed: the token is in use
        ack2 = await _send_raw(rx.address, frames)
        w1.write(b"".join(frames[2:]))
        await w1.drain()
        _, _, payload = await read_frame(r1, 5, 1 << 20)
        blocks, _ = await rx.wait(token, 5)
        await layers.aclose()
        w1.close()
        await rx.close()
        return ack2, json.loads(payload), blocks, first

    ack2, ack1, blocks, first = run(go())
    assert first == 0
    assert ack2["ok"] is False and ack2["error"] == "transfer token already used"
    assert ack1["ok"] and all(torch.equal(a, b) for a, b in zip(kv.layers, blocks.layers))
