"""The front's worker registry over a real NATS server: liveness from heartbeats, scopes kept apart."""
from __future__ import annotations

import asyncio
import time

import nats

from pdserve.front.registry import WorkerRegistry
from pdserve.kvtransfer.protocol import LoadReport, Subjects


class Clock:
    """The registry's clock, moved by the test: staleness without waiting for it."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def until(cond, what: str, timeout: float = 10.0):
    """Wait (bounded) until `cond()` holds: the registry has processed what was published."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_registry_sees_only_its_scope_and_forgets_the_silent(nats_server):
    async def go():
        async with await nats.connect(**nats_server.creds.connect_kwargs()) as nc:
            clock = Clock()
            reg = WorkerRegistry("ns.llama", clock=clock)
            await reg.attach(nc)

            async def beat(scope, role, wid, **kw):
                r = LoadReport(worker_id=wid, role=role, model="m", scope=scope, **kw)
                await nc.publish(Subjects.load(scope, role, wid), r.encode())

            await beat("ns.llama", "decode", "d1", running=3, stale_after_s=0.6)
            await beat("ns.llama", "decode", "d2", running=1, stale_after_s=5)
            await beat("ns.other", "decode", "d3", running=0)  # same model, other deployment
            await nc.publish(Subjects.load("ns.llama", "decode", "bad"), b"{not json")
            await beat("ns.llama", "prefill", "p1")  # published last: once seen, all before it were
            await until(lambda: reg.alive("prefill"), "p1's report")
            first = sorted(r.worker_id for r in reg.alive("decode", "m"))
            picked = reg.pick_decode("m").worker_id
            clock.now += 0.7  # d1 stops beating and goes stale
            later = sorted(r.worker_id for r in reg.alive("decode", "m"))
            await nc.publish(Subjects.bye("ns.llama", "prefill", "p1"),
                             LoadReport(worker_id="p1", role="prefill", model="m", scope="ns.llama").encode())
            await until(lambda: not reg.alive("prefill"), "p1's bye")
            return first, picked, later, reg.alive("prefill", "m"), reg.malformed

    first, picked, later, prefill_after_bye, malformed = asyncio.run(go())
    assert first == ["d1", "d2"]  # d3 belongs to another scope
    assert picked == "d2"  # fewest running sequences
    assert later == ["d2"]
    assert prefill_after_bye == []
    assert malformed == 1


def test_a_draining_worker_is_followed_but_never_picked(nats_server):
    """After `bye` a worker gets no new work, yet its heartbeats keep the requests it holds followed
    (even a beat late past the staleness bound); restarted under the same id (a newer generation),
    it is picked again. A request's error names how its worker was last heard of."""
    async def go():
        async with await nats.connect(**nats_server.creds.connect_kwargs()) as nc:
            clock = Clock()
            reg = WorkerRegistry("s", clock=clock)
            await reg.attach(nc)

            async def send(subject_of, gen):
                r = LoadReport(worker_id="d1", role="decode", model="m", scope="s", generation=gen)
                await nc.publish(subject_of("s", "decode", "d1"), r.encode())

            def state(name):
                return name, reg.pick_decode("m") is not None, reg.is_alive("decode", "d1")

            seen = []
            await send(Subjects.load, 1)
            await until(lambda: reg.alive("decode"), "d1's report")
            seen.append(state("beating"))
            await send(Subjects.bye, 1)
            await until(lambda: not reg.alive("decode"), "d1's bye")
            seen.append(state("bye"))
            clock.now += 4.0  # past stale_after_s (3 s) without a beat
            seen.append(state("silent"))
            heard = [reg.last_heard("decode", "d1"), reg.last_heard("decode", "never")]
            await send(Subjects.load, 1)  # a late beat of the draining process
            await until(lambda: reg.is_alive("decode", "d1"), "d1's late beat")
            seen.append(state("late beat"))
            await send(Subjects.load, 2)  # a new process under the same id
            await until(lambda: reg.alive("decode"), "d1's restart")
            seen.append(state("restarted"))
            heard.append(reg.last_heard("decode", "d1"))
            return seen, heard

    seen, heard = asyncio.run(go())
    assert seen == [("beating", True, True), ("bye", False, True), ("silent", False, False),
                    ("late beat", False, True), ("restarted", True, True)]
    assert heard == ["its last heartbeat was 4.0 s ago, after it said bye (draining)",
                     "no heartbeat from it was ever seen", "its last heartbeat was 0.0 s ago"]


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
            await until(lambda: len(reg.alive()) == 4, "the four reports")
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


def test_pool_sizes_and_restarts_on_the_front_metrics(nats_server):
    """`pdserve_workers{role}` counts the workers taking work; a worker back under a newer generation counts
    as a restart (what the dashboard's P:D ratio and the flapping alert read)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.front.registry import RegistryCollector

    async def go():
        async with await nats.connect(**nats_server.creds.connect_kwargs()) as nc:
            reg = WorkerRegistry("ns.llama")
            await reg.attach(nc)
            prom = CollectorRegistry()
            prom.register(RegistryCollector(reg, "m"))
            for role, wid, gen in [("prefill", "p1", 1), ("prefill", "p2", 1), ("decode", "d1", 1),
                                   ("decode", "d1", 1), ("decode", "d1", 2), ("decode", "d2", 1)]:
                r = LoadReport(worker_id=wid, role=role, model="m", scope="ns.llama", generation=gen)
                await nc.publish(Subjects.load("ns.llama", role, wid), r.encode())
            await until(lambda: len(reg.alive()) == 4 and reg.restarts["decode"], "the reports")
            return generate_latest(prom).decode()

    text = asyncio.run(go())
    assert 'pdserve_workers{role="prefill"} 2.0' in text and 'pdserve_workers{role="decode"} 2.0' in text
    assert 'pdserve_workers{role="draft"} 0.0' in text
    assert 'pdserve_worker_restarts_total{role="decode"} 1.0' in text
    assert 'pdserve_worker_restarts_total{role="prefill"} 0.0' in text
