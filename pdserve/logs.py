"""Log lines of every serving process: the request each concerns (a contextvar and a filter), and JSON when asked.

Code that works for one request runs inside `request(rid)` (or `bind(rid)` at the start of a task that
serves only that request); every line logged there, by any logger, carries `request_id` (and the
request's `trace_id` where it is traced), in text as `[rid]` after the logger's name and in JSON as
fields. Asyncio tasks inherit the context where they are created; the workers' compute thread gets the
caller's (`WorkerBase.compute`). `--log-format json` (`PDSERVE_LOG_FORMAT=json`) writes one JSON object a
line: what log collectors (Loki, Elasticsearch, Cloud Logging) parse without a pattern.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time

# (request id, trace id or None) of the request the current code works for
_current: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar("pdserve_request",
                                                                                      default=None)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s %(message)s"


@contextlib.contextmanager
def request(request_id: str, trace_id: str | None = None):
    """Lines logged inside carry `request_id` (and `trace_id`)."""
    token = _current.set((request_id, trace_id))
    try:
        yield
    finally:
        _current.reset(token)


def bind(request_id: str, trace_id: str | None = None) -> None:
    """The rest of this task (or thread's context) logs for `request_id`: for a task that serves one request."""
    _current.set((request_id, trace_id))


def current_request() -> str | None:
    c = _current.get()
    return c[0] if c else None


class RequestFilter(logging.Filter):
    """Puts the current request's id and trace id on every record (`request_id`, `trace_id`, `request_tag`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        c = _current.get()
        record.request_id, record.trace_id = c if c else (None, None)
        record.request_tag = f" [{c[0]}]" if c else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (RFC 3339, UTC), level, logger, message, request_id, trace_id, exc."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        trace_id = getattr(record, "trace_id", None)
        if trace_id:
            out["trace_id"] = trace_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(level: str, fmt: str = "text") -> None:
    """The process's logging: `level`, `fmt` "text" or "json", the request filter on the root handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("nats", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
