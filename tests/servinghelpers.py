"""Test helpers for the serving path: HTTP calls to the front, the `generate` reference, bounded polling."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import torch


def post(url: str, body, timeout: float = 300) -> tuple[int, dict]:
    """POST JSON (or raw bytes) → (status, parsed body); HTTP errors are returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


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
