"""Decode's plain sampled step (nothing drafted, on the CPU) against the two draws it must equal.

`DecodeWorker._verify_sampled` takes a shortcut when no row drafted anything: the race argmax(p / E)
over each row's noise for its position, batched, instead of the verification's [B, K+1, V] tensors. A
request's tokens must not depend on the path that drew them, so the shortcut must draw exactly what
plain sampling draws (`sample_next`: prefill's first token, and every token with speculation off) and
what the verification itself draws at k = 0, for every sampling option the distribution takes. Only
the rows' sampling fields, seed and position are read, so the rows here are plain stand-ins.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from pdserve.basetypes import SamplingParams
from pdserve.decode.worker import DecodeWorker
from pdserve.kernels.spec_verify import verify
from pdserve.sampling import sample_next, verification_randomness


def _rows():
    options = [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.9),
               dict(temperature=0.9, min_p=0.05), dict(temperature=1.0, top_k=50, top_p=0.8, min_p=0.01),
               dict(temperature=0.5)]
    return [SimpleNamespace(seed=1000 + 7 * i, generated=[3] * (i * 5), offer=SimpleNamespace(
        sampling=SamplingParams(max_tokens=64, **o))) for i, o in enumerate(options)]


def test_a_plain_sampled_step_draws_what_plain_sampling_and_the_verification_draw():
    vocab = 5000
    gen = torch.Generator().manual_seed(11)
    batch = _rows()
    worker = SimpleNamespace(verify_impl="reference")
    for trial in range(5):
        # peaked and flat rows alike, so the cuts (top-k, top-p, min-p) keep from a few tokens to many
        logits = [torch.randn(1, vocab, generator=gen) * (0.5 + 2 * trial) for _ in batch]
        got = DecodeWorker._verify_sampled(worker, batch, [None] * len(batch), logits)
        plain = [[sample_next(x[0], s.offer.sampling, len(s.generated), s.seed)] for s, x in zip(batch, logits)]
        assert got == plain
        noise = torch.cat([verification_randomness(s.seed, len(s.generated), 0, vocab)[1] for s in batch])
        sp = [s.offer.sampling for s in batch]
        out, n_acc = verify(torch.stack(logits), torch.zeros(len(batch), 0, dtype=torch.long),
                            torch.zeros(len(batch), dtype=torch.int32), None,
                            torch.tensor([p.temperature for p in sp]), torch.tensor([p.top_k for p in sp], dtype=torch.int32),
                            torch.tensor([p.top_p for p in sp]), torch.zeros(len(batch), 0), noise,
                            min_p=torch.tensor([p.min_p for p in sp]), impl="reference")
        assert n_acc.tolist() == [0] * len(batch)
        assert got == out.tolist()
    # the rows' tokens differ from one another: the draw is not one row's, broadcast
    assert len({t[0] for t in got}) > 1


def test_a_step_with_drafts_still_goes_through_the_verification():
    """One drafted row makes the whole call the verification's: every row then commits 1 + its accepted drafts."""
    vocab = 300
    batch = _rows()[:3]
    gen = torch.Generator().manual_seed(5)
    logits = [torch.randn(1, vocab, generator=gen), torch.randn(3, vocab, generator=gen), torch.randn(1, vocab, generator=gen)]
    drafts = [None, SimpleNamespace(token_ids=[4, 9], probs=None), None]
    got = DecodeWorker._verify_sampled(SimpleNamespace(verify_impl="reference"), batch, drafts, logits)
    assert [len(t) >= 1 for t in got] == [True] * 3 and len(got[0]) == len(got[2]) == 1 and len(got[1]) <= 3
    assert got[0] == [sample_next(logits[0][0], batch[0].offer.sampling, 0, batch[0].seed)]
