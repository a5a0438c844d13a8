"""A small OTLP/HTTP trace receiver: what pdserve exports, decoded with opentelemetry-proto (the span-tree test
reads it; bench/peer.py exports to it when it measures tracing on)."""
from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Span:
    """One exported span, flattened: ids as hex, times in ns, attributes as Python values."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """POST /v1/traces on a loopback port; `spans()` is everything received so far."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest, ExportTraceServiceResponse,
        )

        received: list[Span] = []
        lock = threading.Lock()
        self.requests = 0

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                enc = self.headers.get("Content-Encoding", "")
                if enc == "gzip":
                    body = gzip.decompress(body)
                elif enc == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                spans = []
                for rs in req.resource_spans:
                    service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            spans.append(Span(
                                service, sp.name, sp.trace_id.hex(), sp.span_id.hex(), sp.parent_span_id.hex(),
                                sp.start_time_unix_nano, sp.end_time_unix_nano,
                                {a.key: _value(a.value) for a in sp.attributes}, [e.name for e in sp.events],
                                sp.status.message if sp.status.code == 2 else None))
                with lock:
                    received.extend(spans)
                    outer.requests += 1
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self._received, self._lock = received, lock
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
