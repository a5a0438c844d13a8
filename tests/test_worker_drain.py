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
