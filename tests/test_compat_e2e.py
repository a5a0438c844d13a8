"""vLLM's request extensions and lenient parsing, end to end: real NATS, prefill and decode processes,
the real model, HTTP over loopback.

Every option must hold on each path a token can be chosen on: prefill's first token, plain decode
steps, and speculative verification (n-gram drafts with a fixed k, so every step with a match
drafts). The references are transformers' own processors inside `generate` (repetition penalty,
min_new_tokens), a custom one for OpenAI's frequency/presence formula, and plain decoding of the
same request with speculation off: greedy output must equal it token for token, seeded sampling
must equal it and its own replay.
"""
from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pdserve.local import LocalCluster
from pdserve.natsserver import free_port
import servinghelpers
from servinghelpers import hf_greedy, json_object_prefix, metric, post, wait_for

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"
REPEAT = "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape.\nList: apple, banana,"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    ports = {"prefill": free_port(), "decode": free_port()}
    with LocalCluster(str(model_dir), nats=nats_server.creds, worker_args={
            "prefill": ["--metrics-port", str(ports["prefill"])],
            "decode": ["--spec-method", "ngram", "--spec-k-policy", "fixed", "--spec-max-k", "4",
                       "--metrics-port", str(ports["decode"])]}) as c:
        c.metrics_ports = ports
        yield c


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()


def complete(cluster, prompt, *, spec: bool = True, **body):
    """POST a completion (text prompt) or chat (message list); → the parsed answer (asserting 200)."""
    path = "/v1/chat/completions" if isinstance(prompt, list) else "/v1/completions"
    key = "messages" if isinstance(prompt, list) else "prompt"
    body = {"model": MODEL, key: prompt, "return_token_ids": True, **body}
    if not spec:
        body["speculation"] = {"enabled": False}
    status, out = post(cluster.url + path, body)
    assert status == 200, out
    return out


def ids(out, i: int = 0) -> list[int]:
    return out["choices"][i]["token_ids"]


def prompt_ids(hf, prompt) -> list[int]:
    tok = hf[0]
    if isinstance(prompt, list):
        return tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    return tok.encode(prompt, add_special_tokens=False)


def assert_paths_agree(cluster, prompt, **body) -> list[int]:
    """Speculative and plain decoding give the same tokens (and the speculative run did draft)."""
    spec = complete(cluster, prompt, **body)
    plain = complete(cluster, prompt, spec=False, **body)
    assert ids(spec) == ids(plain), (ids(spec), ids(plain))
    return ids(spec)


# -- greedy against transformers' processors ------------------------------------------------------

@pytest.mark.parametrize("prompt", [REPEAT, CHAT], ids=["repetitive-text", "chat"])
def test_repetition_penalty_and_min_tokens_equal_transformers(cluster, hf, prompt):
    """Greedy with repetition_penalty and min_tokens: HF generate with its processors, on the first
    token (prefill), plain steps and verified drafts alike."""
    pids = prompt_ids(hf, prompt)
    base = hf_greedy(hf, pids, 24)
    assert base[-1] == 2 or prompt is REPEAT  # the chat answer ends with EOS by itself: min_tokens must hold it off
    min_tokens = min(len(base) + 4, 24) if base[-1] == 2 else 0
    got = assert_paths_agree(cluster, prompt, max_tokens=24, temperature=0, repetition_penalty=1.3,
                             min_tokens=min_tokens)
    expected = hf_greedy(hf, pids, 24, repetition_penalty=1.3, min_new_tokens=min_tokens or None)
    assert got == expected
    assert got != hf_greedy(hf, pids, 24)[: len(got)]  # the penalty changed the answer


class FrequencyPresence(LogitsProcessor):
    """OpenAI's definition: logit - f * count - p * (count > 0), counts over the output tokens."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.f, self.p = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids[:, self.prompt_len:],
                                                       torch.ones_like(input_ids[:, self.prompt_len:], dtype=scores.dtype))
        return scores - self.f * counts - self.p * (counts > 0).to(scores.dtype)


def test_frequency_and_presence_penalties_follow_openais_formula(cluster, hf):
    pids = prompt_ids(hf, REPEAT)
    got = assert_paths_agree(cluster, REPEAT, max_tokens=24, temperature=0, frequency_penalty=0.6,
                             presence_penalty=0.4)
    expected = hf_greedy(hf, pids, 24, logits_processor=LogitsProcessorList([FrequencyPresence(len(pids), 0.6, 0.4)]))
    assert got == expected


def test_speculation_drafted_under_history_dependent_options(cluster):
    """The paths above were really different: with these options the n-gram drafter still drafts,
    and the drafts are verified against the processed distribution."""
    out = complete(cluster, REPEAT, max_tokens=24, temperature=0, repetition_penalty=1.05)
    assert out["usage"]["speculation"]["draft_tokens"] > 0


# -- sampling --------------------------------------------------------------------------------------

def test_seeded_sampling_with_every_option_replays_on_both_paths(cluster):
    body = dict(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=11, repetition_penalty=1.2,
                frequency_penalty=0.3, presence_penalty=0.2, min_tokens=6)
    first = assert_paths_agree(cluster, REPEAT, **body)
    assert ids(complete(cluster, REPEAT, **body)) == first
    assert ids(complete(cluster, REPEAT, **{**body, "seed": 12})) != first


def test_min_p_one_keeps_only_the_most_likely_token(cluster):
    """min_p = 1 cuts every token less likely than the top one: sampling becomes greedy."""
    greedy = ids(complete(cluster, CHAT, max_tokens=12, temperature=0))
    for seed in (1, 2):
        assert ids(complete(cluster, CHAT, max_tokens=12, temperature=1.0, min_p=1.0, seed=seed)) == greedy


# -- stop token ids, skip_special_tokens, logprobs ------------------------------------------------

def test_stop_token_ids_end_the_choice_without_their_text(cluster, hf):
    greedy = ids(complete(cluster, REPEAT, max_tokens=12, temperature=0))
    stop = greedy[4]
    out = complete(cluster, REPEAT, max_tokens=12, temperature=0, stop_token_ids=[stop], ignore_eos=True)
    cut = greedy[: greedy.index(stop) + 1]
    assert ids(out) == cut and out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == hf[0].decode(cut[:-1])


def test_skip_special_tokens(cluster):
    body = dict(max_tokens=30, temperature=0, ignore_eos=True)
    kept = complete(cluster, CHAT, skip_special_tokens=False, **body)
    skipped = complete(cluster, CHAT, **body)
    assert ids(kept) == ids(skipped) and 2 in ids(kept)  # EOS ignored: generation went past it
    assert "<|im_end|>" in kept["choices"][0]["message"]["content"]
    assert "<|im_end|>" not in skipped["choices"][0]["message"]["content"]


def raw_logprobs(hf, pids, tokens) -> torch.Tensor:
    """log_softmax of the raw model logits at each generated position `[n, vocab]`."""
    with torch.inference_mode():
        logits = hf[1](torch.tensor([pids + tokens])).logits[0, len(pids) - 1: len(pids) + len(tokens) - 1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_completion_logprobs_are_the_raw_models(cluster, hf):
    pids = prompt_ids(hf, REPEAT)
    out = complete(cluster, REPEAT, max_tokens=8, temperature=0.7, seed=5, logprobs=3)
    choice, tokens = out["choices"][0], ids(out)
    lp = raw_logprobs(hf, pids, tokens)
    got = choice["logprobs"]
    assert got["tokens"] == [hf[0].decode([t]) for t in tokens]
    expected = lp[torch.arange(len(tokens)), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(got["token_logprobs"]), expected, rtol=1e-3, atol=1e-3)
    for j, top in enumerate(got["top_logprobs"]):
        best = lp[j].topk(3)
        assert set(top) >= {hf[0].decode([t]) for t in best.indices.tolist()}
        assert max(top.values()) == pytest.approx(float(best.values[0]), rel=1e-3, abs=1e-3)
    assert got["text_offset"][0] == 0 and got["text_offset"] == sorted(got["text_offset"])


def test_chat_logprobs(cluster, hf):
    out = complete(cluster, CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = out["choices"][0]["logprobs"]["content"]
    tokens = ids(out)
    assert [c["token"] for c in content] == [hf[0].decode([t]) for t in tokens]
    for c in content:  # greedy: the chosen token is the most likely one
        assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"]
        assert c["logprob"] == pytest.approx(c["top_logprobs"][0]["logprob"])
        assert bytes(c["bytes"]).decode("utf-8", "replace") == c["token"]


# -- n --------------------------------------------------------------------------------------------

def test_n_choices_share_the_prompt_kv_and_each_replays(cluster, hf):
    ports = cluster.metrics_ports
    computed = metric(ports["prefill"], "pdserve_prefix_cache_tokens_total")
    forks = metric(ports["decode"], "pdserve_decode_choice_forks_total")
    body = dict(max_tokens=12, temperature=1.0, seed=21, n=3)
    prompt = "Name a colour you like and say why:"
    out = complete(cluster, prompt, **body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    choices = [ids(out, i) for i in range(3)]
    assert len({tuple(c) for c in choices}) == 3  # sampled choices differ
    assert out["usage"]["completion_tokens"] == sum(map(len, choices))
    # one prefill of the prompt (every prompt token counted once: computed or cached), three forks of its KV
    assert metric(ports["prefill"], "pdserve_prefix_cache_tokens_total") - computed == len(prompt_ids(hf, prompt))
    assert metric(ports["decode"], "pdserve_decode_choice_forks_total") - forks == 3
    again = complete(cluster, prompt, **body)
    assert [ids(again, i) for i in range(3)] == choices
    plain = complete(cluster, prompt, spec=False, **body)
    assert [ids(plain, i) for i in range(3)] == choices


def test_n_greedy_choices_equal_the_single_greedy_answer(cluster):
    one = ids(complete(cluster, CHAT, max_tokens=10, temperature=0))
    two = complete(cluster, CHAT, max_tokens=10, temperature=0, n=2)
    assert ids(two, 0) == ids(two, 1) == one


def stream(cluster, prompt, **body) -> tuple[list[dict], dict]:
    """Stream a completion (text prompt) or chat (message list); → its chunks (asserting it ended with [DONE])
    and the response headers."""
    path = "/v1/chat/completions" if isinstance(prompt, list) else "/v1/completions"
    key = "messages" if isinstance(prompt, list) else "prompt"
    events, headers = servinghelpers.stream(cluster.url + path, {"model": MODEL, key: prompt, **body})
    assert events[-1] == "[DONE]", events[-3:]
    return events[:-1], headers


def test_streamed_n_and_continuous_usage(cluster):
    """Chunks of several choices interleave, each choice ends once, and with continuous_usage_stats
    every chunk carries the running usage, as vLLM's do (guidellm reads it)."""
    body = dict(max_tokens=8, temperature=0.8, seed=3, n=2, logprobs=1,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks, _ = stream(cluster, "Once upon a time", **body)
    unary = complete(cluster, "Once upon a time", **{k: v for k, v in body.items() if k != "stream_options"})
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == unary["choices"][i]["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [unary["choices"][i]["finish_reason"]]
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == unary["choices"][i]["logprobs"]["tokens"]
    used = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and used == sorted(used)
    assert chunks[-1]["choices"] == [] and used[-1] == unary["usage"]["completion_tokens"]


# -- JSON mode ------------------------------------------------------------------------------------

JSON_CHAT = [{"role": "user", "content": "Describe a cat (name, age, colour) as a JSON object."}]


def assert_json(text: str, finish_reason: str) -> None:
    """A finished JSON-mode answer is a JSON object; one cut by max_tokens is a prefix of one."""
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert json_object_prefix(text), text


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_json_object_output_is_valid_json_on_both_paths(cluster, temperature):
    body = dict(max_tokens=120, temperature=temperature, seed=4, response_format={"type": "json_object"})
    out = complete(cluster, JSON_CHAT, **body)
    assert out["choices"][0]["finish_reason"] == "stop", out  # the object closed, then EOS
    assert_json(out["choices"][0]["message"]["content"], "stop")
    assert ids(complete(cluster, JSON_CHAT, spec=False, **body)) == ids(out)
    text_prompt = complete(cluster, "Here is a person: Ada, 36, London. As JSON:", **body)["choices"][0]
    assert_json(text_prompt["text"], text_prompt["finish_reason"])


def test_json_mode_constrains_a_prompt_that_asks_for_prose(cluster):
    """The mask, not the prompt: a request for a poem still comes back as a JSON object."""
    body = dict(max_tokens=60, temperature=0, response_format={"type": "json_object"}, min_tokens=3)
    out = complete(cluster, [{"role": "user", "content": "Write a short poem about the sea."}], **body)
    text = out["choices"][0]["message"]["content"]
    assert text.lstrip().startswith("{")
    assert_json(text, out["choices"][0]["finish_reason"])


# -- lenient parsing ------------------------------------------------------------------------------

def test_unknown_fields_are_ignored_named_in_a_header_and_logged_without_values(cluster):
    secret = "value-that-must-not-be-logged-7f3a"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "frobnicate": secret,
            "stream_options": {"include_usage": True, "future_option": secret}}
    req = urllib.request.Request(cluster.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        assert r.headers["X-Pdserve-Ignored-Fields"] == "frobnicate, stream_options.future_option"
    messages = [{"role": "user", "content": "Hi", "refusal": None}]
    _, headers = stream(cluster, messages, max_tokens=3, temperature=0, guided_decoding_backend="auto")
    assert headers["X-Pdserve-Ignored-Fields"] == "guided_decoding_backend, messages[].refusal"
    log = (cluster.log_dir / "front.log").read_text()
    assert "frobnicate" in log and secret not in log


BAD = [
    ({"temperature": "hot"}, "temperature"),
    ({"n": 17}, "n"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"type": "object"}}}, "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ({"logit_bias": {"50": 5}}, "logit_bias"),
    ({"best_of": 3}, "best_of"),
]


@pytest.mark.parametrize("extra,fragment", BAD, ids=[b[1] for b in BAD])
def test_malformed_known_fields_are_still_refused(cluster, extra, fragment):
    status, out = post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": "hi", **extra})
    assert status == 400 and fragment in out["error"]["message"], out


def test_chat_top_logprobs_needs_logprobs(cluster):
    status, out = post(cluster.url + "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_logprobs": 2})
    assert status == 400 and "top_logprobs" in out["error"]["message"]


# -- the published description --------------------------------------------------------------------

def test_openapi_json_describes_the_real_responses(cluster):
    """GET /openapi.json is valid OpenAPI 3.1, and real answers — unary and streamed, chat and text,
    with n and logprobs, errors, the model list — validate against the schemas it publishes."""
    import jsonschema
    from openapi_spec_validator import validate

    with urllib.request.urlopen(cluster.url + "/openapi.json", timeout=30) as r:
        doc = json.loads(r.read())
    validate(doc)

    def check(name: str, body) -> None:
        jsonschema.validate(body, {"$ref": f"#/components/schemas/{name}", "components": doc["components"]},
                            cls=jsonschema.Draft202012Validator)

    check("CompletionResponse", complete(cluster, "Hi", max_tokens=3, n=2, logprobs=2, temperature=0.5, seed=1))
    check("ChatCompletionResponse", complete(cluster, CHAT, max_tokens=3, logprobs=True, top_logprobs=1))
    for c in stream(cluster, "Hi", max_tokens=3, logprobs=1, stream_options={"include_usage": True})[0]:
        check("CompletionResponse", c)
    for c in stream(cluster, CHAT, max_tokens=3, n=2, stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True})[0]:
        check("ChatCompletionChunk", c)
    status, err = post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 99})
    assert status == 400
    check("ErrorResponse", err)
    with urllib.request.urlopen(cluster.url + "/v1/models", timeout=30) as r:
        check("ModelList", json.loads(r.read()))


# -- the CPU lease --------------------------------------------------------------------------------

def test_a_lone_prompt_borrows_the_idle_decode_workers_thread_and_answers_the_same(cluster, hf):
    """`pdserve up` pairs prefill-0 with decode-0 on one CPU lease: with decode idle, a prompt's steps run
    with its thread too, and what they compute is what one thread computes (the greedy answer equals
    transformers'); a prompt arriving while decode steps runs alone."""
    port = cluster.metrics_ports["prefill"]
    prompt = "Summarise in one sentence: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(30))
    pids = prompt_ids(hf, prompt)
    assert len(pids) >= 64  # a step this long borrows (prefill.scheduler.LEASE_MIN_TOKENS)
    before = metric(port, "pdserve_prefill_cpu_lease_steps_total")
    got = complete(cluster, prompt, max_tokens=16, temperature=0, ignore_eos=True, spec=False)
    assert ids(got) == hf_greedy(hf, pids, 16, exact=True)
    assert metric(port, "pdserve_prefill_cpu_lease_steps_total") > before
    # decode stepping holds its thread: the same prompt meanwhile (cached now: a new one) runs alone
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(complete, cluster, "Count slowly:", max_tokens=400, temperature=0, ignore_eos=True,
                           spec=False)
        wait_for(lambda: metric(cluster.metrics_ports["decode"], "pdserve_decode_running_sequences") == 1,
                 "the long request decoding", 120)
        before = metric(port, "pdserve_prefill_cpu_lease_steps_total")
        other = complete(cluster, "Describe: " + prompt, max_tokens=2, temperature=0, spec=False)
        during = metric(port, "pdserve_prefill_cpu_lease_steps_total") - before
        assert not held.done(), "the long request ended before the second prompt was computed: make it longer"
        assert held.result()["usage"]["completion_tokens"] == 400
    assert during == 0 and other["usage"]["completion_tokens"] == 2
