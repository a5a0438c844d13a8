"""Speculative decoding in the decode worker, end to end on the real model through real processes.

Greedy speculative output must equal plain greedy output token for token, for every drafter;
the plain path itself is checked against `transformers` generate in test_serving_e2e.py.
"""
from __future__ import annotations

import pytest

from pdserve.local import LocalCluster
from servinghelpers import post

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"

PROMPTS = [
    ("free", [{"role": "user", "content": "Tell me something interesting about octopuses."}]),
    ("code-edit", [{"role": "user", "content": "Rename the variable x to total in this function and return "
                    "the whole function:\n\ndef add_all(items):\n    x = 0\n    for item in items:\n"
                    "        x = x + item\n    return x\n"}]),
    ("agent", [{"role": "system", "content": "You call tools by answering with JSON only."},
               {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": '{"tool": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'},
               {"role": "tool", "content": '{"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "cloudy"}'},
               {"role": "user", "content": "And in Lyon? Answer with the tool call JSON."}]),
    ("list", "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape.\nList: apple, banana,"),
]


def complete(url, prompt, **extra):
    if isinstance(prompt, list):
        body, path = {"messages": prompt}, "/v1/chat/completions"
    else:
        body, path = {"prompt": prompt}, "/v1/completions"
    body.update(model=MODEL, max_tokens=48, temperature=0, return_token_ids=True)
    body.update(extra)
    status, out = post(url + path, body)
    assert status == 200, out
    choice = out["choices"][0]
    return choice.get("token_ids"), out["usage"], choice


@pytest.fixture(scope="module")
def ngram_cluster(nats_server, model_dir):
    with LocalCluster(str(model_dir), nats=nats_server.creds, worker_args={"decode": ["--spec-method", "ngram"]}) as c:
        yield c


@pytest.mark.parametrize("name,prompt", PROMPTS, ids=[p[0] for p in PROMPTS])
def test_ngram_speculation_equals_plain_greedy(ngram_cluster, name, prompt):
    plain, plain_usage, _ = complete(ngram_cluster.url, prompt, speculation={"enabled": False})
    spec, usage, _ = complete(ngram_cluster.url, prompt)
    assert spec == plain
    assert "speculation" not in plain_usage
    if name in ("list", "agent"):  # text that quotes its context: the drafter must have been used, and right
        assert usage["speculation"]["draft_tokens"] > 0
        assert usage["speculation"]["accepted_tokens"] > 0


def test_sampled_speculation_reproduces_plain_sampling_with_the_same_seed(ngram_cluster):
    """Coupled verification: with a seed, speculative sampling picks the very tokens plain sampling
    picks, whatever k the controller chose (exactness of the distribution itself is tested on the
    verifier in test_spec_distribution.py)."""
    for _, prompt in PROMPTS[2:]:
        kw = dict(temperature=0.8, top_p=0.95, top_k=40, seed=7, max_tokens=30)
        plain = complete(ngram_cluster.url, prompt, speculation={"enabled": False}, **kw)
        spec = complete(ngram_cluster.url, prompt, **kw)
        again = complete(ngram_cluster.url, prompt, **kw)
        assert spec[0] == plain[0] == again[0]
        assert spec[1]["completion_tokens"] == len(spec[0]) <= 30


def test_request_can_bound_or_disable_speculation(ngram_cluster):
    prompt = PROMPTS[3][1]
    _, usage, _ = complete(ngram_cluster.url, prompt, speculation={"max_k": 1})
    spec = usage.get("speculation", {"draft_tokens": 0})
    # with k <= 1 every verified step proposes at most one token
    assert spec["draft_tokens"] <= usage["completion_tokens"]


def test_draft_model_speculation_equals_plain_greedy(nats_server, model_dir):
    """The target as its own draft: proposals are accepted, and output is unchanged.

    k is fixed at 4: a draft as large as its target never pays, so the adaptive policy would
    (rightly) stop drafting, and this test is about the draft-model path, not the policy."""
    with LocalCluster(str(model_dir), nats=nats_server.creds,
                      worker_args={"decode": ["--spec-method", "draft", "--draft-model", str(model_dir),
                                              "--spec-max-k", "4", "--spec-k-policy", "fixed"]}) as c:
        for _, prompt in PROMPTS[1:3]:
            plain, _, _ = complete(c.url, prompt, speculation={"enabled": False}, max_tokens=24)
            spec, usage, _ = complete(c.url, prompt, max_tokens=24)
            assert spec == plain, (spec, plain, usage)
            spec_usage = usage["speculation"]
            # A self-draft agrees with the target except at float near-ties between a 1-token and a
            # (k+1)-token forward; a misaligned draft cache or a broken rollback would collapse this.
            assert spec_usage["accepted_tokens"] >= 0.9 * spec_usage["draft_tokens"] > 0
