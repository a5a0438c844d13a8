"""Structured output and tool calls end to end, with the official `openai` client against a real local
deployment (real NATS, prefill and decode processes, the real model, HTTP over loopback): JSON schemas
that validate with `jsonschema`, tool calls parsed into `message.tool_calls` (whole and streamed),
`tool_choice` required and named, vLLM's guided fields, 400s for grammars that cannot be used, and
grammar-forced drafts that change nothing but the speed."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.local import LocalCluster
from servinghelpers import openai_client, post

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "email": {"type": "string", "maxLength": 30}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def cluster(nats_server, model_dir):
    with LocalCluster(str(model_dir), nats=nats_server.creds) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai_client(cluster.url)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_json_schema_output_validates(client):
    out = client.chat.completions.create(
        model=MODEL, max_tokens=120, temperature=0, response_format=_schema_format(PERSON),
        messages=[{"role": "user", "content": "Describe a person called Ada as JSON."}])
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert out.usage.speculation["forced_draft_tokens"] > 0  # keys, quotes, braces: forced


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_forced_drafts_change_no_token(cluster, temperature):
    """Greedy output with grammar-forced drafts equals it without, token for token; seeded sampling too."""
    body = {"model": MODEL, "max_tokens": 80, "temperature": temperature, "seed": 11, "return_token_ids": True,
            "response_format": _schema_format(PERSON),
            "messages": [{"role": "user", "content": "Invent a person with pets, as JSON."}]}
    status, forced = post(cluster.url + "/v1/chat/completions", body)
    assert status == 200, forced
    status, plain = post(cluster.url + "/v1/chat/completions", {**body, "speculation": {"forced": False}})
    assert status == 200, plain
    assert forced["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert forced["usage"]["speculation"]["forced_accepted_tokens"] > 0
    assert "speculation" not in plain["usage"]


def test_a_constrained_output_cut_by_max_tokens_ends_with_length(client):
    out = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, response_format=_schema_format(PERSON),
        messages=[{"role": "user", "content": "Describe a person as JSON."}])
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.startswith('{"name": "')


def test_tool_choice_required_returns_parsed_calls_whose_arguments_validate(client):
    out = client.chat.completions.create(model=MODEL, max_tokens=80, temperature=0, messages=ASK_WEATHER,
                                         tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    spec = {"get_weather": WEATHER, "add": ADD}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    assert "<tool_call>" not in (choice.message.content or "")


def test_named_tool_choice_streams_the_call_in_pieces(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=80, temperature=0, messages=ASK_WEATHER, tools=[WEATHER, ADD], stream=True,
        tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "add"
    assert all(p.index == 0 and p.id is None for p in pieces[1:]) and len(pieces) > 2  # arguments in fragments
    args = json.loads("".join(p.function.arguments or "" for p in pieces))
    jsonschema.validate(args, ADD["function"]["parameters"])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_parallel_calls_are_separate_calls_with_nothing_between(client):
    out = client.chat.completions.create(model=MODEL, max_tokens=120, temperature=0, messages=ASK_WEATHER,
                                         tools=[WEATHER, ADD], tool_choice="required")
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls
    assert out.choices[0].message.content is None  # no separator or markup leaks into content
    assert len({c.id for c in calls}) == len(calls)


def test_a_tool_result_goes_back_through_the_template(client):
    first = client.chat.completions.create(model=MODEL, max_tokens=80, temperature=0, messages=ASK_WEATHER,
                                           tools=[WEATHER], tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    follow = client.chat.completions.create(model=MODEL, max_tokens=30, temperature=0, tools=[WEATHER], messages=[
        *ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}],
        tool_choice="none")
    assert follow.choices[0].finish_reason in ("stop", "length")
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                      "required": ["ok"]}}}, lambda t: isinstance(json.loads(t)["ok"], bool)),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
])
def test_vllm_guided_fields(client, extra, check):
    out = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, extra_body=extra,
                                         messages=[{"role": "user", "content": "Is this review good? 'Great!'"}])
    assert out.choices[0].finish_reason == "stop"
    assert check(out.choices[0].message.content), out.choices[0].message.content


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_penalty_float32_cannot_hold_keeps_the_grammar(cluster, temperature):
    """schemathesis' find: `repetition_penalty: 5e-324` (float32's 0) turned the cut tokens' logits NaN, prefill
    picked a token the grammar refuses and decode refused it: a 503. Now the grammar holds: only EOS for
    `[""]`, a listed answer for two choices."""
    for choices, ok in (([""], ("",)), (["yes", "no"], ("yes", "no"))):
        status, out = post(cluster.url + "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "yes or no?"}], "guided_choice": choices,
            "repetition_penalty": 5e-324, "frequency_penalty": 2.0, "temperature": temperature, "max_tokens": 4})
        assert status == 200, out
        assert out["choices"][0]["message"]["content"] in ok and out["choices"][0]["finish_reason"] == "stop", out


@pytest.mark.parametrize("regex,where", [("\U00050000", "prefill's first token"), ("H\U00050000", "a decode step")])
def test_a_grammar_the_vocabulary_cannot_spell_is_a_400_and_the_workers_go_on(cluster, regex, where):
    """SmolLM2's vocabulary cannot spell U+50000 (it has no token for the byte 0xF1): the grammar has a dead end,
    at the first token (prefill) or after 'H' (decode). Every token is cut there; a sampler picked token 0 and the
    worker refused it as a 500/503 (schemathesis found it). Now it is the request's 400, naming why, and the next
    request is served."""
    status, out = post(cluster.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Say H."}], "guided_regex": regex, "max_tokens": 8})
    assert status == 400, (where, out)
    assert out["error"]["type"] == "invalid_request_error" and "allows no token" in out["error"]["message"], out
    status, out = post(cluster.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Say H."}], "guided_regex": "H[a-z]", "max_tokens": 8})
    assert status == 200 and len(out["choices"][0]["message"]["content"]) == 2, out


BAD = [
    ({"response_format": _schema_format({"type": "frobnicate"})}, "response_format.json_schema.schema",
     "Unsupported type"),
    ({"response_format": _schema_format({"properties": {"a": {"$ref": "https://example.com/s.json"}}})},
     "response_format.json_schema.schema", "/properties/a/$ref"),
    ({"guided_regex": "(("}, "guided_regex", "parenthesis"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": "root ::= ((("}, "guided_grammar", "grammar"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "auto"),
    ({"guided_choice": []}, "guided_choice", "at least 1"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tool_choice", "Unsupported type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
]


@pytest.mark.parametrize("extra,field,reason", BAD, ids=[b[1] + "-" + b[2] for b in BAD])
def test_unusable_grammars_are_400s_naming_the_field(cluster, extra, field, reason):
    status, out = post(cluster.url + "/v1/chat/completions", {"model": MODEL, "messages": ASK_WEATHER, **extra})
    assert status == 400, out
    assert field in out["error"]["message"] and reason in out["error"]["message"], out
