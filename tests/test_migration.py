"""A request moves when its prefill worker dies before the handoff, against real processes: two prefill
workers, one decode worker, a real NATS server and the front over loopback HTTP.

Nothing of such a request has been streamed, so the client must see nothing: a 200 with the answer an
uninterrupted run gives (greedy: `transformers`'; seeded: the same request sent again), whether the
worker was killed (SIGKILL) or frozen (SIGSTOP) past its heartbeat bound. A frozen worker that thaws drops
the attempt it held (the front cancelled it). Past `--migration-limit` moves the request fails as it did
before migration, with `worker_lost`.
"""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.local import LocalCluster
from servinghelpers import NatsWatch, accepted_by, hf_greedy, metric, post, wait_for

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"
LONG = (Path(__file__).parent / "data" / "long_prompt.txt").read_text()


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    # small chunks: a long prompt stays at prefill for many steps, so a worker is stopped while it holds it;
    # one move allowed, so a request whose second prefill worker dies too fails
    c = LocalCluster(str(model_dir), 2, 1, nats=nats_server.creds, worker_args={
        "prefill": ["--chunk-size", "32"], "front": ["--migration-limit", "1"]})
    c.start()
    yield c
    c.stop()


def _moves(cluster) -> float:
    return metric(cluster.port, "pdserve_request_moves_total")


def _long_ids(hf, part: int) -> list[int]:
    """The long text's `part`-th 500 tokens: each test its own, so no worker holds a prefix of it from another
    (a cached prompt would be computed before the worker could be stopped holding it)."""
    return hf[0].encode(LONG, add_special_tokens=False)[500 * part:500 * (part + 1)]


def _accepted_by(worker_id: str):
    """`accepted_by`, for a watch on every reply: those that are no acknowledgement do not match."""
    match = accepted_by(worker_id)

    def safe(subject, data):
        try:
            return match(subject, data)
        except ValueError:  # another reply on _INBOX (a KV handoff's, a load report request's)
            return False
    return safe


def _accepted_by_a_prefill_worker(subject, data) -> str | None:
    return next((w for w in ("prefill-0", "prefill-1") if _accepted_by(w)(subject, data)), None)


def _stopped_at_prefill(cluster, body: dict, stop, then=None) -> tuple[int, dict, str]:
    """POST `body`; the moment a prefill worker acknowledges it, `stop(that worker)`; → (status, body, worker).
    `then(first worker)` runs next (with the request still in flight), e.g. to stop the worker it moves to."""
    with NatsWatch(cluster.creds, "_INBOX.>") as watch, ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, cluster.url + "/v1/completions", body)
        first = watch.wait(_accepted_by_a_prefill_worker, "a prefill worker to accept the prompt", 60)
        stop(first)
        if then is not None:
            then(first, watch)
        status, out = reply.result()
    return status, out, first


def test_a_prefill_worker_killed_holding_a_prompt_is_invisible_to_the_client(cluster, hf):
    ids = _long_ids(hf, 0)
    before = _moves(cluster)
    status, out, killed = _stopped_at_prefill(cluster, {
        "model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}, lambda w: cluster.kill(w))
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 8, exact=True)
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 8
    assert _moves(cluster) == before + 1
    log = (cluster.log_dir / "front.log").read_text()
    assert f"prefill worker {killed} died while serving the request" in log and "dispatched again" in log
    cluster.restart(killed)


def test_a_seeded_request_moved_off_a_frozen_worker_draws_its_uninterrupted_tokens_and_the_thawed_worker_drops_it(
        cluster, hf):
    body = {"model": MODEL, "prompt": _long_ids(hf, 1), "max_tokens": 10, "temperature": 0.8, "top_p": 0.9,
            "seed": 77, "ignore_eos": True, "return_token_ids": True}
    before = _moves(cluster)
    status, moved, frozen = _stopped_at_prefill(cluster, body, lambda w: cluster.send_signal(w, signal.SIGSTOP))
    try:
        assert status == 200, moved
        assert _moves(cluster) == before + 1
    finally:
        cluster.send_signal(frozen, signal.SIGCONT)
    status, again = post(cluster.url + "/v1/completions", body)
    assert status == 200, again
    assert moved["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    log = cluster.log_dir / f"{frozen}.log"
    # thawed, it finds its attempt cancelled: it drops it instead of handing it to decode
    wait_for(lambda: f"{moved['id']} cancelled: dropped" in log.read_text(), f"{frozen} to drop the attempt it held", 60)
    decode_log = (cluster.log_dir / "decode-0.log").read_text()
    assert "Traceback" not in decode_log
    # and it serves again once it beats again
    wait_for(lambda: cluster.health()["prefill_workers"] == 2, f"{frozen} to be routed to again", 30)


def test_past_the_migration_limit_a_request_fails_with_worker_lost(cluster, hf):
    stopped: list[str] = []

    def stop(worker):
        cluster.send_signal(worker, signal.SIGSTOP)
        stopped.append(worker)

    def stop_the_next(first, watch):
        other = "prefill-1" if first == "prefill-0" else "prefill-0"
        watch.wait(_accepted_by(other), f"{other} to take the moved request", 60)
        stop(other)

    t0 = time.monotonic()
    try:
        status, out, _ = _stopped_at_prefill(cluster, {
            "model": MODEL, "prompt": _long_ids(hf, 2), "max_tokens": 4, "temperature": 0}, stop, stop_the_next)
    finally:
        for w in stopped:
            cluster.send_signal(w, signal.SIGCONT)
    assert status == 502 and out["error"]["code"] == "worker_lost", out
    message = out["error"]["message"]
    assert f"prefill worker {stopped[1]} died" in message and "moved 1 of --migration-limit 1 times" in message
    assert time.monotonic() - t0 < 60  # two heartbeat bounds and slack, not a hang


def test_decode_refuses_the_offer_of_a_request_cancelled_before_it(cluster, model_dir, hf):
    """A prefill worker that thaws after its request was moved may have finished the prompt and offer its KV:
    decode, which saw the cancel, refuses the offer at once (no KV moves) rather than take and free it."""
    import asyncio

    import nats

    from pdserve.basetypes import KVLayout, SamplingParams
    from pdserve.kvtransfer.protocol import Cancel, HandoffOffer, HandoffReply, Subjects
    from pdserve.modelstore import model_fingerprint

    ids = hf[0].encode("The three primary colours are", add_special_tokens=False)
    layout = KVLayout(model_fingerprint=model_fingerprint(model_dir), num_layers=30, kv_heads=3, head_dim=64,
                      dtype="float32", block_size=16)
    offer = HandoffOffer(request_id="moved-away", sender_id="prefill-thawed", sender_generation=1, layout=layout,
                         num_tokens=len(ids), kv_bytes=0, prompt_token_ids=ids, generated_token_ids=[],
                         sampling=SamplingParams(max_tokens=4, temperature=0), seed=0, next_seq=0,
                         kv_deferred=True, queue_ahead_tokens=1000)

    async def go():
        async with await nats.connect(**cluster.creds.connect_kwargs()) as nc:
            await nc.publish(Subjects.cancel(cluster.scope, offer.request_id),
                             Cancel(request_id=offer.request_id, reason="moved").encode())
            await nc.flush()
            refused = HandoffReply.decode((await nc.request(Subjects.decode_handoff(cluster.scope, "decode-0"),
                                                            offer.encode(), timeout=10)).data)
            again = HandoffReply.decode((await nc.request(Subjects.decode_handoff(cluster.scope, "decode-0"),
                                                          offer.encode(), timeout=10)).data)
            return refused, again

    refused, again = asyncio.run(go())
    assert not refused.accepted and "cancelled before its handoff" in refused.error
    assert again.accepted  # the cancel is spent: the id is not refused forever
