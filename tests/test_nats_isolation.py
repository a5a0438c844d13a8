"""Deployments on one REAL nats-server, each with credentials confined to its own scope
(`protocol.permissions`): one cannot publish into, subscribe on, or read the replies and buckets of
another, and each still serves. Also: the metrics adapter's read-only user, and TLS to NATS."""
from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest
import torch

from kvhelpers import random_kv
from pdserve.basetypes import KVLayout, SamplingParams
from pdserve.kvtransfer.channel import KVReceiveChannel, KVSendChannel
from pdserve.kvtransfer.natsdata import ensure_bucket
from pdserve.kvtransfer.protocol import (
    Buckets, HandoffOffer, LoadReport, Subjects, inbox_prefix, observer_permissions, permissions, settle,
)
from pdserve.kvtransfer.tcp_server import KVReceiver
from pdserve.natsserver import EmbeddedNats, NatsUser, ServerTls

A, B = "ns-a.llama", "ns-b.llama"
LAYOUT = KVLayout(model_fingerprint="f00d", num_layers=3, kv_heads=2, head_dim=8, dtype="float32", block_size=4)
BOUND_S = 30  # how long an awaited message may take: a bound on a hang, generous for a loaded host


@pytest.fixture(scope="module")
def tenants():
    """A server with the administrator, two confined deployments and the metrics adapter's observer."""
    users = [NatsUser("isvc-a", "pw-a", permissions(A)), NatsUser("isvc-b", "pw-b", permissions(B)),
             NatsUser("adapter", "pw-obs", observer_permissions())]
    with EmbeddedNats(users=users) as server:
        yield server


class Client:
    """A connection that records the server's asynchronous errors (permission violations arrive so)."""

    def __init__(self):
        self.errors: list[str] = []
        self.violation = asyncio.Event()

    async def connect(self, creds) -> "Client":
        async def on_error(e):
            self.errors.append(str(e).lower())  # nats-py lowercases the server's -ERR text
            if "permissions violation" in self.errors[-1]:
                self.violation.set()

        self.nc = await creds.connect(wait_s=5, error_cb=on_error, max_reconnect_attempts=0)
        return self

    async def violated(self, what: str) -> None:
        """Wait (bounded) until the server reports a permission violation naming `what`."""
        while not any(what.lower() in e for e in self.errors):
            self.violation.clear()
            await asyncio.wait_for(self.violation.wait(), BOUND_S)


def _as(tenants, user: str, password: str, scope: str | None):
    return tenants.creds.with_user(user, password, scope)


def test_a_deployment_cannot_reach_another(tenants):
    async def go():
        a = await Client().connect(_as(tenants, "isvc-a", "pw-a", A))
        b = await Client().connect(_as(tenants, "isvc-b", "pw-b", B))
        admin = await nats.connect(**tenants.creds.connect_kwargs())
        seen_by_admin: list[str] = []
        marker = asyncio.Event()

        async def watch(msg):
            seen_by_admin.append(msg.subject)
            if msg.subject == Subjects.stream(A, "marker"):
                marker.set()

        await admin.subscribe(">", cb=watch)
        await settle(admin)

        # publishing into B: every kind of subject B has, and B's inbox (a forged reply)
        b_subjects = [Subjects.prefill(B, "m"), Subjects.decode_handoff(B, "d0"), Subjects.stream(B, "r1"),
                      Subjects.cancel(B, "r1"), Subjects.load(B, "decode", "d0"), Subjects.kv_data(B, "t"),
                      Subjects.kv_failed(B, "r1"), Subjects.preposition(B, "p0"), f"{inbox_prefix(B)}.x.y",
                      f"$O.{Buckets.kv_transfer(B)}.C.x", f"$JS.API.STREAM.INFO.OBJ_{Buckets.prefix(B)}"]
        for s in b_subjects:
            await a.nc.publish(s, b"from a")
        await a.nc.publish(Subjects.stream(A, "marker"), b"a's own")  # after the others, on one connection
        await asyncio.wait_for(marker.wait(), BOUND_S)
        for s in b_subjects:
            await a.violated(f"Publish to \"{s}\"")
        assert not set(b_subjects) & set(seen_by_admin), "a message of A reached B's subjects"

        # subscribing on B, on B's inbox (its replies), on everything
        got: list[str] = []

        async def take(msg):
            got.append(msg.subject)

        for s in (Subjects.stream(B, "*"), Subjects.load_all(B), f"{inbox_prefix(B)}.>", "_INBOX.>", ">",
                  "pdserve.v2.>"):
            await a.nc.subscribe(s, cb=take)
            await a.violated(f"Subscription to \"{s}\"")
        own = await a.nc.subscribe(Subjects.stream(A, "mine"))
        # B asks and answers on its own subjects; A hears none of it, and then hears its own message
        async def answer(msg):
            await msg.respond(b"b's reply")

        await b.nc.subscribe(Subjects.decode_handoff(B, "d0"), cb=answer)
        await b.nc.flush()
        assert (await b.nc.request(Subjects.decode_handoff(B, "d0"), b"offer", timeout=BOUND_S)).data == b"b's reply"
        await admin.publish(Subjects.stream(B, "r1"), b"for b")
        await admin.publish(Subjects.stream(A, "mine"), b"for a")
        assert (await own.next_msg(BOUND_S)).data == b"for a"
        assert got == [], "A received B's traffic"

        # B's object-store buckets: not even their stream's info
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await a.nc.jetstream(timeout=1).object_store(Buckets.kv_transfer(B))
        for nc in (a.nc, b.nc, admin):
            await nc.close()

    asyncio.run(go())


def test_a_confined_deployment_still_transfers_kv_over_every_nats_transport(tenants):
    """The KV channel with A's credentials on both sides: chunked NATS messages and the object store
    (JetStream API, object subjects, flow control, acks) all within A's permissions."""
    kv = random_kv(LAYOUT, 37, seed=37)

    async def go():
        creds = _as(tenants, "isvc-a", "pw-a", A)
        decode, prefill = await Client().connect(creds), await Client().connect(creds)
        rx = await KVReceiver(LAYOUT).start()
        out = {}
        for transport in ("nats", "objstore"):
            recv = KVReceiveChannel(rx, decode.nc, scope=A, worker_id="decode-a")
            send = KVSendChannel(prefill.nc, scope=A, sender_id="prefill-a", generation=7, transports=[transport])
            offer = HandoffOffer(request_id=f"r-{transport}", sender_id="prefill-a", sender_generation=7,
                                 layout=LAYOUT, num_tokens=kv.num_tokens, kv_bytes=kv.nbytes,
                                 prompt_token_ids=[1], generated_token_ids=[2], sampling=SamplingParams(), seed=0,
                                 next_seq=1, **send.offer_fields())
            reply = await recv.expect(offer)
            header = send.header(reply, offer.request_id, LAYOUT, kv.num_tokens)
            ack, (got, stats) = await asyncio.gather(send.send(reply, header, kv),
                                                     recv.wait(reply.transfer_token, 10))
            out[transport] = (ack["ok"], stats["transport"], all(torch.equal(x, y) for x, y in zip(kv.layers,
                                                                                                  got.layers)))
        await rx.close()
        errors = decode.errors + prefill.errors
        await decode.nc.close()
        await prefill.nc.close()
        return out, errors

    out, errors = asyncio.run(go())
    assert out == {"nats": (True, "nats", True), "objstore": (True, "objstore", True)}
    assert errors == []


def test_the_metrics_adapter_reads_every_deployment_and_speaks_for_none(tenants):
    """The observer reads all deployments' load reports and may publish nothing; a report that A sends
    naming B's InferenceService is refused by the adapter (A may publish only on its own subjects)."""
    from pdserve.autoscale.adapter import MetricsAdapter

    async def go():
        obs = await Client().connect(_as(tenants, "adapter", "pw-obs", None))
        a = await Client().connect(_as(tenants, "isvc-a", "pw-a", A))
        adapter = MetricsAdapter()
        got = asyncio.Queue()
        async def take(msg):
            got.put_nowait(msg)

        await obs.nc.subscribe(Subjects.LOAD_ANY, cb=take)
        await settle(obs.nc)
        mine = LoadReport(worker_id="w1", role="decode", model="m", isvc="llama", namespace="ns-a", pod="p1",
                          scope=A, running=3)
        forged = mine.model_copy(update={"namespace": "ns-b", "scope": B, "pod": "p2"})
        await a.nc.publish(Subjects.load(A, "decode", "w1"), mine.encode())
        await a.nc.publish(Subjects.load(A, "decode", "w2"), forged.encode())
        for _ in range(2):
            msg = await asyncio.wait_for(got.get(), BOUND_S)
            adapter.on_report(msg.data, subject=msg.subject)
        await obs.nc.publish(Subjects.load(B, "decode", "w3"), mine.encode())
        await obs.violated("Publish to")
        for c in (obs, a):
            await c.nc.close()
        return adapter

    adapter = asyncio.run(go())
    assert [e.report.pod for e in adapter.store.fresh("ns-a")] == ["p1"]
    assert adapter.store.fresh("ns-b") == [] and len(adapter.store) == 1
    assert adapter.reports_total.labels("foreign")._value.get() == 1


def test_tls_to_nats_verifies_the_server(tmp_path):
    """A server that speaks TLS only: a client with its CA connects and serves; one that does not trust
    that CA (none given: the system's; or another) is refused."""
    from pdserve.autoscale.certs import make_serving_cert

    certs = make_serving_cert(tmp_path / "server", ["127.0.0.1"])
    other = make_serving_cert(tmp_path / "other", ["127.0.0.1"])

    async def go(server):
        nc = await server.creds.connect(wait_s=5)
        sub = await nc.subscribe(Subjects.stream(A, "r"))
        await nc.publish(Subjects.stream(A, "r"), b"over tls")
        data = (await sub.next_msg(BOUND_S)).data
        tls_used = nc._transport._io_writer.get_extra_info("ssl_object") is not None  # nats-py's TCP transport
        await nc.close()
        outcomes = []
        for creds in (server.creds.__class__(server.creds.url, server.creds.user, server.creds.password),
                      server.creds.__class__(server.creds.url, server.creds.user, server.creds.password,
                                             tls_ca=str(other.ca_cert))):
            try:
                bad = await nats.connect(**creds.connect_kwargs(), allow_reconnect=False, connect_timeout=3)
                await bad.close()
                outcomes.append("connected")
            except Exception as e:
                outcomes.append(type(e).__name__ + ": " + str(e))
        return data, tls_used, outcomes

    with EmbeddedNats(tls=ServerTls(str(certs.cert), str(certs.key)), ca=str(certs.ca_cert)) as server:
        data, tls_used, outcomes = asyncio.run(go(server))
    assert data == b"over tls" and tls_used
    assert all("CERTIFICATE_VERIFY_FAILED" in o for o in outcomes), outcomes
