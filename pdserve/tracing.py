"""OpenTelemetry traces of one request across the front, prefill and decode: off and free unless configured.

A process turns tracing on in `configure` when the standard variables ask for it
(`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp|console`)
and the SDK is installed (`pip install pdserve[otel]`); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
keep it off. The SDK reads the rest itself: `OTEL_SERVICE_NAME` (default `pdserve-<role>`),
`OTEL_RESOURCE_ATTRIBUTES`, the sampler (`OTEL_TRACES_SAMPLER=parentbased_traceidratio`,
`OTEL_TRACES_SAMPLER_ARG=0.1` keeps one request in ten), the exporter's headers, timeouts and batching
(`OTEL_BSP_*`). Only OTLP over HTTP/protobuf is shipped: it needs no gRPC stack in the serving image.

Off, `start_request` returns None and every instrumentation point is one `is not None` test on the
request's own object: no span objects, no clock reads, nothing per token. On, each process records its
part of a request as one root span (`front.request`, `prefill.request`, `decode.request`) with child
spans whose times are taken where the work happens and whose objects are made when it ends
(`RequestSpans.child`), so the hot paths only note timestamps. The W3C `traceparent` joins the three:
the front takes the client's header, and the front's root span travels on the NATS messages
(`PrefillRequest.traceparent`, `HandoffOffer.traceparent`), so prefill's and decode's roots are its
children and one request is one trace. A process that does not trace passes the context it got
through unchanged. Decode's steps are grouped (`StepGroup`: one span per `STEP_GROUP` steps of a
sequence, with the tokens and speculation's drafted and accepted tokens as attributes), never a span per
token.
"""
from __future__ import annotations

import logging
import os
import re
import time

log = logging.getLogger("pdserve.tracing")

# a W3C trace context `traceparent` of version 00 (all-zero ids are invalid)
_TRACEPARENT = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
STEP_GROUP = 32  # decode steps of one sequence per `decode.steps` span

_tracer = None  # the process's opentelemetry Tracer while tracing is on
_provider = None


def valid_traceparent(value: str | None) -> str | None:
    """`value` if it is a valid version-00 `traceparent` header, else None (W3C: an invalid one is ignored
    and a new trace starts)."""
    if value is None:
        return None
    value = value.strip().lower()
    return value if _TRACEPARENT.match(value) else None


def sampled(traceparent: str) -> bool:
    """Whether a valid `traceparent`'s sampled flag is set."""
    return bool(int(traceparent[-2:], 16) & 1)


def wanted(environ=None) -> bool:
    """Whether the standard OpenTelemetry variables ask this process to export traces."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter) or bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(role: str) -> bool:
    """Turn tracing on in this process (`role`: front, prefill, decode) if `wanted` and the SDK is there.

    True when on. Without the SDK a warning says what to install; serving goes on untraced."""
    global _tracer, _provider
    if _tracer is not None or not wanted():
        return _tracer is not None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning("OpenTelemetry variables are set but the SDK is not installed (pip install 'pdserve[otel]'): "
                    "no traces")
        return False
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    else:
        if exporter_name != "otlp":
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported here; exporting OTLP over HTTP", exporter_name)
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol and protocol != "http/protobuf":
            log.warning("OTLP protocol %s is not shipped; exporting http/protobuf", protocol)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("the OTLP/HTTP exporter is not installed (pip install 'pdserve[otel]'): no traces")
            return False
        exporter = OTLPSpanExporter()
    attrs = {"pdserve.role": role}
    if not os.environ.get("OTEL_SERVICE_NAME"):  # the standard variable wins over our default
        attrs["service.name"] = f"pdserve-{role}"
    _provider = TracerProvider(resource=Resource.create(attrs))  # the sampler from OTEL_TRACES_SAMPLER(_ARG)
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer("pdserve")
    log.info("tracing on: %s exporter, service %s", exporter_name,
             os.environ.get("OTEL_SERVICE_NAME") or attrs["service.name"])
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown(timeout_s: float = 2.0) -> None:
    """Export what is buffered (bounded) before the process exits."""
    global _tracer, _provider
    if _provider is None:
        return
    try:
        _provider.force_flush(int(timeout_s * 1000))
        _provider.shutdown()
    except Exception as e:  # an unreachable collector must not hold up a stop
        log.debug("trace export at exit failed: %s", e)
    _tracer = _provider = None


def now_ns() -> int:
    """Wall-clock nanoseconds, the clock spans are stamped with."""
    return time.time_ns()


class RequestSpans:
    """One request's spans in this process: a root span, and children recorded with explicit times.

    `marks` holds timestamps (ns) noted along the way for spans made later."""

    __slots__ = ("root", "ctx", "marks", "open_choices")

    def __init__(self, root, ctx):
        self.root, self.ctx = root, ctx
        self.marks: dict[str, int] = {}
        self.open_choices = 1

    @property
    def recording(self) -> bool:
        return self.root.is_recording()

    def traceparent(self) -> str:
        """This process's root span as the parent of the next process's spans."""
        c = self.root.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"

    @property
    def trace_id(self) -> str:
        return f"{self.root.get_span_context().trace_id:032x}"

    def child(self, name: str, start_ns: int, end_ns: int | None = None, error: str | None = None, **attrs):
        """A finished child span from `start_ns` to `end_ns` (now by default)."""
        span = _tracer.start_span(name, context=self.ctx, start_time=start_ns, attributes=_clean(attrs))
        if error:
            _set_error(span, error)
        span.end(end_time=end_ns if end_ns is not None else now_ns())
        return span

    def set(self, **attrs) -> None:
        self.root.set_attributes(_clean(attrs))

    def event(self, name: str, **attrs) -> None:
        self.root.add_event(name, _clean(attrs))

    def end(self, error: str | None = None, **attrs) -> None:
        """End the root span (once; later calls do nothing)."""
        if not self.root.is_recording():
            return
        if attrs:
            self.set(**attrs)
        if error:
            _set_error(self.root, error)
        self.root.end()


def start_request(name: str, traceparent: str | None, *, start_ns: int | None = None, server: bool = False,
                  **attrs) -> RequestSpans | None:
    """The root span of a request's part in this process, a child of `traceparent` (the caller's span),
    or None: tracing off here, or the caller's trace not sampled (nothing to record; the caller's
    context still travels on as it came)."""
    if _tracer is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = None
    if traceparent is not None:
        if not sampled(traceparent):
            return None
        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.CONSUMER
    start_ns = start_ns or now_ns()
    root = _tracer.start_span(name, context=parent, kind=kind, start_time=start_ns, attributes=_clean(attrs))
    spans = RequestSpans(root, trace.set_span_in_context(root))
    spans.marks["start"] = start_ns
    return spans


class StepGroup:
    """Decode steps of one sequence, gathered into one `decode.steps` span per STEP_GROUP steps."""

    __slots__ = ("spans", "start_ns", "end_ns", "steps", "tokens", "drafted", "accepted", "rows", "first_step")

    def __init__(self, spans: RequestSpans):
        self.spans = spans
        self.steps = 0

    def add(self, step: int, start_ns: int, end_ns: int, tokens: int, drafted: int, accepted: int, rows: int) -> None:
        """One step: `tokens` committed, `drafted`/`accepted` speculative tokens, `rows` sequences in it."""
        if not self.steps:
            self.start_ns, self.first_step = start_ns, step
            self.tokens = self.drafted = self.accepted = self.rows = 0
        self.steps += 1
        self.end_ns = end_ns
        self.tokens += tokens
        self.drafted += drafted
        self.accepted += accepted
        self.rows += rows
        if self.steps >= STEP_GROUP:
            self.flush()

    def flush(self) -> None:
        if not self.steps:
            return
        self.spans.child("decode.steps", self.start_ns, self.end_ns, **{
            "pdserve.steps": self.steps, "pdserve.first_step": self.first_step, "pdserve.tokens": self.tokens,
            "pdserve.spec.drafted": self.drafted, "pdserve.spec.accepted": self.accepted,
            "pdserve.batch_mean": self.rows / self.steps})
        self.steps = 0


def _clean(attrs: dict) -> dict:
    return {k: v for k, v in attrs.items() if v is not None}


def _set_error(span, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, message[:500]))
