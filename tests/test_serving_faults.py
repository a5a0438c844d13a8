"""Faults on the serving path, against real processes: dead workers, lost or mismatched KV, no workers.

Each failure must reach the client as an error within a bound (never a hang, never a 200 with a
truncated answer), and a request whose KV was lost is recomputed or failed, per its policy.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats
import pytest

from pdserve.basetypes import KVLayout, SamplingParams
from pdserve.kvtransfer.protocol import Ack, HandoffOffer, HandoffReply, PrefillRequest, StreamEvent, Subjects
from pdserve.local import LocalCluster
from servinghelpers import NatsWatch, accepted_by, decoded_by, post, stream, stream_subjects, wait_for

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"
LONG_PROMPT = (Path(__file__).parent / "data" / "long_prompt.txt").read_text()


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    c = LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds,
                     worker_args={"decode": ["--transfer-timeout", "2"],
                                  "front": ["--dispatch-timeout", "2"]})
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def greedy_ids(cluster, prompt, n):
    s, out = post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                    "temperature": 0, "return_token_ids": True})
    assert s == 200, out
    return out["choices"][0]["token_ids"]


async def _offer(cluster, offer: HandoffOffer, collect_until_done: bool = True, timeout: float = 60):
    """Play a prefill worker that offers KV and then never sends it (it 'died' after the offer)."""
    async with await nats.connect(**cluster.creds.connect_kwargs()) as nc:
        sub = await nc.subscribe(Subjects.stream(cluster.scope, offer.request_id))
        reply = HandoffReply.decode((await nc.request(Subjects.decode_handoff(cluster.scope, "decode-0"), offer.encode(),
                                                      timeout=5)).data)
        events = []
        if reply.accepted and collect_until_done:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                ev = StreamEvent.decode((await sub.next_msg(timeout=deadline - time.monotonic())).data)
                events.append(ev)
                if ev.kind in ("done", "error"):
                    break
        return reply, events


def _make_offer(cluster_layout: KVLayout, prompt_ids, first, policy, rid, **over) -> HandoffOffer:
    fields = dict(request_id=rid, sender_id="prefill-imposter", sender_generation=1, layout=cluster_layout,
                  num_tokens=len(prompt_ids), kv_bytes=cluster_layout.payload_bytes(len(prompt_ids)),
                  prompt_token_ids=prompt_ids, generated_token_ids=[first],
                  sampling=SamplingParams(max_tokens=8, temperature=0), seed=0, next_seq=1, failure_policy=policy)
    fields.update(over)
    return HandoffOffer(**fields)


def _layout(model_dir) -> KVLayout:
    from pdserve.modelstore import model_fingerprint

    return KVLayout(model_fingerprint=model_fingerprint(model_dir), num_layers=30, kv_heads=3, head_dim=64,
                    dtype="float32", block_size=16)


def test_lost_kv_is_recomputed_under_the_recompute_policy(cluster, nats_server, model_dir, tok):
    prompt = "The three primary colours are"
    expected = greedy_ids(cluster, prompt, 8)
    ids = tok.encode(prompt, add_special_tokens=False)
    offer = _make_offer(_layout(model_dir), ids, expected[0], "recompute", "lost-kv-recompute")
    reply, events = asyncio.run(_offer(cluster, offer))
    assert reply.accepted
    kinds = [e.kind for e in events]
    assert kinds[0] == "handoff" and kinds[-1] == "done", kinds
    got = [expected[0]] + [t for e in events if e.kind == "token" for t in e.token_ids]
    assert got == expected  # recomputed KV continues exactly where a real handoff would have
    assert [e.seq for e in events] == list(range(1, 1 + len(events)))


def test_lost_kv_fails_the_request_under_the_fail_policy(cluster, nats_server, model_dir, tok):
    ids = tok.encode("Hello", add_special_tokens=False)
    offer = _make_offer(_layout(model_dir), ids, 42, "fail", "lost-kv-fail")
    t0 = time.monotonic()
    reply, events = asyncio.run(_offer(cluster, offer))
    assert reply.accepted
    assert [e.kind for e in events] == ["error"]
    assert "did not arrive within 2.0 s" in events[0].error and events[0].status == 502
    assert time.monotonic() - t0 < 20


def test_a_handoff_whose_decode_worker_is_gone_goes_to_another(cluster, tok):
    """The front routed the request to a decode worker that left while prefill ran the prompt (a
    scale-down, a rolling update): nobody listens on that worker's subject any more, so prefill offers
    the KV to the model's other decode workers (a queue group) and the answer is whole and right."""
    prompt = "The three primary colours are"
    expected = greedy_ids(cluster, prompt, 8)
    req = PrefillRequest(request_id="routed-to-a-gone-decode", model=MODEL,
                         prompt_token_ids=tok.encode(prompt, add_special_tokens=False),
                         sampling=SamplingParams(max_tokens=8, temperature=0), seed=0,
                         decode_worker_id="decode-scaled-away", failure_policy="fail")

    async def go():
        async with await nats.connect(**cluster.creds.connect_kwargs()) as nc:
            sub = await nc.subscribe(Subjects.stream(cluster.scope, req.request_id))
            ack = Ack.decode((await nc.request(Subjects.prefill(cluster.scope, MODEL), req.encode(), timeout=10)).data)
            events = []
            while ack.accepted and (not events or events[-1].kind not in ("done", "error")):
                events.append(StreamEvent.decode((await sub.next_msg(timeout=60)).data))
            return ack, events

    ack, events = asyncio.run(go())
    assert ack.accepted, ack
    assert [e.kind for e in events if e.kind != "token"] == ["handoff", "done"], events
    assert [e.worker_id for e in events if e.kind == "handoff"] == ["decode-0"]
    assert [t for e in events if e.kind == "token" for t in e.token_ids] == expected


def test_handoff_for_another_model_is_refused(cluster, nats_server, model_dir, tok):
    ids = tok.encode("Hello", add_special_tokens=False)
    wrong = _layout(model_dir).model_copy(update={"model_fingerprint": "0123456789abcdef", "dtype": "bfloat16"})
    reply, events = asyncio.run(_offer(cluster, _make_offer(wrong, ids, 1, "fail", "wrong-model")))
    assert not reply.accepted and events == []
    assert "model_fingerprint: expected" in reply.error and "dtype: expected 'float32', got 'bfloat16'" in reply.error


def test_malformed_offer_is_refused(cluster, nats_server):
    async def go():
        async with await nats.connect(**nats_server.creds.connect_kwargs()) as nc:
            return HandoffReply.decode((await nc.request(Subjects.decode_handoff(cluster.scope, "decode-0"),
                                                         b'{"v": 1, "x": 2}',
                                                         timeout=5)).data)
    reply = asyncio.run(go())
    assert not reply.accepted and "malformed HandoffOffer" in reply.error


def test_decode_killed_mid_stream_ends_the_stream_with_an_error(cluster):
    killed_at = []

    def kill(i, event):  # at the third event: the stream is under way
        if i == 2:
            killed_at.append(time.monotonic())
            cluster.kill("decode-0")

    body = {"model": MODEL, "prompt": "Count from one to one thousand: one, two,", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True}
    events, _ = stream(cluster.url + "/v1/completions", body, on_event=kill, timeout=120)
    elapsed = time.monotonic() - killed_at[0]
    assert events[-1] != "[DONE]"
    err = events[-1]
    assert err["error"]["code"] == "worker_lost" and "decode worker decode-0 died" in err["error"]["message"]
    assert elapsed < 15  # the heartbeat bound (3 s) plus slack, not a hang
    cluster.restart("decode-0")


def test_decode_killed_mid_request_is_an_error_not_a_truncated_200(cluster):
    with NatsWatch(cluster.creds, stream_subjects()) as watch, ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, cluster.url + "/v1/completions", {
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "temperature": 0, "ignore_eos": True})
        watch.wait(decoded_by("decode-0"), "decode-0's first token", 120)
        cluster.kill("decode-0")  # mid-request: it has 499 tokens to go
        status, out = reply.result()
    assert status == 502 and out["error"]["code"] == "worker_lost"
    cluster.restart("decode-0")


def test_prefill_killed_mid_prefill_is_an_error(cluster):
    with NatsWatch(cluster.creds, "_INBOX.>") as watch, ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        reply = pool.submit(post, cluster.url + "/v1/completions",
                            {"model": MODEL, "prompt": LONG_PROMPT * 3, "max_tokens": 4})
        watch.wait(accepted_by("prefill-0"), "prefill-0 to accept the prompt", 60)
        cluster.kill("prefill-0")  # mid-prefill: it acknowledges a prompt before computing it
        status, out = reply.result()
    assert status == 502 and "prefill worker prefill-0 died" in out["error"]["message"]
    assert time.monotonic() - t0 < 20


def test_no_worker_gives_503_within_a_bound(cluster):
    if cluster.procs["prefill-0"].poll() is None:
        cluster.kill("prefill-0")
    wait_for(lambda: not cluster.health()["prefill_workers"], "the front to forget prefill-0", 10)
    t0 = time.monotonic()
    status, out = post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert status == 503 and out["error"]["code"] == "no_worker"
    assert time.monotonic() - t0 < 5
    cluster.restart("prefill-0")
    assert greedy_ids(cluster, "The sky is", 3)  # and it serves again once a worker is back


def test_a_second_offer_of_a_request_it_holds_is_refused(cluster, nats_server, model_dir, tok):
    """Prefill re-offers a request when the first offer's reply is lost (across a NATS restart, say), and the
    re-offer can reach the worker that took the first. One owner per request: that worker refuses it by name
    and keeps the first. (Accepting it freed the first's KV under its running sequence: the soak's 500s.)"""
    ids = tok.encode("The three primary colours are", add_special_tokens=False)
    offer = _make_offer(_layout(model_dir), ids, ids[0], "fail", "offered-twice")

    async def go():
        async with await nats.connect(**nats_server.creds.connect_kwargs()) as nc:
            subject = Subjects.decode_handoff(cluster.scope, "decode-0")
            first = HandoffReply.decode((await nc.request(subject, offer.encode(), timeout=5)).data)
            second = HandoffReply.decode((await nc.request(subject, offer.encode(), timeout=5)).data)
            return first, second

    first, second = asyncio.run(go())
    assert first.accepted, first
    assert not second.accepted and "already holds request offered-twice" in second.error, second
