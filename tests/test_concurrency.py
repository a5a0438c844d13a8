"""Many requests at once through one decode worker (continuous batching on the paged engine):
interleaved requests of mixed lengths, some cancelled mid-stream, each equal to its output run
alone, and the KV pool back to empty afterwards (no leaked blocks)."""
from __future__ import annotations

import concurrent.futures
import time

import pytest

from pdserve.local import LocalCluster
from pdserve.natsserver import free_port
from servinghelpers import metric, post, stream

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


def complete(url, prompt, n, **extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True, **extra}
    status, out = post(url + "/v1/completions", body, timeout=600)
    assert status == 200, out
    return out["choices"][0]["token_ids"]


def cancel_after(url, prompt, tokens_before_cancel):
    """Stream a long request and hang up after a few tokens (the client going away) → how many events it read."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    events, _ = stream(url + "/v1/completions", body, on_event=lambda i, _: i + 1 >= tokens_before_cancel,
                       timeout=600)
    return sum(isinstance(e, dict) for e in events)  # "[DONE]" is no token


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


# SmolLM2's KV in float32: 30 layers x 2 x 3 heads x 64 dims x 4 bytes a token, 16 tokens a block
BLOCK_BYTES = 30 * 2 * 3 * 64 * 4 * 16


@pytest.fixture(scope="module")
def small_pool(nats_server, model_dir):
    """A decode worker whose KV pool holds 16 blocks (256 tokens): four long answers cannot all fit."""
    port = free_port()
    with LocalCluster(str(model_dir), nats=nats_server.creds,
                      worker_args={"decode": ["--spec-method", "none", "--metrics-port", str(port),
                                              "--kv-capacity-bytes", str(16 * BLOCK_BYTES)]}) as c:
        c.decode_metrics_port = port
        yield c


def test_a_full_pool_preempts_and_recomputes_and_cancels_free_everything(small_pool):
    """Four requests that outgrow the pool together: the newest is preempted, recomputed once there is
    room, and each still answers exactly what it answers alone; requests cancelled meanwhile (running or
    waiting to be recomputed) give their blocks back."""
    c = small_pool
    prompts = PROMPTS[:4]
    alone = [complete(c.url, p, 90, ignore_eos=True) for p in prompts]  # ~96 tokens, 6-7 blocks each
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(complete, c.url, p, 90, ignore_eos=True) for p in prompts]
        cancels = [ex.submit(cancel_after, c.url, f"Count slowly: {i}, {i + 1},", 20) for i in range(2)]
        together = [f.result() for f in futures]
        assert all(x.result() >= 20 for x in cancels)
    assert together == alone
    assert metric(c.decode_metrics_port, "pdserve_decode_preemptions_total") > 0  # the pool did run out
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (metric(c.decode_metrics_port, "pdserve_decode_running_sequences")
                                           or metric(c.decode_metrics_port, "pdserve_decode_kv_utilization")):
        time.sleep(0.5)  # poll interval: a cancel is one NATS message on its way
    assert metric(c.decode_metrics_port, "pdserve_decode_running_sequences") == 0
    assert metric(c.decode_metrics_port, "pdserve_decode_kv_utilization") == 0
