"""JSON mode's automaton and token mask: exactly JSON objects, and the vocabulary walk equals
simulating every token."""
from __future__ import annotations

import json
import random

import pytest
import torch

from pdserve.jsonmask import DONE, INITIAL, MAX_WHITESPACE, JsonVocab, advance


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "lit"] + (["obj", "arr"] if depth < 4 else [])
    k = rng.choice(kinds)
    if k == "str":
        return "".join(rng.choice('ab "\\/\n\té€😀\u0001xyz0') for _ in range(rng.randint(0, 8)))
    if k == "int":
        return rng.randint(-10**6, 10**6)
    if k == "float":
        return rng.choice([0.5, -1.25e-7, 3e21, 1e-300, -0.0, 12.0])
    if k == "lit":
        return rng.choice([True, False, None])
    if k == "obj":
        return {f"k{rng.randint(0, 99)}": random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def random_object_text(rng: random.Random) -> str:
    obj = {f"key {i}": random_value(rng) for i in range(rng.randint(0, 5))}
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1, 2]),
                      separators=rng.choice([None, (",", ":"), (" , ", " : ")]))


def accepts(text: str) -> bool:
    s = advance(INITIAL, text.encode())
    return s is not None and s.mode == DONE


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_the_automaton_accepts_json_objects_and_every_prefix_of_them():
    rng = random.Random(0)
    for _ in range(400):
        text = random_object_text(rng)
        assert accepts(text), text
        data = text.encode()
        for i in range(len(data)):
            s = advance(INITIAL, data[:i])
            assert s is not None and s.mode != DONE, (text, data[:i])


MUTATIONS = list('{}[]",:.-+eE0123456789 \\tnuflsar\x00') + ["\\u12", "\\uZZZZ", "01", "1.", ".5", "-", "tru",
                                                           "nul", "\\x", "'", "\t\n"]


def test_the_automaton_refuses_what_json_refuses():
    """Random mutations of valid objects: accepted exactly when json.loads gives an object, with
    whitespace runs within the bound (json.loads has none) and nothing after the closing brace
    (generation ends there: only EOS may follow)."""
    rng = random.Random(1)
    refused = 0
    for _ in range(3000):
        text = random_object_text(rng)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            op = rng.random()
            if op < 0.4:
                text = text[:i] + rng.choice(MUTATIONS) + text[i:]
            elif op < 0.8:
                text = text[:i] + text[i + rng.randint(1, 3):]
            else:
                text = text[:i]
        expected = is_json_object(text) and text == text.rstrip()
        expected = expected and all(len(run) <= MAX_WHITESPACE for run in _ws_runs(text))
        assert accepts(text) == expected, repr(text)
        refused += not expected
    assert refused > 1000  # the mutations did break things


def _ws_runs(text: str):
    run = ""
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        if ch in " \t\n\r":
            run += ch
        else:
            if run:
                yield run
            run = ""
    if run:
        yield run


def test_whitespace_runs_are_bounded():
    assert accepts("{" + " " * MAX_WHITESPACE + "}")
    assert not accepts("{" + " " * (MAX_WHITESPACE + 1) + "}")
    assert accepts('{"a": "' + " " * 500 + '"}')  # inside a string, spaces are content


@pytest.fixture(scope="module")
def vocab(model_dir):
    from transformers import AutoTokenizer

    return JsonVocab.of(AutoTokenizer.from_pretrained(model_dir), {2})


def brute_force_mask(v: JsonVocab, state) -> torch.Tensor:
    return torch.tensor([v.advance(state, t) is not None for t in range(v.vocab)])


@pytest.mark.model
def test_the_vocabulary_walk_equals_simulating_every_token(vocab):
    """At states along real tokenisations of random objects (inside strings, numbers, literals,
    escapes, after commas, deep in brackets, done), the mask is exactly the tokens whose bytes the
    automaton accepts; and each text's own tokens are allowed all the way to EOS."""
    rng = random.Random(2)
    checked = set()
    for _ in range(12):
        text = random_object_text(rng)
        ids = _encode(vocab, text)
        state = INITIAL
        for t in ids + [2]:
            m = vocab.mask(state)
            assert m[t], (text, state)
            key = vocab._key(state)
            if key not in checked and len(checked) < 60:
                assert torch.equal(m, brute_force_mask(vocab, state)), state
                checked.add(key)
            state = vocab.advance(state, t)
        assert state is not None and state.mode == DONE
        assert vocab.mask(state).nonzero().flatten().tolist() == [2]  # only EOS once the object is closed
    assert len(checked) >= 30


def _encode(v: JsonVocab, text: str) -> list[int]:
    """Greedy longest-match tokenisation over the vocabulary's bytes (any split the model could
    produce is a valid path; this one makes long, multi-byte, multi-bracket tokens)."""
    by_bytes = {b: i for i, b in enumerate(v.bytes_of) if b}
    data, out, i = text.encode(), [], 0
    longest = max(len(b) for b in by_bytes)
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            if data[i: i + n] in by_bytes:
                out.append(by_bytes[data[i: i + n]])
                i += n
                break
        else:
            raise AssertionError(f"no token for byte {data[i]}")
    return out


@pytest.mark.model
def test_masks_are_cached_by_mode_and_stack_top(vocab):
    a = advance(INITIAL, b'{"a": [[[[{"b": "x')
    b = advance(INITIAL, b'{"c": [{"d": [[[{"b": "yz')
    assert a.stack[-3:] == b.stack[-3:] and a.stack != b.stack
    assert vocab.mask(a) is vocab.mask(b)
    closed = advance(INITIAL, b'{"a": [1')
    assert vocab.mask(closed)[_encode(vocab, "]}")[0]] and not vocab.mask(closed)[_encode(vocab, "}")[0]]
