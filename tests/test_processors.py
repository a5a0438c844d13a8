"""History-dependent logits processing against transformers' reference processors, and per-row
processing for speculative verification (row j sees drafts[:j] as generated)."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from pdserve.basetypes import SamplingParams
from pdserve.processors import SequenceProcessor, make_processor, token_logprobs

V = 300
EOS = {2}


def logits(seed: int, n: int = 1) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 4


def proc(params: SamplingParams, prompt, generated, **kw) -> SequenceProcessor:
    return SequenceProcessor(params, prompt, generated, V, EOS, **kw)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    prompt, generated = [5, 9, 9, 40, 200], [7, 9, 250, 7]
    x = logits(1)
    ours = proc(SamplingParams(repetition_penalty=penalty), prompt, generated).process(x)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + generated]), x.clone())
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert not torch.equal(ours, x)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_equals_transformers(ignore_eos):
    """EOS (unless ignore_eos) and stop_token_ids are cut until min_tokens tokens exist."""
    prompt = [5, 6, 7]
    params = SamplingParams(min_tokens=3, max_tokens=10, stop_token_ids=[11], ignore_eos=ignore_eos)
    stops = [11] if ignore_eos else [2, 11]
    x = logits(2)
    for generated in ([], [4], [4, 4], [4, 4, 4], [4, 4, 4, 4]):
        ours = proc(params, prompt, generated).process(x)
        ref = MinNewTokensLengthLogitsProcessor(len(prompt), 3, stops)(torch.tensor([prompt + generated]), x.clone())
        assert torch.equal(ours, ref)
        assert bool(torch.isinf(ours[0, stops]).all()) == (len(generated) < 3)


def test_frequency_and_presence_penalties_are_openais_definition():
    """logit - frequency_penalty * count - presence_penalty * (count > 0), over output tokens only."""
    prompt, generated = [3, 3, 4], [8, 8, 8, 9, 3]
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4)
    x = logits(3)
    ours = proc(params, prompt, generated).process(x)
    counts = torch.bincount(torch.tensor(generated), minlength=V).float()
    torch.testing.assert_close(ours, x - 0.7 * counts - (-0.4) * (counts > 0).float(), rtol=0, atol=1e-6)
    assert ours[0, 4] == x[0, 4]  # a prompt-only token: not an output token


CASES = [
    SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2),
    SamplingParams(min_tokens=3, stop_token_ids=[17], max_tokens=9),
    SamplingParams(repetition_penalty=0.8, min_tokens=2, max_tokens=9),
]


@pytest.mark.parametrize("params", CASES, ids=["penalties", "min-tokens", "both"])
def test_row_j_is_processed_as_if_drafts_before_it_were_generated(params):
    """What speculative verification relies on: one call over k+1 rows equals k+1 plain steps."""
    prompt, generated, drafts = [1, 5, 17], [17, 6], [6, 6, 2, 17]
    x = logits(4, len(drafts) + 1)
    rows = proc(params, prompt, generated).process(x, drafts)
    for j in range(len(drafts) + 1):
        one = proc(params, prompt, generated + drafts[:j]).process(x[j: j + 1])
        assert torch.equal(rows[j: j + 1], one), j
    # advance() after committing equals a processor built with those tokens
    p = proc(params, prompt, generated)
    p.advance(drafts[:2])
    assert torch.equal(p.process(x[:1]), proc(params, prompt, generated + drafts[:2]).process(x[:1]))


def test_token_logprobs_are_the_raw_log_softmax():
    x = logits(5, 3)
    out = token_logprobs(x, [4, 7, 9], top=3)
    lp = torch.log_softmax(x, dim=-1)
    for j, row in enumerate(out):
        assert row["logprob"] == pytest.approx(float(lp[j, [4, 7, 9][j]]), rel=1e-6)
        assert row["top_ids"] == lp[j].topk(3).indices.tolist()
        assert row["top_logprobs"] == pytest.approx(lp[j].topk(3).values.tolist(), rel=1e-6)
    assert token_logprobs(x, [1], top=0) == [{"logprob": pytest.approx(float(lp[0, 1]), rel=1e-6)}]


@pytest.mark.model
def test_json_mask_per_row_and_min_tokens_yield_to_a_closed_object(model_dir):
    from transformers import AutoTokenizer

    from pdserve.basetypes import Guided

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = len(tok)
    params = SamplingParams(guided=Guided(kind="json_object"), min_tokens=8, max_tokens=16)
    ids = tok.encode('{"a": 1}', add_special_tokens=False)
    x = torch.randn(len(ids) + 1, vocab, generator=torch.Generator().manual_seed(6))
    p = make_processor(params, [5], [], vocab, tok, {2})
    rows = p.process(x, ids)
    for j in range(len(ids)):
        assert torch.isfinite(rows[j, ids[j]])  # the object's own next token is allowed
        assert bool(torch.isinf(rows[j, 2]))  # EOS is not, until the object is closed
    # closed before min_tokens: EOS is the only way on, and min_tokens does not cut it
    assert torch.isfinite(rows[-1]).nonzero().flatten().tolist() == [2]
    assert rows[0].isfinite().sum() < vocab // 100  # at the start: '{' and whitespace only
    # the matcher is where the committed tokens left it: masking the drafts' rows moved nothing
    again = p.process(x[:1])
    assert torch.equal(again[0].isfinite(), rows[0].isfinite())


@pytest.mark.parametrize("temperature", [0.0, 1e-300, 1e-6, 1e-5, 0.7, 100.0])
@pytest.mark.parametrize("penalties", [dict(repetition_penalty=5e-324), dict(repetition_penalty=1e-45),
                                       dict(repetition_penalty=1e-30, frequency_penalty=2.0),
                                       dict(repetition_penalty=100.0, presence_penalty=-2.0),
                                       dict(frequency_penalty=-2.0, min_tokens=2)])
def test_a_penalty_past_float32_never_picks_a_cut_token(model_dir, penalties, temperature):
    """A repetition penalty float32 rounds to 0 made x / r inf and a cut token's -inf * r NaN, and the sampler
    then chose token 0 against the grammar (schemathesis found it: `guided_choice: [""]` with
    `repetition_penalty: 5e-324` was a 503). Whatever the penalty and temperature, the processed logits hold no
    NaN, every token the grammar or min_tokens cuts stays cut, and greedy and sampled picks are allowed ones."""
    from transformers import AutoTokenizer

    from pdserve.front.guided import _choice_spec
    from pdserve.sampling import sample_next

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = len(tok)
    prompt = tok.encode("yes or no? yes", add_special_tokens=False)
    for choices in ([""], ["yes", "no"]):
        params = SamplingParams(guided=_choice_spec(choices), temperature=temperature, max_tokens=4, seed=3,
                                **penalties)
        assert params.temperature == (0.0 if temperature < 1e-5 else temperature)
        p = make_processor(params, prompt, [], vocab, tok, {2})
        x = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 8
        x[0, prompt] = 30.0  # the prompt's tokens, penalised, are the likeliest
        rows = p.process(x)
        assert not rows.isnan().any()
        allowed = set(rows[0].isfinite().nonzero().flatten().tolist())
        if choices == [""]:
            assert allowed == {2}
        for position in range(4):
            assert sample_next(rows[0], params, position, 3) in allowed
