"""Graceful drain, against real processes: a worker told to stop (SIGTERM, as Kubernetes does on a rolling
update or a scale-down) says `bye`, takes no new work, finishes what it holds within its drain timeout,
fails what remains with a clear error, and exits."""
from __future__ import annotations

import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats
import pytest

from pdserve.basetypes import KVLayout, SamplingParams
from pdserve.kvtransfer.protocol import HandoffOffer, HandoffReply, Subjects
from pdserve.local import LocalCluster
from servinghelpers import NatsWatch, accepted_by, decoded_by, post, stream_subjects, wait_for

# generous per-test bounds: each test runs requests of tens of tokens on a shared 2-core machine
pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "SmolLM2-135M-Instruct"
LONG_PROMPT = (Path(__file__).parent / "data" / "long_prompt.txt").read_text()
DRAIN_S = 120.0  # long enough for any request here: these workers finish what they hold
EXIT_BOUND_S = 10.0  # drain done or timed out → process gone (bye, NATS close, the kernel freeing its memory)


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    c = LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds, drain_timeout=DRAIN_S,
                     worker_args={"front": ["--dispatch-timeout", "2"]})
    c.start()
    yield c
    c.stop()


def completion(cluster, prompt, n: int) -> tuple[int, dict]:
    return post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True})


async def _offer_to(cluster, worker_id: str) -> HandoffReply:
    offer = HandoffOffer(request_id="offered-while-draining", sender_id="prefill-x", sender_generation=1,
                         layout=KVLayout(model_fingerprint="0" * 16, num_layers=30, kv_heads=3, head_dim=64,
                                         dtype="float32", block_size=16),
                         num_tokens=1, kv_bytes=1, prompt_token_ids=[1], generated_token_ids=[2],
                         sampling=SamplingParams(max_tokens=4, temperature=0), seed=0, next_seq=1)
    async with await nats.connect(**cluster.creds.connect_kwargs()) as nc:
        msg = await nc.request(Subjects.decode_handoff(cluster.scope, worker_id), offer.encode(), timeout=10)
        return HandoffReply.decode(msg.data)


def test_draining_decode_finishes_its_request_and_takes_no_new_one(cluster):
    prompt, n = "Count from one to one thousand: one, two,", 64
    status, expected = completion(cluster, prompt, n)
    assert status == 200, expected
    with NatsWatch(cluster.creds, stream_subjects()) as watch, ThreadPoolExecutor(1) as pool:
        held = pool.submit(completion, cluster, prompt, n)
        watch.wait(decoded_by("decode-0"), "decode-0's first token", 120)
        cluster.send_signal("decode-0", signal.SIGTERM)
        # the front has seen its bye: no new request goes to it ...
        wait_for(lambda: cluster.health()["decode_workers"] == 0, "the front to see decode-0's bye", 30)
        assert not held.done(), "the held request ended before the drain was observed: make it longer"
        status, new = completion(cluster, "Hello", 4)
        assert status == 503 and new["error"]["code"] == "no_worker", new
        # a handoff routed to it before its bye is refused, so prefill takes it to a worker that stays
        reply = asyncio.run(_offer_to(cluster, "decode-0"))
        assert not reply.accepted and "decode worker decode-0 is draining" in reply.error, reply
        # ... while the one it holds completes, whole and right
        status, out = held.result()
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    assert out["usage"]["completion_tokens"] == n
    assert cluster.procs["decode-0"].wait(EXIT_BOUND_S) == 0
    cluster.restart("decode-0")


def test_drain_timeout_fails_what_remains_with_the_reason(cluster):
    cluster.restart("decode-0", extra_args=("--drain-timeout", "1"))
    with NatsWatch(cluster.creds, stream_subjects()) as watch, ThreadPoolExecutor(1) as pool:
        held = pool.submit(completion, cluster, "Once upon a time", 1000)
        watch.wait(decoded_by("decode-0"), "decode-0's first token", 120)
        cluster.send_signal("decode-0", signal.SIGTERM)
        status, out = held.result()
    assert status == 503, out
    assert "decode worker decode-0 stopped before finishing the request (drain timeout 1 s)" in \
        out["error"]["message"], out
    assert cluster.procs["decode-0"].wait(EXIT_BOUND_S) == 0
    cluster.restart("decode-0", extra_args=("--drain-timeout", str(DRAIN_S)))


def test_draining_prefill_finishes_the_prompt_it_took(cluster):
    prompt = "Summarise this text.\n\n" + LONG_PROMPT * 2  # new to prefill-0: computed in full, not cached
    with NatsWatch(cluster.creds, "_INBOX.>") as watch, ThreadPoolExecutor(1) as pool:
        held = pool.submit(completion, cluster, prompt, 4)
        watch.wait(accepted_by("prefill-0"), "prefill-0 to take the prompt", 60)
        cluster.send_signal("prefill-0", signal.SIGTERM)
        status, out = held.result()
    assert status == 200, out
    assert cluster.procs["prefill-0"].wait(EXIT_BOUND_S) == 0
    cluster.restart("prefill-0")
    status, again = completion(cluster, prompt, 4)  # a fresh worker computes it from scratch
    assert status == 200 and again["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]


def test_a_drain_waits_for_the_offer_it_is_still_answering(nats_server, model_dir, hf, monkeypatch):
    """A stop that arrives while the decode worker is still answering an offer (between taking it and
    replying: choosing the transport, subscribing for a layer-streamed first token) must wait for that
    request, which counts as held from the offer's arrival. Before, the drain saw nothing held, the worker
    exited, the accepted request's receive was cancelled, and the client heard only that decode went silent.

    In-process worker, real NATS and model. One pause is injected: the answer is held mid-way until the
    stop has begun (no real prefill can hold it at exactly that point); no KV is sent, so after the KV
    timeout decode recomputes the prompt (failure policy "recompute") and decodes it, greedy, exactly."""
    from pdserve.config import DecodeConfig, load
    from pdserve.decode.worker import DecodeWorker
    from pdserve.kvtransfer.channel import KVReceiveChannel
    from pdserve.kvtransfer.protocol import StreamEvent
    from servinghelpers import hf_greedy

    scope = "held-offer"
    cfg = load(DecodeConfig, ["--model", str(model_dir), "--worker-id", "decode-held", "--dtype", "float32",
                              "--drain-timeout", "60", "--transfer-timeout", "1", "--no-spec-calibrate"],
               environ={**nats_server.creds.env(), "PDSERVE_SCOPE": scope})
    worker = DecodeWorker(cfg)
    prompt_ids = hf[0]("The capital of France is")["input_ids"]
    n = 8
    expected = hf_greedy(hf, prompt_ids, n, exact=True)

    async def scenario():
        answering, resume = asyncio.Event(), asyncio.Event()
        real_expect = KVReceiveChannel.expect

        async def held_expect(channel, offer):
            answering.set()
            await resume.wait()
            return await real_expect(channel, offer)

        monkeypatch.setattr(KVReceiveChannel, "expect", held_expect)
        running = asyncio.create_task(worker.run())
        events: list[StreamEvent] = []
        done = asyncio.Event()
        async with await nats.connect(**nats_server.creds.connect_kwargs()) as nc:
            async def on_event(msg):
                events.append(StreamEvent.decode(msg.data))
                if events[-1].kind in ("done", "error"):
                    done.set()
            await nc.subscribe(Subjects.stream(scope, "held"), cb=on_event)
            # its first heartbeat follows its subscriptions on its connection: it takes offers from then on
            beats = await nc.subscribe(Subjects.load(scope, "decode", "decode-held"))
            await beats.next_msg(timeout=120)
            offer = HandoffOffer(request_id="held", sender_id="prefill-x", sender_generation=1,
                                 layout=worker.runner.layout, num_tokens=len(prompt_ids), kv_bytes=1,
                                 prompt_token_ids=prompt_ids, generated_token_ids=expected[:1],
                                 sampling=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), seed=0,
                                 next_seq=1, failure_policy="recompute", spec={"enabled": False})
            reply = asyncio.ensure_future(nc.request(Subjects.decode_handoff(scope, "decode-held"), offer.encode(),
                                                     timeout=30))
            await asyncio.wait_for(answering.wait(), 30)
            worker._stop.set()  # what SIGTERM does
            await asyncio.sleep(0.5)  # the drain is under way (it polls every 50 ms) while the answer is held
            assert not running.done(), "the worker stopped while it was still answering an offer"
            resume.set()
            assert HandoffReply.decode((await reply).data).accepted
            await asyncio.wait_for(done.wait(), 120)
            await asyncio.wait_for(running, 30)
        return events

    events = asyncio.run(scenario())
    assert [e.kind for e in events][-1] == "done", events[-1]
    assert [t for e in events if e.kind == "token" for t in e.token_ids] == expected[1:]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
