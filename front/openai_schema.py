"""OpenAI-compatible request schemas, validated at the edge with errors a client can act on."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOKENS_LIMIT = 1 << 20  # anything above is absurd whatever the model; the context check is stricter


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SpecOptions(BaseModel):
    """pdserve extension: per-request speculation settings."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    method: Literal["ngram", "draft", "none"] | None = None
    max_k: int | None = Field(default=None, ge=0, le=32)


class _Common(BaseModel):
    # Unknown fields are refused (as OpenAI does) rather than silently ignored.
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    ignore_eos: bool = False
    speculation: SpecOptions | None = None
    return_token_ids: bool = False  # pdserve extension: include the generated token ids in each choice

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return [v] if isinstance(v, str) else v


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: Literal[False] = False
    logprobs: None = None

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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
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


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: Literal[False] = False
    # the tools go to the model's chat template, which shows them to the model; its answer comes back as
    # text (calls are not parsed out of it, nor is decoding constrained to them: "required" is refused)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (None: no tools, or `tool_choice` "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]
