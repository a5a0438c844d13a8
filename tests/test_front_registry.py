"""The front's worker registry over a real NATS server: liveness from heartbeats, scopes kept apart."""
from __future__ import annotations

import asyncio
import time

import nats

from pdserve.front.registry import WorkerRegistry
from pdserve.kvtransfer.protocol import LoadReport, Subjects


def test_registry_sees_only_its_scope_and_forgets_the_silent(nats_server):
    async def go():
        async with await nats.connect(**nats_server.creds.connect_kwargs()) as nc:
            reg = WorkerRegistry("ns.llama")
            await reg.attach(nc)

            async def beat(scope, role, wid, **kw):
                r = LoadReport(worker_id=wid, role=role, model="m", scope=scope, **kw)
                await nc.publish(Subjects.load(scope, role, wid), r.encode())

            await beat("ns.llama", "decode", "d1", running=3, stale_after_s=0.6)
            await beat("ns.llama", "decode", "d2", running=1, stale_after_s=5)
            await beat("ns.other", "decode", "d3", running=0)  # same model, other deployment
            await beat("ns.llama", "prefill", "p1")
            await nc.publish(Subjects.load("ns.llama", "decode", "bad"), b"{not json")
            await nc.flush()
            await asyncio.sleep(0.2)
            first = sorted(r.worker_id for r in reg.alive("decode", "m"))
            picked = reg.pick_decode("m").worker_id
            await asyncio.sleep(0.7)  # d1 stops beating and goes stale
            later = sorted(r.worker_id for r in reg.alive("decode", "m"))
            await nc.publish(Subjects.bye("ns.llama", "prefill", "p1"),
                             LoadReport(worker_id="p1", role="prefill", model="m", scope="ns.llama").encode())
            await nc.flush()
            await asyncio.sleep(0.2)
            return first, picked, later, reg.alive("prefill", "m"), reg.malformed

    first, picked, later, prefill_after_bye, malformed = asyncio.run(go())
    assert first == ["d1", "d2"]  # d3 belongs to another scope
    assert picked == "d2"  # fewest running sequences
    assert later == ["d2"]
    assert prefill_after_bye == []
    assert malformed == 1


def test_routing_prefers_the_cached_prefix_balanced_against_load_and_decode_by_free_kv(nats_server):
    """Prefill: the worker announcing the prompt's longest cached prefix wins unless its queue outweighs
    the saving; decode: the most free KV capacity wins, counting what the caller already sent."""
    from pdserve.basetypes import announced, prefix_hashes

    prompt = list(range(100, 420))  # 320 tokens = 20 blocks of 16
    chain = [announced(h) for h in prefix_hashes(prompt, 16)]

    async def go():
        async with await nats.connect(**nats_server.creds.connect_kwargs()) as nc:
            reg = WorkerRegistry("s")
            await reg.attach(nc)

            async def beat(role, wid, **kw):
                await nc.publish(Subjects.load("s", role, wid), LoadReport(worker_id=wid, role=role, model="m", scope="s",
                                                                           **kw).encode())

            await beat("prefill", "warm", block_size=16, cached_blocks=chain[:12] + ["00" * 8], queue_tokens=50)
            await beat("prefill", "cold", block_size=16, cached_blocks=chain[1:], queue_tokens=0)  # no root: no match
            await beat("decode", "full", kv_bytes_capacity=1000, kv_bytes_used=900, running=1)
            await beat("decode", "roomy", kv_bytes_capacity=1000, kv_bytes_used=200, running=5)
            await nc.flush()
            await asyncio.sleep(0.2)
            warm, hit = reg.pick_prefill("m", prompt)
            # 192 cached tokens save more than the 50 queued there cost ...
            busy, _ = reg.pick_prefill("m", prompt, inflight_tokens={"warm": 400})
            # ... but not once 400 tokens are already on their way to it
            roomy = reg.pick_decode("m").worker_id
            after_sends = reg.pick_decode("m", inflight={"roomy": 3}, inflight_bytes={"roomy": 950}).worker_id
            return warm.worker_id, hit, busy.worker_id, roomy, after_sends

    warm, hit, busy, roomy, after_sends = asyncio.run(go())
    assert (warm, hit) == ("warm", 192)
    assert busy == "cold"
    assert roomy == "roomy"
    assert after_sends == "full"
