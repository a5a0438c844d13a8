"""The draft pool: its suffix index, the pool and a decode worker's drafter on a real NATS server, and
decode workers drafting through a real pool process on the real model.

Nothing here is faked: the pool, its asks and reports run over an authenticated nats-server; the
end-to-end test runs prefill, decode, front and `pdserve draftpool` as processes.
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid

import nats
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.config import DraftPoolConfig
from pdserve.decode.drafters import NgramDrafter, brute_force_ngram_proposal
from pdserve.decode.pool_drafter import PoolDrafter
from pdserve.draftpool.index import SuffixIndex
from pdserve.draftpool.server import DraftPool
from pdserve.kvtransfer.protocol import DraftReply, DraftRequest, Subjects

from bench.sse import sse_events
from servinghelpers import metric, post

# ------------------------------------------------------------------------------------------ the index


def test_lookup_matches_prompt_lookup_over_the_same_text():
    """A one-document index proposes what prompt lookup over that document + the tail would."""
    rng = random.Random(3)
    for _ in range(200):
        doc = [rng.randrange(6) for _ in range(rng.randrange(5, 60))]
        tail = [rng.randrange(6) for _ in range(rng.randrange(2, 9))]
        idx = SuffixIndex(min_n=2, max_n=5)
        idx.add("t", "d", doc)
        got, n = idx.lookup("t", tail, 4)
        # reference: the longest suffix of the tail that occurs in the doc with a follower, latest occurrence
        want, want_n = [], 0
        for m in range(min(5, len(tail)), 1, -1):
            ends = [e for e in range(m, len(doc)) if doc[e - m:e] == tail[-m:]]
            if ends:
                want, want_n = doc[max(ends):max(ends) + 4], m
                break
        assert (got, n) == (want, want_n)


def test_tenants_are_separate_unless_shared():
    text = list(range(100, 140))
    idx = SuffixIndex(min_n=2, max_n=6)
    idx.add("acme", "r1", text)
    assert idx.lookup("acme", text[:10], 5) == (text[10:15], 6)
    assert idx.lookup("globex", text[:10], 5) == ([], 0)
    shared = SuffixIndex(min_n=2, max_n=6, share_tenants=True)
    shared.add("acme", "r1", text)
    assert shared.lookup("globex", text[:10], 5) == (text[10:15], 6)


def test_memory_stays_bounded_and_evicts_least_recently_used():
    idx = SuffixIndex(min_n=2, max_n=4, max_tokens=300)
    docs = {f"r{i}": [1000 * i + j for j in range(100)] for i in range(5)}
    for name in ("r0", "r1", "r2"):
        idx.add("t", name, docs[name])
    assert idx.lookup("t", docs["r0"][:20], 3)[0] == docs["r0"][20:23]  # r0 is now the most recently used
    idx.add("t", "r3", docs["r3"])  # over the bound: r1, the least recently used, goes
    assert idx.num_tokens <= 300 and len(idx) == 3
    assert idx.lookup("t", docs["r1"][:20], 3) == ([], 0)
    assert idx.lookup("t", docs["r0"][:20], 3)[0] == docs["r0"][20:23]
    for name in ("r4", "r0", "r2", "r3"):
        idx.add("t", name, docs[name])
    assert idx.num_tokens <= 300
    # every n-gram left points into a live document: evicted text leaves nothing behind
    grams = idx._grams["t"]
    assert len(grams) == sum(len(d) - n for d in idx._docs.values() for n in range(2, 5))


def test_brute_force_reference_agrees_with_the_local_drafter_it_complements():
    """The pool drafter's local half is plain prompt lookup (the same proposal as its reference)."""
    d = NgramDrafter(min_reach=0.0)
    toks = [5, 6, 7, 8, 5, 6]
    assert d.propose_now("r", toks, 3).token_ids == brute_force_ngram_proposal(toks, 3, 2, 8)


# ------------------------------------------------------------------------------------------ over NATS


def pool_config(**kw) -> DraftPoolConfig:
    """A pool of a scope of its own: no other test's pool or asker shares its subjects."""
    return DraftPoolConfig(scope=f"test-pool-{uuid.uuid4().hex[:8]}", served_model_name="m", **kw)


async def _connect(nats_server):
    return await nats.connect(**nats_server.creds.connect_kwargs())


async def _ask(nc, subject: str, data: bytes, timeout: float = 60.0):
    """A request to a pool that has subscribed, asked again while NATS answers "no responders": now and then
    a request sent right after a subscriber's subscribe and flush finds none (as kvtransfer.natsdata's first
    message does, which retries the same way), and the tests here count asks the pool must receive."""
    deadline = asyncio.get_running_loop().time() + 2.0
    while True:
        try:
            return await nc.request(subject, data, timeout=timeout)
        except nats.errors.NoRespondersError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.02)


def _drafter(tenant: str, **kw) -> PoolDrafter:
    return PoolDrafter(NgramDrafter(), tenant_of=lambda rid: tenant, timeout_s=30.0, **kw)  # no deadline at stake here


async def _report_and_wait(pool: DraftPool, drafter: PoolDrafter, rid: str, tokens: list[int]) -> None:
    """End a request on `drafter` (it reports the tokens) and wait until the pool has indexed them.

    The request proposes nothing (k = 0), so it never asks the pool: were an ask to find no responder, the
    back-off it earns would skip the ask the test is about. (The pool's start settles its subscriptions —
    `protocol.settle` — since a report sent after a bare flush was once lost in CI, and this wait hung.)"""
    pool.indexed.clear()
    await drafter.propose(rid, tokens, 0)
    drafter.release(rid)
    try:
        await asyncio.wait_for(pool.indexed.wait(), 30.0)
    except asyncio.TimeoutError:
        raise AssertionError(f"the pool never indexed {rid}'s report (reports so far: "
                             f"{pool.m_reports._value.get():.0f})") from None


def test_pool_drafts_a_tenants_requests_from_its_earlier_requests_only(nats_server):
    tool_call = list(range(500, 560))  # a tool call's tokens, as an earlier request produced them

    async def main():
        nc_pool, nc_a, nc_b = await _connect(nats_server), await _connect(nats_server), await _connect(nats_server)
        pool = DraftPool(pool_config())
        await pool.start(nc_pool)
        acme, globex = _drafter("acme"), _drafter("globex")
        acme.attach(nc_a, pool.cfg.deployment_scope, "m")
        globex.attach(nc_b, pool.cfg.deployment_scope, "m")
        await _report_and_wait(pool, acme, "earlier", [1, 2, 3] + tool_call)

        context = [9, 9, 4] + tool_call[:12]  # a new request starts the same tool call
        assert NgramDrafter().propose_now("x", context, 6).token_ids == []  # nothing to find in its own text
        answered = acme.stats.asks["answered"]
        d = await acme.propose("new-a", context, 6)
        assert d.token_ids and d.token_ids == tool_call[12:12 + len(d.token_ids)]
        assert acme.stats.asks["answered"] == answered + 1
        other = await globex.propose("new-b", context, 6)
        assert other.token_ids == []  # another tenant's text never drafts for it
        assert globex.stats.asks["answered"] == 1  # asked, and answered with nothing
        # feedback is booked under the drafter that proposed
        acme.trim("new-a", len(d.token_ids))
        acme.feedback("new-a", len(d.token_ids), tool_call[12:12 + len(d.token_ids) + 1])
        assert acme.stats.draft_tokens["pool"] == len(d.token_ids) == acme.stats.accepted_tokens["pool"]
        registry = CollectorRegistry()
        registry.register(acme.stats)  # what the decode worker exports
        text = generate_latest(registry).decode()
        assert f'pdserve_spec_drafter_accepted_tokens_total{{drafter="pool"}} {len(d.token_ids)}.0' in text
        assert f'pdserve_spec_pool_asks_total{{outcome="answered"}} {answered + 1}.0' in text
        await pool.close()
        for nc in (nc_pool, nc_a, nc_b):
            await nc.close()

    asyncio.run(main())


def test_pool_answers_concurrent_asks_in_one_batch(nats_server):
    async def main():
        nc_pool, nc = await _connect(nats_server), await _connect(nats_server)
        pool = DraftPool(pool_config())
        await pool.start(nc_pool, serve=False)  # passes run when the test says
        pool.index.add("t", "doc", list(range(200, 260)))
        asks = [asyncio.create_task(_ask(
            nc, pool.subject, DraftRequest(request_id=f"r{i}", tenant="t", tail=[200 + i, 201 + i],
                                           k=3, timeout_ms=60_000).encode()))
            for i in range(8)]
        while pool.waiting < 8:
            await asyncio.wait_for(pool.arrived.wait(), 30.0)  # a bound on a hang: an ask that never came
            pool.arrived.clear()
        assert await pool.serve_once() == 8
        replies = [DraftReply.decode(m.data) for m in await asyncio.gather(*asks)]
        for i, r in enumerate(replies):
            assert r.batch_size == 8
            assert r.token_ids == [202 + i, 203 + i, 204 + i]
        await pool.close()
        await nc_pool.close()
        await nc.close()

    asyncio.run(main())


def test_the_pools_asks_per_second_cover_the_last_ten_seconds():
    """The rate the pool's heartbeat reports (its HPA's metric), at one beat a second."""
    pool = DraftPool(pool_config())
    assert pool.asks_per_second(now=100.0) == 0.0  # no history yet
    for t in range(101, 131):  # 20 asks a second for 30 s
        pool.asked += 20
        rate = pool.asks_per_second(now=float(t))
    assert rate == 20.0
    assert pool.asks_per_second(now=135.0) == 10.0  # silent for 5 of the last 10 s
    assert pool.asks_per_second(now=141.0) == 0.0
    report = pool.load_report()
    assert (report.role, report.requests_per_second, report.queue_depth) == ("draft", 0.0, 0)


def test_a_gone_or_silent_pool_costs_one_deadline_then_nothing(nats_server):
    """No pool: local drafts at once (no responders), and the pool is left alone for a back-off. A pool
    that never answers: one ask waits the deadline, then the back-off skips it."""
    context = [7, 8, 9, 1, 2, 3, 7, 8]

    async def main():
        nc = await _connect(nats_server)
        local_only = NgramDrafter().propose_now("x", context, 4).token_ids
        gone = _drafter("t", min_backoff_s=600.0)  # a back-off no slow machine outlasts between two proposes
        gone.attach(nc, "nobody-here", "m")
        assert (await gone.propose("r", context, 4)).token_ids == local_only
        assert gone.stats.asks["unavailable"] == 1
        assert (await gone.propose("r", context, 4)).token_ids == local_only
        assert gone.stats.asks["skipped"] == 1  # backing off: not asked again

        silent_sub = await nc.subscribe(Subjects.draft("silent", "m"), queue="draftpool")  # takes asks, never answers
        silent = PoolDrafter(NgramDrafter(), tenant_of=lambda rid: "t", timeout_s=0.05, min_backoff_s=600.0)
        silent.attach(nc, "silent", "m")
        assert (await silent.propose("r", context, 4)).token_ids == local_only
        assert silent.stats.asks["timeout"] == 1
        assert (await silent.propose("r", context, 4)).token_ids == local_only
        assert silent.stats.asks["skipped"] == 1
        await silent_sub.unsubscribe()
        await nc.close()

    asyncio.run(main())


def test_an_overloaded_pool_sheds_asks(nats_server):
    async def main():
        nc_pool, nc = await _connect(nats_server), await _connect(nats_server)
        pool = DraftPool(pool_config(max_queue=1))
        await pool.start(nc_pool, serve=False)
        req = lambda i: DraftRequest(request_id=f"r{i}", tenant="t", tail=[1, 2], k=2, timeout_ms=60_000).encode()  # noqa: E731
        first = asyncio.create_task(_ask(nc, pool.subject, req(0)))
        while pool.waiting < 1:
            await asyncio.wait_for(pool.arrived.wait(), 30.0)  # a bound on a hang: an ask that never came
            pool.arrived.clear()
        shed = DraftReply.decode((await _ask(nc, pool.subject, req(1))).data)
        assert shed.overloaded and shed.token_ids == []
        await pool.serve_once()
        assert not DraftReply.decode((await first).data).overloaded
        await pool.close()
        await nc_pool.close()
        await nc.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ end to end

MODEL = "SmolLM2-135M-Instruct"
AGENT = [{"role": "system", "content": "You call tools by answering with JSON only."},
         {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": '{"tool": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'},
         {"role": "tool", "content": '{"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "cloudy"}'},
         {"role": "user", "content": "And in Lyon? Answer with the tool call JSON."}]


def _complete(url, messages, tenant=None, spec=True, text=False, **sampling):
    body = {"model": MODEL, "messages": messages, "max_tokens": 40, "temperature": 0, "return_token_ids": True,
            "speculation": {"enabled": spec, **({"tenant": tenant} if tenant else {})}, **sampling}
    status, out = post(url + "/v1/chat/completions", body)
    assert status == 200, out
    if text:
        return out["choices"][0]["message"]["content"]
    return out["choices"][0]["token_ids"], out["usage"]


@pytest.mark.model
def test_decode_with_the_pool_equals_plain_greedy_and_seeded_sampling_and_survives_its_death(nats_server, model_dir):
    from pdserve.local import LocalCluster
    from pdserve.natsserver import free_port

    port = free_port()
    with LocalCluster(str(model_dir), nats=nats_server.creds,
                      worker_args={"decode": ["--spec-method", "ngram", "--draft-pool"]}) as c:
        c.spawn("draftpool", "draftpool", "--model", str(model_dir), "--metrics-port", str(port))

        async def pool_answers():  # the pool is up when it answers an ask
            nc = await _connect(nats_server)
            subject = Subjects.draft(c.scope, model_dir.name)
            while True:
                try:
                    await nc.request(subject, DraftRequest(request_id="probe", tenant="x", tail=[1, 2], k=1,
                                                           timeout_ms=1000).encode(), timeout=1)
                    break
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    assert c.procs["draftpool"].poll() is None, c.tail("draftpool")
                    await asyncio.sleep(0.2)  # poll interval while the process starts
            await nc.close()

        asyncio.run(pool_answers())
        plain, _ = _complete(c.url, AGENT, spec=False)
        plain_text = _complete(c.url, AGENT, spec=False, text=True)
        first, _ = _complete(c.url, AGENT, tenant="acme")  # reported to the pool when it ends
        assert first == plain
        while metric(port, "pdserve_draftpool_reports_total") < 1:
            time.sleep(0.05)  # poll interval: the report is one publish on its way
        second, usage = _complete(c.url, AGENT, tenant="acme")  # its whole answer is now in the fleet index
        assert second == plain
        assert metric(port, "pdserve_draftpool_draft_tokens_total") > 0
        assert usage["speculation"]["accepted_tokens"] > 0

        # seeded sampling through the pool picks the very tokens plain seeded sampling picks
        seeded = dict(temperature=0.8, top_p=0.95, top_k=40, seed=7)
        drafted = metric(port, "pdserve_draftpool_draft_tokens_total")
        plain_sampled, _ = _complete(c.url, AGENT, spec=False, **seeded)
        pool_sampled, usage = _complete(c.url, AGENT, tenant="acme", **seeded)
        assert pool_sampled == plain_sampled
        assert metric(port, "pdserve_draftpool_draft_tokens_total") > drafted  # the pool drafted for it
        assert usage["speculation"]["draft_tokens"] > 0

        # the pool dies in the middle of a streamed request: it completes, and so do the next ones
        body = {"model": MODEL, "messages": AGENT, "max_tokens": 40, "temperature": 0, "stream": True,
                "speculation": {"tenant": "acme"}}
        text = []
        for ev in sse_events(c.url, "/v1/chat/completions", body, timeout=300):
            for ch in ev.get("choices", []):
                if ch["delta"].get("content"):
                    if not text:
                        c.kill("draftpool")
                    text.append(ch["delta"]["content"])
        assert c.procs["draftpool"].poll() is not None
        assert "".join(text) == plain_text
        for tenant in ("acme", "globex"):
            after, _ = _complete(c.url, AGENT, tenant=tenant)
            assert after == plain
        assert c.procs["decode-0"].poll() is None


def test_draft_pool_needs_prompt_lookup_beside_it(capsys):
    from pdserve.config import DecodeConfig, load

    with pytest.raises(SystemExit):
        load(DecodeConfig, ["--draft-pool"], {}, prog="pdserve decode")
    assert "--draft-pool drafts beside prompt lookup: it needs --spec-method ngram" in capsys.readouterr().err
    cfg = load(DecodeConfig, ["--draft-pool", "--spec-method", "ngram", "--draft-pool-timeout", "0.005"], {})
    assert cfg.spec.draft_pool and cfg.spec.draft_pool_timeout == 0.005
