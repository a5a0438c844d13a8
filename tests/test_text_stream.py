"""`TextStream`, the incremental detokenizer, against full re-decoding on every token.

The oracle below is the straightforward definition: decode every generated token again after
each new one, then apply the same rules (stop tokens, stop strings after min_tokens, a tail that
could begin a stop string or ends in an incomplete UTF-8 sequence held back). The incremental
stream must give the very same deltas and finish reason, token by token, on random sequences —
random ids (special tokens, byte fragments that split multi-byte characters, invalid UTF-8) and
real text in several scripts cut at random points.
"""
from __future__ import annotations

import random

import pytest

from pdserve.basetypes import SamplingParams
from pdserve.sampling import TextStream

pytestmark = pytest.mark.model


class FullRedecode:
    """The quadratic oracle: the whole output decoded again for every token."""

    def __init__(self, tokenizer, params: SamplingParams, eos: set[int]):
        self.tok, self.params = tokenizer, params
        self.eos = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
        self.tokens: list[int] = []
        self.emitted = ""
        self.finish_reason = None

    def _text(self, ids):
        return self.tok.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _flush(self, text):
        if not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta

    def push(self, token):
        self.tokens.append(token)
        if token in self.eos:
            self.finish_reason = "stop"
            return self._flush(self._text(self.tokens[:-1]))
        text = self._text(self.tokens)
        checking = len(self.tokens) > self.params.min_tokens
        for s in self.params.stop if checking else ():
            idx = text.find(s, max(0, len(self.emitted) - len(s)))
            if idx != -1:
                self.finish_reason = "stop"
                return self._flush(text[:idx])
        if len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
            return self._flush(text)
        safe = len(text.rstrip("\ufffd"))
        hold = 0
        for s in self.params.stop if checking else ():
            for n in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - n: safe] == s[:n]:
                    hold = max(hold, n)
                    break
        return self._flush(text[: safe - hold])


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


TEXTS = [
    "Héllo wörld — naïve café, 東京タワー and 🚀🌍 emoji; Привет, мир! ¿Qué tal? ½ ∑ ∞ ≠ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x ** 2  # ünïcödé\n\n\nclass A:\n\tpass\n",
    '{"name": "Zoë", "city": "Kraków", "note": "≥ 3 ✓", "emoji": "👩‍💻"}',
    "The END. STOP here. Done!!! The end of the story. ###",
]


def sequences(tok, rng: random.Random, count: int):
    vocab = len(tok)
    bytey = [i for i in range(vocab) if len(tok.decode([i])) == 1 and tok.decode([i]) == "\ufffd"]
    for i in range(count):
        kind = i % 3
        if kind == 0:  # random ids, including special tokens and lone byte fragments
            n = rng.randint(1, 40)
            yield [rng.choice(bytey) if rng.random() < 0.3 else rng.randrange(vocab) for _ in range(n)]
        else:  # real text in several scripts, cut anywhere, with fragments and specials spliced in
            ids = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
            a = rng.randrange(len(ids))
            seq = ids[a: a + rng.randint(1, 60)]
            if kind == 2 and seq:
                seq.insert(rng.randrange(len(seq) + 1), rng.choice(bytey + [0, 1, 2]))
            yield seq


PARAMS = [
    dict(),
    dict(skip_special_tokens=False),
    dict(stop=["STOP", "end", "\n\n"], ignore_eos=True),
    dict(stop=["ö", "🚀", "Done!!!"], min_tokens=5),
    dict(stop_token_ids=[13, 30], stop=["##"], skip_special_tokens=False),
]


@pytest.mark.parametrize("kw", PARAMS, ids=["plain", "specials-kept", "stop-strings", "min-tokens", "stop-ids"])
def test_deltas_equal_full_redecoding(tokenizer, kw):
    rng = random.Random(hash(str(kw)) % 1000)
    eos = {2}
    checked = 0
    for seq in sequences(tokenizer, rng, 150):
        params = SamplingParams(max_tokens=max(len(seq), kw.get("min_tokens", 0), 1), **kw)
        ours, oracle = TextStream(tokenizer, params, eos), FullRedecode(tokenizer, params, eos)
        for t in seq:
            got, want = ours.push(t), oracle.push(t)
            assert got == want, (seq, ours.tokens, got, want)
            assert ours.finish_reason == oracle.finish_reason
            checked += 1
            if ours.done:
                break
    assert checked > 1000


def test_resuming_from_generated_tokens_equals_one_stream(tokenizer):
    """Decode continues prefill's stream from its first token: the same deltas after it."""
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), stop=["≠"])
    whole = TextStream(tokenizer, params, {2})
    deltas = [whole.push(t) for t in ids[:3]]
    resumed = TextStream(tokenizer, params, {2}, generated=ids[:3])
    for t in ids[3:]:
        a, b = whole.push(t), resumed.push(t)
        assert a == b
        deltas.append(a)
        if whole.done:
            break
    text = "".join(deltas)
    assert whole.finish_reason == "stop" and text == TEXTS[0][: TEXTS[0].index("≠")]


def test_a_long_output_keeps_a_bounded_tail(tokenizer):
    """The incremental stream holds a bounded window, not the whole output."""
    ids = tokenizer.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids) + 1, stop=["never appears"])
    s = TextStream(tokenizer, params, {2})
    out = "".join(s.push(t) for t in ids)
    assert out == tokenizer.decode(ids)[: len(out)] and len(out) > len(TEXTS[0]) * 20
    assert len(s._settled) < 100 and s._prefix > len(ids) - 10
