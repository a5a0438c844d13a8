"""The benchmarks' streaming client: POST a request to the front and read its server-sent events."""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator


def sse_events(url: str, path: str, body: dict, timeout: float = 900) -> Iterator[dict]:
    """POST `body` as JSON to `url + path`; yield each `data: {…}` event, parsed, as it arrives."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            if raw.startswith(b"data: {"):
                yield json.loads(raw[6:])


def delta_text(choice: dict) -> str | None:
    """The new text of one streamed choice, chat or completion."""
    return choice["delta"].get("content") if "delta" in choice else choice.get("text")
