"""One disaggregated request's trace, as a real deployment exports it over OTLP/HTTP: the span tree across
the front, prefill and decode processes, joined by the client's W3C traceparent."""
from __future__ import annotations

import json
import secrets
import time

import pytest

from bench.otlp_sink import OtlpReceiver
from pdserve.local import LocalCluster
from servinghelpers import post, wait_for

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed (pip install -e '.[otel]')")
pytestmark = pytest.mark.model

# repetitive text: prompt lookup (n-gram speculation) drafts from it
PROMPT = "one two three four five six seven eight nine ten. " * 6 + "one two three"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def traced(nats_server, model_dir):
    receiver = OtlpReceiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    json_logs = ["--log-format", "json"]
    cluster = LocalCluster(str(model_dir), prefill_workers=1, decode_workers=1, nats=nats_server.creds, env=env,
                           worker_args={"decode": ["--spec-method", "ngram", "--spec-k-policy", "fixed",
                                                   "--spec-max-k", "4", *json_logs],
                                        "prefill": json_logs, "front": json_logs})
    cluster.start()
    yield cluster, receiver
    cluster.stop()
    receiver.close()


def test_one_request_is_one_trace_across_three_processes(traced):
    _assert_one_trace(*traced, streamed=False)


def test_a_layer_streamed_handoff_is_traced_the_same_way(nats_server, model_dir):
    """Prefill offers the KV from its last chunk's first layer and sends it layer by layer (`--kv-stream-layers`,
    on where the pair shares no CPU lease): the same tree, the handoff spans marked as streamed."""
    receiver = OtlpReceiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    cluster = LocalCluster(str(model_dir), prefill_workers=1, decode_workers=1, nats=nats_server.creds, env=env,
                           cpu_lease=False, worker_args={"decode": ["--spec-method", "ngram", "--spec-k-policy",
                                                                    "fixed", "--spec-max-k", "4"]})
    cluster.start()
    try:
        _assert_one_trace(cluster, receiver, streamed=True)
    finally:
        cluster.stop()
        receiver.close()


def _assert_one_trace(cluster, receiver, streamed: bool) -> None:
    """One request through `cluster` with a client traceparent; its export at `receiver` is the whole tree."""
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    t_start = time.time_ns()
    status, out = post(cluster.url + "/v1/completions",
                       {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True}, headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    t_end = time.time_ns()
    assert status == 200, out
    completion = out["usage"]["completion_tokens"]
    assert completion == MAX_TOKENS

    roots = {"front": "POST /v1/completions", "prefill": "prefill.request", "decode": "decode.request"}

    def ended():
        spans = [s for s in receiver.spans() if s.trace_id == trace_id]
        names = {s.name for s in spans}
        return spans if set(roots.values()) <= names and "handoff.transfer" in names else None

    spans = wait_for(ended, "the request's three root spans at the OTLP receiver", 30)
    assert {s.trace_id for s in spans} == {trace_id}, "one request, one trace"
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    one = {name: v[0] for name, v in by_name.items()}
    front, prefill, decode = (one[roots[r]] for r in ("front", "prefill", "decode"))

    # each part from its own process, and the client's span is the front's parent
    assert (front.service, prefill.service, decode.service) == ("pdserve-front", "pdserve-prefill", "pdserve-decode")
    assert front.parent_id == client_span, "the client's traceparent is honoured"
    assert prefill.parent_id == front.span_id and decode.parent_id == front.span_id
    assert front.attributes["pdserve.request_id"] == out["id"] == prefill.attributes["pdserve.request_id"] \
        == decode.attributes["pdserve.request_id"]

    children = {"front": (front, ["front.parse", "front.route", "front.queue"]),
                "prefill": (prefill, ["prefill.queue", "prefill.chunk", "prefill.first_token", "handoff.offer",
                                      "handoff.transfer"]),
                "decode": (decode, ["handoff.import", "decode.admission", "decode.queue", "decode.steps"])}
    for part, (root, names) in children.items():
        for name in names:
            assert name in by_name, f"{part}: no {name} span (got {sorted(by_name)})"
            for s in by_name[name]:
                assert s.parent_id == root.span_id, f"{name} is not a child of {root.name}"
                assert s.service == root.service
                assert root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns, f"{name} outside {root.name}"
                assert s.error is None, f"{name}: {s.error}"

    # everything within the request's wall time as the client saw it
    for s in spans:
        assert t_start <= s.start_ns <= s.end_ns <= t_end, f"{s.name} outside the request's wall time"
    assert front.duration_ns <= t_end - t_start
    for root in (prefill, decode):
        assert front.start_ns <= root.start_ns and root.end_ns <= front.end_ns
    chunks, steps = by_name["prefill.chunk"], by_name["decode.steps"]
    assert sum(c.duration_ns for c in chunks) <= prefill.duration_ns
    assert sum(s.duration_ns for s in steps) <= decode.duration_ns

    # what the spans say matches what happened
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert sum(c.attributes["pdserve.chunk.tokens"] for c in chunks) \
        == prompt_tokens - one["prefill.queue"].attributes["pdserve.cached_tokens"]
    transfer, imported = one["handoff.transfer"], one["handoff.import"]
    assert transfer.attributes["pdserve.kv.bytes"] > 0
    assert transfer.attributes["pdserve.kv.bytes"] == imported.attributes["pdserve.kv.bytes"]
    assert transfer.attributes["pdserve.kv.transport"] == imported.attributes["pdserve.kv.transport"] \
        in ("shm", "tcp", "nats")
    assert one["handoff.offer"].attributes["pdserve.accepted"] is True
    for name in ("handoff.offer", "handoff.transfer"):
        assert one[name].attributes.get("pdserve.kv.layer_streamed", False) is streamed, name
    assert one["handoff.offer"].end_ns <= transfer.start_ns
    assert imported.end_ns <= one["decode.admission"].start_ns <= one["decode.queue"].start_ns
    assert one["decode.queue"].end_ns <= min(s.start_ns for s in steps)
    # steps grouped, not a span per token: prefill made the first token, decode the rest
    assert len(steps) < completion - 1
    assert sum(s.attributes["pdserve.tokens"] for s in steps) == completion - 1
    drafted = sum(s.attributes["pdserve.spec.drafted"] for s in steps)
    accepted = sum(s.attributes["pdserve.spec.accepted"] for s in steps)
    assert 0 < drafted and 0 <= accepted <= drafted
    assert (decode.attributes["pdserve.spec.drafted"], decode.attributes["pdserve.spec.accepted"]) \
        == (drafted, accepted) == (out["usage"]["speculation"]["draft_tokens"],
                                   out["usage"]["speculation"]["accepted_tokens"])
    assert {"first_token", "handoff"} <= set(front.events)


def test_unsampled_client_trace_records_nothing(traced):
    """A client's traceparent whose sampled flag is off: no process records the request (parent-based sampling)."""
    cluster, receiver = traced
    trace_id = secrets.token_hex(16)
    status, out = post(cluster.url + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hello",
                                                         "max_tokens": 2},
                       headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-00"})
    assert status == 200, out
    assert out["choices"][0]["text"] is not None
    # a request after it, sampled, is exported: once it is there, the unsampled one would have been too
    marker = secrets.token_hex(16)
    status, sampled = post(cluster.url + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hello",
                                                             "max_tokens": 2},
                           headers={"traceparent": f"00-{marker}-{secrets.token_hex(8)}-01"})
    assert status == 200, sampled
    wait_for(lambda: sum(s.trace_id == marker and s.name.endswith(".request") for s in receiver.spans()) == 2,
             "the sampled request's worker spans", 30)
    assert not [s for s in receiver.spans() if s.trace_id == trace_id]


def test_a_malformed_client_traceparent_starts_a_trace_of_its_own(traced):
    """W3C trace context: a traceparent that does not parse is ignored, not an error."""
    cluster, receiver = traced
    status, out = post(cluster.url + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                                         "max_tokens": 2},
                       headers={"traceparent": "00-not-a-trace-01"})
    assert status == 200, out

    def front_root():
        return next((s for s in receiver.spans() if s.name == "POST /v1/completions"
                     and s.attributes.get("pdserve.request_id") == out["id"]), None)

    root = wait_for(front_root, "the request's front span", 30)
    assert root.parent_id == "" and len(root.trace_id) == 32
    wait_for(lambda: sum(s.trace_id == root.trace_id and s.name.endswith(".request") for s in receiver.spans()) == 2,
             "the workers' spans in the front's new trace", 30)


def test_log_lines_name_their_request_and_trace_in_json(traced):
    """`--log-format json`: a line logged for a request (here the front's warning about an unknown field) is a
    JSON object carrying the request's id and its trace id."""
    cluster, receiver = traced
    trace_id = secrets.token_hex(16)
    status, out = post(cluster.url + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                                         "max_tokens": 2, "frobnicate": 1},
                       headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    assert status == 200, out

    def logged():
        for line in (cluster.log_dir / "front.log").read_text().splitlines():
            if line.startswith("{") and "frobnicate" in line:
                return json.loads(line)
        return None

    line = wait_for(logged, "the front's log line about the ignored field", 30)
    assert line["request_id"] == out["id"] and line["trace_id"] == trace_id
    assert line["level"] == "WARNING" and line["logger"] == "pdserve.front"
    for role in ("front", "prefill-0", "decode-0"):  # every log record of every process is JSON (progress bars are not records)
        records = [ln for ln in (cluster.log_dir / f"{role}.log").read_text().splitlines() if '"level": ' in ln]
        assert records and all(json.loads(ln)["message"] for ln in records), role
