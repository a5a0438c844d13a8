"""JSON mode (`response_format: {"type": "json_object"}`): a token mask that keeps output valid JSON.

Output is constrained, not prompted: at every position only tokens whose bytes continue a valid
JSON object are allowed, and once the object is closed only an end-of-sequence token is.

Two parts:

* `JsonState` and `advance` — a byte-level pushdown automaton for one JSON object (RFC 8259
  values inside: objects, arrays, strings with escapes, numbers, true/false/null). Whitespace
  between tokens is allowed in runs of at most `MAX_WHITESPACE` bytes, so a model cannot pad
  forever.
* `JsonVocab` — the vocabulary's token strings as bytes, sorted, walked as an implicit trie with
  the automaton's state: a subtree is left as soon as its common prefix is refused. Inside a
  string (where most of an object's tokens fall) the walk does not go byte by byte: a token is
  allowed there unless it holds `"`, `\\` or a control byte, which few tokens do (358 of SmolLM2's
  49,152), and only those are simulated. The mask of a state depends only on the automaton mode
  and the top of its bracket stack (a token closes at most a few brackets), so masks are cached
  per such key and a step usually costs one dictionary lookup.
"""
from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

MAX_WHITESPACE = 40  # bytes in one run between JSON tokens (deep pretty-printing fits)
_MASK_CACHE_ENTRIES = 512  # bool masks [vocab] kept per vocabulary (~48 KiB each for 49k tokens)

# automaton modes
START, VALUE, ARR_FIRST, OBJ_FIRST, KEY, COLON, AFTER, STR, STR_ESC, STR_U, LIT, DONE = range(12)
NUM_MINUS, NUM_ZERO, NUM_INT, NUM_DOT, NUM_FRAC, NUM_E, NUM_ESIGN, NUM_EXP = range(12, 20)
_NUM_END = (NUM_ZERO, NUM_INT, NUM_FRAC, NUM_EXP)  # a number may end here
_WS_MODES = (START, VALUE, ARR_FIRST, OBJ_FIRST, KEY, COLON, AFTER)
_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = (b"true", b"false", b"null")
_LIT_START = {lit[0]: i for i, lit in enumerate(_LITERALS)}
_STRING_SPECIAL = frozenset(b'"\\') | frozenset(range(0x20))  # bytes that end plain string content


class JsonState(NamedTuple):
    """Where the automaton stands. `stack`: open brackets, b"{" / b"[" bytes, innermost last.
    `aux`: the whitespace run (structural modes), whether the string is a key (STR, STR_ESC: 0/1;
    STR_U: 2 * hex digits left + key), or literal index * 8 + bytes matched (LIT)."""

    mode: int
    stack: bytes
    aux: int


INITIAL = JsonState(START, b"", 0)


def _after_value(stack: bytes) -> JsonState:
    return JsonState(AFTER, stack, 0) if stack else JsonState(DONE, b"", 0)


def _value_start(c: int, stack: bytes) -> JsonState | None:
    if c == 0x22:  # "
        return JsonState(STR, stack, 0)
    if c == 0x7B:  # {
        return JsonState(OBJ_FIRST, stack + b"{", 0)
    if c == 0x5B:  # [
        return JsonState(ARR_FIRST, stack + b"[", 0)
    if c == 0x2D:  # -
        return JsonState(NUM_MINUS, stack, 0)
    if c == 0x30:
        return JsonState(NUM_ZERO, stack, 0)
    if c in _DIGITS:
        return JsonState(NUM_INT, stack, 0)
    if c in _LIT_START:
        return JsonState(LIT, stack, _LIT_START[c] * 8 + 1)
    return None


def _close(c: int, stack: bytes) -> JsonState | None:
    if stack and ((c == 0x7D and stack[-1] == 0x7B) or (c == 0x5D and stack[-1] == 0x5B)):
        return _after_value(stack[:-1])
    return None


def step(s: JsonState, c: int) -> JsonState | None:
    """The state after byte `c` (0-255), or None if no valid JSON object continues that way."""
    mode, stack, aux = s
    if mode == STR:
        if c == 0x22:
            return JsonState(COLON, stack, 0) if aux else _after_value(stack)
        if c == 0x5C:
            return JsonState(STR_ESC, stack, aux)
        return None if c < 0x20 else s
    if mode in _WS_MODES and c in _WS:
        return JsonState(mode, stack, aux + 1) if aux < MAX_WHITESPACE else None
    if mode == AFTER:
        if c == 0x2C:  # ,
            return JsonState(KEY if stack[-1] == 0x7B else VALUE, stack, 0)
        return _close(c, stack)
    if mode == VALUE:
        return _value_start(c, stack)
    if mode == OBJ_FIRST:
        if c == 0x22:
            return JsonState(STR, stack, 1)
        return _close(c, stack) if c == 0x7D else None
    if mode == KEY:
        return JsonState(STR, stack, 1) if c == 0x22 else None
    if mode == COLON:
        return JsonState(VALUE, stack, 0) if c == 0x3A else None
    if mode == ARR_FIRST:
        return _close(c, stack) if c == 0x5D else _value_start(c, stack)
    if mode == START:
        return JsonState(OBJ_FIRST, b"{", 0) if c == 0x7B else None
    if mode == STR_ESC:
        if c in _ESCAPES:
            return JsonState(STR, stack, aux)
        return JsonState(STR_U, stack, 8 + aux) if c == 0x75 else None  # \u: 4 hex digits
    if mode == STR_U:
        if c not in _HEX:
            return None
        left = aux // 2 - 1
        return JsonState(STR_U, stack, left * 2 + aux % 2) if left else JsonState(STR, stack, aux % 2)
    if mode == LIT:
        lit, pos = _LITERALS[aux // 8], aux % 8
        if c != lit[pos]:
            return None
        return _after_value(stack) if pos + 1 == len(lit) else JsonState(LIT, stack, aux + 1)
    if mode == DONE:
        return None
    # numbers: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
    if c in _DIGITS:
        if mode in (NUM_MINUS,):
            return JsonState(NUM_ZERO if c == 0x30 else NUM_INT, stack, 0)
        if mode in (NUM_INT, NUM_FRAC, NUM_EXP):
            return s
        if mode == NUM_DOT:
            return JsonState(NUM_FRAC, stack, 0)
        if mode in (NUM_E, NUM_ESIGN):
            return JsonState(NUM_EXP, stack, 0)
        return None  # a digit after a leading zero
    if c == 0x2E and mode in (NUM_ZERO, NUM_INT):
        return JsonState(NUM_DOT, stack, 0)
    if c in b"eE" and mode in (NUM_ZERO, NUM_INT, NUM_FRAC):
        return JsonState(NUM_E, stack, 0)
    if c in b"+-" and mode == NUM_E:
        return JsonState(NUM_ESIGN, stack, 0)
    if mode in _NUM_END:  # the number ends; the byte is what follows a value
        return step(JsonState(AFTER, stack, 0), c)
    return None


def advance(s: JsonState | None, data: bytes) -> JsonState | None:
    """The state after `data`, or None once any byte is refused."""
    for c in data:
        if s is None:
            return None
        s = step(s, c)
    return s


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


class JsonVocab:
    """One tokenizer's vocabulary prepared for JSON masks; thread-safe, built once per tokenizer.

    `mask(state)` → bool `[vocab]`: True where the token keeps the output a valid JSON object
    prefix (in DONE: exactly the EOS tokens).
    """

    def __init__(self, tokens: list[bytes | None], eos_token_ids: set[int]):
        self.vocab = len(tokens)
        self.eos = sorted(t for t in eos_token_ids if 0 <= t < self.vocab)
        self.bytes_of = tokens
        order = sorted((b, i) for i, b in enumerate(tokens) if b)
        self._sorted = [b for b, _ in order]
        self._ids = np.array([i for _, i in order], dtype=np.int64)
        # per sorted token: index of its last byte that ends plain string content (-1: none)
        last = np.full(len(order), -1, dtype=np.int64)
        for j, b in enumerate(self._sorted):
            for p in range(len(b) - 1, -1, -1):
                if b[p] in _STRING_SPECIAL:
                    last[j] = p
                    break
        self._last_special = last
        closers = max((b.count(b"}") + b.count(b"]") for b in self._sorted), default=0)
        self._key_depth = closers + 1  # stack entries a single token can reach
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    _shared: dict[int, "JsonVocab"] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer, eos_token_ids: set[int]) -> "JsonVocab":
        """The vocabulary of `tokenizer`, built on first use (about a second for 50k tokens) and shared."""
        key = id(tokenizer)
        with cls._shared_lock:
            v = cls._shared.get(key)
            if v is None:
                v = cls._shared[key] = cls(token_bytes(tokenizer), eos_token_ids)
            return v

    def advance(self, state: JsonState | None, token: int) -> JsonState | None:
        """The state after one token (EOS keeps DONE; any other token without bytes is refused)."""
        if state is None:
            return None
        if state.mode == DONE:
            return state if token in self.eos else None
        data = self.bytes_of[token] if 0 <= token < self.vocab else None
        return advance(state, data) if data else None

    def _key(self, s: JsonState) -> tuple:
        d = self._key_depth
        return s.mode, s.aux, s.stack[-d:], len(s.stack) > d

    def mask(self, state: JsonState) -> torch.Tensor:
        """Allowed tokens `[vocab]` bool in `state` (cached per mode and top of the stack)."""
        key = self._key(state)
        with self._lock:
            m = self._cache.get(key)
            if m is not None:
                self._cache.move_to_end(key)
                return m
        m = torch.zeros(self.vocab, dtype=torch.bool)
        if state.mode == DONE:
            m[self.eos] = True
        else:
            ids: list[np.ndarray] = []
            self._walk(state, 0, 0, len(self._sorted), ids)
            if ids:
                m[torch.from_numpy(np.concatenate(ids))] = True
        with self._lock:
            self._cache[key] = m
            while len(self._cache) > _MASK_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return m

    def _walk(self, state: JsonState, depth: int, lo: int, hi: int, out: list[np.ndarray]) -> None:
        """Collect the ids of tokens in sorted[lo:hi] (sharing their first `depth` bytes, consumed
        into `state`) whose remaining bytes the automaton accepts."""
        toks = self._sorted
        if state.mode == STR:
            # plain string content keeps the state: only bytes at or after a special one need simulating
            tail = self._last_special[lo:hi] < depth
            out.append(self._ids[lo:hi][tail])
            for j in np.nonzero(~tail)[0] + lo:
                b = toks[j]
                p = depth
                while b[p] not in _STRING_SPECIAL:
                    p += 1
                if advance(state, b[p:]) is not None:
                    out.append(self._ids[j : j + 1])
            return
        i = lo
        while i < hi and len(toks[i]) == depth:  # tokens that end here (they sort first)
            out.append(self._ids[i : i + 1])
            i += 1
        while i < hi:
            c = toks[i][depth]
            end = bisect.bisect_left(toks, toks[i][:depth] + bytes([c + 1]), i, hi) if c < 255 else hi
            nxt = step(state, c)
            if nxt is not None:
                self._walk(nxt, depth + 1, i, end, out)
            i = end
