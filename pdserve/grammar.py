"""Constrained decoding: a request's grammar compiled with xgrammar, and one sequence's matcher over it.

A grammar (`basetypes.Guided`: a JSON schema, any JSON object, a regular expression, an EBNF grammar,
or a structural tag — the tool-call formats) is checked where the request arrives (`check`: no
tokenizer needed, so a bad schema is a 400 before anything is generated) and compiled against the
vocabulary on each worker that samples for it (`GrammarVocab.compile`, cached per grammar text).

xgrammar over llguidance: with SmolLM2's vocabulary on this project's CPUs, xgrammar fills a batch's
masks several times faster (its token masks are precomputed per grammar state when it compiles) and
applies them an order of magnitude faster (`bench/structured.py --mask-only` times both engines);
it also has rollback, jump-forward tokens and structural tags for tool calls.

Masks are filled when a step's logits are there, not ahead while the step before runs: step N+1's
mask depends on step N's token, and filling a batch's masks is a few percent of a decode step at most
(same benchmark), so overlapping it would save little, at the price of a thread. What costs is
applying the masks (`apply_masks`).

`GrammarState` is one sequence's matcher. Its state is a function of the tokens generated so far,
so it survives any move of the sequence (prefill → decode, preemption and recompute) by replaying
them (`advance`). Speculative rows are masked as if the drafts before them were accepted, and the
matcher is rolled back after (`masks`); `forced` proposes the tokens the grammar leaves no choice
about (the grammar-forced drafts).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import numpy as np
import torch

from pdserve.basetypes import Guided

# JSON mode's whitespace bound between tokens: a model cannot pad forever (deep pretty-printing fits)
JSON_OBJECT_MAX_WHITESPACE = 40
_COMPILED_ENTRIES = 256  # compiled grammars kept per vocabulary
SPARSE_FRACTION = 64  # a row allowing fewer than vocab / this many tokens is masked from its allowed tokens


class GrammarError(ValueError):
    """A grammar that cannot be used: unsupported, malformed, or one the output left."""


class GrammarDeadEnd(GrammarError):
    """The grammar allows no token from here: what it requires next is nothing the vocabulary can spell (a
    regex's character the tokenizer cannot encode that way). The request's constraint, not a fault of the
    worker's: the request ends with a 400 naming it, the tokens before it stay generated."""

    def __init__(self, generated: int):
        super().__init__(f"the output's grammar allows no token after {generated} generated tokens: none of the "
                         f"model's tokens continues it (it requires text this tokenizer cannot spell)")


def _xgr():
    import xgrammar

    return xgrammar


def _schema_text(value: str) -> str:
    try:
        schema = json.loads(value)
    except ValueError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("the JSON schema must be an object")
    if where := _external_ref(schema):
        raise GrammarError(f"{where}: a $ref outside the schema is not supported (only '#...' references)")
    return value


def check(spec: Guided) -> None:
    """Raise GrammarError with the reason when `spec` cannot be compiled. Parses the grammar without a
    vocabulary (milliseconds), so the front refuses a request before any worker sees it."""
    xgr = _xgr()
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(_schema_text(spec.value), any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.value)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec.value)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar's own errors (RuntimeError, ValueError, InvalidJSONError, …)
        raise GrammarError(_reason(e)) from None


def _reason(e: Exception) -> str:
    """xgrammar's message without its log prefix (time, source file and line)."""
    lines = str(e).strip().splitlines()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0] if lines else type(e).__name__)[:400]


def _external_ref(node, pointer: str = "") -> str | None:
    """The JSON pointer of the first `$ref` that points outside the schema (nothing fetches it), or None."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"{pointer}/$ref"
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for k, v in items:
        found = _external_ref(v, f"{pointer}/{str(k).replace('~', '~0').replace('/', '~1')}")
        if found:
            return found
    return None


def lark_to_ebnf(text: str) -> str:
    """A Lark grammar (vLLM's `guided_grammar` accepts either) as xgrammar's EBNF."""
    try:
        return str(_xgr().Grammar.from_lark(text))
    except Exception as e:
        raise GrammarError(_reason(e)) from None


class GrammarVocab:
    """A tokenizer's vocabulary as xgrammar sees it, and the grammars compiled against it."""

    _cache: dict[tuple[int, int, tuple[int, ...]], "GrammarVocab"] = {}
    _cache_lock = threading.Lock()

    def __init__(self, tokenizer, vocab: int, stop_ids: tuple[int, ...]):
        xgr = _xgr()
        self.vocab = vocab
        self.stop_ids = stop_ids
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=list(stop_ids))
        # one compile thread: workers pin their threads, and a compile competes with the model's steps
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._compiled: OrderedDict[Guided, object] = OrderedDict()
        self._lock = threading.Lock()
        self.words = xgr.get_bitmask_shape(1, vocab)[1]  # int32 words of one row's bitmask
        bits = np.zeros(self.words, dtype=np.uint32)
        for t in stop_ids:
            bits[t // 32] |= np.uint32(1 << (t % 32))
        self.stop_bits = torch.from_numpy(bits.view(np.int32))  # a bitmask row allowing the stop tokens only

    @classmethod
    def of(cls, tokenizer, vocab: int, stop_ids) -> "GrammarVocab":
        key = (id(tokenizer), vocab, tuple(sorted(stop_ids)))
        with cls._cache_lock:
            if key not in cls._cache:
                cls._cache[key] = cls(tokenizer, vocab, key[2])
            return cls._cache[key]

    @classmethod
    def compiled(cls, tokenizer, vocab: int, stop_ids, spec: Guided):
        """`spec` compiled against the tokenizer's vocabulary (both cached): what a worker runs off its event loop
        as a request arrives, so the step that first masks for it finds the grammar ready."""
        return cls.of(tokenizer, vocab, stop_ids).compile(spec)

    def compile(self, spec: Guided):
        """The compiled grammar of `spec` (cached); GrammarError when it cannot be compiled."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        c = self.compiler
        try:
            if spec.kind == "json_object":
                out = c.compile_json_schema('{"type": "object"}', any_whitespace=True,
                                            max_whitespace_cnt=JSON_OBJECT_MAX_WHITESPACE, strict_mode=False)
            elif spec.kind == "json_schema":
                out = c.compile_json_schema(_schema_text(spec.value), any_whitespace=False)
            elif spec.kind == "regex":
                out = c.compile_regex(spec.value)
            elif spec.kind == "grammar":
                out = c.compile_grammar(spec.value)
            else:
                out = c.compile_structural_tag(spec.value)
        except GrammarError:
            raise
        except Exception as e:
            raise GrammarError(_reason(e)) from None
        with self._lock:
            self._compiled[spec] = out
            while len(self._compiled) > _COMPILED_ENTRIES:
                self._compiled.popitem(last=False)
        return out


def _popcount(words: torch.Tensor) -> int:
    return int(np.bitwise_count(words.numpy().view(np.uint32)).sum())


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, vocab: GrammarVocab, spec: Guided):
        xgr = _xgr()
        self.vocab = vocab
        self.matcher = xgr.GrammarMatcher(vocab.compile(spec))
        self._row = xgr.allocate_token_bitmask(1, vocab.vocab)
        self.accepted = 0  # tokens committed

    def dead_end(self) -> bool:
        """Nothing may follow (not even an end token): the grammar requires what no token spells."""
        if self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(self._row, 0)
        return _popcount(self._row) == 0

    @property
    def done(self) -> bool:
        """The grammar is complete: only an end token may follow."""
        return self.matcher.is_completed() or self.matcher.is_terminated()

    def advance(self, tokens: list[int]) -> None:
        """Commit generated tokens. A token the grammar refuses is a GrammarDeadEnd where the grammar allowed
        nothing there (a row with every token cut gives some token), else a GrammarError (the masks never allow
        one, so it means the sequence was sampled elsewhere without them)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return  # an end token was accepted; what follows (ignore_eos) is outside the grammar
            if not self.matcher.accept_token(t):
                if self.dead_end():
                    raise GrammarDeadEnd(self.accepted)
                raise GrammarError(f"token {t} does not continue the output's grammar")
            self.accepted += 1

    def masks(self, drafts: list[int], n: int) -> torch.Tensor:
        """Bitmasks `[n, words]` int32: row j allows what may follow drafts[:j]. Rows after a draft the
        grammar refuses repeat the last allowed mask (verification rejects that draft, so they are never
        sampled from). The matcher is left as it was."""
        out = torch.empty(n, self.vocab.words, dtype=torch.int32)
        m = self.matcher
        if m.is_terminated():  # an end token was accepted (ignore_eos): only end tokens, as at the end
            out[:] = self.vocab.stop_bits
            return out
        m.fill_next_token_bitmask(out, 0)
        taken = 0
        for j in range(1, n):
            if not m.accept_token(drafts[j - 1]):
                out[j:] = out[j - 1]
                break
            taken += 1
            if m.is_terminated():  # the draft was an end token: nothing is sampled after it
                out[j:] = out[j - 1]
                break
            m.fill_next_token_bitmask(out, j)
        if taken:
            m.rollback(taken)
        return out

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar leaves (next to) no choice about from here: its jump-forward
        tokens (a forced string, in the vocabulary's longest tokens) and single allowed tokens. The
        matcher is left as it was."""
        m, out = self.matcher, []
        while len(out) < limit and not m.is_terminated():
            run = m.find_jump_forward_tokens()[: limit - len(out)]
            if not run:
                m.fill_next_token_bitmask(self._row, 0)
                if _popcount(self._row) != 1:
                    break
                run = [int(np.flatnonzero(np.unpackbits(self._row.numpy().view(np.uint8), bitorder="little"))[0])]
                if run[0] in self.vocab.stop_ids:
                    out.append(run[0])  # the end: proposed, not entered (nothing follows it)
                    break
            accepted = 0
            for t in run:
                if not m.accept_token(t):
                    break
                accepted += 1
            out.extend(run[:accepted])
            if accepted < len(run) or not accepted:
                break
        entered = len(out) - (1 if out and out[-1] in self.vocab.stop_ids else 0)
        if entered:
            m.rollback(entered)
        return out


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Set the logits `[n, V]` float32 (any device) of tokens the bitmasks `[n, words]` int32 (CPU) refuse to
    -inf, in place; no Python over the vocabulary.

    Rows that allow much of the vocabulary (inside a string) go through xgrammar's native kernel, which is
    fast where few bits are refused; rows that allow few tokens (keys, punctuation, numbers: most of a
    schema's positions), where that kernel is slowest, are set to
    -inf and their allowed tokens, found from the nonzero words alone, put back (`bench/structured.py
    --mask-only` times both ways)."""
    V = logits.shape[-1]
    words = masks.numpy().view(np.uint32)
    allowed = np.bitwise_count(words).sum(axis=1)
    sparse = np.flatnonzero(allowed < V // SPARSE_FRACTION)
    dense = np.flatnonzero(allowed >= V // SPARSE_FRACTION)
    if len(dense):  # (on a GPU, xgrammar's kernel for the device takes the masks there)
        _xgr().apply_token_bitmask_inplace(logits, masks.to(logits.device), vocab_size=V,
                                           indices=None if len(dense) == len(words) else dense.tolist())
    if not len(sparse):
        return
    rows, cols = np.nonzero(words[sparse])
    bits = np.unpackbits(words[sparse][rows, cols].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    hit, bit = np.nonzero(bits)
    tokens = cols[hit] * 32 + bit
    keep = tokens < V
    row_ids = torch.from_numpy(sparse[rows[hit][keep]]).to(logits.device)
    token_ids = torch.from_numpy(tokens[keep]).to(logits.device)
    values = logits[row_ids, token_ids]
    for r in sparse.tolist():  # a row at a time: a plain fill, far cheaper than an indexed one
        logits[r].fill_(float("-inf"))
    logits.index_put_((row_ids, token_ids), values)
