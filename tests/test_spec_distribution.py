"""Statistical exactness of speculative sampling: verified output follows the target distribution.

Many identical requests go through the verifier (the torch reference: fast on a big batch; the kernel
is held equal to it token for token by test_kernel_spec_verify.py). The empirical distribution of the
first output token must match p = process_logits(target row 0), and the second token, given that the
first draft was accepted, must match p of row 1. A chi-square test at a small significance level
(1e-4, seeds fixed, so nothing flakes) decides; deliberately wrong verifiers must FAIL the same test.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.spec_verify import draw_randomness, process_logits, verify_reference

ALPHA = 1e-4
VOCAB = 8
SAMPLES = 120_000


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, p-value) of observed counts against probabilities; zero-probability cells must be empty."""
    counts = counts.double()
    probs = probs.double()
    support = probs > 0
    assert float(counts[~support].sum()) == 0, f"tokens outside the target's support: {counts[~support].tolist()}"
    n = counts.sum()
    expected = probs[support] / probs[support].sum() * n
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 0.0, 1.0
    # survival function of chi2(dof) = regularised upper incomplete gamma Q(dof/2, stat/2)
    pvalue = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2)
    return float(stat), float(pvalue)


def fixed_rows(seed: int, k: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k + 1, vocab, generator=g) * 1.5


def speculative_batch(seed: int, temperature: float, top_k: int, top_p: float, model_like: bool, k: int = 2,
                      samples: int = SAMPLES, per_position: bool = False):
    """SAMPLES identical requests: same target rows, drafts drawn afresh per request.

    per_position: exp_noise is [samples, k+1, V], one noise row per position (the coupled mode for
    deterministic drafts; the stop position's row for draft-model drafts).
    """
    target_rows = fixed_rows(seed, k)
    g = torch.Generator().manual_seed(seed + 50_000)  # not the target's stream: q must differ from p
    target = target_rows.expand(samples, k + 1, VOCAB)
    t = torch.full((samples,), temperature)
    tk = torch.full((samples,), top_k, dtype=torch.int32)
    tp = torch.full((samples,), top_p)
    if model_like:
        # a draft model that disagrees with the target: its own logits, its own temperature
        q_rows = torch.softmax(torch.randn(k, VOCAB, generator=g) * 1.5, -1)
        draft_probs = q_rows.expand(samples, k, VOCAB)
        drafts = torch.stack([torch.multinomial(q_rows[j], samples, replacement=True, generator=g) for j in range(k)], 1)
    else:
        # n-gram proposals: whatever token the lookup found (varies per request), q one-hot on it
        draft_probs = None
        lookup = torch.softmax(torch.randn(k, VOCAB, generator=g), -1)
        drafts = torch.stack([torch.multinomial(lookup[j], samples, replacement=True, generator=g) for j in range(k)], 1)
    u, noise = draw_randomness(samples, k, VOCAB, generator=g)
    if per_position:
        noise = draw_randomness(samples * (k + 1), 0, VOCAB, generator=g)[1].view(samples, k + 1, VOCAB)
    num_draft = torch.full((samples,), k, dtype=torch.int32)
    case = (target, drafts, num_draft, draft_probs, t, tk, tp, u, noise)
    p = process_logits(target_rows, torch.full((k + 1,), temperature), torch.full((k + 1,), top_k, dtype=torch.int32),
                       torch.full((k + 1,), top_p))
    return case, p


CONFIGS = [
    # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.6, 0, 1.0),
    (1.7, 0, 1.0),
    (1.0, 0, 0.7),
    (0.8, 4, 0.9),
]


@pytest.mark.parametrize("per_position", [False, True], ids=["one-noise-row", "per-position-noise"])
@pytest.mark.parametrize("model_like", [False, True], ids=["deterministic-draft", "model-draft"])
@pytest.mark.parametrize("temperature,top_k,top_p", CONFIGS)
def test_first_and_second_token_follow_target(temperature, top_k, top_p, model_like, per_position):
    # deterministic drafts with per-position noise are the coupled mode
    seed = 1000 + CONFIGS.index((temperature, top_k, top_p)) * 2 + model_like
    case, p = speculative_batch(seed, temperature, top_k, top_p, model_like, per_position=per_position)
    out, num_acc = verify_reference(*case)
    # the first emitted token is distributed as p_0 whatever happened to the drafts
    _, pv = chi_square_pvalue(torch.bincount(out[:, 0], minlength=VOCAB), p[0])
    assert pv > ALPHA, f"first token deviates from the target distribution (p-value {pv:.2e})"
    # given the first draft was accepted, the next token is distributed as p_1
    cont = num_acc >= 1
    assert int(cont.sum()) > 5_000  # enough continuations to test
    _, pv = chi_square_pvalue(torch.bincount(out[cont, 1], minlength=VOCAB), p[1])
    assert pv > ALPHA, f"second token deviates from the target distribution (p-value {pv:.2e})"
    # acceptance happened and was not universal: both branches were exercised
    assert 0.05 < float(cont.double().mean()) < 0.98


def residual_without_q(target, drafts, num_draft, draft_probs, temperature, top_k, top_p, uniform, noise):
    """WRONG: on rejection samples from p instead of max(0, p - q) (first token only)."""
    b, k1, vocab = target.shape
    p0 = process_logits(target[:, 0], temperature, top_k, top_p)
    x = drafts[:, 0]
    q_x = torch.ones(b) if draft_probs is None else draft_probs[:, 0].gather(1, x[:, None])[:, 0]
    accept = uniform[:, 0] * q_x < p0.gather(1, x[:, None])[:, 0]
    return torch.where(accept, x, (p0 / noise).argmax(-1))


def accept_always(target, drafts, *args):
    """WRONG: takes every draft."""
    return drafts[:, 0]


def ratio_without_q(target, drafts, num_draft, draft_probs, temperature, top_k, top_p, uniform, noise):
    """WRONG: accepts with probability p(x) instead of min(1, p/q), residual correct."""
    b, k1, vocab = target.shape
    p0 = process_logits(target[:, 0], temperature, top_k, top_p)
    x = drafts[:, 0]
    accept = uniform[:, 0] < p0.gather(1, x[:, None])[:, 0]
    q0 = draft_probs[:, 0] if draft_probs is not None else torch.nn.functional.one_hot(x, vocab).float()
    residual = (p0 - q0).clamp_min(0)
    return torch.where(accept, x, (residual / noise).argmax(-1))


def coupled_fresh_race_on_rejection(target, drafts, num_draft, draft_probs, temperature, top_k, top_p, uniform, noise):
    """WRONG coupled verifier: accepts iff the draft wins the race, but on rejection draws again from p with
    the next row's noise (a fresh sample that may be the rejected token: P(x) = p(x) + (1 - p(x)) p(x))."""
    p0 = process_logits(target[:, 0], temperature, top_k, top_p)
    x = drafts[:, 0]
    winner = (p0 / noise[:, 0]).argmax(-1)
    return torch.where(winner == x, x, (p0 / noise[:, 1]).argmax(-1))


def coupled_shared_noise(target, drafts, num_draft, draft_probs, temperature, top_k, top_p, uniform, noise):
    """WRONG coupled verifier: one noise row for every position. The first token is exact; the second, given
    the first draft won, is biased (the shared noise that made x_0 win leans towards x_0 again)."""
    b, k1, vocab = target.shape
    p = process_logits(target.reshape(-1, vocab), temperature.repeat_interleave(k1), top_k.repeat_interleave(k1),
                       top_p.repeat_interleave(k1)).view(b, k1, vocab)
    winners = (p / noise[:, :1]).argmax(-1)  # [b, k1], row 0's noise everywhere
    out = torch.full((b, k1), -1, dtype=torch.int64)
    out[:, 0] = winners[:, 0]
    accepted = winners[:, 0] == drafts[:, 0]
    out[accepted, 1] = winners[accepted, 1]
    return out, accepted.to(torch.int32)


@pytest.mark.parametrize("wrong", [coupled_fresh_race_on_rejection, coupled_shared_noise], ids=lambda f: f.__name__)
def test_wrong_coupled_verifiers_fail_the_same_test(wrong):
    # the same draft lookup and target as the passing coupled case, with the per-position noise it gets
    case, p = speculative_batch(2077, 1.0, 0, 1.0, model_like=False, per_position=True)
    result = wrong(*case)
    if isinstance(result, tuple):
        # the second token given an accepted first draft (the first token of this one is right)
        out, num_acc = result
        cont = num_acc >= 1
        assert int(cont.sum()) > 5_000
        _, pv0 = chi_square_pvalue(torch.bincount(out[:, 0], minlength=VOCAB), p[0])
        assert pv0 > ALPHA  # it fails where it should, not somewhere else
        stat, pv = chi_square_pvalue(torch.bincount(out[cont, 1], minlength=VOCAB), p[1])
    else:
        stat, pv = chi_square_pvalue(torch.bincount(result, minlength=VOCAB), p[0])
    assert pv < ALPHA, f"{wrong.__name__} passed the exactness test (statistic {stat:.1f}, p-value {pv:.2e})"
    # and the right coupled verifier passes on the very same inputs
    out, num_acc = verify_reference(*case)
    assert chi_square_pvalue(torch.bincount(out[:, 0], minlength=VOCAB), p[0])[1] > ALPHA
    cont = num_acc >= 1
    assert chi_square_pvalue(torch.bincount(out[cont, 1], minlength=VOCAB), p[1])[1] > ALPHA


@pytest.mark.parametrize("wrong,model_like", [
    (residual_without_q, False), (residual_without_q, True), (accept_always, False), (accept_always, True),
    (ratio_without_q, True),  # with a one-hot q, p(x) IS min(1, p/q): only a model draft can tell
], ids=lambda v: v.__name__ if callable(v) else ("model-draft" if v else "deterministic-draft"))
def test_wrong_verifiers_fail_the_same_test(wrong, model_like):
    case, p = speculative_batch(77 + model_like, 1.0, 0, 1.0, model_like)
    first = wrong(*case)
    stat, pv = chi_square_pvalue(torch.bincount(first, minlength=VOCAB), p[0])
    assert pv < ALPHA, f"{wrong.__name__} passed the exactness test (statistic {stat:.1f}, p-value {pv:.2e})"


def test_chi_square_pvalue_calibration():
    # chi2 with 1 dof: statistic 3.841 is the 5% point, 15.137 the 1e-4 point
    counts = torch.tensor([50.0 + 3.841 ** 0.5 * 50 ** 0.5 / 2 ** 0.5, 50.0 - 3.841 ** 0.5 * 50 ** 0.5 / 2 ** 0.5])
    stat, pv = chi_square_pvalue(counts, torch.tensor([0.5, 0.5]))
    assert abs(stat - 3.841) < 1e-3 and abs(pv - 0.05) < 1e-3
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    counts = torch.bincount(torch.multinomial(probs, 50_000, replacement=True, generator=g), minlength=4)
    assert chi_square_pvalue(counts, probs)[1] > ALPHA
    assert chi_square_pvalue(counts, torch.tensor([0.11, 0.2, 0.3, 0.39]))[1] < ALPHA


@pytest.mark.model
def test_real_model_first_token_follows_target(model_dir):
    """SmolLM2's own next-token distribution as p, another prompt's as the draft q.

    The vocabulary is cut to the target's 1,024 most likely tokens plus the draft's 256 (renormalised by
    the verifier as any logits would be): the cost of the reference is samples x vocabulary, and the
    full 49,152 would take minutes here; the kernel's full-vocabulary path is covered token for token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def next_logits(prompt: str) -> torch.Tensor:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            return model(ids).logits[0, -1].float()

    full_target = next_logits("My favourite colour is")
    full_draft = next_logits("The weather today is")
    kept = torch.unique(torch.cat([full_target.topk(1024).indices, full_draft.topk(256).indices]))
    target_row, draft_row = full_target[kept], full_draft[kept]
    vocab = target_row.numel()
    temperature = 1.2
    one = lambda v, dtype=torch.float32: torch.full((1,), v, dtype=dtype)  # noqa: E731
    p = process_logits(target_row[None], one(temperature), one(0, torch.int32), one(1.0))[0]
    q = process_logits(draft_row[None], one(1.0), one(0, torch.int32), one(1.0))[0]

    # cells: the target's 12 most likely tokens, the draft's 6 most likely, everything else
    cells = torch.unique(torch.cat([p.topk(12).indices, q.topk(6).indices]))
    cell_of = torch.full((vocab,), len(cells), dtype=torch.int64)
    cell_of[cells] = torch.arange(len(cells))
    p_cells = torch.cat([p[cells], (1 - p[cells].sum()).clamp_min(0)[None]])

    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(len(cells) + 1, dtype=torch.int64)
    accepted = 0
    chunk, chunks = 4_000, 5
    target = torch.stack([target_row, target_row]).expand(chunk, 2, vocab)  # row 1 is the bonus row
    draft_probs = q[None, None].expand(chunk, 1, vocab)
    for _ in range(chunks):
        drafts = torch.multinomial(q, chunk, replacement=True, generator=g)[:, None]
        u, noise = draw_randomness(chunk, 1, vocab, generator=g)
        out, num_acc = verify_reference(target, drafts, torch.ones(chunk, dtype=torch.int32), draft_probs,
                                        torch.full((chunk,), temperature), torch.zeros(chunk, dtype=torch.int32),
                                        torch.ones(chunk), u, noise)
        counts += torch.bincount(cell_of[out[:, 0]], minlength=len(cells) + 1)
        accepted += int(num_acc.sum())
    stat, pv = chi_square_pvalue(counts, p_cells)
    assert pv > ALPHA, f"real-model first token deviates from p (statistic {stat:.1f}, p-value {pv:.2e})"
    # the draft is a different prompt: some but not all drafts survive
    assert 0.01 < accepted / (chunk * chunks) < 0.95
    # and the test has power: the draft's own distribution is rejected on the same cells
    q_cells = torch.cat([q[cells], (1 - q[cells].sum()).clamp_min(0)[None]])
    assert chi_square_pvalue(counts, q_cells)[1] < ALPHA
