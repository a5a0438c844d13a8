"""OpenAI-compatible request schemas, validated at the edge with errors a client can act on."""
from __future__ import annotations

from typing import Literal

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
    # whose earlier text may draft for this request through the draft pool (default: the deployment's one tenant)
    tenant: str | None = Field(default=None, min_length=1, max_length=128)


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: Literal[False] = False
