"""A front that dies leaves no orphan behind: the workers cancel what it asked for once its heartbeats stop.

The end-to-end test runs real processes (NATS, a prefill and a decode worker, the front) over loopback: a long
stream is cut by killing the front (SIGKILL: no cancel is ever sent), a new front starts, and the decode worker
must drop the request within the front's bound plus a sweep — not decode it to its last token.
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from pdserve.basetypes import SamplingParams
from pdserve.frontwatch import FrontWatch
from pdserve.kvtransfer.protocol import FrontBeat, PrefillRequest, ProtocolError
from pdserve.local import LocalCluster
from pdserve.natsserver import free_port
from servinghelpers import metric, stream, wait_for

MODEL = "SmolLM2-135M-Instruct"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Msg:
    def __init__(self, data: bytes):
        self.data = data


def _beat(watch: FrontWatch, front_id: str, stale_after_s: float = 10.0) -> None:
    _hear(watch, FrontBeat(front_id=front_id, stale_after_s=stale_after_s).encode())


def _hear(watch: FrontWatch, data: bytes) -> None:
    asyncio.run(watch._on_beat(Msg(data)))  # what NATS calls with each message on the beats' subject


def test_a_request_is_an_orphan_only_once_its_front_is_silent_past_its_bound():
    clock = Clock()
    watch = FrontWatch(clock)
    _beat(watch, "front-a", 5.0)
    watch.vouch("front-b")  # heard of through a request only: it counts as alive from then on
    held = [("r1", "front-a"), ("r2", "front-b"), ("r3", None), ("r4", "front-never-heard")]
    clock.t += 5.0
    assert watch.orphans(held) == []  # at the bound, not past it
    clock.t += 0.5
    assert watch.orphans(held) == [("r1", "front-a", 5.5)]
    _beat(watch, "front-a", 5.0)  # it beats again (a NATS blip): its requests are not orphans any more
    assert watch.orphans(held) == []
    clock.t += 10.0
    orphans = {rid for rid, _, _ in watch.orphans(held)}
    # a request no front vouches for (None), or from a front never heard of, is never taken for an orphan
    assert orphans == {"r1", "r2"}
    assert watch.orphans([("r1", "front-a"), ("r1", "front-a")]) == [("r1", "front-a", 10.0)]  # n > 1: once


def test_a_malformed_beat_is_counted_and_changes_nothing():
    clock = Clock()
    watch = FrontWatch(clock)
    watch.vouch("front-a")
    clock.t += 11.0
    _hear(watch, b'{"v": 2, "front_id": ""}')
    _hear(watch, b"not json")
    assert watch.malformed == 2
    assert [rid for rid, _, _ in watch.orphans([("r", "front-a")])] == ["r"]
    with pytest.raises(ProtocolError):
        FrontBeat.decode(json.dumps({"v": 2, "front_id": "f", "stale_after_s": 0}).encode())


def test_fields_added_within_v2_are_left_out_until_used():
    """A message that uses none of them is byte for byte what an earlier v2 build sent, so such a build (which
    refuses fields it does not know) still reads it during a rolling upgrade."""
    req = PrefillRequest(request_id="r", model="m", prompt_token_ids=[1, 2], sampling=SamplingParams(), seed=7,
                         decode_worker_id="d")
    plain = json.loads(req.encode())
    assert not {"generated_token_ids", "front_id", "traceparent"} & plain.keys()
    used = req.model_copy(update={"generated_token_ids": [5], "front_id": "front-x"})
    back = PrefillRequest.decode(used.encode())
    assert back.front_id == "front-x" and back.generated_token_ids == [5] and back.resumed and not req.resumed


@pytest.mark.model
def test_a_killed_fronts_stream_is_cancelled_on_decode_not_decoded_to_its_end(nats_server, model_dir):
    decode_port = free_port()
    c = LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds,
                     worker_args={"decode": ["--metrics-port", str(decode_port)]})
    c.start()
    try:
        killed_at = []

        def kill_front(i, event):
            if i == 2:
                killed_at.append(time.monotonic())
                c.kill("front")
                return True  # nothing more comes: the connection died with the front
            return False

        # far more tokens than the bound leaves time for: only a cancel ends it before the test gives up
        body = {"model": MODEL, "prompt": "Count from one to ten thousand: one, two,", "max_tokens": 6000,
                "temperature": 0, "ignore_eos": True}
        events, _ = stream(c.url + "/v1/completions", body, on_event=kill_front)
        assert killed_at and len(events) == 3 and "[DONE]" not in events
        assert metric(decode_port, "pdserve_decode_running_sequences") == 1  # decoding on, nobody to read it
        c.restart("front")  # a new front (a new front id): the old one's requests are nobody's
        wait_for(lambda: metric(decode_port, "pdserve_orphans_cancelled_total") >= 1,
                 "decode to cancel the dead front's request", 60)
        wait_for(lambda: metric(decode_port, "pdserve_decode_running_sequences") == 0,
                 "decode to drop it", 10)
        log = (c.log_dir / "decode-0.log").read_text()
        assert "went silent" in log and "cancelled by decode" in log
        # the new front serves as before, and its own requests are nobody's orphans
        events, _ = stream(c.url + "/v1/completions", {**body, "max_tokens": 8})
        assert events[-1] == "[DONE]"
        assert metric(decode_port, "pdserve_orphans_cancelled_total") == 1
    finally:
        c.stop()
