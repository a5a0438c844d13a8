"""OpenAI-compatible request schemas, validated at the edge with errors a client can act on.

Unknown fields are accepted and ignored, as vLLM does: benchmark clients, LiteLLM and agent
frameworks send fields of their own (or of newer API versions), and refusing them would refuse
the client. `ignored_fields` names them, so the front can log them and say so in a response
header. Known fields stay strict: a malformed value of one is a 400 that names it.

Besides OpenAI's fields, vLLM's common extensions: `min_tokens`, `stop_token_ids`,
`repetition_penalty`, `min_p`, `top_k` (-1 = off, as vLLM), `ignore_eos`,
`skip_special_tokens`, `stream_options.continuous_usage_stats`, the structured-output fields
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`; and
pdserve's `speculation` and `return_token_ids`.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.basetypes import MAX_CHOICES, MAX_LOGPROBS

MAX_TOKENS_LIMIT = 1 << 20  # anything above is absurd whatever the model; the context check is stricter


class Lenient(BaseModel):
    """A request part whose unknown fields are kept aside (`model_extra`) and ignored. Known fields take their
    JSON type only (strict): `true` is no penalty and `"5"` no token count (an int is still a float)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (with include_usage)


class SpecOptions(Lenient):
    """pdserve extension: per-request speculation settings."""

    enabled: bool = True
    method: Literal["ngram", "draft", "none"] | None = None
    max_k: int | None = Field(default=None, ge=0, le=32)
    # whose earlier text may draft for this request through the draft pool (default: the deployment's one tenant)
    tenant: str | None = Field(default=None, min_length=1, max_length=128)
    # grammar-forced drafts: tokens the request's grammar leaves no choice about are verified as drafts
    forced: bool = True


class JsonSchemaFormat(Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema, strict}")
        return self


class StructuredOutputs(Lenient):
    """vLLM's `structured_outputs`: one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    json_object: bool | None = None


class _Common(Lenient):
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's structured-output extensions
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)
    structured_outputs: StructuredOutputs | None = None
    speculation: SpecOptions | None = None
    return_token_ids: bool = False  # pdserve extension: include the generated token ids in each choice

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it may only equal n)")
        return self


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: Literal[False] = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("batched prompts are not supported: send one prompt per request")
                v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(Lenient):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates take it: text content, and tool calls with their arguments as
        objects (templates render them; OpenAI sends them as JSON text)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return out


def _json_or_text(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return s


class FunctionSpec(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # the tools go to the model's chat template (or a system prompt, where the template shows none); calls
    # are parsed out of the answer (`front.toolcalls`); "required", a named function and `strict` tools
    # constrain decoding to the call format
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (None: no tools, or `tool_choice` "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def parses_calls(self) -> bool:
        """Whether the answer is searched for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_functions(self) -> list[dict] | None:
        """The functions decoding must call (tool_choice required: any; named: that one), else None."""
        if self.tool_choice == "required":
            return [t.function.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t.function.model_dump(exclude_none=True) for t in self.tools
                    if t.function.name == self.tool_choice.function.name]
        return None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice required needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                 f"among the tools ({', '.join(names) or 'none given'})")
        return self

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


def asked_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Alternatives per token the request asks for; None when it asks for no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def ignored_fields(model: BaseModel, path: str = "") -> list[str]:
    """Dotted names of the unknown fields of a request and its parts (`messages[].x` for a list's items)."""
    out = [f"{path}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out += ignored_fields(value, f"{path}{name}.")
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, BaseModel):
                    out += ignored_fields(item, f"{path}{name}[].")
    return list(dict.fromkeys(out))
