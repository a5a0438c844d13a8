"""The clients people point at a vLLM-compatible server, against a real local cluster (real NATS,
prefill and decode processes, the real model, HTTP over loopback): the official `openai` Python
client with vLLM's extensions, guidellm, and vLLM's own benchmark client (`vllm bench serve`).

guidellm and vLLM run from their own virtual environments under `~/.cache/pdserve/peers/`
(`bench/peer.py` installs them: `python -c 'import bench.peer as p; p.ensure_vllm(); p.ensure_guidellm()'`);
their tests skip, saying so, where those are absent. They run with a working directory outside
the repo, whose top-level `operator/` folder would shadow the standard library's in their processes.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pdserve.local import LocalCluster
from servinghelpers import json_object_prefix, openai_client

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _peer():
    spec = importlib.util.spec_from_file_location("pdserve_bench_peer", Path(__file__).parent.parent / "bench" / "peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peer = _peer()


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    with LocalCluster(str(model_dir), nats=nats_server.creds) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster.url)


# -- the openai client --------------------------------------------------------------------------

def test_openai_completions_n_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Name a colour you like:", max_tokens=8, temperature=1.0,
                                    seed=11, n=2, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text
        assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
        assert all(v <= 0 for v in lp.token_logprobs)
        # the sampled token and (at least) the 2 most likely ones; none more likely than the best alternative
        for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert tok in top and 2 <= len(top) <= 3 and v <= max(top.values()) + 1e-6
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    again = client.completions.create(model=MODEL, prompt="Name a colour you like:", max_tokens=8, temperature=1.0,
                                      seed=11, n=2, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_openai_chat_logprobs_streaming_and_not(client):
    # Both measured requests must take the same path: the first request of a prompt computes all of it, a
    # later one reuses its cached blocks and computes only the rest, through other kernels (float32 rounding
    # apart by ~1e-6 of the logits' scale, enough to move a logprob by 1e-5). One request first, so both
    # measured ones are prefix-cache hits and streaming is the only difference between them.
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = full.choices[0].logprobs.content
    tokens = [t.token for t in content]
    if full.choices[0].finish_reason == "stop":  # the end-of-turn token has its logprob, as vLLM's, and no text
        assert tokens.pop() == "<|im_end|>"
    assert "".join(tokens) == full.choices[0].message.content
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], rel=1e-5, abs=1e-6)


def test_openai_chat_n_streamed_with_continuous_usage(client):
    """vLLM's `continuous_usage_stats` rides in `stream_options` (the client passes the dict through)."""
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0.8, seed=7, n=2)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == full.choices[i].message.content
    used = [c.usage.completion_tokens for c in chunks]  # every chunk carries the running usage
    assert used == sorted(used) and used[-1] == full.usage.completion_tokens


def test_openai_json_object_and_vllm_extensions_via_extra_body(client):
    out = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=120, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat (name, age, colour) as a JSON object."}],
        extra_body={"min_tokens": 4, "repetition_penalty": 1.1, "top_k": 40, "min_p": 0.05,
                    "stop_token_ids": [], "skip_special_tokens": True, "guided_decoding_backend": "auto"})
    assert out.headers["X-Pdserve-Ignored-Fields"] == "guided_decoding_backend"
    choice = out.parse().choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict), choice.message.content
    else:
        assert json_object_prefix(choice.message.content), choice.message.content


def test_openai_client_gets_a_clear_error_for_a_bad_known_field(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, top_logprobs=3)
    with pytest.raises(openai.BadRequestError, match="json_schema.schema: Unsupported type"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})


# -- benchmark clients --------------------------------------------------------------------------

@pytest.mark.slow
def test_guidellm_concurrent_run_has_no_errors(cluster, model_dir, tmp_path_factory):
    guidellm = peer.installed("guidellm")
    if guidellm is None:
        pytest.skip(f"guidellm is not installed under {peer.PEERS} (bench/peer.py: ensure_guidellm)")
    work = tmp_path_factory.mktemp("guidellm")  # outside the repo
    report = peer.run_guidellm(guidellm, cluster.url, MODEL, Path(model_dir), streams=[2], requests=6,
                               prompt_tokens=48, output_tokens=16, out=work / "report.json", log=work / "guidellm.log")
    rows = peer.summarize(report, [2])
    assert len(rows) == 1 and rows[0]["errored"] == 0, (rows, peer.tail(work / "guidellm.log"))
    assert rows[0]["output_tok_s"] > 0, rows


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_vllm_bench_serve_has_no_failed_requests(cluster, model_dir, tmp_path_factory, backend):
    py = peer.installed("vllm")
    if py is None:
        pytest.skip(f"vLLM is not installed under {peer.PEERS} (bench/peer.py: ensure_vllm)")
    work = tmp_path_factory.mktemp("vllm-bench")
    result = peer.run_vllm_bench(py, cluster.url, MODEL, Path(model_dir), backend, prompts=4, input_len=32,
                                 output_len=12, concurrency=2, out=work / "result.json", log=work / "bench.log")
    assert result["failed"] == 0 and result["completed"] == 4, ([e for e in result.get("errors", []) if e],
                                                                 peer.tail(work / "bench.log"))
    assert result["total_output_tokens"] > 0, result
