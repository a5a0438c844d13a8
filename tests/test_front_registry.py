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
                await nc.publish(Subjects.load(role, wid), r.encode())

            await beat("ns.llama", "decode", "d1", running=3, stale_after_s=0.6)
            await beat("ns.llama", "decode", "d2", running=1, stale_after_s=5)
            await beat("ns.other", "decode", "d3", running=0)  # same model, other deployment
            await beat("ns.llama", "prefill", "p1")
            await nc.publish(Subjects.load("decode", "bad"), b"{not json")
            await nc.flush()
            await asyncio.sleep(0.2)
            first = sorted(r.worker_id for r in reg.alive("decode", "m"))
            picked = reg.pick_decode("m").worker_id
            await asyncio.sleep(0.7)  # d1 stops beating and goes stale
            later = sorted(r.worker_id for r in reg.alive("decode", "m"))
            await nc.publish(Subjects.bye("prefill", "p1"), LoadReport(worker_id="p1", role="prefill", model="m",
                                                                       scope="ns.llama").encode())
            await nc.flush()
            await asyncio.sleep(0.2)
            return first, picked, later, reg.alive("prefill", "m"), reg.malformed

    first, picked, later, prefill_after_bye, malformed = asyncio.run(go())
    assert first == ["d1", "d2"]  # d3 belongs to another scope
    assert picked == "d2"  # fewest running sequences
    assert later == ["d2"]
    assert prefill_after_bye == []
    assert malformed == 1
