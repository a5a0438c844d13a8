"""Prefill under load, against real processes: batched chunked prefill, the prefix cache, pre-positioning,
KV-aware routing across prefill workers, and bad input that must not disturb a batch.

Every output is checked against `transformers` greedy `generate` on the same prompt, so reusing
cached or pre-positioned KV never changes an answer.
"""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import nats
import pytest

from pdserve.basetypes import SamplingParams, announced, prefix_hashes
from pdserve.kvtransfer.protocol import Ack, Buckets, LoadReport, PrefillRequest, PrepositionHint, Subjects
from pdserve.local import LocalCluster
from servinghelpers import hf_greedy as _hf_greedy, post, wait_for

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"


def hf_greedy(hf, prompt_ids, n):
    return _hf_greedy(hf, prompt_ids, n, exact=True)  # requests here use ignore_eos
LONG = (Path(__file__).parent / "data" / "long_prompt.txt").read_text()


def chat(cluster, messages, n=12, **extra) -> dict:
    s, out = post(cluster.url + "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": n,
                                                         "temperature": 0, "return_token_ids": True,
                                                         "ignore_eos": True, **extra})
    assert s == 200, out
    return out


def chat_ids(tok, messages) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def load_reports(cluster, role: str, seconds: float = 1.5) -> dict[str, LoadReport]:
    """The latest LoadReport of each worker of `role` in this cluster's scope, read off real NATS."""
    async def go():
        nc = await nats.connect(**cluster.creds.connect_kwargs())
        seen: dict[str, LoadReport] = {}

        async def cb(msg):
            r = LoadReport.decode(msg.data)
            if r.scope == cluster.scope:
                seen[r.worker_id] = r

        await nc.subscribe(Subjects.load_role(cluster.scope, role), cb=cb)
        await asyncio.sleep(seconds)
        await nc.close()
        return seen

    return asyncio.run(go())


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    # Small chunks and budget so that scheduling is visible with short prompts; the KV sent after
    # prefill (every other cluster streams it layer by layer, the default).
    c = LocalCluster(str(model_dir), prefill_workers=1, decode_workers=1, nats=nats_server.creds,
                     worker_args={"prefill": ["--chunk-size", "128", "--max-batch-tokens", "256",
                                              "--no-kv-stream-layers"]})
    c.start()
    yield c
    c.stop()


def test_shared_system_prompt_is_computed_once_and_answers_do_not_change(cluster, hf):
    tok = hf[0]
    system = {"role": "system", "content": LONG[:3000]}
    q1 = [system, {"role": "user", "content": "Who is the text about?"}]
    q2 = [system, {"role": "user", "content": "Name one place mentioned in the text."}]
    first = chat(cluster, q1)
    second = chat(cluster, q2)
    p1, p2 = chat_ids(tok, q1), chat_ids(tok, q2)
    common = next(i for i, (a, b) in enumerate(zip(p1, p2)) if a != b)
    assert common > 500
    # the second request reused every whole block of the common prefix
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= common - 16
    assert first["choices"][0]["token_ids"] == hf_greedy(hf, p1, 12)
    assert second["choices"][0]["token_ids"] == hf_greedy(hf, p2, 12)


def test_pre_positioning_computes_the_next_turn_while_idle(cluster, hf):
    tok = hf[0]
    turn1 = [{"role": "user", "content": "Write three sentences about the sea, " + LONG[:200]}]
    a1 = chat(cluster, turn1, n=48)
    answer = a1["choices"][0]["message"]["content"]
    hint = tok.encode(tok.apply_chat_template(turn1 + [{"role": "assistant", "content": answer}], tokenize=False),
                      add_special_tokens=False)
    last_block = announced(prefix_hashes(hint, 16)[-1])
    wait_for(lambda: last_block in load_reports(cluster, "prefill", 1.1)["prefill-0"].cached_blocks,
             "the prefill worker to pre-position the next turn", 60)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now one about rivers."}]
    a2 = chat(cluster, turn2)
    details = a2["usage"]["prompt_tokens_details"]
    assert details.get("prepositioned") is True
    p2 = chat_ids(tok, turn2)
    # everything up to the answer's last whole block came from the cache
    assert details["cached_tokens"] >= len(hint) - 16
    assert a2["choices"][0]["token_ids"] == hf_greedy(hf, p2, 12)
    assert load_reports(cluster, "prefill")["prefill-0"].preposition_hits >= 1


def test_concurrent_mixed_prompts_with_shared_prefixes_equal_each_alone(cluster, hf):
    tok = hf[0]
    base = tok.encode(LONG, add_special_tokens=False)
    prompts = [base[:40], base[:300], base[:300] + base[900:950], base[500:520], base[:700], base[100:400],
               base[:300] + base[1000:1100], base[1200:1210]]
    outs: list = [None] * len(prompts)

    def run(i):
        outs[i] = post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": prompts[i], "max_tokens": 8,
                                                         "temperature": 0, "return_token_ids": True,
                                                         "ignore_eos": True})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for ids, (status, out) in zip(prompts, outs):
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 8)
    # Nothing held afterwards: prompts leave the pool (their blocks only stay as evictable cache).
    rep = wait_for(lambda: (r := load_reports(cluster, "prefill")["prefill-0"]).queue_depth == 0
                   and r.kv_utilization == 0.0 and r, "the prefill pool to drain", 30)
    assert rep.queue_tokens == 0


def test_bad_prompts_and_hints_are_refused_without_disturbing_anyone(cluster, nats_server, hf):
    """Out-of-vocabulary ids straight on NATS get a 400-style refusal; a malformed or oversized hint is
    ignored; the worker keeps serving."""
    async def go():
        nc = await nats.connect(**nats_server.creds.connect_kwargs())
        try:
            req = PrefillRequest(request_id="bad-1", model=MODEL, prompt_token_ids=[1, 2, 10 ** 7],
                                 sampling=SamplingParams(max_tokens=2), seed=1, decode_worker_id="decode-0")
            msg = await nc.request(Subjects.prefill_worker(cluster.scope, MODEL, "prefill-0"), req.encode(), timeout=5)
            ack = Ack.decode(msg.data)
            await nc.publish(Subjects.preposition(cluster.scope, "prefill-0"), b'{"not": "a hint"}')
            await nc.publish(Subjects.preposition(cluster.scope, "prefill-0"),
                             PrepositionHint(request_id="h", model=MODEL, token_ids=[5] * 100_000).encode())
            await nc.flush()
            return ack
        finally:
            await nc.close()

    ack = asyncio.run(go())
    assert not ack.accepted and ack.status == 400 and "0.." in ack.error
    tok = hf[0]
    ids = tok.encode("One plus one is", add_special_tokens=False)
    s, out = post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0,
                                                    "return_token_ids": True, "ignore_eos": True})
    assert s == 200 and out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 4)


def test_prompt_larger_than_the_prefill_pool_fails_clearly_and_others_go_on(nats_server, model_dir, hf):
    tok = hf[0]
    # 8 blocks of 16 tokens: room for 128 tokens in flight
    per_block = 30 * 2 * 3 * 16 * 64 * 4
    with LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds,
                      worker_args={"prefill": ["--kv-capacity-bytes", str(16 * per_block)]}) as c:
        big = tok.encode(LONG, add_special_tokens=False)[:400]
        s, out = post(c.url + "/v1/completions", {"model": MODEL, "prompt": big, "max_tokens": 2})
        assert s == 503 and "does not fit the prefill KV pool" in out["error"]["message"]
        small = tok.encode("Two plus two is", add_special_tokens=False)
        s, out = post(c.url + "/v1/completions", {"model": MODEL, "prompt": small, "max_tokens": 3, "temperature": 0,
                                                  "return_token_ids": True, "ignore_eos": True})
        assert s == 200 and out["choices"][0]["token_ids"] == hf_greedy(hf, small, 3)


def test_router_sends_a_known_prefix_to_the_worker_that_holds_it(nats_server, model_dir, hf):
    """Two prefill workers: after one computed a long prefix, requests that share it go to that worker
    (the queue group alone would split them about evenly)."""
    tok = hf[0]
    with LocalCluster(str(model_dir), prefill_workers=2, decode_workers=1, nats=nats_server.creds,
                      worker_args={"front": ["--no-preposition"]}) as c:
        prefix = tok.encode(LONG, add_special_tokens=False)[:600]
        first = post(c.url + "/v1/completions", {"model": MODEL, "prompt": prefix + [13], "max_tokens": 1})[1]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        holder = wait_for(lambda: [w for w, r in load_reports(c, "prefill").items() if len(r.cached_blocks) >= 37],
                          "a prefill worker to announce the prefix", 30)
        assert len(holder) == 1
        for i in range(6):
            ids = prefix + tok.encode(f" Question {i}: what happened next?", add_special_tokens=False)
            s, out = post(c.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2,
                                                      "temperature": 0, "return_token_ids": True, "ignore_eos": True})
            assert s == 200, out
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 592, (i, out["usage"])
            assert out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 2)


def test_offload_tier_lets_another_worker_skip_a_stored_prefix(nats_server, model_dir, hf):
    """Two deployments of one scope on one NATS, one after the other, both with --prefix-offload: what
    the first computed, the second fetches from the JetStream object store instead of recomputing; the
    answer is unchanged. A damaged stored block is refused and the prompt computed instead (nothing lost)."""
    from pdserve.kvtransfer.offload import KVPrefixStore, block_hashes
    from pdserve.runtime import ModelRunner

    tok = hf[0]
    ids = tok.encode(LONG, add_special_tokens=False)[1100:1500]
    args = {"prefill": ["--prefix-offload"]}
    scope = {"PDSERVE_SCOPE": "offload-test"}  # the offload tier is per scope: b is a's successor
    layout = ModelRunner(model_dir).layout

    async def stored(prompt):
        nc = await nats.connect(**nats_server.creds.connect_kwargs())
        try:
            got = await KVPrefixStore(nc, layout, bucket=Buckets.prefix("offload-test")).get_longest_prefix(prompt)
            return got[1] if got else 0
        finally:
            await nc.close()

    with LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds, worker_args=args, env=scope) as a:
        s, out = post(a.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2})
        assert s == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for(lambda: asyncio.run(stored(ids)) == 400 // 16 * 16, "the prompt's blocks in the object store", 60)
    with LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds, worker_args=args, env=scope) as b:
        s, out = post(b.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                  "return_token_ids": True, "ignore_eos": True})
        assert s == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 384
        assert out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 6)

        # damage the first stored block of another prompt's prefix: b must compute, not fail
        other = tok.encode(LONG, add_special_tokens=False)[300:400]

        async def damage():
            nc = await nats.connect(**nats_server.creds.connect_kwargs())
            try:
                store = KVPrefixStore(nc, layout, bucket=Buckets.prefix("offload-test"))
                bucket = await store._bucket()
                await bucket.put(store._name(block_hashes(other, 16)[0]), b"\x00garbage" * 100)
            finally:
                await nc.close()

        asyncio.run(damage())
        s, out = post(b.url + "/v1/completions", {"model": MODEL, "prompt": other, "max_tokens": 4, "temperature": 0,
                                                  "return_token_ids": True, "ignore_eos": True})
        assert s == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert out["choices"][0]["token_ids"] == hf_greedy(hf, other, 4)


def test_layer_streamed_handoff_gives_the_same_tokens_and_stops_at_a_first_token_stop(nats_server, model_dir, hf):
    """The default handoff streams each layer's KV during the prompt's last forward (checked on
    prefill's metrics); decode continues from the first token it reads off the stream. A request whose
    first token already stops it is finished by prefill and never continued by decode. Workers that share no
    cores (no CPU lease), as in separate pods: a pair sharing them hands off after the forward (the next
    test)."""
    import urllib.request

    from pdserve.natsserver import free_port

    tok = hf[0]
    port = free_port()
    with LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds, cpu_lease=False,
                      worker_args={"prefill": ["--metrics-port", str(port)]}) as c:
        def streamed() -> float:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("pdserve_kv_layer_streamed_total "))

        ids = tok.encode(LONG, add_special_tokens=False)[:700]
        s, out = post(c.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 10, "temperature": 0,
                                                  "return_token_ids": True, "ignore_eos": True})
        assert s == 200 and out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 10)
        assert wait_for(lambda: streamed() >= 1, "prefill to count the streamed handoff", 10)
        first = tok.decode(hf_greedy(hf, ids, 1))
        s, out = post(c.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 10, "temperature": 0,
                                                  "stop": [first.strip() or first], "return_token_ids": True})
        assert s == 200, out
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 1
        # decode is still healthy afterwards
        s, out = post(c.url + "/v1/completions", {"model": MODEL, "prompt": ids[:50], "max_tokens": 4, "temperature": 0,
                                                  "return_token_ids": True, "ignore_eos": True})
        assert s == 200 and out["choices"][0]["token_ids"] == hf_greedy(hf, ids[:50], 4)


def test_workers_sharing_cpu_cores_hand_kv_off_after_the_forward(nats_server, model_dir, hf):
    """A prefill and a decode worker on the same CPU cores (`pdserve up`'s pairs, a CPU lease) send the KV
    after the prompt's forward, not layer by layer: receiving a stream competes with the step for the very
    cores (here the lone prompt borrows decode's), and decode accepting it first would stall the step on
    decode's loop. The handoff gives the same tokens."""
    import urllib.request

    from pdserve.natsserver import free_port

    port = free_port()
    with LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds,
                      worker_args={"prefill": ["--metrics-port", str(port)]}) as c:
        def metric(name: str) -> float:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " "))

        ids = hf[0].encode(LONG, add_special_tokens=False)[:200]  # one step (chunks of 256)
        s, out = post(c.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                  "return_token_ids": True, "ignore_eos": True})
        assert s == 200 and out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 6)
        assert metric("pdserve_prefill_cpu_lease_steps_total") >= 1  # the step ran on both workers' threads
        assert metric("pdserve_kv_layer_streamed_total") == 0


def test_a_prompt_stops_a_pre_positioning_step_between_layers(nats_server, model_dir, hf):
    """A hint's chunk is one long step here (2048-token chunks, a hint of ~1500 tokens: seconds on a CPU
    core). A prompt arriving while it runs stops it at the next layer (`yielded`), is answered as transformers
    answers it, and the hint is computed afterwards, from where it stood."""
    import urllib.request

    from pdserve.natsserver import free_port

    port = free_port()
    c = LocalCluster(str(model_dir), prefill_workers=1, decode_workers=1, nats=nats_server.creds,
                     worker_args={"prefill": ["--chunk-size", "2048", "--max-batch-tokens", "2048",
                                              "--metrics-port", str(port)]})
    c.start()
    try:
        def outcomes() -> dict[str, float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("pdserve_preposition_total{")}

        tok = hf[0]
        hint_ids = tok.encode(LONG[:7000], add_special_tokens=False)[:1500]

        async def send_hint():
            nc = await nats.connect(**nats_server.creds.connect_kwargs())
            try:
                await nc.publish(Subjects.preposition(c.scope, "prefill-0"),
                                 PrepositionHint(request_id="long-hint", model=MODEL, token_ids=hint_ids).encode())
                await nc.flush()
            finally:
                await nc.close()

        asyncio.run(send_hint())
        wait_for(lambda: outcomes().get("received", 0) >= 1, "the hint to arrive", 30)
        time.sleep(0.3)  # its step has begun (it takes seconds)
        ids = tok.encode("One plus one is", add_special_tokens=False)
        s, out = post(c.url + "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0,
                                                  "return_token_ids": True, "ignore_eos": True})
        assert s == 200 and out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 4)
        assert outcomes().get("yielded", 0) >= 1
        last_block = announced(prefix_hashes(hint_ids, 16)[-1])
        wait_for(lambda: last_block in load_reports(c, "prefill", 1.1)["prefill-0"].cached_blocks,
                 "the hint to be computed after the prompt", 120)
    finally:
        c.stop()


def test_pre_positioning_waits_while_the_co_located_decode_worker_steps(nats_server, model_dir, hf):
    """Pre-positioning is idle-time work: with decode on the same machine (`pdserve.cpulease`), a hint is not
    computed while decode holds its lease (steps), so the core it borrows stays its own, and it is computed
    once decode is idle. Here this test holds the lease file as a stepping decode does."""
    import urllib.request

    from pdserve.cpulease import CpuLease
    from pdserve.natsserver import free_port

    port = free_port()
    c = LocalCluster(str(model_dir), prefill_workers=1, decode_workers=1, nats=nats_server.creds,
                     worker_args={"prefill": ["--metrics-port", str(port)]})
    c.start()
    busy = CpuLease(c.log_dir / "cpu-lease-0")
    try:
        def outcomes() -> dict[str, float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("pdserve_preposition_total{")}

        hint_ids = hf[0].encode(LONG[:2000], add_special_tokens=False)[:200]
        last_block = announced(prefix_hashes(hint_ids, 16)[-1])

        async def send_hint():
            nc = await nats.connect(**nats_server.creds.connect_kwargs())
            try:
                await nc.publish(Subjects.preposition(c.scope, "prefill-0"),
                                 PrepositionHint(request_id="h", model=MODEL, token_ids=hint_ids).encode())
                await nc.flush()
            finally:
                await nc.close()

        busy.hold()  # decode "steps" from now on
        asyncio.run(send_hint())
        wait_for(lambda: outcomes().get("received", 0) >= 1, "the hint to arrive", 30)
        # prefill lends its threads meanwhile; that the hint waits is `step_action`'s (tests/test_prefill_scheduler.py)
        wait_for(lambda: busy.idle_threads() >= 1, "prefill to lend its threads", 30)
        assert outcomes().get("computed", 0) == 0
        busy.release()  # decode idle
        wait_for(lambda: last_block in load_reports(c, "prefill", 1.1)["prefill-0"].cached_blocks,
                 "the hint to be computed once decode is idle", 60)
        assert outcomes().get("computed", 0) >= 1
    finally:
        busy.close()
        c.stop()
