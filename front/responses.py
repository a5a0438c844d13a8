"""OpenAI response shapes: the pydantic models `/openapi.json` publishes, and the logprobs formats.

The front builds its bodies as plain dicts on the hot path; these models describe them (the tests
validate real responses against the published schema). Logprobs are the raw model's, as vLLM v1
returns them by default (see `pdserve.processors`); a token's text is its bytes decoded alone,
and `bytes` (chat) are its real bytes, so characters split across tokens can be put back together.
"""
from __future__ import annotations

import json
import threading
from typing import Literal

from pydantic import BaseModel, Field

from pdserve.kvtransfer.protocol import TokenLogprob


def token_bytes(tokenizer) -> list[bytes | None]:
    """Each token id's bytes, None for special/added tokens (they carry no text of the output).

    Byte-level BPE (GPT-2, Llama 3, SmolLM2): token strings spell bytes in GPT-2's printable
    alphabet. SentencePiece (Llama 2, Gemma): "▁" is a space and "<0xNN>" a raw byte.
    """
    n = len(tokenizer)
    strings = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    decoder = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder = (json.loads(backend.to_str()).get("decoder") or {}).get("type")
    out: list[bytes | None] = []
    if decoder == "ByteLevel":
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        inverse = {ch: b for b, ch in bytes_to_unicode().items()}
        for i, t in enumerate(strings):
            try:
                out.append(None if i in special or t is None else bytes(inverse[ch] for ch in t))
            except KeyError:
                out.append(None)
        return out
    for i, t in enumerate(strings):
        if i in special or t is None:
            out.append(None)
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            out.append(bytes([int(t[3:5], 16)]))
        else:
            out.append(t.replace("\u2581", " ").encode())
    return out


class TokenTexts:
    """Each token id's text and bytes, built once per tokenizer from its vocabulary."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes = token_bytes(tokenizer)

    def text(self, token: int) -> str:
        b = self._bytes[token] if 0 <= token < len(self._bytes) else None
        return b.decode("utf-8", errors="replace") if b is not None else self.tokenizer.decode([token])

    def bytes(self, token: int) -> list[int]:
        b = self._bytes[token] if 0 <= token < len(self._bytes) else None
        return list(b if b is not None else self.text(token).encode())

    _lock = threading.Lock()
    _shared: dict[int, "TokenTexts"] = {}

    @classmethod
    def of(cls, tokenizer) -> "TokenTexts":
        with cls._lock:
            t = cls._shared.get(id(tokenizer))
            if t is None:
                t = cls._shared[id(tokenizer)] = cls(tokenizer)
            return t


def chat_logprobs(tokens: list[int], lps: list[TokenLogprob], texts: TokenTexts) -> dict:
    """`choices[].logprobs` of a chat completion (or chunk) for these tokens."""
    def entry(t: int, lp: float) -> dict:
        return {"token": texts.text(t), "logprob": lp, "bytes": texts.bytes(t)}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                        for t, lp in zip(tokens, lps)]}


def completion_logprobs(tokens: list[int], lps: list[TokenLogprob], texts: TokenTexts, offset: int) -> dict:
    """`choices[].logprobs` of a text completion (or chunk): `offset` is the choice's text length
    before these tokens (text_offset counts characters of the tokens' texts)."""
    strings = [texts.text(t) for t in tokens]
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    top = [{**{texts.text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}, s: lp.logprob}
           for s, lp in zip(strings, lps)]
    return {"tokens": strings, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


# -- the shapes, for /openapi.json -----------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    prepositioned: bool | None = None


class SpeculationUsage(BaseModel):
    draft_tokens: int
    accepted_tokens: int
    forced_draft_tokens: int | None = Field(default=None, description="of the drafts, those the grammar forced")
    forced_accepted_tokens: int | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculation: SpeculationUsage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = Field(default=None, description="pdserve: with return_token_ids")


class CompletionResponse(BaseModel):
    """`/v1/completions`; streamed, each SSE `data:` is this shape (object `text_completion`) with the
    new text of one choice, then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls alone")
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: ChatFinishReason | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = Field(default=None, description="pdserve: with return_token_ids")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str = Field(description="the next fragment of the arguments' JSON text")


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: the first names it (id, type, function name), later ones add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: ChatFinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE `data:` of a streamed `/v1/chat/completions`, then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error; on a stream that already started, one SSE `data:` of this shape and no `[DONE]`."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
