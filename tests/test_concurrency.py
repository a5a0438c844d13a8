"""Many requests at once through one decode worker (continuous batching on the paged engine):
interleaved requests of mixed lengths, some cancelled mid-stream, each equal to its output run
alone, and the KV pool back to empty afterwards (no leaked blocks)."""
from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request

import pytest

from pdserve.local import LocalCluster
from pdserve.natsserver import free_port
from servinghelpers import metric

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"

PROMPTS = [
    "The capital of Italy is", "def add(a, b):", "My favourite fruit is", "Water boils at",
    "List three colours:", "The quick brown fox", "import numpy as np\n", "Once upon a time",
    "The speed of light is", "SELECT name FROM", "Dear Sir or Madam,", "In 1969, astronauts",
    "A haiku about rain:", "for i in range(10):", "The best way to learn", "Photosynthesis is",
]


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    port = free_port()
    with LocalCluster(str(model_dir), nats=nats_server.creds,
                      worker_args={"decode": ["--spec-method", "ngram", "--metrics-port", str(port)]}) as c:
        c.decode_metrics_port = port
        yield c


def complete(url, prompt, n):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def cancel_after(url, prompt, tokens_before_cancel):
    """Stream a long request and hang up after a few tokens (the client going away)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    seen = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            if raw.startswith(b"data: {"):
                seen += 1
                if seen >= tokens_before_cancel:
                    break
    return seen


def test_sixteen_interleaved_requests_equal_each_alone_and_leave_no_blocks(cluster):
    lengths = [4 + (i * 7) % 20 for i in range(len(PROMPTS))]  # mixed output lengths, 4..23
    alone = [complete(cluster.url, p, n) for p, n in zip(PROMPTS, lengths)]
    with concurrent.futures.ThreadPoolExecutor(20) as ex:
        futures = [ex.submit(complete, cluster.url, p, n) for p, n in zip(PROMPTS, lengths)]
        cancels = [ex.submit(cancel_after, cluster.url, f"Count slowly: {i}, {i + 1},", 3) for i in range(4)]
        together = [f.result() for f in futures]
        assert all(c.result() >= 3 for c in cancels)
    assert together == alone
    # every sequence, the cancelled ones included, gave its blocks back
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric(cluster.decode_metrics_port, "pdserve_decode_running_sequences") == 0 and \
                metric(cluster.decode_metrics_port, "pdserve_decode_kv_utilization") == 0:
            break
        time.sleep(0.5)
    assert metric(cluster.decode_metrics_port, "pdserve_decode_running_sequences") == 0
    assert metric(cluster.decode_metrics_port, "pdserve_decode_kv_utilization") == 0
    assert metric(cluster.decode_metrics_port, "pdserve_decode_tokens_total") >= 2 * sum(lengths) - 32
