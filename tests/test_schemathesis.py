"""schemathesis against the front's published `/openapi.json`, served by a real front in front of a real
prefill and decode worker (real NATS, the real model): for every operation, generated requests (valid ones
and ones that break the schema) never get a 5xx, and every response conforms to the document (status code
listed, content type, headers, body schema).

Not checked: that every schema-valid request is accepted (schemathesis' positive_data_acceptance). Rules
across fields (top_logprobs needs logprobs, min_tokens <= max_tokens, the prompt within the context) are the
front's alone (see tests/test_openapi.py); it refuses those with a 400 that names the field.

Bounded: `MAX_EXAMPLES` per operation (not shrunk), and each generated request's completion capped at
`MAX_NEW_TOKENS` (a valid request without max_tokens would otherwise generate up to the model's context:
minutes on this CPU, and nothing more for the schema to check). Generated requests name the served model, so they reach
the workers instead of all stopping at the 404 for an unknown model. The examples are random; the seed is
printed at the start, and a run is repeated with PDSERVE_SCHEMATHESIS_SEED=N.
"""
from __future__ import annotations

import json
import os
import secrets
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from pdserve.front.openai_schema import MAX_TOKENS_LIMIT
from pdserve.front.openapi import openapi_document
from pdserve.local import LocalCluster

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]
MAX_EXAMPLES = 25
MAX_NEW_TOKENS = 4
SEED = int(os.environ.get("PDSERVE_SCHEMATHESIS_SEED") or secrets.randbelow(2**32))


@pytest.fixture(scope="module")
def front(nats_server, model_dir):
    # a 503 while a worker is briefly busy would be a documented answer, not a finding: generous dispatch.
    # A generated chat request can render to thousands of prompt tokens, minutes of prefill on this CPU and
    # nothing more for the schema to check: --max-model-len makes those the documented 400 instead.
    with LocalCluster(str(model_dir), 1, 1, nats=nats_server.creds,
                      worker_args={"front": ["--dispatch-timeout", "30", "--max-model-len", "512"]}) as c:
        yield c


@pytest.fixture(scope="module")
def api(front):
    print(f"\nschemathesis seed {SEED} (repeat with PDSERVE_SCHEMATHESIS_SEED={SEED})", flush=True)
    with urllib.request.urlopen(front.url + "/v1/models", timeout=10) as r:
        served = json.loads(r.read())["data"][0]["id"]
    return schemathesis.openapi.from_url(front.url + "/openapi.json"), served


def bounded(served: str):
    """A generated case made cheap to serve: the served model's name, at most MAX_NEW_TOKENS generated."""
    def fix(case):
        body = case.body
        if isinstance(body, dict):
            if isinstance(body.get("model"), str):
                body["model"] = served
            for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
                v = body.get(field)
                if type(v) is int and MAX_NEW_TOKENS < v <= MAX_TOKENS_LIMIT:  # a value out of range stays so
                    body[field] = MAX_NEW_TOKENS
            body.setdefault("max_tokens", MAX_NEW_TOKENS)
        return case
    return fix


DOC = openapi_document("m", auth=False)
# negative cases only where there is input to break: the generation endpoints' bodies
CASES = [(path, method, mode) for path, ops in DOC["paths"].items() for method, op in ops.items()
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode == GenerationMode.POSITIVE or "requestBody" in op]


@pytest.mark.parametrize("path,method,mode", CASES, ids=[f"{m.upper()} {p} {mode}" for p, m, mode in CASES])
def test_every_operation_answers_within_its_documented_responses(api, path, method, mode):
    schema, served = api
    operation = schema[path][method]

    @seed(SEED)
    # no shrinking: a failing request is reported as generated, and a slow one cannot stretch the run
    @settings(max_examples=MAX_EXAMPLES, deadline=None, print_blob=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode).map(bounded(served)))
    def check(case):
        case.call_and_validate(timeout=120, excluded_checks=[positive_data_acceptance])

    check()


def test_max_model_len_bounds_what_the_front_serves(front):
    """--max-model-len (512 here) stands in for the model's context: a longer prompt, or a prompt whose
    max_tokens would pass it, is the documented 400 naming the limit; within it the request is served."""
    from servinghelpers import post

    with urllib.request.urlopen(front.url + "/v1/models", timeout=10) as r:
        served = json.loads(r.read())["data"][0]["id"]
    url = front.url + "/v1/completions"
    got, out = post(url, {"model": served, "prompt": "word " * 600, "max_tokens": 1})
    assert got == 400 and out["error"]["code"] == "context_length_exceeded" and "512" in out["error"]["message"]
    got, out = post(url, {"model": served, "prompt": "word " * 100, "max_tokens": 450})
    assert got == 400 and out["error"]["code"] == "context_length_exceeded" and "512" in out["error"]["message"]
    got, out = post(url, {"model": served, "prompt": "word " * 100, "max_tokens": 2, "ignore_eos": True})
    assert got == 200 and out["usage"]["completion_tokens"] == 2
