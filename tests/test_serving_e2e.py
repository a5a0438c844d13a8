"""The disaggregated serving path end to end: real NATS, real model, separate prefill and decode
processes, KV over the direct channel, real HTTP over loopback, the official openai client."""
from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.local import LocalCluster
from servinghelpers import hf_greedy, post

pytestmark = pytest.mark.model

LONG_PROMPT = (Path(__file__).parent / "data" / "long_prompt.txt").read_text()


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    c = LocalCluster(str(model_dir), prefill_workers=1, decode_workers=1, nats=nats_server.creds)
    c.start()
    yield c
    c.stop()


PROMPTS = [
    ("chat", [{"role": "user", "content": "What is the capital of France?"}], 16),
    ("chat", [{"role": "system", "content": "You are a terse assistant."},
              {"role": "user", "content": "List three prime numbers."}], 20),
    ("text", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", 24),
    ("text", "Once upon a time, in a village by the sea,", 16),
    ("text", LONG_PROMPT, 12),
]


@pytest.mark.parametrize("kind,prompt,n", PROMPTS, ids=["chat-short", "chat-system", "code", "story", "long-1588-tokens"])
def test_greedy_equals_transformers_generate(cluster, hf, kind, prompt, n):
    tok, _ = hf
    if kind == "chat":
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        body = {"model": "SmolLM2-135M-Instruct", "messages": prompt}
        url = cluster.url + "/v1/chat/completions"
    else:
        text = prompt
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt}
        url = cluster.url + "/v1/completions"
    prompt_ids = tok.encode(text, add_special_tokens=False)
    if kind == "text" and len(prompt_ids) > 1000:
        assert len(prompt_ids) >= 1000
    status, out = post(url, {**body, "max_tokens": n, "temperature": 0, "return_token_ids": True})
    assert status == 200, out
    expected = hf_greedy(hf, prompt_ids, n)
    assert out["choices"][0]["token_ids"] == expected
    assert out["usage"]["prompt_tokens"] == len(prompt_ids)
    assert out["usage"]["completion_tokens"] == len(expected)
    assert out["choices"][0]["finish_reason"] == ("stop" if expected[-1] == tok.eos_token_id else "length")


def test_openai_client_streaming_and_not(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    models = [m.id for m in client.models.list()]
    assert models == ["SmolLM2-135M-Instruct"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=models[0], messages=msgs, max_tokens=12, temperature=0)
    assert "Paris" in full.choices[0].message.content
    chunks = list(client.chat.completions.create(model=models[0], messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    comp = list(client.completions.create(model=models[0], prompt="The sky is", max_tokens=8, temperature=0,
                                          stream=True))
    assert "".join(c.choices[0].text for c in comp) == client.completions.create(
        model=models[0], prompt="The sky is", max_tokens=8, temperature=0).choices[0].text


def test_sampling_is_reproducible_with_a_seed_and_stop_strings_stop(cluster):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Three colours I like are", "max_tokens": 20,
            "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 1234}
    s1, a = post(cluster.url + "/v1/completions", body)
    s2, b = post(cluster.url + "/v1/completions", body)
    assert s1 == s2 == 200 and a["choices"][0]["text"] == b["choices"][0]["text"]
    greedy = post(cluster.url + "/v1/completions", {**body, "temperature": 0, "max_tokens": 20})[1]["choices"][0]["text"]
    word = greedy.split()[1] if len(greedy.split()) > 1 else greedy.strip()
    status, stopped = post(cluster.url + "/v1/completions", {**body, "temperature": 0, "stop": [word]})
    assert status == 200
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert word not in stopped["choices"][0]["text"]
    assert greedy.startswith(stopped["choices"][0]["text"])


def test_concurrent_requests_never_mix_their_tokens(cluster):
    prompts = ["The capital of Italy is", "def add(a, b):", "My favourite fruit is", "Water boils at"]

    def one(p):
        return post(cluster.url + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": p,
                                                      "max_tokens": 10, "temperature": 0, "return_token_ids": True})

    alone = [one(p)[1]["choices"][0]["token_ids"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        together = [r[1]["choices"][0]["token_ids"] for r in ex.map(one, prompts)]
    assert together == alone
    assert len(set(map(tuple, alone))) == len(prompts)


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "SmolLM2-135M-Instruct"}, 400, "prompt"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": 42}, 400, "prompt"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 9000}, 400, "context"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "echo": True}, 400, "echo"),
    ({"model": "SmolLM2-135M-Instruct", "prompt": [99999999]}, 400, "vocabulary"),
]


@pytest.mark.parametrize("body,status,fragment", BAD)
def test_bad_completion_requests_get_openai_style_errors(cluster, body, status, fragment):
    got, out = post(cluster.url + "/v1/completions", body)
    assert got == status
    assert set(out) == {"error"} and fragment in out["error"]["message"]
    assert out["error"]["type"]


def test_prompt_longer_than_context_is_refused(cluster):
    huge = "word " * 9000  # > 8192 tokens
    got, out = post(cluster.url + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": huge})
    assert got == 400 and out["error"]["code"] == "context_length_exceeded"
    got, out = post(cluster.url + "/v1/chat/completions",
                    {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": huge}]})
    assert got == 400 and out["error"]["code"] == "context_length_exceeded"


def test_bad_chat_requests(cluster):
    url = cluster.url + "/v1/chat/completions"
    assert post(url, {"model": "SmolLM2-135M-Instruct", "messages": []})[0] == 400
    assert post(url, {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "wizard", "content": "x"}]})[0] == 400
    assert post(url, {"model": "SmolLM2-135M-Instruct", "messages": "hello"})[0] == 400


def test_health_metrics_and_models(cluster):
    with urllib.request.urlopen(cluster.url + "/health") as r:
        h = json.loads(r.read())
    assert h == {"status": "ok", "nats": True, "prefill_workers": 1, "decode_workers": 1}
    with urllib.request.urlopen(cluster.url + "/metrics") as r:
        text = r.read().decode()
    for name in ("pdserve_requests_total", "pdserve_time_to_first_token_seconds_bucket",
                 "pdserve_inter_token_latency_seconds_bucket", "pdserve_queue_depth",
                 "pdserve_kv_transfer_moved_bytes_total"):
        assert name in text
    moved = [l for l in text.splitlines() if l.startswith("pdserve_kv_transfer_moved_bytes_total ")]
    assert moved and float(moved[0].split()[1]) > 0
