"""Bring your own model: every decoder-only family through real prefill and decode processes, end to end.

Per family (tiny random-weight checkpoints from transformers' config classes, tests/tinymodels.py), one
cluster — front, decode speculating k = 3 tokens a step with the model as its own draft (it always has a
proposal), prefill — serves greedy requests over each KV path in turn (shared memory; TCP; TCP with
int8), the prefill worker restarted between them with its transports and compression. Greedy output
must equal transformers' `generate` token for token over the exact paths; over int8 (lossy) the request
completes through the compressed path with prefill's first token exact. Which way the KV went is read
from decode's metrics. Then decode is restarted with the n-gram drafter, whose proposals are coupled to
plain sampling: seeded sampling with speculation must pick the very tokens it picks without, and greedy
output still equals `generate` (with drafts wherever the continuation repeats itself). Gemma-3-270M, a
real checkpoint, is served the same way.
"""
from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.local import LocalCluster
from pdserve.natsserver import free_port
from servinghelpers import hf_greedy, post, wait_for, wire_bytes
from tinymodels import TOOLS_TEMPLATE_FAMILIES, make_tiny, set_stop_tokens

# a family test starts a cluster and restarts workers four times: longer than the suite's 5-minute hang bound
pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe", "gpt_oss")
PROMPTS = ["The printing press spread literacy across Europe because", "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3"]
NEW = 12
PATHS = [  # (prefill's arguments, the transport and compression decode must see)
    (["--kv-transports", "shm,tcp"], ("shm", "none")),
    (["--kv-transports", "tcp"], ("tcp", "none")),
    (["--kv-transports", "tcp", "--kv-compression", "int8"], ("tcp", "int8")),
]
BLOCKS = ["--block-size", "4"]  # small blocks: the 8-token windows span several


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-serving")


def complete(url: str, model: str, prompt: str, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "return_token_ids": True, **extra}
    status, out = post(url + "/v1/completions", body)
    assert status == 200, out
    return out


def replace_worker(c: LocalCluster, role: str, old: str, new: str, args: list[str]) -> None:
    """Stop worker `old` (it says goodbye) and start `new` with `args`, waiting for the front to see each."""
    proc = c.procs.pop(old)  # gone on purpose: no longer one of the cluster's processes
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(120)  # a bound: a loaded 2-core machine takes seconds to shut a worker down
    wait_for(lambda: c.health()[f"{role}_workers"] == 0, f"the front to drop {old}", 60, retry_on=(OSError,))
    c.spawn(new, role, "--model", c.model, "--worker-id", new, *BLOCKS, *args)
    c.wait_ready(240)


def repeats(ids: list[int]) -> bool:
    """Whether a continuation repeats a pair of tokens (where the n-gram drafter finds something to propose)."""
    pairs = list(zip(ids, ids[1:]))
    return len(set(pairs)) < len(pairs)


def reference(path, prompts: list[str], n: int) -> dict[str, list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return {p: hf_greedy((tok, model), tok.encode(p), n) for p in prompts}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_served_end_to_end(family, tiny_root, model_dir, nats_server):
    path = make_tiny(family, tiny_root, model_dir)
    if family == "llama":
        # several stop tokens (Llama 3 style): the second is one the model says a few tokens in
        plain = reference(path, PROMPTS[:1], NEW)[PROMPTS[0]]
        stop = next(t for i, t in enumerate(plain) if i >= 3 and t not in plain[:i] and t != 2)
        set_stop_tokens(path, [2, stop])
    want = reference(path, PROMPTS, NEW)
    if family == "llama":
        assert want[PROMPTS[0]][-1] == stop and len(want[PROMPTS[0]]) < NEW  # generate stops at the second one
    port = free_port()
    decode = ["--spec-method", "draft", "--draft-model", str(path), "--spec-k-policy", "fixed", "--spec-max-k", "3",
              "--kv-compression", "int8", "--metrics-port", str(port), *BLOCKS]
    with LocalCluster(str(path), nats=nats_server.creds,
                      worker_args={"prefill": [*BLOCKS, *PATHS[0][0]], "decode": decode}) as c:
        name = json.loads(urllib.request.urlopen(c.url + "/v1/models").read())["data"][0]["id"]
        prefill = "prefill-0"
        for i, (args, via) in enumerate(PATHS):
            if i:
                replace_worker(c, "prefill", prefill, f"prefill-{i}", args)
                prefill = f"prefill-{i}"
            before = wire_bytes(port)[0]
            for p in PROMPTS:
                out = complete(c.url, name, p)
                ids, usage = out["choices"][0]["token_ids"], out["usage"]
                if via[1] == "none":
                    assert ids == want[p], (family, via, p)
                else:  # lossy: prefill's first token exact, then the model continues from int8 KV to its end
                    assert ids[0] == want[p][0] and out["choices"][0]["finish_reason"] in ("stop", "length"), out
                if len(ids) > 2:  # decode had tokens to speculate on, and did
                    assert usage["speculation"]["draft_tokens"] > 0, usage
            after = wire_bytes(port)[0]
            grew = {k for k in after if after[k] > before.get(k, 0.0)}
            assert grew == {via}, (family, via, before, after)  # the KV went this way, and only this way
        replace_worker(c, "decode", "decode-0", "decode-1", ["--spec-method", "ngram", "--spec-k-policy", "fixed",
                                                             "--spec-max-k", "4"])
        for p in PROMPTS:
            out = complete(c.url, name, p)
            assert out["choices"][0]["token_ids"] == want[p], (family, "ngram", p)
            if repeats(want[p]):
                assert out["usage"]["speculation"]["draft_tokens"] > 0, out["usage"]
            # seeded sampling: speculation picks the very tokens plain sampling picks
            kw = dict(temperature=0.7, top_p=0.95, seed=11, max_tokens=NEW)
            plain = complete(c.url, name, p, speculation={"enabled": False}, **kw)["choices"][0]["token_ids"]
            assert complete(c.url, name, p, **kw)["choices"][0]["token_ids"] == plain
        if family in TOOLS_TEMPLATE_FAMILIES:
            check_tools_and_system_reach_the_template(c.url, name, path)


def check_tools_and_system_reach_the_template(url: str, name: str, path) -> None:
    """A chat request's system prompt, tools and earlier tool calls reach the model's chat template: the
    prompt the model saw is exactly the template's rendering of all of them; and a required tool call comes
    back parsed in the template's format."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "system", "content": "Answer with a tool call."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 18}'},
                {"role": "user", "content": "And in Lyon?"}]
    tok = AutoTokenizer.from_pretrained(path)
    rendered = [dict(m) for m in messages]
    rendered[2]["tool_calls"] = [{"id": "c1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    text = tok.apply_chat_template(rendered, tools=[tool], add_generation_prompt=True, tokenize=False)
    assert "get_weather" in text and "Answer with a tool call." in text and '"city": "Paris"' in text
    expected = len(tok.encode(text, add_special_tokens=False))
    without = tok.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert "get_weather\"" not in without.split("<|im_start|>user")[0]  # no tool list without tools
    for body, n in (({"tools": [tool]}, expected),
                    ({"tools": [tool], "tool_choice": "none"}, len(tok.encode(without, add_special_tokens=False)))):
        status, out = post(url + "/v1/chat/completions", {"model": name, "messages": messages, "max_tokens": 2,
                                                          "temperature": 0, **body})
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == n
    # tool_choice required: whatever the (random) weights, decoding is constrained to a call in the template's
    # format (Qwen's <tool_call>), which comes back parsed (random weights spell it in short tokens: room for them)
    bounded = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
        "additionalProperties": False}}}
    status, out = post(url + "/v1/chat/completions", {"model": name, "messages": messages, "tools": [bounded],
                                                      "tool_choice": "required", "parallel_tool_calls": False,
                                                      "max_tokens": 200, "temperature": 0})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) in ({"city": "Paris"}, {"city": "Lyon"})


def test_gemma3_270m_served_end_to_end_equals_generate(nats_server):
    """A real checkpoint of another architecture (Gemma 3: alternating sliding/global layers, a 262k vocabulary),
    installed from the package registry and converted once, served as `pdserve up --model gemma-3-270m` does."""
    from pdserve.modelstore import resolve_model

    path = resolve_model("gemma-3-270m")
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    want = reference(path, prompts, 8)
    with LocalCluster(str(path), nats=nats_server.creds, worker_args={"decode": ["--spec-method", "ngram"]}) as c:
        name = json.loads(urllib.request.urlopen(c.url + "/v1/models").read())["data"][0]["id"]
        for p in prompts:
            out = complete(c.url, name, p, max_tokens=8)
            assert out["choices"][0]["token_ids"] == want[p], p
