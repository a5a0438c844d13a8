"""Drafters: n-gram lookup against a brute-force scan, the draft model against the model's own
greedy decoding, tokenizer refusal, and greedy speculative decoding == plain greedy (real model)."""
from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch

from pdserve.decode.drafters import (
    Draft,
    DraftModelDrafter,
    Drafter,
    NgramDrafter,
    NoDrafter,
    TokenizerMismatchError,
    brute_force_ngram_proposal,
    check_tokenizer_compatible,
    crop_cache,
    make_drafter,
)
from pdserve.basetypes import SamplingParams


def _propose(drafter, rid, toks, k, sampling=None) -> Draft:
    return asyncio.run(drafter.propose(rid, toks, k, sampling))


# ---------------------------------------------------------------------------------------------
# n-gram


@pytest.mark.parametrize(
    "seq, k, expected",
    [
        ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]),  # plain lookup
        ([5, 6, 1, 5, 6, 2, 7, 5, 6], 2, [2, 7]),  # most recent of two equal-length matches
        ([1, 2, 3, 7, 9, 2, 3, 8, 0, 1, 2, 3], 1, [7]),  # longest match beats a more recent shorter one
        ([1, 2, 3, 4], 4, []),  # nothing recurs
        ([1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),  # a match running into the end continues periodically
        ([7, 7, 7], 3, [7, 7, 7]),
    ],
)
def test_ngram_constructed(seq, k, expected):
    d = NgramDrafter(min_n=2, max_n=4, min_reach=0.0)
    assert _propose(d, "r", seq, k).token_ids == expected
    assert brute_force_ngram_proposal(seq, k, 2, 4) == expected


def test_ngram_prefers_longest_then_most_recent_with_max_n():
    # suffix (1,2,3,4,5) of length 5 exists earlier but max_n=3 only sees (3,4,5): most recent wins
    seq = [1, 2, 3, 4, 5, 10, 0, 3, 4, 5, 20, 0, 1, 2, 3, 4, 5]
    assert _propose(NgramDrafter(min_n=1, max_n=3, min_reach=0.0), "r", seq, 1).token_ids == [20]
    assert _propose(NgramDrafter(min_n=1, max_n=5, min_reach=0.0), "r", seq, 1).token_ids == [10]


def test_ngram_incremental_equals_brute_force():
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.randint(2, 6)
        min_n, max_n = rng.choice([(1, 3), (2, 4), (2, 6), (3, 5)])
        d = NgramDrafter(min_n=min_n, max_n=max_n, min_reach=0.0)
        seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        while len(seq) < 200:
            k = rng.randint(1, 8)
            got = _propose(d, f"r{trial}", seq, k).token_ids
            assert got == brute_force_ngram_proposal(seq, k, min_n, max_n), (seq, k)
            # tokens arrive in steps of 1..k+1 (accepted drafts + one target token)
            seq = seq + [rng.randrange(vocab) for _ in range(rng.randint(1, k + 1))]
        # a rewound or edited sequence is re-indexed, not proposed from stale text
        seq = seq[:120] + [vocab + 1, 0, 1]
        assert _propose(d, f"r{trial}", seq, 4).token_ids == brute_force_ngram_proposal(seq, 4, min_n, max_n)


def test_ngram_requests_are_independent_and_released():
    d = NgramDrafter(min_n=2, max_n=4, min_reach=0.0)
    assert _propose(d, "a", [1, 2, 3, 1, 2], 1).token_ids == [3]
    assert _propose(d, "b", [1, 2, 4, 1, 2], 1).token_ids == [4]
    assert _propose(d, "a", [1, 2, 3, 1, 2], 0).token_ids == []
    d.release("a")
    d.release("a")  # idempotent
    assert _propose(d, "b", [1, 2, 4, 1, 2, 4, 1], 2).token_ids == [2, 4]


def test_ngram_trims_proposals_by_learned_match_confidence():
    d = NgramDrafter(min_n=2, max_n=4, min_reach=0.2, prior_strength=2.0, decay=1.0)
    short = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]  # a 2-token match (1, 2)
    long = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4]  # a 4-token match (1, 2, 3, 4)
    assert len(_propose(d, "s", short, 8).token_ids) < len(_propose(d, "l", long, 8).token_ids)
    # continuations after 4-token matches keep being right: their proposals grow to k
    for i in range(20):
        draft = _propose(d, f"l{i}", long, 8)
        d.feedback(f"l{i}", len(draft), draft.token_ids)
    assert _propose(d, "l", long, 8).token_ids == [5, 6, 7, 8, 0, 1, 2, 3]
    assert d.match_alpha(4) > 0.9
    # continuations after 2-token matches keep being wrong: proposals shrink to nothing, but
    # every 8th suppressed match still probes with one token (deterministically)
    lengths = []
    for i in range(40):
        draft = _propose(d, f"s{i}", short, 8)
        lengths.append(len(draft))
        d.feedback(f"s{i}", 0, [42])
    assert d.match_alpha(2) < 0.2
    assert lengths[0] == 1 and set(lengths[1:]) == {0, 1}
    assert [i for i, n in enumerate(lengths[1:]) if n] == [7, 15, 23, 31]
    # the untrimmed lookup is still the brute-force one
    assert _propose(NgramDrafter(2, 4, min_reach=0.0), "x", short, 3).token_ids == [3, 4, 5]


def test_ngram_confidence_and_trim_feed_the_right_match_length():
    d = NgramDrafter(min_n=2, max_n=4, min_reach=0.0, prior_strength=2.0, decay=1.0)
    long = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4]
    assert d.confidence("r") is None  # nothing proposed yet
    assert len(_propose(d, "r", long, 6)) == 6
    assert d.confidence("r") == pytest.approx(d.prior_alpha(4))
    d.trim("r", 2)  # the controller verifies 2 of the 6; both accepted
    d.feedback("r", 2, [5, 6, 9])
    assert d.match_alpha(4) == pytest.approx((2 + 2 * d.prior_alpha(4)) / (2 + 2))  # 2 of 2, not 2 of 3
    assert d.confidence("r") is None
    assert len(_propose(d, "q", long, 6)) == 6
    d.trim("q", 0)  # not verified at all: no evidence either way
    d.feedback("q", 0, [1])
    assert d.match_alpha(4) == pytest.approx((2 + 2 * d.prior_alpha(4)) / (2 + 2))
    # a request whose last proposal was accepted whole is copying: it is judged by the "hot" record
    assert d.prior_alpha(4, hot=True) > d.prior_alpha(4)
    _propose(d, "h", long, 2)
    d.feedback("h", 2, [5, 6, 7])
    seq = long + [5, 6, 7]
    assert _propose(d, "h", seq, 3).token_ids == [8, 0, 1]
    assert d.confidence("h") == pytest.approx(d.prior_alpha(4, hot=True))
    d.feedback("h", 1, [8, 5])  # partly rejected: no longer hot, and the hot record learned 1 of 2
    assert d.match_alpha(4, hot=True) == pytest.approx((1 + 2 * d.prior_alpha(4, hot=True)) / (2 + 2))
    _propose(d, "h", seq + [8, 5], 3)
    assert d.confidence("h") is None or d.confidence("h") == pytest.approx(d.match_alpha(d.last_match_n["h"]))


def test_drafters_share_one_protocol():
    assert isinstance(NgramDrafter(), Drafter)
    assert isinstance(make_drafter("ngram", max_n=5), NgramDrafter)
    assert isinstance(make_drafter("none"), NoDrafter)
    assert _propose(make_drafter("none"), "r", [1, 1, 1], 4).token_ids == []
    with pytest.raises(ValueError, match="unknown speculation method"):
        make_drafter("medusa")
    with pytest.raises(ValueError):
        NgramDrafter(min_n=3, max_n=2)


# ---------------------------------------------------------------------------------------------
# real model fixtures


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _chat(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def _plain_greedy(model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    feed, out = prompt, []
    while len(out) < n:
        logits = model(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        out.append(int(logits[0, -1].argmax()))
        if out[-1] == eos:
            break
        feed = [out[-1]]
    return out


@torch.inference_mode()
def _speculative_greedy(model, drafter, prompt: list[int], n: int, k: int, eos: int | None, rid: str):
    """Reference greedy speculative loop: draft, verify k + 1 in one forward, accept the prefix
    the target's argmax agrees with plus the target's next token, crop the rejected KV."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    out = [int(logits[0, -1].argmax())]
    drafted = accepted_total = 0
    while len(out) < n and out[-1] != eos:
        proposal = asyncio.run(drafter.propose(rid, prompt + out, k)).token_ids[:k]
        base = cache.get_seq_length()
        preds = model(input_ids=torch.tensor([[out[-1]] + proposal]), past_key_values=cache, use_cache=True).logits[0].argmax(-1).tolist()
        a = 0
        while a < len(proposal) and proposal[a] == preds[a]:
            a += 1
        crop_cache(cache, base + 1 + a)
        new = (proposal[:a] + [preds[a]])[: n - len(out)]
        if eos in new:
            new = new[: new.index(eos) + 1]
        drafter.feedback(rid, a, new)
        out.extend(new)
        drafted += len(proposal)
        accepted_total += a
    drafter.release(rid)
    return out, drafted, accepted_total


# ---------------------------------------------------------------------------------------------
# draft model


def test_draft_model_greedy_proposals_equal_own_greedy(model, tokenizer):
    prompt = _chat(tokenizer, "Name three primary colors.")
    d = DraftModelDrafter(model, target_tokenizer=tokenizer, draft_tokenizer=tokenizer)
    draft = _propose(d, "r", prompt, 6)
    assert draft.probs is None
    assert draft.token_ids == _plain_greedy(model, prompt, 6)


def test_draft_model_rollback_after_partial_acceptance(model, tokenizer):
    prompt = _chat(tokenizer, "Write one sentence about rivers.")
    d = DraftModelDrafter(model)
    first = _propose(d, "r", prompt, 4).token_ids
    # the target accepted 2 and then chose another token than the draft's third
    other = (first[2] + 1) % len(tokenizer)
    committed = first[:2] + [other]
    d.feedback("r", 2, committed)
    seq = prompt + committed
    again = _propose(d, "r", seq, 4).token_ids
    assert again == _plain_greedy(model, seq, 4)
    # without feedback (e.g. a lost message) the common-prefix sync rolls back as well
    d2 = DraftModelDrafter(model)
    _propose(d2, "r", prompt, 4)
    assert _propose(d2, "r", seq, 4).token_ids == again
    # full acceptance: the cache keeps every draft position and continues from there
    seq2 = seq + again + [_plain_greedy(model, seq + again, 1)[0]]
    d.feedback("r", 4, again + seq2[-1:])
    assert _propose(d, "r", seq2, 3).token_ids == _plain_greedy(model, seq2, 3)
    d.release("r")


def test_draft_model_sampled_proposals_carry_probs(model, tokenizer):
    prompt = _chat(tokenizer, "Say something.")
    d = DraftModelDrafter(model, seed=1)
    draft = _propose(d, "r", prompt, 3, SamplingParams(temperature=0.8, top_k=20, top_p=0.9))
    assert len(draft.token_ids) == 3
    assert draft.probs is not None and draft.probs.shape == (3, model.config.vocab_size)
    assert draft.probs.dtype == torch.float32
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
    assert all((row > 0).sum() <= 20 for row in draft.probs)
    assert all(float(draft.probs[i, t]) > 0 for i, t in enumerate(draft.token_ids))


class _SwappedIds:
    """The target tokenizer with the ids of two ordinary tokens exchanged (same size, same
    special tokens) — what a retrained BPE with the same merges could look like."""

    def __init__(self, tok):
        self._tok = tok
        self.name_or_path = "swapped-ids"

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def get_vocab(self):
        vocab = dict(self._tok.get_vocab())
        a, b = "Ġthe", "Ġand"
        vocab[a], vocab[b] = vocab[b], vocab[a]
        return vocab


def test_draft_with_other_tokenizer_is_refused(model, tokenizer, tmp_path):
    check_tokenizer_compatible(tokenizer, copy.deepcopy(tokenizer))  # the same vocabulary: accepted
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<draft_only_token>"])
    other.name_or_path = "my-draft"
    with pytest.raises(TokenizerMismatchError) as err:
        check_tokenizer_compatible(tokenizer, other)
    msg = str(err.value)
    assert "my-draft" in msg and str(tokenizer.name_or_path) in msg
    assert "vocab size" in msg and "fingerprint" in msg
    with pytest.raises(TokenizerMismatchError):
        DraftModelDrafter(model, target_tokenizer=tokenizer, draft_tokenizer=other)
    # same size and special tokens, two ids swapped: only the fingerprint tells them apart
    assert "my-draft" not in str(_SwappedIds(tokenizer).name_or_path)
    with pytest.raises(TokenizerMismatchError, match="fingerprint") as err:
        check_tokenizer_compatible(tokenizer, _SwappedIds(tokenizer))
    assert "vocab size" not in str(err.value)
    # loading a draft folder whose tokenizer differs fails before its weights are read
    other.save_pretrained(tmp_path)
    with pytest.raises(TokenizerMismatchError, match="differs from target tokenizer"):
        DraftModelDrafter.from_pretrained(str(tmp_path), tokenizer)


# ---------------------------------------------------------------------------------------------
# greedy speculative decoding == plain greedy, on the real model

PROMPTS = [
    "What is the capital of France?",
    "Rewrite this function with a list comprehension:\n\ndef f(xs):\n    out = []\n    for x in xs:\n        out.append(x * 2)\n    return out",
    'Call the tool again for Berlin: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": "metric"}}\n</tool_call>',
]


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_speculative_greedy_equals_plain_greedy(model, tokenizer, method):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    drafter = NgramDrafter(min_n=2, max_n=5) if method == "ngram" else DraftModelDrafter(model)
    n = 24
    total_drafted = total_accepted = 0
    for i, text in enumerate(PROMPTS):
        prompt = _chat(tokenizer, text)
        plain = _plain_greedy(model, prompt, n, eos)
        spec, drafted, accepted = _speculative_greedy(model, drafter, prompt, n, 4, eos, f"r{i}")
        assert spec == plain, f"{method} prompt {i}: {tokenizer.decode(spec)!r} != {tokenizer.decode(plain)!r}"
        total_drafted += drafted
        total_accepted += accepted
    assert total_drafted > 0
    if method == "self_draft":  # the target as its own draft agrees with itself
        assert total_accepted == total_drafted
