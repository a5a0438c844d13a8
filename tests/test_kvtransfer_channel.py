"""The KV channel facade over every transport (tcp, shm, nats, objstore) with real sockets, real
shared memory and a real NATS server: intact transfers, negotiation, compression, layer streaming,
and the faults (dead sender, dead receiver, corruption, truncation, stalls, NATS restart, wrong
model, stale generation) — each bounded, each an error, nothing left behind.
(Over ~600 lines: the same faults once per transport, sharing one NATS server and fixture set.)
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import nats
import pytest
import torch

from kvhelpers import random_kv
from pdserve.kvtransfer.channel import KVReceiveChannel, KVSendChannel
from pdserve.basetypes import KVLayout, LayoutMismatch, SamplingParams
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.kvtransfer.natsdata import _msg, object_name
from pdserve.kvtransfer.protocol import Buckets, HandoffOffer, Subjects, TransferFailed
from pdserve.kvtransfer.frames import (
    CHUNK, END, HELLO, TransferError, TransferHeader, from_token_groups, layer_wire_pieces, to_token_groups,
)
from pdserve.kvtransfer.shm import SHM_DIR, SHM_PREFIX, host_id, owned_elsewhere, shm_path
from pdserve.kvtransfer.tcp_server import KVReceiver

LAYOUT = KVLayout(model_fingerprint="f00d", num_layers=4, kv_heads=2, head_dim=16, dtype="bfloat16", block_size=8)
ALL = ["tcp", "shm", "nats", "objstore"]
STREAMING = ["tcp", "shm", "nats"]


def make_kv(num_tokens: int = 37, layout: KVLayout = LAYOUT, seed: int = 0) -> KVBlocks:
    return random_kv(layout, num_tokens, seed)


def make_offer(kv: KVBlocks, send: KVSendChannel, **over) -> HandoffOffer:
    fields = dict(request_id="r1", sender_id=send.sender_id, sender_generation=send.generation, layout=kv.layout,
                  num_tokens=kv.num_tokens, kv_bytes=kv.nbytes, prompt_token_ids=[1, 2], generated_token_ids=[3],
                  sampling=SamplingParams(), seed=0, next_seq=1, **send.offer_fields())
    fields.update(over)
    return HandoffOffer(**fields)


def our_segments() -> set[str]:
    """Transfer segments, and pool segments of this process or of dead ones (leaks); not the pools of live
    workers elsewhere on the host (other tests' decode workers keep theirs for reuse)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX) and not owned_elsewhere(SHM_DIR, n)}


class Pair:
    """A receive channel (own data server) and a send channel on one NATS connection."""

    def __init__(self, nc, stall_timeout: float = 5.0, **send_kw):
        self.nc, self.stall, self.send_kw = nc, stall_timeout, send_kw

    async def __aenter__(self):
        self.rx = await KVReceiver(LAYOUT, stall_timeout=self.stall).start()
        self.recv = KVReceiveChannel(self.rx, self.nc, worker_id="decode-a", stall_timeout=self.stall)
        kw = dict(sender_id="prefill-a", generation=7, timeout=self.stall)
        kw.update(self.send_kw)
        self.send = KVSendChannel(self.nc, **kw)
        return self

    async def __aexit__(self, *exc):
        await self.rx.close()


async def _connect(server):
    return await nats.connect(**server.creds.connect_kwargs(), max_reconnect_attempts=-1, reconnect_time_wait=0.2)


async def _objects(nc) -> list[str]:
    store = await nc.jetstream().object_store(Buckets.kv_transfer("default"))
    try:
        return [o.name for o in await store.list(ignore_deletes=True)]
    except Exception:  # nats.js.errors.NotFoundError: the bucket is empty
        return []


# --- intact transfers ---------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ALL)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_transport_is_bit_exact_and_leaves_nothing(nats_server, transport, dtype):
    layout = LAYOUT.model_copy(update={"dtype": dtype})
    kv = make_kv(37, layout)
    before = our_segments()

    async def go():
        nc = await _connect(nats_server)
        rx = await KVReceiver(layout).start()
        recv = KVReceiveChannel(rx, nc, worker_id="decode-a")
        send = KVSendChannel(nc, sender_id="prefill-a", generation=7, transports=[transport])
        reply = await recv.expect(make_offer(kv, send))
        assert reply.accepted and reply.transport == transport and reply.compression == "none"
        header = send.header(reply, "r1", layout, kv.num_tokens)
        ack, (got, stats) = await asyncio.gather(send.send(reply, header, kv), recv.wait(reply.transfer_token, 10))
        objects = await _objects(nc) if transport == "objstore" else []
        await rx.close()
        await nc.close()
        return ack, got, stats, reply, objects

    ack, got, stats, reply, objects = asyncio.run(go())
    assert ack["ok"] and stats["transport"] == transport and stats["bytes"] == kv.nbytes
    assert got.num_tokens == 37 and len(got.layers) == layout.num_layers
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(kv.layers, got.layers))
    assert our_segments() == before, "a shared-memory segment outlived its transfer"
    assert not os.path.exists(shm_path(reply.transfer_token))
    assert object_name(reply.transfer_token) not in objects, "the receiver must delete the fetched object"


def test_nats_transfer_sent_the_moment_the_reply_is_out_finds_its_receiver(nats_server):
    """Prefill and decode hold NATS connections of their own, and the reply may reach the sender sooner
    than decode's subscription reaches the server (a reply relayed by another worker or over HTTP). The
    receive channel's `expect` returns only once the server has its subscription, and a sender told "no
    responders" for its first message asks again for a moment (NO_RESPONDERS_RETRY_S), so a sender that
    starts at that instant is heard, every time. (Without the flush this failed on the first transfer;
    with the flush alone, on one of the first five now and then.)"""
    kv = make_kv(37)

    async def go():
        nc_decode, nc_prefill = await _connect(nats_server), await _connect(nats_server)
        rx = await KVReceiver(LAYOUT).start()
        recv = KVReceiveChannel(rx, nc_decode, worker_id="decode-a")
        send = KVSendChannel(nc_prefill, sender_id="prefill-a", generation=7, transports=["nats"])
        for i in range(10):
            reply = await recv.expect(make_offer(kv, send, request_id=f"r{i}"))
            header = send.header(reply, f"r{i}", LAYOUT, kv.num_tokens)
            ack, (got, _) = await asyncio.gather(send.send(reply, header, kv), recv.wait(reply.transfer_token, 10))
            assert ack["ok"] and all(torch.equal(a, b) for a, b in zip(kv.layers, got.layers))
        await rx.close()
        await nc_decode.close()
        await nc_prefill.close()

    asyncio.run(go())


@pytest.mark.parametrize("transport", ["tcp", "nats", "objstore"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_compression_is_negotiated_and_matches_the_quantiser(nats_server, transport, fmt):
    from pdserve.kernels.kv_quant import pack, unpack

    kv = make_kv(37, LAYOUT.model_copy(update={"dtype": "float32"}))

    async def go():
        nc = await _connect(nats_server)
        rx = await KVReceiver(kv.layout).start()
        recv = KVReceiveChannel(rx, nc)
        send = KVSendChannel(nc, sender_id="prefill-a", generation=7, transports=[transport], compression=fmt)
        reply = await recv.expect(make_offer(kv, send))
        header = send.header(reply, "r1", kv.layout, kv.num_tokens)
        _, (got, stats) = await asyncio.gather(send.send(reply, header, kv), recv.wait(reply.transfer_token, 10))
        await rx.close()
        await nc.close()
        return reply, got, stats

    reply, got, stats = asyncio.run(go())
    assert reply.compression == fmt and stats["compression"] == fmt
    # float32 → at most one byte per value plus a float32 scale per (token, K/V, head) of 16 values; the
    # deflate pass takes off what it can (here: the zero padding of the last block)
    nb = kv.layout.num_blocks(kv.num_tokens)
    sent = sum(len(p) for i, layer in enumerate(kv.layers) for _, _, _, p in layer_wire_pieces(i, layer, fmt))
    assert stats["wire_bytes"] == sent <= kv.layout.num_layers * nb * 8 * 2 * 2 * (16 + 4) == kv.nbytes * 20 // 64
    for layer, out in zip(kv.layers, got.layers):
        groups = to_token_groups(layer)
        ids = torch.arange(groups.shape[0])
        payload, scales = pack(groups, ids, fmt, impl="reference")
        want = torch.empty_like(groups)
        unpack(payload, scales, want, ids, fmt, impl="reference")
        # exactly the kernel's round trip: the channel adds no error of its own
        assert torch.equal(out, from_token_groups(want, kv.layout.block_size))
        assert (out - layer).abs().max() <= layer.abs().max() / (127 if fmt == "int8" else 8)


def test_negotiation_picks_what_both_sides_can_do(nats_server):
    kv = make_kv()

    async def go():
        nc = await _connect(nats_server)
        rx = await KVReceiver(LAYOUT).start()
        recv = KVReceiveChannel(rx, nc)
        recv_no_nats = KVReceiveChannel(rx, None)
        send = KVSendChannel(nc, sender_id="p", generation=1, transports=["shm", "tcp", "nats"], compression="int8")
        out = {}
        # same host: shm wins, and shm never compresses
        out["local"] = recv.choose(make_offer(kv, send))
        # another host: shm is skipped, compression granted
        out["remote"] = recv.choose(make_offer(kv, send, host_id="other-node"))
        # the receiver serves only nats, the sender offers shm/tcp/nats
        out["nats_only"] = KVReceiveChannel(rx, nc, transports=["nats"]).choose(make_offer(kv, send))
        # a receiver that refuses compression
        out["no_comp"] = KVReceiveChannel(rx, nc, compressions=["none"]).choose(
            make_offer(kv, send, host_id="other-node"))
        with pytest.raises(TransferError, match="no common KV transport.*no NATS connection"):
            recv_no_nats.choose(make_offer(kv, send, transports=["nats", "objstore"]))
        # an old offer (no transport fields) still means direct TCP, uncompressed
        old = HandoffOffer.decode(json.dumps({k: v for k, v in json.loads(make_offer(kv, send).encode()).items()
                                              if k not in ("transports", "host_id", "compression")}).encode())
        out["old"] = recv.choose(old)
        await rx.close()
        await nc.close()
        return out

    out = asyncio.run(go())
    assert out == {"local": ("shm", "none"), "remote": ("tcp", "int8"), "nats_only": ("nats", "int8"),
                   "no_comp": ("tcp", "none"), "old": ("tcp", "none")}
    assert host_id() == host_id() and ":" in host_id()


def test_handoff_for_a_model_the_receiver_does_not_serve_is_refused(nats_server):
    other = LAYOUT.model_copy(update={"model_fingerprint": "beef", "num_layers": 6})
    kv = make_kv(10, other)

    async def go():
        nc = await _connect(nats_server)
        async with Pair(nc) as p:
            for t in ALL:
                p.send.transports = [t]
                with pytest.raises(LayoutMismatch, match="model_fingerprint: expected 'f00d', got 'beef'.*num_layers"):
                    await p.recv.expect(make_offer(kv, p.send))
            assert not p.rx._expected
        await nc.close()

    asyncio.run(go())


@pytest.mark.parametrize("transport", ALL)
def test_stale_generation_is_refused_and_recorded(nats_server, transport):
    kv = make_kv()

    async def go():
        nc = await _connect(nats_server)
        records: list[TransferFailed] = []

        async def on_failed(m):
            records.append(TransferFailed.decode(m.data))

        sub = await nc.subscribe(Subjects.kv_failed_all("default"), cb=on_failed)
        async with Pair(nc, transports=[transport]) as p:
            reply = await p.recv.expect(make_offer(kv, p.send))
            stale = p.send.header(reply, "r1", LAYOUT, kv.num_tokens).model_copy(update={"sender_generation": 6})
            results = await asyncio.gather(p.send.send(reply, stale, kv), p.recv.wait(reply.transfer_token, 10),
                                           return_exceptions=True)
            await nc.flush()
            for _ in range(500):  # both sides' failure records, back through our subscription (bounded)
                if {r.side for r in records} == {"sender", "receiver"}:
                    break
                await asyncio.sleep(0.01)
            assert not p.rx._expected
        await sub.unsubscribe()
        await nc.close()
        return results, records, reply

    results, records, reply = asyncio.run(go())
    for r in results:
        assert isinstance(r, TransferError) and "stale or foreign sender" in str(r) and "gen 6" in str(r)
    assert {r.side for r in records} == {"sender", "receiver"}
    assert all(r.request_id == "r1" and r.transport == transport and "stale" in r.reason for r in records)
    assert not os.path.exists(shm_path(reply.transfer_token))


# --- layer streaming ----------------------------------------------------------------------------


@pytest.mark.parametrize("transport", STREAMING)
def test_layers_stream_before_the_sender_has_them_all(nats_server, transport):
    """The sender yields layer i+1 only after the receiver has seen layer i: without streaming, deadlock
    (caught by the per-layer bound); with it, every layer arrives intact and in step."""
    kv = make_kv(29)

    async def go():
        nc = await _connect(nats_server)
        async with Pair(nc, transports=[transport]) as p:
            reply = await p.recv.expect(make_offer(kv, p.send))
            header = p.send.header(reply, "r1", LAYOUT, kv.num_tokens)
            seen: list[int] = []
            arrived = asyncio.Event()

            async def produce():
                for i, layer in enumerate(kv.layers):
                    if i:
                        await asyncio.wait_for(arrived.wait(), 10)
                        arrived.clear()
                    yield i, layer

            async def consume():
                got = []
                async for i, t in p.recv.layers(reply.transfer_token, timeout=10):
                    seen.append(i)
                    got.append((i, t))
                    arrived.set()
                return got

            ack, got = await asyncio.gather(p.send.send_stream(reply, header, produce()), consume())
            kv_all, stats = await p.recv.wait(reply.transfer_token, 5)
        await nc.close()
        return ack, got, kv_all, seen

    ack, got, kv_all, seen = asyncio.run(go())
    assert ack["ok"] and seen == list(range(LAYOUT.num_layers))
    assert all(torch.equal(t, kv.layers[i]) for i, t in got)
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, kv_all.layers))


# --- faults -------------------------------------------------------------------------------------

_CHILD_SENDER = textwrap.dedent("""
    import asyncio, json, os, sys, time, torch, nats
    from pdserve.kvtransfer.channel import KVSendChannel
    from pdserve.kvtransfer.protocol import HandoffReply
    from pdserve.kvtransfer.frames import TransferHeader
    reply = HandoffReply.model_validate_json(sys.argv[1])
    header = TransferHeader.model_validate_json(sys.argv[2])
    nl = header.layout.num_layers
    nb = header.layout.num_blocks(header.num_tokens)
    async def layers():
        for i in range(nl):
            if i == nl // 2:
                print("HALF", flush=True)
                await asyncio.sleep(3600)  # the parent kills us here, mid-transfer
            yield i, torch.ones(nb, 2, header.layout.kv_heads, header.layout.block_size, header.layout.head_dim,
                                dtype=header.layout.torch_dtype)
    async def main():
        nc = None
        if reply.transport in ("nats", "objstore"):
            nc = await nats.connect(os.environ["PDSERVE_NATS_URL"], user=os.environ["PDSERVE_NATS_USER"],
                                    password=os.environ["PDSERVE_NATS_PASSWORD"])
        ch = KVSendChannel(nc, sender_id=header.sender_id, generation=header.sender_generation,
                           transports=[reply.transport])
        await ch.send_stream(reply, header, layers())
    asyncio.run(main())
""")


@pytest.mark.slow
@pytest.mark.parametrize("transport", STREAMING)
def test_sender_killed_mid_transfer(nats_server, transport):
    kv = make_kv(64)

    async def go():
        nc = await _connect(nats_server)
        async with Pair(nc, stall_timeout=1.0, transports=[transport]) as p:
            reply = await p.recv.expect(make_offer(kv, p.send))
            header = p.send.header(reply, "r1", LAYOUT, kv.num_tokens)
            child = subprocess.Popen([sys.executable, "-c", _CHILD_SENDER, reply.model_dump_json(),
                                      header.model_dump_json()], stdout=subprocess.PIPE,
                                     env={**os.environ, **nats_server.creds.env()})
            try:
                line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
                assert line.strip() == b"HALF"
                os.kill(child.pid, signal.SIGKILL)
                t0 = time.monotonic()
                with pytest.raises(TransferError, match="truncated|connection lost|stalled"):
                    await p.recv.wait(reply.transfer_token, 20)
                waited = time.monotonic() - t0
            finally:
                child.kill()
                child.wait()
            assert not p.rx._expected
        await nc.close()
        return reply, waited

    reply, waited = asyncio.run(go())
    assert waited < 15  # the stall bound (1 s) or the broken socket ended it, not the 20 s outer wait
    assert not os.path.exists(shm_path(reply.transfer_token)), "the dead sender's segment must be removed"


_CHILD_RECEIVER = textwrap.dedent("""
    import asyncio, os, sys, nats
    from pdserve.kvtransfer.channel import KVReceiveChannel
    from pdserve.basetypes import KVLayout
    from pdserve.kvtransfer.protocol import HandoffOffer
    from pdserve.kvtransfer.tcp_server import KVReceiver
    offer = HandoffOffer.model_validate_json(sys.argv[1])
    async def main():
        nc = await nats.connect(os.environ["PDSERVE_NATS_URL"], user=os.environ["PDSERVE_NATS_USER"],
                                password=os.environ["PDSERVE_NATS_PASSWORD"])
        rx = await KVReceiver(offer.layout, stall_timeout=60).start()
        reply = await KVReceiveChannel(rx, nc).expect(offer)
        print(reply.model_dump_json(), flush=True)
        await asyncio.sleep(3600)  # the parent kills us mid-receive
    asyncio.run(main())
""")


@pytest.mark.slow
@pytest.mark.parametrize("transport", STREAMING)
def test_receiver_killed_mid_receive(nats_server, transport):
    """The sender fails within its bound. What the dead receiver leaves in /dev/shm is cleaned up: a shm
    segment it granted, by the sender at once; a pooled segment a TCP receive had leased (when the receiver
    got that far before it died), by the next receiver that starts on the host, as a restarted decode does."""
    from pdserve.kvtransfer.protocol import HandoffReply
    from pdserve.kvtransfer.shm import sweep_stale_segments

    kv = make_kv(64)
    sweep_stale_segments()  # orphans of processes that died before this test are not its business
    before = our_segments()

    async def go():
        nc = await _connect(nats_server)
        send = KVSendChannel(nc, sender_id="prefill-a", generation=7, transports=[transport], timeout=2.0)
        child = subprocess.Popen([sys.executable, "-c", _CHILD_RECEIVER, make_offer(kv, send).model_dump_json()],
                                 stdout=subprocess.PIPE, env={**os.environ, **nats_server.creds.env()})
        try:
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
            reply = HandoffReply.model_validate_json(line)
            header = send.header(reply, "r1", LAYOUT, kv.num_tokens)

            async def layers():
                for i, layer in enumerate(kv.layers):
                    if i == LAYOUT.num_layers // 2:
                        os.kill(child.pid, signal.SIGKILL)
                        await asyncio.to_thread(child.wait)
                    yield i, layer

            t0 = time.monotonic()
            with pytest.raises(TransferError, match="lost|refused|stalled|nobody receives|broke|acknowledge|reach"):
                await send.send_stream(reply, header, layers())
            waited = time.monotonic() - t0
        finally:
            child.kill()
            child.wait()
        await nc.close()
        return reply, waited

    reply, waited = asyncio.run(go())
    assert waited < 15
    assert not os.path.exists(shm_path(reply.transfer_token))
    if transport == "shm":
        assert our_segments() == before, "the sender reaps the segment a dead receiver granted"
    sweep_stale_segments()  # what the next receiver to start on this host does
    assert our_segments() == before


def _nats_frames(kv: KVBlocks, header: TransferHeader) -> list[bytes]:
    out = [_msg(HELLO, header.model_dump_json().encode())]
    for i, layer in enumerate(kv.layers):
        out += [_msg(k, p, li, off) for k, li, off, p in layer_wire_pieces(i, layer)]
    out.append(_msg(END, b"{}"))
    return out


async def _raw_nats_transfer(nc, p: Pair, kv: KVBlocks, mutate, wait_timeout: float = 10.0):
    """Drive the NATS transport by hand with mutated frames; → (receiver's error, sender's replies)."""
    reply = await p.recv.expect(make_offer(kv, p.send))
    header = p.send.header(reply, "r1", LAYOUT, kv.num_tokens)
    frames = mutate(_nats_frames(kv, header))
    answers = []
    for f in frames:
        try:
            answers.append(json.loads((await nc.request(Subjects.kv_data("default", reply.transfer_token), f, timeout=2)).data))
        except Exception as e:
            answers.append(type(e).__name__)
    with pytest.raises(TransferError) as err:
        await p.recv.wait(reply.transfer_token, wait_timeout)
    assert not p.rx._expected
    return str(err.value), answers


def test_nats_corrupt_chunk_is_refused(nats_server):
    def corrupt(frames):
        bad = bytearray(frames[2])
        bad[-1] ^= 0xFF
        frames[2] = bytes(bad)
        return frames[:3]

    async def go():
        nc = await _connect(nats_server)
        async with Pair(nc, transports=["nats"]) as p:
            out = await _raw_nats_transfer(nc, p, make_kv(), corrupt)
        await nc.close()
        return out

    err, answers = asyncio.run(go())
    assert "corrupt chunk (layer 1): crc32 mismatch" in err
    assert answers[2] == {"ok": False, "error": "corrupt chunk (layer 1): crc32 mismatch"}


def test_nats_truncated_stream_is_refused(nats_server):
    async def go():
        nc = await _connect(nats_server)
        async with Pair(nc, transports=["nats"]) as p:
            out = await _raw_nats_transfer(nc, p, make_kv(), lambda f: f[:2] + f[-1:])  # HELLO, layer 0, END
        await nc.close()
        return out

    err, answers = asyncio.run(go())
    assert "END before layers [1, 2, 3]" in err and answers[-1]["ok"] is False


@pytest.mark.parametrize("transport", ["nats", "shm"])
def test_stalled_peer_fails_within_its_bound(nats_server, transport):
    """HELLO and one layer, then silence: the receiver's stall bound (0.5 s) ends it, not the 10 s wait."""
    kv = make_kv()
    before = our_segments()

    async def go():
        nc = await _connect(nats_server)
        async with Pair(nc, stall_timeout=0.5, transports=[transport]) as p:
            reply = await p.recv.expect(make_offer(kv, p.send))
            header = p.send.header(reply, "r1", LAYOUT, kv.num_tokens)
            stop = asyncio.Event()

            async def layers():
                yield 0, kv.layers[0]
                await stop.wait()

            sender = asyncio.create_task(p.send.send_stream(reply, header, layers()))
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="stalled"):
                await p.recv.wait(reply.transfer_token, 10)
            waited = time.monotonic() - t0
            stop.set()
            with pytest.raises(TransferError):
                await asyncio.wait_for(sender, 10)
            assert not p.rx._expected
        await nc.close()
        return reply, waited

    reply, waited = asyncio.run(go())
    assert waited < 8
    assert our_segments() == before and not os.path.exists(shm_path(reply.transfer_token))


def test_objstore_corrupt_or_missing_object_is_refused_and_deleted(nats_server):
    kv = make_kv()

    async def go():
        from pdserve.kvtransfer.frames import OBJECT
        from pdserve.kvtransfer.natsdata import ensure_bucket

        nc = await _connect(nats_server)
        out = []
        async with Pair(nc, transports=["objstore"]) as p:
            store = await ensure_bucket(nc.jetstream(), Buckets.kv_transfer("default"))
            for case in ("corrupt", "truncated", "missing"):
                reply = await p.recv.expect(make_offer(kv, p.send))
                header = p.send.header(reply, "r1", LAYOUT, kv.num_tokens)
                frames = _nats_frames(kv, header)[1:]
                blob = bytearray(b"".join(frames))
                if case == "corrupt":
                    blob[len(frames[0]) + len(frames[1]) - 1] ^= 0xFF  # last payload byte of layer 1
                elif case == "truncated":
                    blob = blob[: len(blob) // 2]
                name = object_name(reply.transfer_token)
                if case != "missing":
                    await store.put(name, bytes(blob))
                ref = json.dumps({"bucket": Buckets.kv_transfer("default"), "name": name}).encode()
                ans = json.loads((await nc.request(Subjects.kv_data("default", reply.transfer_token),
                                                   _msg(HELLO, header.model_dump_json().encode()) + _msg(OBJECT, ref),
                                                   timeout=5)).data)
                with pytest.raises(TransferError) as err:
                    await p.recv.wait(reply.transfer_token, 5)
                out.append((case, ans, str(err.value), name in await _objects(nc)))
        await nc.close()
        return out

    for case, ans, err, still_there in asyncio.run(go()):
        assert ans["ok"] is False and err == ans["error"]
        assert {"corrupt": "crc32 mismatch", "truncated": "stream truncated", "missing": "cannot fetch"}[case] in err
        assert not still_there, f"{case}: the object must be deleted"


def test_objstore_objects_expire_by_ttl(nats_server):
    """What a dead sender leaves in the object store goes away by itself (bucket TTL)."""
    async def go():
        from pdserve.kvtransfer.natsdata import ensure_bucket

        nc = await _connect(nats_server)
        store = await ensure_bucket(nc.jetstream(), "pdserve-kv-ttl-test", ttl_s=1.0)
        await store.put("kv-orphan", b"x" * 1000)
        present = "kv-orphan" in [o.name for o in await store.list(ignore_deletes=True)]
        deadline = time.monotonic() + 10
        gone = False
        while time.monotonic() < deadline and not gone:
            await asyncio.sleep(0.25)
            try:
                # bounded: nats-py can wait forever on an object whose chunks have expired — that
                # object is gone too (the channel's own fetch is bounded the same way)
                await asyncio.wait_for(store.get("kv-orphan"), 2.0)
            except Exception:
                gone = True
        await nc.jetstream().delete_object_store("pdserve-kv-ttl-test")
        await nc.close()
        return present, gone

    present, gone = asyncio.run(go())
    assert present and gone


def test_nats_restart_mid_flight_fails_bounded_then_recovers():
    """Own server (others share the session one): restart it while layers are in flight. Both sides end
    within their bounds, with an error on both or (when the client rides through the restart) the exact
    KV on both; nothing stays registered, and the next transfer works."""
    from pdserve.natsserver import EmbeddedNats

    server = EmbeddedNats().start()
    kv = make_kv(64)

    async def go():
        nc = await _connect(server)
        async with Pair(nc, stall_timeout=1.5, transports=["nats"]) as p:
            reply = await p.recv.expect(make_offer(kv, p.send))
            header = p.send.header(reply, "r1", LAYOUT, kv.num_tokens)

            async def layers():
                for i, layer in enumerate(kv.layers):
                    if i == 2:
                        await asyncio.to_thread(server.restart)
                    yield i, layer

            t0 = time.monotonic()
            results = await asyncio.gather(p.send.send_stream(reply, header, layers()),
                                           p.recv.wait(reply.transfer_token, 30), return_exceptions=True)
            waited = time.monotonic() - t0
            assert not p.rx._expected
            # after the reconnect the channel works again
            for _ in range(100):
                if nc.is_connected:
                    break
                await asyncio.sleep(0.1)
            reply2 = await p.recv.expect(make_offer(kv, p.send, request_id="r2"))
            h2 = p.send.header(reply2, "r2", LAYOUT, kv.num_tokens)
            ack2, (got2, _) = await asyncio.gather(p.send.send(reply2, h2, kv), p.recv.wait(reply2.transfer_token, 10))
        await nc.close()
        return results, waited, ack2, got2

    try:
        results, waited, ack2, got2 = asyncio.run(go())
    finally:
        server.close()
    # nats-py buffers what is published while it reconnects and replays it, so a quick restart can be
    # ridden through. Either way the two sides agree: both fail with TransferError, or both complete and
    # the receiver holds exactly the KV that was sent (chunk crcs checked) — never one side's success
    # over the other's failure, never a hang past the bound.
    failed = [isinstance(r, TransferError) for r in results]
    if any(failed):
        assert all(failed), results
    else:
        ack, (got, _) = results
        assert ack["ok"] and all(torch.equal(a, b) for a, b in zip(kv.layers, got.layers))
    assert waited < 25
    assert ack2["ok"] and all(torch.equal(a, b) for a, b in zip(kv.layers, got2.layers))
