"""Hypothesis against the KV data path's parsers and every NATS control message: malformed and
adversarial input (truncated, oversized, wrong kinds and versions, huge counts, NaN, negative sizes,
unicode ids) gets a clear refusal (TransferError, LayoutMismatch, ProtocolError) and nothing else,
and after the fuzz the real receiver still takes a legitimate transfer.

Bounded: each test's `max_examples` keeps the file to about a minute on a busy 2-core host. The examples are
random by default; the seed of a failure is printed (`print_blob`), and a run is repeated with
`pytest --hypothesis-seed=N`; CI may pin one with `--hypothesis-profile=ci` (derandomized).
"""
from __future__ import annotations

import asyncio
import json
import math
import socket
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhelpers import random_kv
from pdserve.basetypes import KVLayout, LayoutMismatch
from pdserve.kvtransfer import protocol
from pdserve.kvtransfer.frames import (
    CHUNK, END, FRAME_VERSION, HEADER, HELLO, MAGIC, SCALES, TCHUNK, ZCHUNK, TransferError, TransferHeader, frame,
    layer_wire_pieces, split_frames,
)
from pdserve.kvtransfer.receiver import Assembly, Receiver
from pdserve.kvtransfer.tcp_send import send_kv
from pdserve.kvtransfer.tcp_server import KVReceiver

FUZZ = settings(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])

LAYOUT = KVLayout(model_fingerprint="f00d", num_layers=2, kv_heads=2, head_dim=8, dtype="float32", block_size=4)
NUM_TOKENS = 6
REFUSALS = (TransferError, LayoutMismatch)

# ints at the edges: negative, zero, the frame fields' limits and past them
EDGE_INTS = st.one_of(st.integers(-2**70, 2**70),
                      st.sampled_from([-1, 0, 1, 2**8, 2**16 - 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 2**64]))
UNI = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
JSON_SCALARS = st.one_of(st.none(), st.booleans(), EDGE_INTS, st.floats(allow_nan=True, allow_infinity=True), UNI)
JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(UNI, inner, max_size=4)), max_leaves=12)


def _raw_header(kind: int, layer: int, crc: int, offset: int, length: int, magic=MAGIC, version=FRAME_VERSION) -> bytes:
    return HEADER.pack(magic, version, kind & 0xFF, layer & 0xFFFF, crc & 0xFFFFFFFF, offset & (2**64 - 1),
                       length & (2**64 - 1))


def _header(num_tokens: int = NUM_TOKENS, compression: str = "none", **over) -> TransferHeader:
    fields = dict(transfer_token="t", request_id="r1", sender_id="prefill-a", sender_generation=7, layout=LAYOUT,
                  num_tokens=num_tokens, num_chunks=LAYOUT.num_layers,
                  total_bytes=LAYOUT.payload_bytes(num_tokens), compression=compression)
    return TransferHeader(**{**fields, **over})


def _valid_stream(compression: str = "none") -> bytes:
    kv = random_kv(LAYOUT, NUM_TOKENS, seed=1)
    out = [b"".join(bytes(x) for x in frame(HELLO, _header(compression=compression).model_dump_json().encode()))]
    for i, layer in enumerate(kv.layers):
        for kind, li, off, payload in layer_wire_pieces(i, layer, compression, chunk_bytes=64):
            out.append(b"".join(bytes(x) for x in frame(kind, payload, li, off)))
    out.append(b"".join(bytes(x) for x in frame(END, b"{}")))
    return b"".join(out)


VALID = _valid_stream()


# ---- the frame parser -------------------------------------------------------------------------

@settings(FUZZ, max_examples=200)
@given(data=st.one_of(st.binary(max_size=200),
                      st.builds(lambda k, la, c, o, n, tail: _raw_header(k, la, c, o, n) + tail,
                                EDGE_INTS, EDGE_INTS, EDGE_INTS, EDGE_INTS, EDGE_INTS, st.binary(max_size=64))))
def test_frame_parser_refuses_garbage_cleanly(data):
    try:
        for _kind, _layer, _crc, _offset, payload in split_frames(data, 1 << 20):
            assert len(payload) <= 1 << 20
    except TransferError as e:
        assert str(e)


@settings(FUZZ, max_examples=200)
@given(cut=st.integers(0, len(VALID)), flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)),
                                                      max_size=3))
def test_truncated_or_flipped_streams_parse_or_refuse(cut, flips):
    data = bytearray(VALID[:cut])
    for pos, x in flips:
        if pos < len(data):
            data[pos] ^= x
    try:
        list(split_frames(bytes(data), 1 << 20))
    except TransferError as e:
        assert "truncated" in str(e) or "KV" in str(e) or "exceeds" in str(e), e


# ---- the receiver's assembly ------------------------------------------------------------------

FRAMES = st.lists(st.tuples(st.sampled_from([CHUNK, ZCHUNK, SCALES, TCHUNK, HELLO, END, 0, 255]),
                            st.one_of(st.integers(-3, LAYOUT.num_layers + 2), EDGE_INTS),
                            st.one_of(st.integers(0, 512), EDGE_INTS),
                            st.binary(max_size=300)), max_size=8)


@settings(FUZZ, max_examples=200)
@given(frames=FRAMES, compression=st.sampled_from(["none", "int8", "fp8"]),
       num_tokens=st.sampled_from([0, 1, NUM_TOKENS, 4 * LAYOUT.block_size]))
def test_assembly_refuses_adversarial_frames_without_crashing(frames, compression, num_tokens):
    """Wrong kinds, layers out of range (negative, huge), offsets out of order or past the layout,
    oversized and deflated-garbage payloads: each refused as such; a layer never ends up the wrong size."""
    try:
        asm = Assembly(LAYOUT, _header(num_tokens, compression))
        for kind, layer, offset, payload in frames:
            asm.accept(kind, layer, offset, payload)
        kv, stats = asm.finish()
    except (*REFUSALS, ValueError) as e:  # ValueError: the header itself is refused (no tokens)
        assert str(e)
        return
    assert all(t.shape == asm.shape for t in kv.layers) and stats["bytes"] == LAYOUT.payload_bytes(num_tokens)


# ---- the HELLO's header -----------------------------------------------------------------------

def _mutated_hello(over: dict) -> bytes:
    base = json.loads(_header().model_dump_json())
    for key, value in over.items():
        if key in base and value is None:
            del base[key]
        else:
            base[key] = value
    return json.dumps(base, allow_nan=True).encode()


HEADER_FIELDS = st.sampled_from(list(TransferHeader.model_fields) + ["extra", "v"])


@settings(FUZZ, max_examples=150)
@given(over=st.dictionaries(HEADER_FIELDS, st.one_of(st.none(), JSON), min_size=1, max_size=3))
def test_hello_headers_out_of_shape_are_refused(over):
    """A HELLO whose fields are missing, of the wrong type, negative, huge, NaN or unicode: refused with
    the reason, and the transfer agreed with this receiver is never matched by one."""
    async def go():
        rx = Receiver(LAYOUT)
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, NUM_TOKENS)
        raw = _mutated_hello({**over, "transfer_token": over.get("transfer_token", token)})
        try:
            header = TransferHeader.model_validate_json(raw)
        except ValueError:
            return "malformed"
        try:
            rx.begin(header, header.transport)
        except REFUSALS as e:
            assert str(e)
            return "refused"
        # admitted: then it says exactly what was agreed
        assert header.transfer_token == token and header.request_id == "r1" and header.num_tokens == NUM_TOKENS
        assert header.sender_generation == 7
        return "admitted"

    assert asyncio.run(go()) in ("malformed", "refused", "admitted")


# ---- every NATS control message ---------------------------------------------------------------

MESSAGES = [m for m in vars(protocol).values()
            if isinstance(m, type) and issubclass(m, protocol.Message) and m is not protocol.Message]


@settings(FUZZ, max_examples=150)
@given(cls=st.sampled_from(MESSAGES), body=st.one_of(st.binary(max_size=120), JSON.map(
    lambda j: json.dumps(j, allow_nan=True).encode())), data=st.data())
def test_control_messages_decode_or_refuse(cls, body, data):
    """Bytes, JSON of any shape, and a real message's fields replaced by adversarial values: decoded into
    the message, or a ProtocolError naming it. A decoded message holds no NaN or infinity, no negative
    size or count, and speaks this protocol's version."""
    fields = data.draw(st.dictionaries(st.one_of(st.sampled_from(sorted(cls.model_fields)), UNI), JSON, max_size=3))
    for raw in (body, _with(cls, fields)):
        try:
            msg = cls.decode(raw)
        except protocol.ProtocolError as e:
            assert cls.__name__ in str(e)
            continue
        assert msg.v == protocol.PROTOCOL_VERSION
        for name, value in msg:
            if isinstance(value, float):
                assert math.isfinite(value), (cls.__name__, name, value)
            if isinstance(value, int) and not isinstance(value, bool) and name in NON_NEGATIVE:
                assert value >= 0, (cls.__name__, name, value)


NON_NEGATIVE = {"num_tokens", "kv_bytes", "next_seq", "seq", "bytes_done", "queue_depth", "running", "waiting",
                "kv_bytes_used", "kv_bytes_capacity", "transfer_backlog_handoffs", "transfer_backlog_bytes",
                "queue_tokens", "block_size", "generation", "sender_generation"}


def _with(cls, fields: dict) -> bytes:
    """A plausible message of `cls` (every required field of a sane value) with `fields` laid over it."""
    sample = {"worker_id": "w", "role": "decode", "model": "m", "request_id": "r", "prompt_token_ids": [1],
              "sampling": {}, "seed": 1, "decode_worker_id": "d", "token_ids": [1], "accepted": True,
              "sender_id": "p", "sender_generation": 1, "layout": json.loads(LAYOUT.model_dump_json()),
              "num_tokens": 1, "kv_bytes": 1, "generated_token_ids": [], "next_seq": 0, "side": "sender",
              "transport": "tcp", "reason": "x", "seq": 0, "kind": "token"}
    body = {k: v for k, v in sample.items() if k in cls.model_fields}
    body.update({k: v for k, v in fields.items()})
    return json.dumps(body, allow_nan=True).encode()


@pytest.mark.parametrize("cls,field,value", [
    (protocol.LoadReport, "kv_utilization", "NaN"), (protocol.LoadReport, "queue_wait_seconds", "Infinity"),
    (protocol.LoadReport, "queue_depth", "-1"), (protocol.HandoffOffer, "num_tokens", "-1"),
    (protocol.StreamEvent, "seq", "-1"), (protocol.TransferFailed, "bytes_done", "-5")])
def test_a_nan_or_negative_count_is_refused(cls, field, value):
    """The cases the fuzz found, pinned: a report of NaN load or a negative count is refused by name."""
    raw = _with(cls, {}).decode().rstrip("}") + f', "{field}": {value}}}'
    with pytest.raises(protocol.ProtocolError, match=f"(?s)malformed {cls.__name__}.*{field}"):
        cls.decode(raw.encode())


def test_a_zero_probability_token_travels_as_a_finite_logprob():
    """A masked token's logprob is -inf, which JSON would carry as null and the event's decoder would
    then refuse: it travels floored at the value vLLM reports, and the event round-trips."""
    ev = protocol.StreamEvent(request_id="r", seq=0, kind="token", worker_id="d", token_ids=[5],
                              logprobs=[protocol.TokenLogprob(logprob=float("-inf"), top_ids=[1, 5],
                                                              top_logprobs=[-0.1, float("-inf")])])
    back = protocol.StreamEvent.decode(ev.encode())
    assert back.logprobs[0].logprob == protocol.LOGPROB_FLOOR
    assert back.logprobs[0].top_logprobs == [-0.1, protocol.LOGPROB_FLOOR]


# ---- the real data port -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def live_rx():
    """A real KVReceiver on loopback, its own event loop in a thread, shared by the examples."""
    import threading

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    rx = asyncio.run_coroutine_threadsafe(KVReceiver(LAYOUT, stall_timeout=2.0).start(), loop).result(10)
    yield rx, loop
    asyncio.run_coroutine_threadsafe(rx.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


@settings(FUZZ, max_examples=60)
@given(data=st.one_of(st.binary(max_size=300), st.builds(lambda cut, tail: VALID[:cut] + tail,
                                                         st.integers(0, len(VALID)), st.binary(max_size=40))))
def test_the_data_port_refuses_garbage_and_closes(live_rx, data):
    """A connection of arbitrary bytes (then end of stream) is answered (a refusal, or nothing) and
    closed, within the receiver's stall bound: never held open, never a crash."""
    rx, _ = live_rx
    host, _, port = rx.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := s.recv(65536):  # EOF within the timeout, or socket.timeout fails the test
                reply += chunk
        except ConnectionResetError:
            return  # refused before it read everything: closed, which is the point
    if reply:
        _, _, kind, _, _, _, length = struct.unpack_from(HEADER.format, reply)
        ack = json.loads(reply[HEADER.size:HEADER.size + length])
        assert ack["ok"] is False and ack["error"], ack


def test_after_the_fuzz_a_legitimate_transfer_still_arrives(live_rx):
    rx, loop = live_rx
    kv = random_kv(LAYOUT, NUM_TOKENS, seed=2)

    async def go():
        token = rx.expect("r9", "prefill-a", 7, LAYOUT, NUM_TOKENS)
        header = _header(transfer_token=token, request_id="r9")
        return await asyncio.gather(send_kv(rx.address, header, kv), rx.wait(token, 10))

    ack, (got, _) = asyncio.run_coroutine_threadsafe(go(), loop).result(30)
    assert ack["ok"] and all(torch.equal(a, b) for a, b in zip(kv.layers, got.layers))


# ---- the front's registry of workers (its load-report and bye handlers) -------------------------

class _Msg:
    def __init__(self, data: bytes):
        self.data = data


REPORTS = st.builds(
    lambda role, wid, model, nums, blocks, block_size, stale: protocol.LoadReport(
        worker_id=wid, role=role, model=model, scope="s", kv_bytes_capacity=nums[0], kv_bytes_used=nums[1],
        running=nums[2], waiting=nums[3], queue_tokens=nums[4], queue_depth=nums[5], cached_blocks=blocks,
        block_size=block_size, stale_after_s=stale).encode(),
    st.sampled_from(["prefill", "decode"]), st.one_of(UNI, st.sampled_from(["w1", "w2"])),
    st.sampled_from(["m", "m", "\u00e9\u200b"]), st.lists(st.integers(0, 2**70), min_size=6, max_size=6),
    st.lists(UNI, max_size=5), st.sampled_from([0, 1, 16, 2**31]), st.floats(0, 1e12))


@settings(FUZZ, max_examples=80)
@given(payloads=st.lists(st.one_of(REPORTS, st.binary(max_size=80), JSON.map(lambda j: json.dumps(j).encode())),
                         max_size=8), prompt=st.lists(st.integers(0, 2**31), max_size=40))
def test_the_front_registry_takes_any_reports_and_still_routes(payloads, prompt):
    """Reports with unicode ids and models, counts up to 2^70, odd block sizes, garbage in between: the
    handlers count what they refuse, routing over what they took never raises, and a sane worker
    reported after them all is the one picked where it is the only candidate."""
    from pdserve.front.registry import WorkerRegistry

    async def go():
        reg = WorkerRegistry("s")
        for data in payloads:
            await reg._on_load(_Msg(data))
            await reg._on_bye(_Msg(data[::-1]))
        reg.pick_decode("m")
        reg.pick_prefill("m", prompt)
        reg.models()
        sane = protocol.LoadReport(worker_id="sane", role="decode", model="only-sane", scope="s",
                                   kv_bytes_capacity=1 << 30)
        await reg._on_load(_Msg(sane.encode()))
        return reg.pick_decode("only-sane")

    picked = asyncio.run(go())
    assert picked is not None and picked.worker_id == "sane"


# ---- the NATS data receiver (chunked messages, object references) -------------------------------

@pytest.fixture(scope="module")
def nats_loop(nats_server):
    """A NATS connection to the real server on an event loop of its own, shared by the examples."""
    import threading

    import nats

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    nc = asyncio.run_coroutine_threadsafe(nats.connect(**nats_server.creds.connect_kwargs()), loop).result(10)
    yield nc, loop
    asyncio.run_coroutine_threadsafe(nc.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def _nats_stream(token: str, kv) -> bytes:
    """A whole transfer as one NATS message: HELLO, every layer's chunks, END."""
    out = [b"".join(bytes(x) for x in frame(HELLO, _header(transfer_token=token, transport="nats")
                                                   .model_dump_json().encode()))]
    for i, layer in enumerate(kv.layers):
        for kind, li, off, payload in layer_wire_pieces(i, layer, "none", chunk_bytes=64):
            out.append(b"".join(bytes(x) for x in frame(kind, payload, li, off)))
    out.append(b"".join(bytes(x) for x in frame(END, b"{}")))
    return b"".join(out)


@settings(FUZZ, max_examples=40)
@given(garbage=st.one_of(st.none(), st.binary(max_size=200)), cut=st.floats(0, 1),
       flips=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), max_size=3),
       ref=st.one_of(st.none(), JSON))
def test_the_nats_data_receiver_refuses_garbage_and_lets_go(nats_loop, garbage, cut, flips, ref):
    """A transfer's subject fed garbage, a cut or bit-flipped stream, or a foreign object reference: the
    answer is a refusal with its reason (or, for a stream left whole, the KV), the transfer ends either
    way, and its subscription is dropped."""
    from pdserve.kvtransfer.natsdata import NatsTransferServer
    from pdserve.kvtransfer.protocol import Subjects

    nc, loop = nats_loop
    kv = random_kv(LAYOUT, NUM_TOKENS, seed=3)

    async def go():
        rx = Receiver(LAYOUT, stall_timeout=0.3)
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, NUM_TOKENS, transport="nats")
        # a stream cut at a frame's end is answered ok, then goes silent: the stall bound ends it
        await NatsTransferServer(nc, rx, token, 0.3).start()
        if garbage is not None:
            data = garbage
        elif ref is not None:  # an object reference that is not this transfer's own
            head = b"".join(bytes(x) for x in frame(HELLO, _header(transfer_token=token, transport="objstore")
                                                           .model_dump_json().encode()))
            data = head + b"".join(bytes(x) for x in frame(7, json.dumps(ref).encode()))
        else:
            data = bytearray(_nats_stream(token, kv))
            data = data[:max(1, int(cut * len(data)))]
            for pos, x in flips:
                data[int(pos * (len(data) - 1))] ^= x
            data = bytes(data)
        reply = json.loads((await nc.request(Subjects.kv_data("default", token), data, timeout=5)).data)
        try:
            got, _ = await rx.wait(token, 5)
            outcome = "delivered"
        except TransferError as e:
            assert str(e)
            outcome = "failed"
        subject = Subjects.kv_data("default", token)
        for _ in range(100):  # the cleanup's unsubscribe is a task of its own: a few turns of the loop
            if not any(sub.subject == subject for sub in nc._subs.values()):
                break
            await asyncio.sleep(0)
        left = [sub.subject for sub in nc._subs.values() if sub.subject == subject]
        return reply, outcome, left, got if outcome == "delivered" else None

    reply, outcome, left, got = asyncio.run_coroutine_threadsafe(go(), loop).result(30)
    if reply["ok"] is False:
        assert reply["error"] and outcome == "failed", (reply, outcome)
    elif outcome == "delivered":  # a stream that survived the cut and flips whole
        assert all(torch.equal(a, b) for a, b in zip(kv.layers, got.layers))
    assert left == []  # the transfer's subscription is gone, however it ended


def test_after_the_fuzz_a_nats_transfer_still_arrives(nats_loop):
    from pdserve.kvtransfer.natsdata import NatsTransferServer, send_kv_nats

    nc, loop = nats_loop
    kv = random_kv(LAYOUT, NUM_TOKENS, seed=4)

    async def layers():
        for i, layer in enumerate(kv.layers):
            yield i, layer

    async def go():
        rx = Receiver(LAYOUT, stall_timeout=2.0)
        token = rx.expect("r2", "prefill-a", 7, LAYOUT, NUM_TOKENS, transport="nats")
        await NatsTransferServer(nc, rx, token, 2.0).start()
        header = _header(transfer_token=token, request_id="r2", transport="nats")
        return await asyncio.gather(send_kv_nats(nc, header, layers()), rx.wait(token, 10))

    ack, (got, _) = asyncio.run_coroutine_threadsafe(go(), loop).result(30)
    assert ack["ok"] and all(torch.equal(a, b) for a, b in zip(kv.layers, got.layers))
