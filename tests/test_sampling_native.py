"""Sampling's native half (`kernels/cpu_sampling.c`) against its torch definition.

The noise of a position must be the same uniforms whichever side makes it (native where the kernel builds,
torch where it does not), Exp(1)-distributed and a function of (seed, position) alone; the one-pass race
must draw what the torch path draws from the same noise (`process_logits`, then argmax(p / E)) and follow
the softmax's distribution; rows with a cut, greedy rows and a row without a finite logit take torch.
"""
from __future__ import annotations

import math

import pytest
import torch

from pdserve.basetypes import SamplingParams
from pdserve.kernels import cpu_sampling
from pdserve.kernels.spec_verify import process_logits
from pdserve.sampling import exp_noise_torch, position_key, position_noise, sample_next, sample_rows

needs_kernel = pytest.mark.skipif(cpu_sampling.library() is None, reason="no C compiler: sampling runs on torch")


def _torch_draw(logits: torch.Tensor, params: list[SamplingParams], positions, seeds) -> list[int]:
    """The definition: processed distribution, the torch noise of each position, argmax(p / E)."""
    probs = process_logits(logits, torch.tensor([p.temperature for p in params]),
                           torch.tensor([p.top_k for p in params], dtype=torch.int32),
                           torch.tensor([p.top_p for p in params]),
                           torch.tensor([p.min_p for p in params]) if any(p.min_p for p in params) else None)
    noise = torch.stack([exp_noise_torch(position_key(s, t), logits.shape[1]) for s, t in zip(seeds, positions)])
    return (probs / noise).argmax(dim=-1).tolist()


@needs_kernel
def test_native_noise_is_the_torch_definition_bit_for_bit():
    """The same bits natively (vector lanes and the scalar tail) and with torch, so a worker without a
    compiler draws what one with it draws; and element j depends on (key, j) alone, not on the length."""
    for seed, position, n in ((0, 0, 17), (123456789, 41, 49152), (2 ** 62 + 5, 7, 1000), (5, 2, 200_003)):
        key = position_key(seed, position)
        native, ref = cpu_sampling.exp_noise(key, n), exp_noise_torch(key, n)
        assert native.shape == ref.shape == (n,) and bool((native > 0).all())
        assert torch.equal(native, ref)
    key = position_key(9, 3)
    assert torch.equal(cpu_sampling.exp_noise(key, 100), cpu_sampling.exp_noise(key, 5000)[:100])


def test_the_noise_log_is_within_an_ulp_of_the_library_log():
    """The written-out log (`log_positive`) against torch's over every value 1 - u takes near 0 and 1 and a
    spread between: at most one float32 ulp apart."""
    from pdserve.sampling import _log_positive

    k = torch.cat([torch.arange(1, 5000), torch.arange(16777216 - 5000, 16777217), torch.randint(
        1, 16777217, (200_000,), generator=torch.Generator().manual_seed(1))])
    x = k.to(torch.float32) / 16777216.0
    mine, lib = _log_positive(x), torch.log(x.double())
    ulp = torch.finfo(torch.float32).eps * lib.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert float(((mine.double() - lib).abs() / ulp).max()) <= 1.0


def test_the_noise_is_exp1_and_a_function_of_seed_and_position_alone():
    a = position_noise(77, 5, 200_000)
    assert torch.equal(a, position_noise(77, 5, 200_000))  # reproducible
    assert not torch.equal(a[:1000], position_noise(77, 6, 1000))  # another position, other noise
    assert not torch.equal(a[:1000], position_noise(78, 5, 1000))  # another seed, other noise
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e (200k samples: standard errors ~0.002-0.003)
    assert abs(float(a.mean()) - 1) < 0.015
    assert abs(float(a.var()) - 1) < 0.03
    assert abs(float((a > 1).float().mean()) - math.exp(-1)) < 0.006
    # uniform over the positions: no element's noise leans on its index
    assert abs(float(a[:100_000].mean()) - float(a[100_000:].mean())) < 0.03


@needs_kernel
def test_the_native_race_draws_what_the_torch_path_draws():
    gen = torch.Generator().manual_seed(3)
    for vocab, scale in ((10, 1.0), (5000, 0.3), (49152, 4.0)):
        rows = 12
        logits = torch.randn(rows, vocab, generator=gen) * scale
        params = [SamplingParams(max_tokens=8, temperature=t) for t in (1.0, 0.7, 1.3, 0.05) * 3]
        positions, seeds = list(range(rows)), [1000 + 17 * i for i in range(rows)]
        got = cpu_sampling.race(logits, torch.tensor([p.temperature for p in params]),
                                [position_key(s, t) for s, t in zip(seeds, positions)])
        assert got == _torch_draw(logits, params, positions, seeds)
        assert sample_rows(logits, params, positions, seeds) == got


def test_rows_with_a_cut_and_greedy_rows_draw_as_the_torch_definition():
    gen = torch.Generator().manual_seed(8)
    vocab = 3000
    params = [SamplingParams(max_tokens=8, **o) for o in (
        dict(temperature=1.0), dict(temperature=0.8, top_k=30), dict(temperature=1.2, top_p=0.85),
        dict(temperature=0.9, min_p=0.1), dict(temperature=0.0), dict(temperature=1.0, top_k=5, top_p=0.5))]
    for trial in range(4):
        logits = torch.randn(len(params), vocab, generator=gen) * (0.5 + trial)
        positions, seeds = [3 * trial + i for i in range(len(params))], [50 + i for i in range(len(params))]
        got = sample_rows(logits, params, positions, seeds)
        assert got == _torch_draw(logits, params, positions, seeds)
        assert got[4] == int(logits[4].argmax())  # the greedy row's one-hot
        assert got == [sample_next(logits[i], params[i], positions[i], seeds[i]) for i in range(len(params))]


@needs_kernel
def test_a_row_without_a_finite_logit_is_left_to_torch():
    x = torch.full((2, 50), float("-inf"))
    x[1, 7] = 0.0  # one finite logit: that token, always
    with pytest.raises(ValueError, match="row 0 has no finite scaled logit"):
        cpu_sampling.race(x, torch.ones(2), [1, 2])
    params = [SamplingParams(max_tokens=4, temperature=1.0)] * 2
    got = sample_rows(x, params, [0, 0], [1, 2])
    assert got[1] == 7 and got == _torch_draw(x, params, [0, 0], [1, 2])


def test_sampled_tokens_follow_the_softmax():
    """40 000 positions of one 6-token row: each token's frequency within 4.5 standard errors of its
    probability, and a chi-square of the counts under its 0.999 quantile (deterministic: the noise is a
    function of the positions)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = torch.softmax(logits[0] / 0.8, dim=-1)
    n = 40_000
    params = [SamplingParams(max_tokens=8, temperature=0.8)] * 1000
    counts = torch.zeros(6)
    for start in range(0, n, 1000):
        drawn = sample_rows(logits.expand(1000, 6), params, list(range(start, start + 1000)), [42] * 1000)
        counts += torch.bincount(torch.tensor(drawn), minlength=6).float()
    freq = counts / n
    se = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() < 4.5 * se).all()), (freq, p)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5  # chi-square with 5 degrees of freedom: 0.999 quantile
