"""The grammar a request's output must follow, from whichever field asks for one, checked before dispatch.

Fields, one per request: `response_format` (`json_object`, `json_schema`), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (EBNF, or Lark) and `structured_outputs.{json,
regex, choice, grammar, json_object}`; and in chat, tools: `tool_choice` `required` or a named
function constrains the answer to the tool-call format of the model's family with each function's
parameter schema, and under `auto` a tool with `strict: true` constrains any call the model starts.
A grammar that cannot be compiled is a `GuidedError` naming the field and the reason (a 400).
"""
from __future__ import annotations

import json

from pdserve.basetypes import Guided
from pdserve.front.openai_schema import ChatCompletionRequest, CompletionRequest
from pdserve.front.toolcalls import call_structural_tag
from pdserve.grammar import GrammarError, check, lark_to_ebnf


class GuidedError(ValueError):
    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field


def _json_spec(field: str, schema) -> Guided:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GuidedError(field, f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GuidedError(field, "the JSON schema must be an object")
    return Guided(kind="json_schema", value=json.dumps(schema))


def _choice_spec(choices: list[str]) -> Guided:
    tag = {"type": "structural_tag",
           "format": {"type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}}
    return Guided(kind="structural_tag", value=json.dumps(tag))


def _grammar_spec(field: str, text: str) -> Guided:
    spec = Guided(kind="grammar", value=text)
    try:
        check(spec)
        return spec
    except GrammarError as ebnf_error:
        try:  # vLLM takes Lark too
            return Guided(kind="grammar", value=lark_to_ebnf(text))
        except GrammarError:
            raise GuidedError(field, f"not a grammar xgrammar can compile (EBNF or Lark): {ebnf_error}") from None


def _vllm_fields(prefix: str, json_, regex, choice, grammar) -> list[tuple[str, Guided]]:
    """vLLM's four ways to ask for a grammar, named `{prefix}json`, `{prefix}regex`, … (guided_* and
    structured_outputs.* take the same values)."""
    out = []
    if json_ is not None:
        out.append((f"{prefix}json", _json_spec(f"{prefix}json", json_)))
    if regex is not None:
        out.append((f"{prefix}regex", Guided(kind="regex", value=regex)))
    if choice is not None:
        out.append((f"{prefix}choice", _choice_spec(choice)))
    if grammar is not None:
        out.append((f"{prefix}grammar", _grammar_spec(f"{prefix}grammar", grammar)))
    return out


def _asked(req: CompletionRequest | ChatCompletionRequest, family: str) -> list[tuple[str, Guided]]:
    out: list[tuple[str, Guided]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", Guided(kind="json_object")))
    elif rf is not None and rf.type == "json_schema":
        out.append(("response_format.json_schema.schema", _json_spec("response_format.json_schema.schema",
                                                                     rf.json_schema.schema_ or {"type": "object"})))
    out += _vllm_fields("guided_", req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar)
    so = req.structured_outputs
    if so is not None:
        out += _vllm_fields("structured_outputs.", so.json_, so.regex, so.choice, so.grammar)
        if so.json_object:
            out.append(("structured_outputs.json_object", Guided(kind="json_object")))
    if isinstance(req, ChatCompletionRequest) and req.parses_calls:
        forced = req.forced_functions()
        strict = [t.function.model_dump(exclude_none=True) for t in req.tools if t.function.strict]
        if forced is not None or strict:
            tag = call_structural_tag(family, forced if forced is not None else strict, must_call=forced is not None,
                                      parallel=req.parallel_tool_calls)
            out.append(("tool_choice" if forced is not None else "tools", Guided(kind="structural_tag",
                                                                                 value=json.dumps(tag))))
    return out


def guided_spec(req: CompletionRequest | ChatCompletionRequest, family: str) -> Guided | None:
    """The grammar `req` asks for (None: unconstrained); `family`: the deployment's tool-call format.
    GuidedError when it asks for two, or for one that cannot be compiled."""
    asked = _asked(req, family)
    if not asked:
        return None
    if len(asked) > 1:
        raise GuidedError(asked[1][0], f"only one structured-output constraint per request ({asked[0][0]} is "
                                       f"given too)")
    field, spec = asked[0]
    try:
        check(spec)
    except GrammarError as e:
        raise GuidedError(field, str(e)) from None
    return spec
