"""Test helpers for the serving path: HTTP calls to the front, the `generate` reference, bounded polling,
and a NATS watcher for tests that act on an event."""
from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request

import torch


def post(url: str, body, timeout: float = 300, *, headers: dict | None = None) -> tuple[int, dict]:
    """POST JSON (or raw bytes), with extra request `headers` (a traceparent, say) → (status, parsed body);
    HTTP errors are returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(url: str, body: dict, *, on_event=None, timeout: float = 300) -> tuple[list[dict | str], dict]:
    """POST `body` with `"stream": true` → (its server-sent events, the response headers). Each `data:` event
    parsed, the closing `data: [DONE]` kept as the string "[DONE]": a stream cut short (an error event last)
    is told from a whole one. Read as the events arrive, so `on_event(i, event)` (i from 0) acts mid-stream
    (kills a worker, say); when it returns True the client hangs up there and the events so far are returned.
    An HTTP error status (no stream at all) raises, with its body."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    events: list[dict | str] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            headers = dict(r.headers)
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                events.append("[DONE]" if data == "[DONE]" else json.loads(data))
                if on_event is not None and on_event(len(events) - 1, events[-1]):
                    break
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{url}: HTTP {e.code} instead of a stream: {e.read().decode(errors='replace')}") from e
    return events, headers


def hf_greedy(hf, prompt_ids: list[int], n: int, *, exact: bool = False, **generate_kw) -> list[int]:
    """`transformers` greedy `generate` of up to `n` tokens (exactly `n` with `exact`, as `ignore_eos` does);
    `generate_kw` go to `generate` (its logits processors: repetition_penalty, min_new_tokens, …)."""
    tok, model = hf
    generate_kw.setdefault("min_new_tokens", n if exact else None)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.eos_token_id, **generate_kw)
    return out[0, len(prompt_ids):].tolist()


def metric(port: int, name: str) -> float:
    """The sum of a Prometheus metric's samples (all labels) at a worker's /metrics port."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def wait_for(fn, what: str, timeout: float, *, interval: float = 0.3, retry_on: tuple = ()):
    """Call `fn` until it returns something truthy (an exception in `retry_on` counts as not yet).
    A bound on waiting, never asserted as a duration."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except retry_on as e:
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


class NatsWatch:
    """Messages on NATS subjects, gathered by a thread of its own while the test thread makes blocking
    calls: a test acts the moment something happens (a worker took a request, sent its first token)
    instead of after a guessed delay. Subscribed (and flushed to the server) before the constructor returns."""

    def __init__(self, creds, *subjects: str):
        self._messages: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(creds, subjects),),
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error:
            raise RuntimeError(f"NATS watcher did not subscribe to {subjects}: {self._error}")

    async def _main(self, creds, subjects) -> None:
        import nats

        from pdserve.kvtransfer.protocol import settle

        self._stop = asyncio.Event()
        try:
            nc = await nats.connect(**creds.connect_kwargs())
            for subject in subjects:
                await nc.subscribe(subject, cb=self._on_msg)
            await settle(nc)  # the subscriptions are the server's before the caller goes on
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        await nc.close()

    async def _on_msg(self, msg) -> None:
        self._messages.put((msg.subject, msg.data))

    def wait(self, match, what: str, timeout: float):
        """The first message (from here on) for which `match(subject, data)` returns something truthy
        → that value. A `match` may raise on messages it cannot parse: they count as not matching."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                subject, data = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}") from None
            try:
                found = match(subject, data)
            except Exception:
                continue
            if found:
                return found

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "NatsWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream_subjects() -> str:
    """The NATS subject pattern of every request's event stream."""
    from pdserve.kvtransfer.protocol import Subjects

    return Subjects.stream("x", "y").split(".stream.")[0] + ".stream.>"  # every scope's


def decoded_by(worker_id: str):
    """NatsWatch match on `stream_subjects()`: a token event that `worker_id` sent on a request's stream."""
    from pdserve.kvtransfer.protocol import StreamEvent

    def match(subject, data):
        ev = StreamEvent.decode(data)
        return ev.kind == "token" and ev.worker_id == worker_id
    return match


def accepted_by(worker_id: str):
    """NatsWatch match on `_INBOX.>` (replies): `worker_id`'s acknowledgement of a prompt it took
    (a prefill worker acknowledges a prompt before computing it)."""
    from pdserve.kvtransfer.protocol import Ack

    def match(subject, data):
        ack = Ack.decode(data)
        return ack.accepted and ack.worker_id == worker_id
    return match


def wire_bytes(metrics_port: int) -> tuple[dict[tuple[str, str], float], float]:
    """decode's pdserve_kv_transfer_wire_bytes_total by (transport, compression), and the KV bytes received
    (pdserve_kv_transfer_received_bytes_total)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    wire = {}
    for labels, value in re.findall(r"^pdserve_kv_transfer_wire_bytes_total\{(.*)\} (\S+)$", text, re.M):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        wire[label["transport"], label["compression"]] = float(value)
    kv = re.search(r"^pdserve_kv_transfer_received_bytes_total (\S+)$", text, re.M)
    return wire, float(kv.group(1))


def json_object_prefix(text: str) -> bool:
    """Whether `text` is a JSON object or the start of one (what a JSON-mode answer cut by max_tokens is)."""
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"])).compile_json_schema(
        '{"type": "object"}', any_whitespace=True, strict_mode=False)
    return xgr.GrammarMatcher(compiled).accept_string(text)


def openai_client(url: str):
    """The official `openai` client on a deployment's front: no retries (a failure is the finding), a long timeout."""
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
