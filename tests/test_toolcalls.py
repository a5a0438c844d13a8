"""Tool-call parsing per family (`front.toolcalls`): whole answers, and streamed answers split at every
character boundary, which must add up to exactly what the whole answer parses to."""
from __future__ import annotations

import json

import pytest

from pdserve.front.toolcalls import ToolCallStream, extract, family_for_template, render_calls

CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": [2, {"c": "}]\"x"}]})]

# (family, scripted answer, expected content, expected calls as (name, arguments object))
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": "<tool_call>"}}]'
               '</tool_call> done', "done", [("a", {}), ("b", {"x": "<tool_call>"})]),
    ("hermes", render_calls("hermes", CALLS), None, CALLS),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}</tool_call>', None,
     [("get_weather", {"city": "Zürich 東京"})]),  # text arrives decoded: pieces split between characters
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", render_calls("llama3_json", CALLS), None, CALLS),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Sure",
     [("add", {"a": 1, "b": 2})]),
    ("mistral", render_calls("mistral", CALLS), None, CALLS),
    ("json", '{"name": "lookup", "arguments": {"q": "a \\"quoted\\" word"}}', None, [("lookup", {"q": 'a "quoted" word'})]),
    ("json", render_calls("json", CALLS), None, CALLS),
]
# answers that are no calls: everything stays content
PLAIN = [
    ("hermes", "The weather in Paris is <b>sunny</b> and 20 <tool degrees."),
    ("llama3_json", '{"answer": 42} is the JSON you asked for'),
    ("json", '{"not": "a call"}'),
    ("mistral", "no calls here [TOOL"),
    ("hermes", "<tool_call>{\"name\": \"broken\", \"arguments\": {\"x\": "),  # cut mid-call: kept as text
]


def _stream(family: str, pieces: list[str]):
    s = ToolCallStream(family)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        for d in (s.feed(piece), *( [s.finish()] if i == len(pieces) - 1 else [])):
            content += d.content
            for tc in d.tool_calls:
                if "id" in tc:
                    assert tc["index"] not in calls and tc["id"].startswith("call_") and tc["type"] == "function"
                    assert tc["function"]["arguments"] == ""
                    calls[tc["index"]] = [tc["function"]["name"], ""]
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                    calls[tc["index"]][1] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in range(len(calls))]


@pytest.mark.parametrize("family,text,content,expected", CASES)
def test_a_whole_answer_parses_to_its_calls(family, text, content, expected):
    got_content, calls = extract(family, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("family,text,content,expected", CASES)
def test_a_streamed_answer_split_anywhere_adds_up_to_the_whole(family, text, content, expected):
    _, whole = extract(family, text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut], *text[cut:]]):
            got_content, calls = _stream(family, pieces)
            assert got_content.strip() == (content or ""), (cut, got_content)
            for marker in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"'):
                assert marker not in got_content or marker in (content or "")
            assert calls == [(c.name, c.arguments) for c in whole], cut


@pytest.mark.parametrize("family,text", PLAIN)
def test_an_answer_without_calls_is_content_whole_and_streamed(family, text):
    assert extract(family, text) == (text, [])
    for cut in range(len(text) + 1):
        got, calls = _stream(family, [text[:cut], *text[cut:]])
        assert calls == [] or family == "hermes"  # a cut Hermes call was announced before it broke off
        if not calls:
            assert got == text, cut


def test_text_before_a_call_streams_before_the_call_is_complete():
    s = ToolCallStream("hermes")
    assert s.feed("Checking the weather ").content == "Checking the weather "
    assert s.feed("<tool").content == ""  # may be the marker: held
    d = s.feed('_call>{"name": "get_weather", "arguments": {"ci')
    assert d.content == "" and d.tool_calls[0]["function"]["name"] == "get_weather"
    assert d.tool_calls[1]["function"]["arguments"] == '{"ci'


def test_the_family_comes_from_the_chat_template():
    assert family_for_template("{{'<|im_start|>' + message['role']}}") == "hermes"  # ChatML (SmolLM2)
    assert family_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert family_for_template("[TOOL_CALLS] {{ tools }}") == "mistral"
    assert family_for_template("<|start_header_id|>ipython{{ parameters }}<|python_tag|>") == "llama3_json"
    assert family_for_template("{{ messages }}") == "json"
    assert family_for_template(None) == "json"


def _chat(**fields):
    from pdserve.front.openai_schema import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_which_tool_requests_constrain_decoding():
    from pdserve.front.guided import guided_spec

    fn = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    loose, strict = {"type": "function", "function": fn}, {"type": "function", "function": {**fn, "strict": True}}
    assert guided_spec(_chat(tools=[loose]), "hermes") is None  # auto: the model may answer in text
    assert guided_spec(_chat(tools=[strict], tool_choice="none"), "hermes") is None
    auto = json.loads(guided_spec(_chat(tools=[strict]), "hermes").value)["format"]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"]  # text, or a strict call
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        must = json.loads(guided_spec(_chat(tools=[loose], tool_choice=choice, parallel_tool_calls=False),
                                      "llama3_json").value)["format"]
        assert must["type"] == "tags_with_separator" and must["at_least_one"] and must["stop_after_first"]
        assert must["tags"][0]["begin"] == '{"name": "add", "parameters": '
        assert must["tags"][0]["content"]["json_schema"] == fn["parameters"]
