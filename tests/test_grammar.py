"""The grammar engine's integration (`pdserve.grammar`): checks before dispatch, masks per speculative row with
the matcher rolled back, forced tokens, and a state rebuilt from the generated tokens (the prefill → decode
handoff, a preempted sequence's recompute) that masks exactly as the one it replaces."""
from __future__ import annotations

import json

import pytest
import torch

from pdserve.basetypes import Guided, SamplingParams
from pdserve.grammar import GrammarDeadEnd, GrammarError, GrammarState, GrammarVocab, apply_masks, check
from pdserve.processors import make_processor

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "kind": {"enum": ["alpha", "beta"]},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["name", "kind", "n"], "additionalProperties": False}
SPEC = Guided(kind="json_schema", value=json.dumps(SCHEMA))
TEXT = '{"name": "Bob", "kind": "beta", "n": 7}'


@pytest.mark.parametrize("spec,reason", [
    (Guided(kind="json_schema", value='{"type": "frob"}'), "Unsupported type"),
    (Guided(kind="json_schema", value="[1, 2]"), "must be an object"),
    (Guided(kind="json_schema", value='{"items": {"$ref": "other.json#/x"}}'), "/items/$ref"),
    (Guided(kind="regex", value="a{2"), "egex"),
    (Guided(kind="grammar", value="root ::= ("), "rror"),
    (Guided(kind="structural_tag", value='{"type": "structural_tag", "format": {"type": "nope"}}'), "nope"),
])
def test_unusable_grammars_are_refused_with_the_reason_before_any_vocabulary(spec, reason):
    with pytest.raises(GrammarError, match=None) as e:
        check(spec)
    assert reason in str(e.value)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def vocab(tok):
    return GrammarVocab.of(tok, len(tok), {2})


def _allowed(masks: torch.Tensor, V: int) -> list[set[int]]:
    x = torch.zeros(masks.shape[0], V)
    apply_masks(x, masks)
    return [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in x]


@pytest.mark.parametrize("density", [0.0, 0.0005, 0.01, 0.3, 0.9995, 1.0])
def test_masks_apply_as_xgrammars_kernel_does(density):
    """Rows with few allowed tokens take pdserve's sparse path, the rest xgrammar's kernel: the same result."""
    import numpy as np
    import xgrammar as xgr

    rng = np.random.default_rng(int(density * 1e4))
    V = 1000 * 32 + 17  # a vocabulary that does not fill its last bitmask word
    words = -(-V // 32)
    dens = [density, 0.0005, 0.9995]  # a batch mixes sparse and dense rows
    bits = rng.random((3, words * 32)) < np.array(dens)[:, None]
    masks = torch.from_numpy(np.packbits(bits, axis=-1, bitorder="little").view(np.int32).copy())
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    x[0, 5] = float("nan")  # a stale value stays where allowed, and goes where refused, as in the kernel
    want, got = x.clone(), x.clone()
    xgr.apply_token_bitmask_inplace(want, masks, vocab_size=V)
    apply_masks(got, masks)
    assert torch.equal(want.isnan(), got.isnan())
    assert torch.equal(torch.nan_to_num(want), torch.nan_to_num(got))


@pytest.mark.model
def test_row_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(tok, vocab):
    ids = tok.encode(TEXT, add_special_tokens=False)
    V = len(tok)
    state = GrammarState(vocab, SPEC)
    rows = _allowed(state.masks(ids, len(ids) + 1), V)
    for j, t in enumerate(ids):
        assert t in rows[j]
        step = GrammarState(vocab, SPEC)  # the state plain decoding has at position j
        step.advance(ids[:j])
        assert _allowed(step.masks([], 1), V)[0] == rows[j], j
    assert rows[-1] == {2}  # the object is closed: only EOS
    assert _allowed(state.masks([], 1), V)[0] == rows[0]  # rolled back
    # a draft the grammar refuses: the rows after it repeat the last mask (verification rejects it)
    bad = tok.encode("x", add_special_tokens=False)[0]
    r = _allowed(state.masks([ids[0], bad, ids[2]], 4), V)
    assert bad not in r[1] and r[2] == r[1] == r[3]
    with pytest.raises(GrammarError):
        GrammarState(vocab, SPEC).advance([bad])


@pytest.mark.model
def test_forced_tokens_are_what_the_grammar_leaves_and_are_not_entered(tok, vocab):
    state = GrammarState(vocab, SPEC)
    forced = state.forced(16)
    assert tok.decode(forced) == '{"name":'  # '{"name": "' less the token that could grow
    assert state.forced(16) == forced  # nothing was entered
    state.advance(tok.encode('{"name": "Bob", "kind": "b', add_special_tokens=False))
    rest = state.forced(16)
    assert tok.decode(rest).startswith('eta", "n":')
    state.advance(tok.encode('eta", "n": 7}', add_special_tokens=False))
    assert state.forced(16) == [2] and state.done  # the end: EOS, proposed


@pytest.mark.model
def test_a_state_rebuilt_from_the_generated_tokens_masks_the_same(tok):
    """What the decode worker does with prefill's first token, and with a preempted sequence: replay."""
    V = len(tok)
    params = SamplingParams(guided=SPEC, max_tokens=64)
    ids = tok.encode(TEXT, add_special_tokens=False)
    live = make_processor(params, [1, 2, 3], [], V, tok, {2})
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    for cut in (1, 5, len(ids) - 1):
        live = make_processor(params, [1, 2, 3], [], V, tok, {2})
        live.advance(ids[:cut])
        rebuilt = make_processor(params, [1, 2, 3], ids[:cut], V, tok, {2})
        drafts = ids[cut: cut + 3]
        assert torch.equal(live.process(x[: len(drafts) + 1], drafts), rebuilt.process(x[: len(drafts) + 1], drafts))


@pytest.mark.model
def test_json_object_bounds_whitespace_as_json_mode_did(tok):
    V = len(tok)
    p = make_processor(SamplingParams(guided=Guided(kind="json_object")), [], [], V, tok, {2})
    space = tok.encode(" ", add_special_tokens=False)
    p.advance(tok.encode("{", add_special_tokens=False) + space * 40)
    assert not torch.isfinite(p.process(torch.zeros(1, V))[0, space[0]])  # a 41st space is refused


def test_a_grammar_no_token_can_continue_is_a_dead_end_not_a_refused_token(tok, vocab):
    """SmolLM2's byte-level vocabulary has no token for the byte 0xF1, so U+50000 (F1 90 80 80) cannot be spelled
    and a regex requiring it has a dead end right after 'H'. A token committed there is `GrammarDeadEnd` (the
    request's constraint, a 400); a token refused where others were allowed stays a plain GrammarError (a bug)."""
    assert tok.convert_ids_to_tokens(tok.encode("\U00050000", add_special_tokens=False))[0] != "ñ"  # 0xF1 is lost
    h = tok.encode("H", add_special_tokens=False)
    state = GrammarState(vocab, Guided(kind="regex", value="H\U00050000"))
    assert not state.dead_end()
    with pytest.raises(GrammarDeadEnd, match="after 1 generated tokens"):
        state.advance([*h, 0])
    assert state.dead_end() and state.accepted == 1
    alive = GrammarState(vocab, Guided(kind="regex", value="H\U00030000"))  # F0 B0 80 80: spelled
    alive.advance(h)
    assert not alive.dead_end()
    with pytest.raises(GrammarError) as refused:
        alive.advance([0])
    assert not isinstance(refused.value, GrammarDeadEnd)
    assert GrammarState(vocab, Guided(kind="regex", value="\U00050000")).dead_end()  # dead from the first token
