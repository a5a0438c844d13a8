"""The plain types every layer shares: sampling parameters, the KV layout, block addresses, pool labels.

This is the bottom of pdserve's import graph: it imports the standard library and pydantic,
nothing of ours and nothing heavy, so the HTTP front, the wire protocol, the operator and the
engines can all use one definition of each (tests/test_layering.py holds it to that). Tensor
code that goes with these types lives above, beside the tensors (`kvtransfer.layout.KVBlocks`).

Not named `types`: a module named like a standard library module shadows it for any script run
from its folder, the trap the design card names for `operator`.
"""
from __future__ import annotations

import array
import hashlib
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# --- sampling ---------------------------------------------------------------------------------

MAX_STOP_STRINGS = 8
MAX_CHOICES = 16  # `n`: choices of one request, all sharing the prompt's KV
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default `max_logprobs`
# A temperature below this samples as greedy (vLLM's `_SAMPLING_EPS`): logits divided by less overflow float32,
# and a distribution that sharp is the argmax anyway.
GREEDY_BELOW = 1e-5


ToolCallFormat = Literal["hermes", "llama3_json", "mistral", "json"]  # tool-call formats (`front.toolcalls`)
TOOL_CALL_FORMATS: tuple[str, ...] = get_args(ToolCallFormat)

GuidedKind = Literal["json_object", "json_schema", "regex", "grammar", "structural_tag"]


class Guided(BaseModel):
    """A grammar the output must follow (`pdserve.grammar` compiles it on each worker). `value`: the JSON
    schema (JSON text), the regular expression, the EBNF grammar, or the structural tag (JSON text, the
    tool-call formats); empty for `json_object` (any JSON object)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: GuidedKind
    value: str = ""


class SamplingParams(BaseModel):
    """What a request asks of generation. Validated at the edge (the front) and again by workers.

    `temperature == 0` is greedy (one below `GREEDY_BELOW` is made 0, as vLLM does); `top_k == 0`,
    `top_p == 1` and `min_p == 0` turn those filters off. The order of processing is vLLM's: the raw
    logits get the history-dependent processors (`min_tokens`, the grammar's mask (`guided`), then the
    repetition, frequency and presence penalties — `pdserve.processors`); greedy takes their argmax;
    sampling goes on with temperature → min-p → top-k → top-p (`pdserve.kernels.spec_verify.process_logits`).
    """

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0 = off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # 0 = off
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)  # end generation like EOS (even with ignore_eos)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)  # no EOS or stop token / stop string before this many tokens
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)  # prompt and output tokens; 1 = off
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # output tokens; 0 = off
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # output tokens; 0 = off
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # None: none; k: the token's and k alternatives
    skip_special_tokens: bool = True
    guided: Guided | None = None  # constrained decoding: the grammar the output follows

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        return v

    @model_validator(mode="after")
    def _min_within_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def history_dependent(self) -> bool:
        """Whether a token's distribution depends on the tokens before it beyond the model's logits
        (penalties, min_tokens, a format mask): then every position needs its own processing."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or self.guided is not None)


# --- how KV moves ---------------------------------------------------------------------------
# The words a handoff offer, the workers' settings and the CRD share.

Compression = Literal["none", "int8", "fp8"]  # of KV on the wire
COMPRESSIONS: tuple[str, ...] = get_args(Compression)
TRANSPORTS = ("shm", "tcp", "nats", "objstore")  # KV data paths, in a sender's usual preference


# --- the KV layout --------------------------------------------------------------------------
# A KV cache is a list of blocks of `block_size` tokens; one layer's KV is a tensor
# `[num_blocks, 2, kv_heads, block_size, head_dim]` (2 = keys, values). The `KVLayout` names what
# a receiver must agree with before it accepts a single byte: same model (fingerprint), same
# shape, same dtype, same block size, and per layer the same attention (full, or a sliding window
# of how many tokens). A sliding-window layer's next query sees only its window, so a handoff
# carries only the blocks that hold it (`KVLayout.layer_blocks`); the receiver places them at the
# end of the sequence's blocks and never reads the ones before.

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block

# KV element types by name, with their size in bytes (names as torch spells them after "torch.")
_DTYPES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
}


class LayoutMismatch(ValueError):
    """A handoff whose KV layout differs from what the receiver serves. Names every field that differs."""


class KVLayout(BaseModel):
    """What a KV payload is: identical on both sides of a handoff, or the handoff is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_fingerprint: str
    num_layers: int
    kv_heads: int  # every layer's (one pool holds all layers)
    head_dim: int  # every layer's, keys and values alike
    dtype: str  # one of _DTYPES
    block_size: int  # tokens per block
    # per layer: its sliding window in tokens (a query at position i sees positions i - window + 1 .. i), or
    # 0 for full attention; () when every layer is full (the one way to say so: layouts compare equal)
    layer_windows: tuple[int, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _all_full_is_empty(cls, data):
        if isinstance(data, dict) and data.get("layer_windows") and not any(data["layer_windows"]):
            data = {**data, "layer_windows": ()}
        return data

    @model_validator(mode="after")
    def _one_window_per_layer(self) -> "KVLayout":
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ValueError(f"layer_windows must be >= 0 (0 = full attention), got {self.layer_windows}")
        return self

    @property
    def torch_dtype(self):
        """The `torch.dtype` of the elements. For code that holds tensors: torch is imported here only
        when asked, so the types stay importable without it."""
        import torch

        _DTYPES[self.dtype]  # a dtype the layout does not know is a KeyError, as in block_bytes
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.kv_heads * self.block_size * self.head_dim * _DTYPES[self.dtype]

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def attention(self, layer: int) -> str:
        """Layer `layer`'s attention in words: "full" or "sliding window of N"."""
        w = self.window(layer)
        return f"sliding window of {w}" if w else "full"

    def layer_blocks(self, layer: int, num_tokens: int) -> int:
        """How many blocks of layer `layer` a handoff of `num_tokens` carries: all of them for full attention;
        for a sliding window, the last ones, from the block holding the first position the next query sees."""
        nb = self.num_blocks(num_tokens)
        w = self.window(layer)
        if not w:
            return nb
        return nb - max(0, num_tokens - w + 1) // self.block_size

    def payload_bytes(self, num_tokens: int) -> int:
        """Bytes of a handoff of `num_tokens` (each layer's `layer_blocks`)."""
        return sum(self.layer_blocks(i, num_tokens) for i in range(self.num_layers)) * self.block_bytes

    def layer_offsets(self, num_tokens: int) -> list[int]:
        """Where each layer starts in a handoff's payload of `num_tokens`, in bytes (layers in order, then the
        total): `num_layers + 1` offsets."""
        out = [0]
        for i in range(self.num_layers):
            out.append(out[-1] + self.layer_blocks(i, num_tokens) * self.block_bytes)
        return out

    def check_matches(self, other: "KVLayout", *, what: str = "handoff") -> None:
        """Raise LayoutMismatch naming each field where `other` (incoming) differs from self (expected)."""
        diffs = [
            f"{name}: expected {getattr(self, name)!r}, got {getattr(other, name)!r}"
            for name in type(self).model_fields
            if name != "layer_windows" and getattr(self, name) != getattr(other, name)
        ]
        if self.layer_windows != other.layer_windows and self.num_layers == other.num_layers:
            layers = [i for i in range(self.num_layers) if self.window(i) != other.window(i)]
            diffs.append(f"attention of {len(layers)} layer(s): " + ", ".join(
                f"layer {i} expected {self.attention(i)}, got {other.attention(i)}" for i in layers[:4])
                + (", ..." if len(layers) > 4 else ""))
        if diffs:
            raise LayoutMismatch(f"{what} refused, KV layout differs: " + "; ".join(diffs))


def dtype_name(dtype) -> str:
    """The layout's name of a `torch.dtype` ("float32", "bfloat16", "float16"); ValueError for any other."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {', '.join(_DTYPES)}")
    return name


# --- prefix addresses ------------------------------------------------------------------------
# A full KV block is addressed by a hash chain over token ids, h_i = sha256(h_{i-1} || tokens of
# block i as int64), so a block matches only if everything before it matches too. Workers cache
# blocks under these addresses and announce them (truncated to ANNOUNCED_HASH_BYTES) in their
# LoadReports; the router computes the same chain for a prompt to find who holds its longest prefix.

ROOT_HASH = b""
ANNOUNCED_HASH_BYTES = 8


def block_hash(parent: bytes, tokens) -> bytes:
    """The hash-chain address of a full block: sha256(parent hash || token ids as little-endian int64)."""
    a = array.array("q", tokens)
    if array.array("q", [1]).tobytes()[0] != 1:  # big-endian host: hash the same bytes as everyone else
        a.byteswap()
    h = hashlib.sha256(parent)
    h.update(a.tobytes())
    return h.digest()


def prefix_hashes(token_ids, block_size: int) -> list[bytes]:
    """The hash chain of every full block of `token_ids`."""
    out, h = [], ROOT_HASH
    for i in range(len(token_ids) // block_size):
        h = block_hash(h, token_ids[i * block_size : (i + 1) * block_size])
        out.append(h)
    return out


def announced(h: bytes) -> str:
    """How a block address appears in a LoadReport."""
    return h[:ANNOUNCED_HASH_BYTES].hex()


def selector_labels(name: str, component: str) -> dict[str, str]:
    """The labels that select an InferenceService's pool `component` ("prefill", "decode", "front"):
    the operator's Deployment selectors and the metrics adapter's reports, which its HPAs must find,
    share them. Deployment selectors are immutable, so only labels that never change for a pool."""
    return {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}
