"""Conditional disaggregation, against real processes: a prompt queued behind a long one at prefill is
handed to decode uncomputed, and decode computes it in chunks inside its own steps.

What must hold: the answer is the one `transformers` gives (greedy) and the one the same seed draws when
prefill computes the prompt (sampled); decode takes such a prompt only while its own queue of them is
shorter than prefill's; a cancel frees what it had computed; a decode worker dying while computing one
is reported to the client as a lost worker, never a hang.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats
import pytest

from pdserve.basetypes import KVLayout, SamplingParams
from pdserve.kvtransfer.protocol import Cancel, HandoffOffer, HandoffReply, StreamEvent, Subjects
from pdserve.local import LocalCluster
from pdserve.natsserver import free_port
from servinghelpers import NatsWatch, hf_greedy, metric, post, stream_subjects, wait_for

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"
LONG = (Path(__file__).parent / "data" / "long_prompt.txt").read_text()
QUESTIONS = ["The three primary colours are", "Write a haiku about the sea:", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def ports():
    return {"prefill": free_port(), "decode": free_port()}


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir, ports):
    # any prompt waiting ahead makes the next one a candidate; small chunks on both sides, so a long prompt
    # keeps prefill's queue long for a while and decode computes a handed-over prompt over several steps
    c = LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds, worker_args={
        "prefill": ["--defer-queue-tokens", "1", "--chunk-size", "64", "--metrics-port", str(ports["prefill"])],
        "decode": ["--local-prefill-chunk", "16", "--metrics-port", str(ports["decode"])]})
    c.start()
    yield c
    c.stop()


def _labelled(port: int, name: str, outcome: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f'{name}{{outcome="{outcome}"}}'))


def _local(ports, outcome: str) -> float:
    """decode's uncomputed prompts by outcome (computed, cancelled, failed)."""
    return _labelled(ports["decode"], "pdserve_decode_local_prefills_total", outcome)


def _deferred(ports) -> float:
    """prefill's prompts that decode took uncomputed."""
    return _labelled(ports["prefill"], "pdserve_prefill_requests_total", "deferred")


def _behind_a_long_prompt(cluster, ports, tok, bodies: list[dict]) -> list[tuple[int, dict]]:
    """Send a long prompt, and once prefill holds it, `bodies` at once: each arrives behind it."""
    long_ids = tok.encode(LONG, add_special_tokens=False)[:640]
    url = cluster.url + "/v1/completions"
    with ThreadPoolExecutor(1 + len(bodies)) as pool:
        first = pool.submit(post, url, {"model": MODEL, "prompt": long_ids, "max_tokens": 2, "temperature": 0})
        wait_for(lambda: metric(ports["prefill"], "pdserve_prefill_queue_depth") >= 1, "prefill to queue the long "
                 "prompt", 60, interval=0.02)
        rest = [pool.submit(post, url, b) for b in bodies]
        assert first.result()[0] == 200
        return [f.result() for f in rest]


def test_prompts_queued_behind_a_long_one_are_computed_on_decode_as_generate_computes_them(cluster, ports, hf):
    tok = hf[0]
    before = _local(ports, "computed")
    deferred = _deferred(ports)
    prompts = [tok.encode(q, add_special_tokens=False) for q in QUESTIONS]
    out = _behind_a_long_prompt(cluster, ports, tok, [
        {"model": MODEL, "prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
         "return_token_ids": True} for ids in prompts])
    for (status, body), ids in zip(out, prompts):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == hf_greedy(hf, ids, 10, exact=True)
        assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 10
    assert _local(ports, "computed") > before  # decode computed at least one of them
    assert _deferred(ports) > deferred
    assert metric(ports["decode"], "pdserve_decode_local_prefill_tokens_total") > 0
    wait_for(lambda: metric(ports["decode"], "pdserve_decode_local_prefill_queue_tokens") == 0,
             "decode's queue of prompts to drain", 10)


def test_a_seeded_sampled_request_draws_the_same_tokens_when_decode_computes_its_prompt(cluster, model_dir, ports, hf):
    """Prefill samples the first token from (seed, position 0); decode's first step makes the same draw.

    The prompt is offered to decode uncomputed directly, as prefill offers it: sent behind a long prompt through
    the front, whether prefill defers it depends on how far the long prompt has got when it arrives (a race
    on a loaded machine); the greedy test above covers that path."""
    tok = hf[0]
    body = {"model": MODEL, "prompt": "Once upon a time, in a small village,", "max_tokens": 12,
            "temperature": 0.9, "top_p": 0.95, "seed": 1234, "ignore_eos": True, "return_token_ids": True}
    status, alone = post(cluster.url + "/v1/completions", body)  # nothing queued: prefill computes it
    assert status == 200, alone
    before = _local(ports, "computed")
    ids = tok.encode(body["prompt"], add_special_tokens=False)
    offer = _uncomputed(model_dir, "uncomputed-seeded", ids, ahead=1000, max_tokens=12)
    offer.sampling = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    offer.seed = 1234
    reply, events = asyncio.run(_send(cluster, offer))
    assert reply.accepted and events[-1].kind == "done", (reply, events[-1:])
    assert _local(ports, "computed") == before + 1
    drawn = [t for e in events if e.kind == "token" for t in e.token_ids]
    assert drawn == alone["choices"][0]["token_ids"]
    assert len(drawn) == 12


def _layout(model_dir) -> KVLayout:
    from pdserve.modelstore import model_fingerprint

    return KVLayout(model_fingerprint=model_fingerprint(model_dir), num_layers=30, kv_heads=3, head_dim=64,
                    dtype="float32", block_size=16)


def _uncomputed(model_dir, rid: str, ids: list[int], ahead: int, max_tokens: int = 8) -> HandoffOffer:
    return HandoffOffer(request_id=rid, sender_id="prefill-test", sender_generation=1, layout=_layout(model_dir),
                        num_tokens=len(ids), kv_bytes=0, prompt_token_ids=ids, generated_token_ids=[],
                        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), seed=0,
                        next_seq=0, kv_deferred=True, queue_ahead_tokens=ahead)


async def _send(cluster, offer: HandoffOffer, then=None, until=("done", "error")):
    """Offer `offer` to decode-0 as prefill would; → (reply, the request's events up to one of `until`)."""
    async with await nats.connect(**cluster.creds.connect_kwargs()) as nc:
        sub = await nc.subscribe(Subjects.stream(cluster.scope, offer.request_id))
        raw = await nc.request(Subjects.decode_handoff(cluster.scope, "decode-0"), offer.encode(), timeout=10)
        reply, events = HandoffReply.decode(raw.data), []
        while reply.accepted and (not events or events[-1].kind not in until):
            events.append(StreamEvent.decode((await sub.next_msg(timeout=60)).data))
            if then is not None and len(events) == 1:
                await then(nc)
        return reply, events


def test_decode_takes_an_uncomputed_prompt_only_while_its_own_queue_is_shorter(cluster, model_dir, hf):
    tok = hf[0]
    ids = tok.encode(QUESTIONS[0], add_special_tokens=False)
    reply, events = asyncio.run(_send(cluster, _uncomputed(model_dir, "uncomputed-short-queue", ids, ahead=len(ids) - 1)))
    assert not reply.accepted and events == []
    assert "no shorter than prefill's" in reply.error
    log = cluster.log_dir / "decode-0.log"
    assert "handoff refused: its queue" not in log.read_text()  # routine (prefill offers its queue every step)

    reply, events = asyncio.run(_send(cluster, _uncomputed(model_dir, "uncomputed-taken", ids, ahead=1000)))
    assert reply.accepted and reply.transfer_token is None  # nothing is sent: decode computes it
    assert events[0].kind == "handoff" and events[0].seq == 0 and events[0].kv_bytes == 0
    assert events[-1].kind == "done" and [e.seq for e in events] == list(range(len(events)))
    assert [t for e in events if e.kind == "token" for t in e.token_ids] == hf_greedy(hf, ids, 8, exact=True)

    wrong = _uncomputed(model_dir, "uncomputed-other-model", ids, ahead=1000)
    wrong.layout = wrong.layout.model_copy(update={"model_fingerprint": "0123456789abcdef"})
    reply, events = asyncio.run(_send(cluster, wrong))
    assert not reply.accepted and "model_fingerprint: expected" in reply.error
    warned = [ln for ln in log.read_text().splitlines() if "WARNING" in ln and "handoff refused" in ln]
    assert any("model_fingerprint" in ln for ln in warned), warned  # a deployment mistake is a warning


def test_a_cancel_frees_a_prompt_decode_was_computing(cluster, ports, model_dir, hf):
    tok = hf[0]
    ids = tok.encode(LONG, add_special_tokens=False)[:1200]
    before = _local(ports, "cancelled")

    async def cancel(nc):
        await nc.publish(Subjects.cancel(cluster.scope, "uncomputed-cancelled"),
                         Cancel(request_id="uncomputed-cancelled", reason="client went away").encode())

    offer = _uncomputed(model_dir, "uncomputed-cancelled", ids, ahead=5000, max_tokens=200)
    reply, events = asyncio.run(_send(cluster, offer, then=cancel, until=("handoff",)))
    assert reply.accepted and [e.kind for e in events] == ["handoff"]
    wait_for(lambda: _local(ports, "cancelled") > before, "decode to drop the cancelled prompt", 30)
    wait_for(lambda: metric(ports["decode"], "pdserve_decode_kv_utilization") == 0, "its KV blocks to be freed", 30)
    assert metric(ports["decode"], "pdserve_decode_local_prefill_queue_tokens") == 0
    short = tok.encode(QUESTIONS[1], add_special_tokens=False)  # and it serves on
    status, out = post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": short, "max_tokens": 4,
                                                         "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert status == 200 and out["choices"][0]["token_ids"] == hf_greedy(hf, short, 4, exact=True)


def test_decode_killed_while_computing_a_handed_over_prompt_is_a_lost_worker(cluster, ports, hf):
    """The handoff event made decode responsible before any token: its death is reported as such."""
    tok = hf[0]
    long_ids = tok.encode(LONG * 2, add_special_tokens=False)[:2000]
    half = len(LONG) // 2  # a prompt none of whose prefix prefill holds (a cached prefix stays with prefill)
    behind = tok.encode(LONG[half:] + LONG[:half], add_special_tokens=False)[:1200]
    url = cluster.url + "/v1/completions"

    def uncomputed_handoff(subject, data):
        ev = StreamEvent.decode(data)
        return ev.kind == "handoff" and ev.worker_id == "decode-0" and ev.kv_bytes == 0 and ev.seq == 0

    with NatsWatch(cluster.creds, stream_subjects()) as watch, ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, url, {"model": MODEL, "prompt": long_ids, "max_tokens": 2})
        wait_for(lambda: metric(ports["prefill"], "pdserve_prefill_queue_depth") >= 1, "prefill to queue the long "
                 "prompt", 60, interval=0.02)
        second = pool.submit(post, url, {"model": MODEL, "prompt": behind, "max_tokens": 4})
        watch.wait(uncomputed_handoff, "decode-0 to take the prompt uncomputed", 60)
        t0 = time.monotonic()
        cluster.kill("decode-0")
        status, out = second.result()
        assert status == 502 and out["error"]["code"] == "worker_lost", out
        assert "decode worker decode-0 died" in out["error"]["message"]
        assert time.monotonic() - t0 < 20  # the heartbeat bound, not a hang
        assert first.result()[0] in (502, 503)  # its KV had no decode worker to go to: an error, not a 200
    cluster.restart("decode-0")
    ids = tok.encode(QUESTIONS[2], add_special_tokens=False)
    status, out = post(url, {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True})
    assert status == 200 and out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 4, exact=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_defaults_defer_where_a_chunk_rides_in_decode_s_native_step(model_dir, dtype):
    """Left unset, prefill defers prompts behind 512 queued tokens and decode computes 256 of them a step where
    the workers' steps run the native CPU decoder, bfloat16 or float32 (a chunk beside decode's rows is one
    forward at the projections' rate there); through transformers' forward (no AVX2 + FMA, no kernels) none is
    deferred and decode's chunk stays 64. Given values are kept either way."""
    from pdserve.kernels import cpu_decoder

    from pdserve.config import DecodeConfig, PrefillConfig, load
    from pdserve.decode.worker import DecodeWorker
    from pdserve.prefill.worker import PrefillWorker

    common = ["--model", str(model_dir), "--dtype", dtype, "--kv-capacity-bytes", str(64 << 20)]
    prefill = PrefillWorker(load(PrefillConfig, common, environ={}))
    decode = DecodeWorker(load(DecodeConfig, [*common, "--no-spec-calibrate"], environ={}))
    native = prefill.engine.native_rows() > 0
    assert native == (decode.engine.native_rows() > 0)
    if dtype == "float32":
        assert native == cpu_decoder.float32_available()
    assert (prefill.defer_tokens, decode.local_chunk) == ((512, 256) if native else (0, 64))
    given = PrefillWorker(load(PrefillConfig, [*common, "--defer-queue-tokens", "0"], environ={}))
    assert given.defer_tokens == 0
    given = DecodeWorker(load(DecodeConfig, [*common, "--no-spec-calibrate", "--local-prefill-chunk", "32"], environ={}))
    assert given.local_chunk == 32


def test_a_prompt_left_queued_is_offered_again_once_per_step_the_last_first(model_dir):
    """Prompts are offered to decode on arrival; one decode refused (its own queue was as long) stays queued, and
    between two steps the prompt that would wait longest is offered again while enough is queued ahead of it:
    one offer at a time, at most one per step, never a prompt already started (`PrefillWorker._reoffer`; the
    offer itself, `_defer`, is recorded here instead of sent)."""
    from pdserve.config import PrefillConfig, load
    from pdserve.kvtransfer.protocol import PrefillRequest
    from pdserve.prefill.worker import Job, PrefillWorker

    worker = PrefillWorker(load(PrefillConfig, ["--model", str(model_dir), "--dtype", "float32", "--defer-queue-tokens",
                                                "100", "--kv-capacity-bytes", str(64 << 20)], environ={}))
    offered = []

    async def record(job, ahead):
        offered.append((job.seq_id, ahead))

    worker._defer = record

    def job(i: int, n: int = 80, choices: int = 1) -> Job:
        req = PrefillRequest(request_id=f"r{i}", model=MODEL, prompt_token_ids=list(range(5, 5 + n)),
                             sampling=SamplingParams(max_tokens=4, n=choices), seed=0, decode_worker_id="decode-0")
        return Job(f"j{i}", req.prompt_token_ids, 0.0, req)

    async def between_steps() -> None:
        worker._reoffer()
        await asyncio.sleep(0)  # the offer's task runs

    async def scenario():
        worker.jobs.extend([job(0), job(1), job(2, choices=2)])
        worker.jobs[0].started = True
        await between_steps()  # the last is not to be offered (two choices); the one before is, 80 tokens ahead: too few
        assert offered == []
        worker.jobs.append(job(3))
        await between_steps()
        assert offered == [("j3", 240)] and worker.jobs[-1].offering  # 80 + 80 + 80 ahead of it
        worker.jobs[-1].offering = False  # refused: it stays
        await between_steps()
        assert len(offered) == 1  # not again in the same step
        worker._steps += 1
        worker.jobs[-1].started = True  # begun meanwhile: never offered; the last not begun has two choices
        await between_steps()
        assert len(offered) == 1
        worker.jobs[-1].started = False
        worker._steps += 1
        worker.jobs[1].offering = True  # an offer is out: no second one
        await between_steps()
        assert len(offered) == 1
        worker.jobs[1].offering = False
        await between_steps()  # the next step's offer, of the same prompt, which still waits last
        assert offered == [("j3", 240), ("j3", 240)]

    asyncio.run(scenario())
