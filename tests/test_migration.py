"""A request moves when the worker holding it dies, against real processes: two prefill workers, two decode
workers, a real NATS server and the front over loopback HTTP.

The client must see nothing of it: a 200 (or a whole SSE stream) with the answer an uninterrupted run gives
(greedy: `transformers`'; seeded: the same request sent again), no token repeated or missing, whether the
worker was killed (SIGKILL) or frozen (SIGSTOP) past its heartbeat bound, before the handoff (prefill) or
mid-stream (decode: the tokens streamed so far go with the request, and the new prefill worker computes
their KV beside the prompt's). A frozen worker that thaws drops the attempt it held (the front cancelled
it). Past `--migration-limit` moves the request fails as it did before migration, with `worker_lost`.
"""
from __future__ import annotations

import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.local import LocalCluster
from servinghelpers import (NatsWatch, accepted_by, decoded_by, hf_greedy, metric, post, stream, stream_subjects,
                            wait_for)

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"
LONG = (Path(__file__).parent / "data" / "long_prompt.txt").read_text()


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    # small chunks: a long prompt stays at prefill for many steps, so a worker is stopped while it holds it;
    # one move allowed, so a request whose second prefill worker dies too fails
    c = LocalCluster(str(model_dir), 2, 2, nats=nats_server.creds, drain_timeout=1, worker_args={
        "prefill": ["--chunk-size", "32", "--prefix-offload"], "front": ["--migration-limit", "1"]})
    c.start()
    yield c
    c.stop()


def _moves(cluster) -> float:
    return metric(cluster.port, "pdserve_request_moves_total")


def _move_kv(cluster) -> dict[str, float]:
    """The front's pdserve_request_move_kv_tokens_total by source, and the moves its stall histogram counted."""
    text = urllib.request.urlopen(cluster.url + "/metrics", timeout=5).read().decode()
    out = {src: 0.0 for src in ("prefix", "offload", "computed")}
    for line in text.splitlines():
        if line.startswith("pdserve_request_move_kv_tokens_total{"):
            out[line.split('source="')[1].split('"')[0]] = float(line.split()[-1])
    out["stalls"] = metric(cluster.port, "pdserve_request_move_stall_seconds_count")
    return out


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
    assert f"prefill worker {killed} died while serving the request" in log and "moved with 0 tokens streamed" in log
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
    decode, which saw the cancel, refuses the offer at once (no KV moves) rather than take and free it — and
    again when prefill re-offers the refused handoff, to the routed worker or to any through the queue group."""
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
            replies = []
            for subject in (Subjects.decode_handoff(cluster.scope, "decode-0"),
                            Subjects.decode_handoff(cluster.scope, "decode-0"),
                            Subjects.decode_handoff_any(cluster.scope, MODEL),
                            Subjects.decode_handoff_any(cluster.scope, MODEL)):
                replies.append(HandoffReply.decode((await nc.request(subject, offer.encode(), timeout=10)).data))
            return replies

    for reply in asyncio.run(go()):
        assert not reply.accepted and "cancelled before its handoff" in reply.error, reply


def _decoding(subject, data) -> str | None:
    """NatsWatch match: the decode worker that sent a token event."""
    return next((w for w in ("decode-0", "decode-1") if decoded_by(w)(subject, data)), None)


def _killed_mid_stream(cluster, send, tokens_first: int = 3):
    """`send()` (in a thread) → its result, the decode worker serving it killed once it streamed `tokens_first`
    token events; → (result, the killed worker)."""
    with NatsWatch(cluster.creds, stream_subjects()) as watch, ThreadPoolExecutor(1) as pool:
        reply = pool.submit(send)
        worker = watch.wait(_decoding, "a decode worker's first token", 120)
        for _ in range(tokens_first - 1):
            watch.wait(decoded_by(worker), f"{worker}'s next token", 60)
        cluster.kill(worker)
        result = reply.result()
    return result, worker


def test_a_decode_worker_killed_mid_stream_is_invisible_to_the_client(cluster, hf):
    """The move's KV comes from the prefill worker that computed the prompt: it keeps the prompt's blocks in its
    prefix cache, the router sends the moved request back to it, and only the rest is computed."""
    # 48 tokens of the long text behind a preamble of its own (no other test's prefix), whose greedy 96 tokens hold
    # no EOS: `ignore_eos` goes on past one (as vLLM's does) where the reference's min_new_tokens would forbid it
    ids = hf[0].encode("Go on with this text:\n" + LONG, add_special_tokens=False)[:48]
    before, kv_before = _moves(cluster), _move_kv(cluster)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 96, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    (status, out), killed = _killed_mid_stream(cluster, lambda: post(cluster.url + "/v1/completions", body))
    try:
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 96, exact=True)
        assert out["usage"]["completion_tokens"] == 96 and out["choices"][0]["finish_reason"] == "length"
        assert _moves(cluster) == before + 1
        moved = [ln for ln in (cluster.log_dir / "front.log").read_text().splitlines()
                 if out["id"] in ln and "moved with" in ln]
        assert len(moved) == 1 and f"decode worker {killed} died" in moved[0], moved
        streamed = int(moved[0].split("moved with ")[1].split()[0])
        assert 3 <= streamed < 96  # it moved mid-stream, with what the client had
        # the new workers needed the KV of the prompt and the streamed tokens but the last: every one accounted
        kv = {k: v - kv_before[k] for k, v in _move_kv(cluster).items()}
        blocks = len(ids) // 16 * 16  # the prompt's whole blocks; what was streamed was never cached
        assert len(ids) >= 32 and kv == {"prefix": blocks, "offload": 0, "computed": len(ids) - blocks + streamed - 1,
                                         "stalls": 1}, kv
    finally:
        cluster.restart(killed)


def _prefilling(subject, data) -> str | None:
    """NatsWatch match: the prefill worker that sent a request's first token."""
    return next((w for w in ("prefill-0", "prefill-1") if decoded_by(w)(subject, data)), None)


def _stored(cluster, model_dir, ids: list[int]) -> int:
    """How many leading tokens of `ids` the deployment's offload tier holds."""
    import asyncio

    import nats

    from pdserve.kvtransfer.offload import KVPrefixStore
    from pdserve.kvtransfer.protocol import Buckets
    from pdserve.runtime import ModelRunner

    layout = ModelRunner(model_dir).layout

    async def go():
        async with await nats.connect(**cluster.creds.connect_kwargs()) as nc:
            got = await KVPrefixStore(nc, layout, bucket=Buckets.prefix(cluster.scope)).get_longest_prefix(ids)
            return got[1] if got else 0
    return asyncio.run(go())


def test_a_moved_request_fetches_its_prompts_kv_from_the_offload_tier_when_its_prefill_worker_died_too(
        cluster, model_dir, hf):
    """Decode dies mid-stream, and so does the prefill worker that computed the prompt (their node lost, say): the
    other prefill worker fetches the prompt's KV from the offload tier (`--prefix-offload`) instead of computing it
    again, and computes only what it lacks; the client gets the uninterrupted greedy answer."""
    # the long text behind a preamble of its own: no worker holds any block of it (a chain of hashes from the start)
    ids = hf[0].encode("Summarise the following text.\n" + LONG, add_special_tokens=False)[:480]
    want = hf_greedy(hf, ids, 200, exact=True)
    kv_before = _move_kv(cluster)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with NatsWatch(cluster.creds, stream_subjects()) as watch, ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, cluster.url + "/v1/completions", body)
        prefill = watch.wait(_prefilling, "the prompt's first token", 120)
        decode = watch.wait(_decoding, "a decode worker's first token", 60)
        blocks = len(ids) // 16 * 16
        wait_for(lambda: _stored(cluster, model_dir, ids) == blocks, "the prompt's blocks in the offload tier", 60)
        cluster.kill(prefill)
        cluster.kill(decode)
        status, out = reply.result()
    try:
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want
        moved = [ln for ln in (cluster.log_dir / "front.log").read_text().splitlines()
                 if out["id"] in ln and "moved with" in ln]
        assert len(moved) == 1, moved
        streamed = int(moved[0].split("moved with ")[1].split()[0])
        assert 1 <= streamed < 200, moved
        kv = {k: v - kv_before[k] for k, v in _move_kv(cluster).items()}
        assert kv == {"prefix": 0, "offload": blocks, "computed": len(ids) - blocks + streamed - 1, "stalls": 1}
    finally:
        cluster.restart(prefill, decode)


def test_a_seeded_stream_moved_off_a_dead_decode_worker_is_its_uninterrupted_replay(cluster, hf):
    """A prompt shorter than a block: nothing of it can be cached anywhere, so the move computes all its KV."""
    body = {"model": MODEL, "prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 80,
            "temperature": 0.9, "top_p": 0.95, "seed": 2024, "ignore_eos": True}
    kv_before = _move_kv(cluster)
    (events, _), killed = _killed_mid_stream(cluster, lambda: stream(cluster.url + "/v1/completions", body,
                                                                     timeout=120))
    try:
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        status, replay = post(cluster.url + "/v1/completions", {**body, "return_token_ids": True})
        assert status == 200, replay
        assert text == replay["choices"][0]["text"]  # no token's text repeated, none missing
        finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
        assert finish == ["length"]
        kv = {k: v - kv_before[k] for k, v in _move_kv(cluster).items()}
        prompt = len(hf[0].encode(body["prompt"], add_special_tokens=False))
        assert prompt < 16 and kv["prefix"] == kv["offload"] == 0 and kv["stalls"] == 1, kv
        assert prompt + 3 <= kv["computed"] < prompt + 80, kv  # the prompt and what was streamed, less the last
    finally:
        cluster.restart(killed)


def _resumed(cluster, hf, rid: str, generated: list[int], **sampling) -> tuple["Ack", list]:
    """Dispatch a moved request (its tokens so far in `generated`) to prefill-0 as the front does → (its
    acknowledgement, the events of its stream up to done or error)."""
    import asyncio

    import nats

    from pdserve.basetypes import SamplingParams
    from pdserve.kvtransfer.protocol import Ack, PrefillRequest, StreamEvent, Subjects

    ids = hf[0].encode("The three primary colours are", add_special_tokens=False)
    req = PrefillRequest(request_id=rid, model=MODEL, prompt_token_ids=ids, seed=5, decode_worker_id="decode-1",
                         sampling=SamplingParams(**{"temperature": 0, "ignore_eos": True, **sampling}),
                         generated_token_ids=generated)

    async def go():
        async with await nats.connect(**cluster.creds.connect_kwargs()) as nc:
            sub = await nc.subscribe(Subjects.stream(cluster.scope, rid))
            ack = Ack.decode((await nc.request(Subjects.prefill_worker(cluster.scope, MODEL, "prefill-0"),
                                               req.encode(), timeout=10)).data)
            events = []
            while ack.accepted and (not events or events[-1].kind not in ("done", "error")):
                events.append(StreamEvent.decode((await sub.next_msg(timeout=60)).data))
            return ack, events
    return asyncio.run(go())


def test_a_moved_request_whose_streamed_tokens_already_end_it_gets_its_done(cluster, hf):
    """Decode died after streaming the last token, before its "done": the new decode worker replays the tokens,
    finds the answer complete and says so, with the whole usage (the client must not wait for a silence bound)."""
    ids = hf[0].encode("The three primary colours are", add_special_tokens=False)
    tokens = hf_greedy(hf, ids, 6, exact=True)
    ack, events = _resumed(cluster, hf, "resumed-complete", tokens, max_tokens=6)
    assert ack.accepted, ack
    assert [e.kind for e in events] == ["done"] and events[0].seq == 0, events
    assert events[0].finish_reason == "length" and events[0].usage.completion_tokens == 6


def test_a_moved_request_goes_on_from_its_tokens_and_bad_ones_are_refused(cluster, hf):
    ids = hf[0].encode("The three primary colours are", add_special_tokens=False)
    want = hf_greedy(hf, ids, 12, exact=True)
    ack, events = _resumed(cluster, hf, "resumed-midway", want[:5], max_tokens=12)
    assert ack.accepted, ack
    assert events[0].kind == "handoff" and events[-1].kind == "done", events
    assert want[:5] + [t for e in events if e.kind == "token" for t in e.token_ids] == want
    assert events[-1].usage.completion_tokens == 12

    ack, _ = _resumed(cluster, hf, "resumed-n2", want[:2], max_tokens=12, n=2)
    assert not ack.accepted and ack.status == 400 and "one choice, not n=2" in ack.error
    ack, _ = _resumed(cluster, hf, "resumed-vocab", [want[0], 10**6], max_tokens=12)
    assert not ack.accepted and ack.status == 400 and "generated token ids must lie in" in ack.error


def test_a_moved_guided_request_goes_on_under_its_grammar_from_where_the_client_is(cluster, hf):
    """A structured-output request moved mid-stream: the new decode worker's grammar state is advanced over the
    tokens already streamed (not restarted at the grammar's start, which would refuse them or restart the
    object), so the continuation is the uninterrupted one and the whole answer parses."""
    import json

    from pdserve.basetypes import Guided

    schema = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string"},
                                                            "maxItems": 3}}, "required": ["colours"]}
    status, whole = post(cluster.url + "/v1/completions", {
        "model": MODEL, "prompt": "The three primary colours are", "max_tokens": 48, "temperature": 0,
        "guided_json": schema, "return_token_ids": True})
    assert status == 200, whole
    want = whole["choices"][0]["token_ids"]
    assert len(want) > 8 and whole["choices"][0]["finish_reason"] == "stop", whole
    json.loads(whole["choices"][0]["text"])
    ack, events = _resumed(cluster, hf, "resumed-guided", want[:6], max_tokens=48, ignore_eos=False,
                           guided=Guided(kind="json_schema", value=json.dumps(schema)))
    assert ack.accepted, ack
    assert events[-1].kind == "done" and events[-1].finish_reason == "stop", events[-1]
    assert want[:6] + [t for e in events if e.kind == "token" for t in e.token_ids] == want


def test_a_decode_worker_stopped_mid_stream_moves_what_it_could_not_finish(cluster, hf):
    """A planned exit (SIGTERM: a scale-down, a rollout) with a generation longer than the drain timeout: the
    worker finishes what it can, then the rest moves (`WORKER_STOPPED`), and the client gets the whole answer."""
    ids = hf[0].encode("List the countries of Europe and their capitals:", add_special_tokens=False)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 320, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    before = _moves(cluster)
    with NatsWatch(cluster.creds, stream_subjects()) as watch, ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, cluster.url + "/v1/completions", body)
        worker = watch.wait(_decoding, "a decode worker's first token", 120)
        cluster.send_signal(worker, signal.SIGTERM)  # drains for 1 s: too short for 320 tokens
        status, out = reply.result()
    try:
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 320, exact=True)
        assert _moves(cluster) == before + 1
        assert cluster.procs[worker].wait(30) == 0  # a drain, not a crash
        moved = [ln for ln in (cluster.log_dir / "front.log").read_text().splitlines()
                 if out["id"] in ln and "moved with" in ln]
        assert len(moved) == 1 and f"decode worker {worker} stopped before finishing" in moved[0], moved
    finally:
        cluster.restart(worker)
