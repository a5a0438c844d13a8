"""The fused speculative-verification kernel (Triton interpreter) against its torch reference, plus semantics."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.spec_verify import (
    draw_randomness,
    process_logits,
    verify,
    verify_greedy,
    verify_reference,
    verify_triton,
)

TEMPS = (0.0, 0.5, 1.0, 1.7)


def make_case(seed: int, batch: int, k: int, vocab: int, *, with_q: bool, top_k_on: bool, top_p_on: bool,
              temps=TEMPS, full: bool = False):
    """Random but realistic inputs: drafts that the target often (not always) agrees with, ragged k."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=g) * 2.5
    num_draft = torch.full((batch,), k, dtype=torch.int32) if full else torch.randint(0, k + 1, (batch,), generator=g, dtype=torch.int32)
    temperature = torch.tensor([temps[(seed + i) % len(temps)] for i in range(batch)], dtype=torch.float32)
    top_k = torch.randint(1, max(2, vocab // 3), (batch,), generator=g, dtype=torch.int32) if top_k_on else torch.zeros(batch, dtype=torch.int32)
    if top_k_on:
        top_k[0] = 0  # one row off inside the same launch
    top_p = (torch.rand(batch, generator=g) * 0.8 + 0.15) if top_p_on else torch.ones(batch)
    if top_p_on:
        top_p[-1] = 1.0
    draft_probs = None
    if k == 0:
        drafts = torch.zeros(batch, 0, dtype=torch.int64)
        if with_q:
            draft_probs = torch.zeros(batch, 0, vocab)
    elif with_q:
        # a draft model: the target's logits plus noise, processed at its own temperature, then sampled
        draft_logits = target[:, :k] + torch.randn(batch, k, vocab, generator=g) * 1.5
        draft_probs = process_logits(draft_logits.reshape(-1, vocab), torch.full((batch * k,), 0.9),
                                     torch.zeros(batch * k, dtype=torch.int32), torch.ones(batch * k)).view(batch, k, vocab)
        drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).view(batch, k)
    else:
        # n-gram-like: the target's argmax half the time, a random token otherwise
        agree = torch.rand(batch, k, generator=g) < 0.6
        drafts = torch.where(agree, target[:, :k].argmax(-1), torch.randint(0, vocab, (batch, k), generator=g))
    uniform, noise = draw_randomness(batch, k, vocab, generator=g)
    return (target, drafts, num_draft, draft_probs, temperature, top_k, top_p, uniform, noise)


def check_output_shape(case, out, num_acc):
    target, drafts, num_draft = case[0], case[1], case[2]
    batch, k1, vocab = target.shape
    assert out.shape == (batch, k1) and out.dtype == torch.int64
    assert num_acc.shape == (batch,) and num_acc.dtype == torch.int32
    for b in range(batch):
        a = int(num_acc[b])
        assert 0 <= a <= int(num_draft[b])
        assert torch.equal(out[b, :a], drafts[b, :a])
        assert 0 <= int(out[b, a]) < vocab
        assert bool((out[b, a + 1:] == -1).all())


def assert_same(case):
    ref = verify_reference(*case)
    tri = verify_triton(*case)
    check_output_shape(case, *ref)
    assert torch.equal(tri[1], ref[1]), f"num_accepted differs: triton {tri[1].tolist()} reference {ref[1].tolist()}"
    assert torch.equal(tri[0], ref[0]), f"tokens differ:\ntriton {tri[0].tolist()}\nreference {ref[0].tolist()}"
    return ref


CASES = [
    # (batch, k, vocab)
    (1, 0, 7), (2, 3, 7), (6, 5, 7),
    (1, 4, 100), (5, 5, 100), (6, 1, 100),
    (3, 2, 1000), (4, 5, 1000),
]


@pytest.mark.parametrize("with_q", [False, True], ids=["deterministic", "draft-probs"])
@pytest.mark.parametrize("filters", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "top-k", "top-p", "top-k+top-p"])
@pytest.mark.parametrize("batch,k,vocab", CASES)
def test_triton_matches_reference(batch, k, vocab, filters, with_q):
    seed = hash((batch, k, vocab, filters, with_q)) % 10_000
    case = make_case(seed, batch, k, vocab, with_q=with_q, top_k_on=filters[0], top_p_on=filters[1])
    assert_same(case)


@pytest.mark.parametrize("with_q", [False, True], ids=["deterministic", "draft-probs"])
def test_triton_matches_reference_large_vocab(with_q):
    # SmolLM2's vocabulary: the kernel loops over several BLOCK_V chunks and bisects top-k / top-p
    case = make_case(11 + with_q, 2, 2, 49_152, with_q=with_q, top_k_on=True, top_p_on=True, temps=(1.0, 0.7), full=True)
    case[5][:] = torch.tensor([50, 0], dtype=torch.int32)
    case[6][:] = torch.tensor([0.9, 0.8])
    assert_same(case)


def test_triton_small_blocks_cross_block_boundaries():
    # BLOCK_V far below V: argmax ties across blocks, bisection sums across blocks
    case = make_case(5, 2, 2, 300, with_q=True, top_k_on=True, top_p_on=True, temps=(1.0, 0.0))
    case[0][1, :, 7] = case[0][1, :, 200] = case[0][1].max() + 1.0  # a greedy tie in two different blocks
    ref = verify_reference(*case)
    tri = verify_triton(*case, block_v=64)
    assert int(ref[0][1, int(ref[1][1])]) == 7
    assert torch.equal(tri[0], ref[0]) and torch.equal(tri[1], ref[1])


def greedy_oracle(target, drafts, num_draft):
    """Plain greedy decoding, one request and one position at a time."""
    out = []
    for b in range(target.shape[0]):
        tokens = []
        for j in range(int(num_draft[b]) + 1):
            best = int(target[b, j].argmax())
            if j < int(num_draft[b]) and int(drafts[b, j]) == best:
                tokens.append(best)
                continue
            tokens.append(best)
            break
        out.append(tokens)
    return out


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_greedy_equals_plain_greedy(impl):
    case = list(make_case(3, 6, 5, 100, with_q=True, top_k_on=True, top_p_on=True, temps=(0.0,)))
    target = case[0]
    # ties on the max: argmax must pick the first index, as torch.argmax does
    target[0, :, 10] = target[0, :, 60] = target[0].max() + 1.0
    case[1][0] = 10
    expected = greedy_oracle(target, case[1], case[2])
    out, num_acc = verify(*case, impl=impl)
    for b, tokens in enumerate(expected):
        assert int(num_acc[b]) == len(tokens) - 1
        assert out[b, : len(tokens)].tolist() == tokens
    assert int(num_acc[0]) == int(case[2][0])  # request 0 drafted the tied argmax everywhere


@pytest.mark.parametrize("seed", range(6))
def test_verify_greedy_is_the_greedy_rule_of_verify(seed):
    # the decode worker's per-row greedy path must commit exactly what the batch verifier does
    batch, k, vocab = 5, 6, 64
    case = list(make_case(seed, batch, k, vocab, with_q=False, top_k_on=False, top_p_on=False, temps=(0.0,)))
    target, drafts, num = case[0], case[1], case[2]
    # drafts the target agrees with for a while, and a tie on the max (first index wins)
    agree = target.argmax(dim=-1)[:, :k]
    drafts[:, :3] = agree[:, :3]
    target[1, :, 7] = target[1, :, 40] = target[1].max() + 1.0
    drafts[1] = 7
    out, num_acc = verify_reference(*case)
    for b in range(batch):
        kb = int(num[b])
        tokens = verify_greedy(target[b, : kb + 1], drafts[b, :kb].tolist())
        assert tokens == out[b, : int(num_acc[b]) + 1].tolist()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_greedy_ignores_q_and_randomness(impl):
    case = list(make_case(4, 3, 4, 100, with_q=True, top_k_on=True, top_p_on=True, temps=(0.0,), full=True))
    first = verify(*case, impl=impl)
    g = torch.Generator().manual_seed(99)
    case[7], case[8] = draw_randomness(3, 4, 100, generator=g)
    case[3] = torch.softmax(torch.randn(3, 4, 100, generator=g), -1)
    second = verify(*case, impl=impl)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_k_zero_samples_bonus_from_row_zero(impl):
    case = make_case(7, 5, 0, 100, with_q=False, top_k_on=False, top_p_on=False)
    out, num_acc = verify(*case, impl=impl)
    assert out.shape == (5, 1) and num_acc.tolist() == [0] * 5
    target, temperature, noise = case[0], case[4], case[8]
    for b in range(5):
        if float(temperature[b]) <= 0:
            expected = int(target[b, 0].argmax())
        else:
            expected = int((torch.softmax(target[b, 0] / temperature[b], -1) / noise[b]).argmax())
        assert int(out[b, 0]) == expected


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("with_q", [False, True], ids=["deterministic", "draft-probs"])
def test_all_accepted_then_bonus(impl, with_q):
    case = list(make_case(8, 4, 3, 100, with_q=with_q, top_k_on=False, top_p_on=False, temps=(1.0, 0.5), full=True))
    case[7] = torch.zeros_like(case[7])  # u = 0 accepts any draft with p > 0 (no filters: all p > 0)
    out, num_acc = verify(*case, impl=impl)
    assert num_acc.tolist() == [3] * 4
    assert torch.equal(out[:, :3], case[1])
    for b in range(4):
        bonus = torch.softmax(case[0][b, 3] / case[4][b], -1)
        assert int(out[b, 3]) == int((bonus / case[8][b]).argmax())


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_tiny_top_p_is_argmax(impl):
    # top_p -> 0 keeps only the most likely token: sampling becomes greedy, whatever the noise
    case = list(make_case(9, 4, 3, 100, with_q=False, top_k_on=False, top_p_on=True, temps=(0.8, 1.3)))
    case[6] = torch.full((4,), 1e-6)
    out, num_acc = verify(*case, impl=impl)
    greedy_case = list(case)
    greedy_case[4] = torch.zeros(4)
    g_out, g_acc = verify(*greedy_case, impl="reference")
    assert torch.equal(out, g_out) and torch.equal(num_acc, g_acc)


def test_rejection_uses_residual_not_drafted_token():
    # deterministic draft rejected: the residual max(0, p - onehot) never re-emits the drafted token
    vocab, n = 5, 12
    target = torch.zeros(n, 2, vocab)
    target[:, 0] = torch.tensor([2.0, 1.0, 0.0, 0.0, 0.0])
    drafts = torch.zeros(n, 1, dtype=torch.int64)  # token 0, p(0) ~ 0.6
    g = torch.Generator().manual_seed(0)
    u, noise = draw_randomness(n, 1, vocab, generator=g)
    u[:] = 0.999  # always rejected
    case = (target, drafts, torch.ones(n, dtype=torch.int32), None, torch.ones(n), torch.zeros(n, dtype=torch.int32),
            torch.ones(n), u, noise)
    for impl in ("reference", "triton"):
        out, num_acc = verify(*case, impl=impl)
        assert num_acc.tolist() == [0] * n
        assert bool((out[:, 0] != 0).all()) and bool((out[:, 1] == -1).all())


def brute_force_filter(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep-mask of one scaled-logit row straight from the written definitions (O(V^2), tiny V)."""
    vocab = x.numel()
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        keep = x >= kth
    if top_p < 1.0:
        p = torch.softmax(torch.where(keep, x, torch.tensor(float("-inf"))).double(), -1)
        candidates = [t for t in p.tolist() if t > 0]
        # the largest threshold whose kept mass reaches top_p
        best = max(t for t in candidates if float(p[p >= t].sum()) >= top_p - 1e-12)
        keep = keep & (p >= best)
    return keep


def test_process_logits_thresholds_against_definition():
    g = torch.Generator().manual_seed(1)
    for trial in range(60):
        vocab = int(torch.randint(2, 12, (1,), generator=g))
        # integers make exact ties common: ties at the top-k and top-p boundary must be kept
        x = torch.randint(-3, 3, (vocab,), generator=g).float()
        top_k = int(torch.randint(0, vocab + 1, (1,), generator=g))
        top_p = [1.0, 0.3, 0.5, 0.9, 1e-6][trial % 5]
        probs = process_logits(x[None], torch.ones(1), torch.tensor([top_k]), torch.tensor([top_p]))[0]
        keep = brute_force_filter(x, top_k, top_p)
        assert torch.equal(probs > 0, keep), (x.tolist(), top_k, top_p, probs.tolist())
        expected = torch.softmax(torch.where(keep, x, torch.tensor(float("-inf"))), -1)
        assert torch.allclose(probs, expected, atol=1e-6)


def test_process_logits_greedy_is_one_hot_on_first_argmax():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    probs = process_logits(x, torch.zeros(1), torch.zeros(1, dtype=torch.int32), torch.ones(1))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_draw_randomness_shapes_and_support():
    g = torch.Generator().manual_seed(0)
    u, e = draw_randomness(3, 4, 1000, generator=g)
    assert u.shape == (3, 4) and e.shape == (3, 1000)
    assert bool(((u >= 0) & (u < 1)).all()) and bool((e > 0).all())
    assert abs(float(e.mean()) - 1.0) < 0.05  # Exp(1)


def test_shape_mismatch_is_a_clear_error():
    case = list(make_case(0, 2, 2, 10, with_q=True, top_k_on=False, top_p_on=False))
    case[8] = case[8][:, :5]
    with pytest.raises(ValueError, match="exp_noise"):
        verify(*case, impl="reference")
    with pytest.raises(ValueError, match="impl"):
        verify(*make_case(0, 2, 2, 10, with_q=True, top_k_on=False, top_p_on=False), impl="cuda-graph")


def test_auto_picks_triton_under_the_interpreter():
    case = make_case(2, 3, 2, 50, with_q=True, top_k_on=True, top_p_on=True)
    out, num_acc = verify(*case)
    ref = verify_reference(*case)
    assert torch.equal(out, ref[0]) and torch.equal(num_acc, ref[1])


@pytest.mark.parametrize("filters", [(False, False), (True, True)], ids=["plain", "top-k+top-p"])
def test_masked_vocabulary_minus_inf_logits(filters):
    # models mask padded / banned tokens with -inf: they must never be emitted, and top-k larger than the
    # number of finite logits must keep exactly the finite ones
    case = list(make_case(21, 4, 3, 100, with_q=True, top_k_on=filters[0], top_p_on=filters[1], temps=(1.0, 0.0, 0.6)))
    case[0][:, :, 60:] = float("-inf")
    if filters[0]:
        case[5][1:] = torch.tensor([70, 5, 99], dtype=torch.int32)
    ref = assert_same(tuple(case))
    out = ref[0]
    assert bool(((out < 60) | (out == -1)).all())


# --------------------------------------------------------------------------------------------------
# Per-position noise [B, K+1, V]: the coupled mode for point-mass drafts of sampled requests
# --------------------------------------------------------------------------------------------------


def with_position_noise(case, seed: int):
    """The same case with per-position Exp(1) noise [B, K+1, V] instead of one row per request."""
    target = case[0]
    batch, k1, vocab = target.shape
    _, noise = draw_randomness(batch * k1, 0, vocab, generator=torch.Generator().manual_seed(seed))
    return (*case[:8], noise.view(batch, k1, vocab))


@pytest.mark.parametrize("with_q", [False, True], ids=["coupled", "draft-probs"])
@pytest.mark.parametrize("filters", [(False, False), (True, True)], ids=["plain", "top-k+top-p"])
@pytest.mark.parametrize("batch,k,vocab", [(1, 0, 7), (6, 5, 7), (5, 5, 100), (6, 1, 100), (4, 5, 1000)])
def test_triton_matches_reference_per_position_noise(batch, k, vocab, filters, with_q):
    seed = hash((batch, k, vocab, filters, with_q, "per-position")) % 10_000
    case = with_position_noise(make_case(seed, batch, k, vocab, with_q=with_q, top_k_on=filters[0], top_p_on=filters[1]), seed + 1)
    assert_same(case)


def test_triton_matches_reference_per_position_noise_small_blocks():
    case = with_position_noise(make_case(8, 4, 4, 300, with_q=False, top_k_on=True, top_p_on=True, temps=(1.0, 0.0, 0.6)), 9)
    ref = verify_reference(*case)
    tri = verify_triton(*case, block_v=64)
    assert torch.equal(tri[0], ref[0]) and torch.equal(tri[1], ref[1])


def coupled_batch(seed: int, batch: int, k: int, vocab: int):
    """Sampled and greedy requests with their own (seed, start position); per-position noise from pdserve.sampling.

    Drafts are the plain-sampling token at the position most of the time (so runs of acceptances happen),
    a random token otherwise; num_draft is ragged.
    """
    from pdserve.basetypes import SamplingParams
    from pdserve.sampling import position_noise, sample_next

    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=g) * 2.0
    num_draft = torch.randint(0, k + 1, (batch,), generator=g, dtype=torch.int32)
    num_draft[0] = k
    settings = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.0, 0, 1.0), (0.9, 8, 0.8)]
    params = [SamplingParams(temperature=t, top_k=tk, top_p=tp) for t, tk, tp in (settings[(seed + b) % len(settings)] for b in range(batch))]
    seeds = [int(torch.randint(0, 2**31, (1,), generator=g)) for _ in range(batch)]
    starts = [int(torch.randint(0, 50, (1,), generator=g)) for _ in range(batch)]
    plain = [[sample_next(target[b, j], params[b], starts[b] + j, seeds[b]) for j in range(k + 1)] for b in range(batch)]
    agree = torch.rand(batch, k, generator=g) < 0.7
    drafts = torch.where(agree, torch.tensor([row[:k] for row in plain], dtype=torch.int64).view(batch, k),
                         torch.randint(0, vocab, (batch, k), generator=g))
    num_draft[1] = max(1, int(num_draft[1]))
    drafts[1, 0] = (plain[1][0] + 1) % vocab  # one certain rejection at position 0
    noise = torch.stack([torch.stack([position_noise(seeds[b], starts[b] + j, vocab) for j in range(k + 1)]) for b in range(batch)])
    case = (target, drafts, num_draft, None, torch.tensor([p.temperature for p in params]),
            torch.tensor([p.top_k for p in params], dtype=torch.int32), torch.tensor([p.top_p for p in params]),
            torch.rand(batch, k, generator=g), noise)
    # what plain sampling emits while each draft token matches: the accepted drafts, then the first differing token
    expected = []
    for b in range(batch):
        row = []
        for j in range(int(num_draft[b]) + 1):
            row.append(plain[b][j])
            if j == int(num_draft[b]) or plain[b][j] != int(drafts[b, j]):
                break
        expected.append(row)
    return case, expected


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("seed,batch,k,vocab", [(0, 5, 4, 50), (1, 6, 3, 300), (2, 4, 6, 20)])
def test_coupled_rows_reproduce_plain_sampling(impl, seed, batch, k, vocab):
    case, expected = coupled_batch(seed, batch, k, vocab)
    out, num_acc = verify(*case, impl=impl)
    check_output_shape(case, out, num_acc)
    got = [out[b, : int(num_acc[b]) + 1].tolist() for b in range(batch)]
    assert got == expected
    assert any(len(row) > 1 for row in expected) and any(len(row) <= int(case[2][b]) for b, row in enumerate(expected))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_coupled_rows_ignore_uniform_accept(impl):
    case, expected = coupled_batch(3, 5, 4, 40)
    for u in (0.0, 0.999999):
        case = (*case[:7], torch.full_like(case[7], u), case[8])
        out, num_acc = verify(*case, impl=impl)
        assert [out[b, : int(num_acc[b]) + 1].tolist() for b in range(5)] == expected


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_draft_probs_rows_sample_from_the_noise_of_their_stop_position(impl):
    # a draft model whose q puts nothing on the target's support past position 0: every row is rejected at
    # position 1 (or takes the bonus at 1 when k = 1) and its token is the race over row 1's noise only
    vocab, k = 12, 3
    g = torch.Generator().manual_seed(4)
    target = torch.randn(3, k + 1, vocab, generator=g)
    target[:, 1:, 6:] = float("-inf")  # p_j for j >= 1 lives on tokens 0..5
    drafts = torch.full((3, k), 9, dtype=torch.int64)
    drafts[:, 0] = target[:, 0].argmax(-1)
    q = torch.zeros(3, k, vocab)
    q[torch.arange(3)[:, None], torch.arange(k)[None, :], drafts] = 1.0
    num_draft = torch.tensor([3, 1, 2], dtype=torch.int32)
    noise = draw_randomness(3 * (k + 1), 0, vocab, generator=g)[1].view(3, k + 1, vocab)
    case = (target, drafts, num_draft, q, torch.ones(3), torch.zeros(3, dtype=torch.int32), torch.ones(3),
            torch.zeros(3, k), noise)  # u = 0: the first draft is always accepted (p > 0)
    out, num_acc = verify(*case, impl=impl)
    assert num_acc.tolist() == [1, 1, 1]
    p1 = process_logits(target[:, 1], torch.ones(3), torch.zeros(3, dtype=torch.int32), torch.ones(3))
    # residual max(0, p - q) = p here (q sits on token 9, outside p's support)
    assert out[:, 1].tolist() == (p1 / noise[:, 1]).argmax(-1).tolist()


def test_per_position_noise_shape_is_checked():
    case = make_case(0, 2, 2, 10, with_q=False, top_k_on=False, top_p_on=False)
    bad = (*case[:8], torch.ones(2, 2, 10))  # K rows, not K+1
    with pytest.raises(ValueError, match="exp_noise"):
        verify(*bad, impl="reference")


@pytest.mark.parametrize("with_q", [False, True], ids=["deterministic", "draft-probs"])
@pytest.mark.parametrize("filters", [(False, False), (True, True)], ids=["min-p", "min-p+top-k+top-p"])
@pytest.mark.parametrize("batch,k,vocab", [(4, 3, 100), (3, 2, 1000)])
def test_triton_matches_reference_with_min_p(batch, k, vocab, filters, with_q):
    """min-p cuts inside the same launch as top-k / top-p, a row with it off among rows with it on,
    and -inf logits (what a format mask or min_tokens leave) in some rows."""
    seed = hash(("min_p", batch, k, vocab, filters, with_q)) % 10_000
    case = make_case(seed, batch, k, vocab, with_q=with_q, top_k_on=filters[0], top_p_on=filters[1],
                     temps=(0.7, 1.0, 0.0, 1.3))
    case[0][1, :, : vocab // 2] = float("-inf")
    min_p = torch.tensor([0.05, 0.2, 0.1, 0.0][:batch] + [0.3] * max(0, batch - 4))
    ref = verify_reference(*case, min_p=min_p)
    tri = verify_triton(*case, min_p=min_p)
    check_output_shape(case, *ref)
    assert torch.equal(tri[1], ref[1]) and torch.equal(tri[0], ref[0]), (tri, ref)


def test_min_p_keeps_what_is_at_least_min_p_of_the_most_likely():
    """The definition (vLLM's, and transformers' MinPLogitsWarper): after temperature, tokens with
    p < min_p * max(p) are cut, the rest renormalised."""
    from transformers.generation.logits_process import MinPLogitsWarper

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 500, generator=g) * 3
    x[2, 100:] = float("-inf")
    for min_p in (0.01, 0.1, 0.5, 1.0):
        for t in (0.6, 1.0):
            ours = process_logits(x, torch.full((4,), t), torch.zeros(4, dtype=torch.int32), torch.ones(4),
                                  torch.full((4,), min_p))
            hf = torch.softmax(MinPLogitsWarper(min_p, min_tokens_to_keep=1)(None, x / t), dim=-1)
            torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-7)
    off = process_logits(x, torch.ones(4), torch.zeros(4, dtype=torch.int32), torch.ones(4), torch.zeros(4))
    torch.testing.assert_close(off, process_logits(x, torch.ones(4), torch.zeros(4, dtype=torch.int32), torch.ones(4)))
