"""Tracing's switch and trace context, the protocol's optional traceparent, and request ids in log lines."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import io
import json
import logging

import pytest

from pdserve import logs, tracing
from pdserve.basetypes import SamplingParams
from pdserve.kvtransfer.protocol import HandoffOffer, PrefillRequest, ProtocolError

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("env,want", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
])
def test_tracing_is_on_only_where_the_standard_variables_ask(env, want):
    assert tracing.wanted(env) is want


def test_off_records_nothing():
    assert not tracing.enabled()  # the test process configures no exporter
    assert tracing.start_request("prefill.request", TP) is None


@pytest.mark.parametrize("value,valid", [
    (TP, TP), (TP.upper(), TP), (f" {TP} ", TP),
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # all-zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),  # all-zero span id
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # a version we do not speak
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None), ("garbage", None), ("", None), (None, None),
])
def test_traceparent_validation(value, valid):
    assert tracing.valid_traceparent(value) == valid


def test_sampled_flag():
    assert tracing.sampled(TP) and not tracing.sampled(TP[:-2] + "00") and tracing.sampled(TP[:-2] + "03")


def _prefill_request(**kw) -> PrefillRequest:
    return PrefillRequest(request_id="r1", model="m", prompt_token_ids=[1, 2], sampling=SamplingParams(), seed=7,
                          decode_worker_id="decode-0", **kw)


def test_traceparent_travels_on_the_request_path_and_is_left_out_when_absent():
    plain = _prefill_request()
    assert b"traceparent" not in plain.encode(), "an untraced message is what v2 sent before the field"
    assert PrefillRequest.decode(plain.encode()) == plain
    traced = _prefill_request(traceparent=TP)
    assert PrefillRequest.decode(traced.encode()).traceparent == TP
    assert "traceparent" in HandoffOffer.model_fields


def test_a_bad_traceparent_on_nats_is_refused_naming_the_field():
    data = json.loads(_prefill_request().encode())
    data["traceparent"] = "00-xyz"
    with pytest.raises(ProtocolError, match="traceparent"):
        PrefillRequest.decode(json.dumps(data).encode())


def _capture(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.addFilter(logs.RequestFilter())
    handler.setFormatter(logs.JsonFormatter() if fmt == "json" else logging.Formatter(logs.TEXT_FORMAT))
    logger = logging.getLogger(f"test.logs.{fmt}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, buf


def test_lines_carry_the_request_they_concern_and_only_inside():
    logger, buf = _capture("text")
    logger.info("before")
    with logs.request("cmpl-1"):
        logger.info("inside")
    logger.info("after")
    lines = buf.getvalue().splitlines()
    assert "[cmpl-1] inside" in lines[1]
    assert "[" not in lines[0] and "[" not in lines[2]


def test_json_lines():
    logger, buf = _capture("json")
    with logs.request("cmpl-2", "4bf92f3577b34da6a3ce929d0e0e4736"):
        logger.warning("KV for %s lost", "cmpl-2")
    logger.info("no request")
    first, second = (json.loads(line) for line in buf.getvalue().splitlines())
    assert first["message"] == "KV for cmpl-2 lost" and first["level"] == "WARNING"
    assert first["request_id"] == "cmpl-2" and first["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert first["time"].endswith("Z") and first["logger"] == "test.logs.json"
    assert "request_id" not in second


def test_request_id_follows_tasks_and_the_compute_thread():
    """What the workers rely on: tasks inherit the context they are created in, and `WorkerBase.compute`
    runs its function in the caller's context on the compute thread."""
    pool = concurrent.futures.ThreadPoolExecutor(1)

    async def main():
        async def task():
            return logs.current_request()

        logs.bind("cmpl-3")
        inherited = await asyncio.create_task(task())
        on_thread = await asyncio.get_running_loop().run_in_executor(pool, contextvars.copy_context().run,
                                                                     logs.current_request)
        bare = await asyncio.get_running_loop().run_in_executor(pool, logs.current_request)
        return inherited, on_thread, bare

    assert asyncio.run(main()) == ("cmpl-3", "cmpl-3", None)
    pool.shutdown()


CONFIGURE = """
import json, sys
from pdserve import tracing
on = tracing.configure("prefill")
spans = tracing.start_request("prefill.request", None) if on else None
print(json.dumps({"on": on, "recording": spans.recording if spans else None,
                  "service": tracing._provider.resource.attributes.get("service.name") if on else None}))
"""


def _configure(env: dict, tmp_path, hide_sdk: bool = False) -> tuple[dict, str]:
    """`tracing.configure` in a fresh process with `env` (the console exporter: nothing leaves the process)."""
    import os
    import subprocess
    import sys

    full = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full.update(env)
    if hide_sdk:  # an `opentelemetry` that fails to import: the SDK absent
        (tmp_path / "opentelemetry").mkdir()
        (tmp_path / "opentelemetry" / "__init__.py").write_text("raise ImportError('absent')\n")
        full["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-P", "-c", CONFIGURE], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def test_the_standard_variables_set_sampling_and_service_name(tmp_path):
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    base = {"OTEL_TRACES_EXPORTER": "console"}
    got, _ = _configure(base, tmp_path)
    assert got == {"on": True, "recording": True, "service": "pdserve-prefill"}
    got, _ = _configure({**base, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, tmp_path)
    assert got["on"] and got["recording"] is False, "ratio 0 samples nothing"
    got, _ = _configure({**base, "OTEL_SERVICE_NAME": "llm-prefill"}, tmp_path)
    assert got["service"] == "llm-prefill"


def test_without_the_sdk_tracing_stays_off_and_says_why(tmp_path):
    got, err = _configure({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, tmp_path, hide_sdk=True)
    assert got == {"on": False, "recording": None, "service": None}
    assert "pdserve[otel]" in err
