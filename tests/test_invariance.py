"""Same request, same answer, at bfloat16 and float32: a sequence's logits are the same bits however the engine computed it.

On the native decoder (AVX512-BF16 or AVX2 + FMA; float32: AVX2 + FMA), every reduction of a row is fixed by its
position alone: the GEMV sums each output in input order whatever the row count, the attention of a prompt
chunk's row scores its keys in the decode kernel's order (`cpu_chunk_attention.c`; in float32 every row takes
the decode kernel), the norms and softmax reduce in fixed trees.
So a prompt computed in one step, in chunks of 17 or 64 (crossing the 16-row tiles and the KV blocks), behind a
cached prefix, or in the same step as another sequence's decode row gives the same logits, and so does a decode
row alone or in a batch of 3, 16 or 64. Token ids follow from logits, so these compare the logits themselves:
a difference in the last bit fails here before it flips a token. bench/determinism.py measures the same paths
over 100 prompts, greedy tokens.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def runner(model_dir, request):
    from pdserve.engine.runner import PagedRunner

    torch.set_num_threads(1)
    r = PagedRunner(model_dir, dtype=getattr(torch, request.param), num_blocks=1024)
    if not r.native_rows():
        pytest.skip(f"no native {request.param} decoder on this CPU: transformers' forward serves, and its GEMMs "
                    "are not row-invariant")
    return r


def _prompt(r, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(r.vocab_size, 49152), (n,), generator=g).tolist()


def _decode(r, sid, token: int, steps: int) -> list[torch.Tensor]:
    out = []
    for _ in range(steps):
        (lg,) = r.step([(sid, [token])])
        out.append(lg[-1])
        token = int(lg[-1].argmax())
    return out


@pytest.mark.parametrize("n", [150, 261])
def test_a_prompt_gets_the_same_logits_however_it_was_split_cached_or_batched(runner, n):
    r = runner
    prompt = _prompt(r, n, seed=n)
    r.prefill("filler", _prompt(r, 60, seed=1), reuse_prefix=False)
    paths = {}
    try:
        ref = r.prefill(("alone", n), prompt, reuse_prefix=False)
        paths["chunk17"] = r.prefill(("chunk17", n), prompt, chunk_size=17, reuse_prefix=False)
        paths["chunk64"] = r.prefill(("chunk64", n), prompt, chunk_size=64, reuse_prefix=False)
        paths["cached"] = r.prefill(("cached", n), prompt)  # its leading whole blocks from the prefix cache
        r.start(("mixed", n), prompt, reuse_prefix=False)  # the whole prompt in one step beside a decode row
        paths["mixed"] = r.step([("filler", [500]), (("mixed", n), prompt)], last_only=True)[1][-1]
        differ = [name for name, lg in paths.items() if not torch.equal(lg.reshape(-1), ref.reshape(-1))]
        assert not differ, f"the prompt's logits changed along {differ}"
        # the KV each path wrote is the same too: the next steps' logits agree bit for bit
        token = int(ref.reshape(-1, ref.shape[-1])[-1].argmax())
        want = _decode(r, ("alone", n), token, 3)
        for name in paths:
            got = _decode(r, (name, n), token, 3)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), f"decoding after {name} differs"
    finally:
        for sid in ["filler", ("alone", n), *((name, n) for name in ("chunk17", "chunk64", "cached", "mixed"))]:
            if sid in r:
                r.free(sid)


def test_a_decode_row_gets_the_same_logits_alone_and_in_batches_of_3_16_and_64(runner):
    r = runner
    prompt = _prompt(r, 140, seed=7)
    first = int(r.prefill("seq", prompt, reuse_prefix=False).reshape(-1, r.vocab_size)[-1].argmax())
    r.prefill("base", _prompt(r, 90, seed=8), reuse_prefix=False)
    try:
        alone = _decode(r, "seq", first, 3)
        r.rollback("seq", len(prompt))
        for width in (3, 16, 64):
            fillers = [("f", width, k) for k in range(width - 1)]
            for f in fillers:
                r.fork("base", f)
            token, nxt = first, {f: 321 for f in fillers}
            for step in range(3):
                logits = r.step([("seq", [token])] + [(f, [nxt[f]]) for f in fillers])
                assert torch.equal(logits[0][-1], alone[step]), f"step {step} in a batch of {width} differs"
                token = int(logits[0][-1].argmax())
                nxt = {f: int(lg[-1].argmax()) for f, lg in zip(fillers, logits[1:])}
            for f in fillers:
                r.free(f)
            r.rollback("seq", len(prompt))
    finally:
        r.free("seq")
        r.free("base")


def test_a_sequence_recomputed_as_a_prompt_gets_the_logits_its_decode_steps_had(runner):
    """Preemption drops a sequence's KV and recomputes its prompt and generated tokens as one prompt later (and a
    multi-turn conversation brings an answer back as prompt): the rows its decode steps computed one at a time
    are the same bits as the same positions computed in a prompt, whole or in chunks."""
    r = runner
    prompt = _prompt(r, 130, seed=11)
    try:
        first = int(r.prefill("seq", prompt, reuse_prefix=False).reshape(-1, r.vocab_size)[-1].argmax())
        steps = _decode(r, "seq", first, 6)
        generated = [first] + [int(lg.argmax()) for lg in steps[:-1]]  # the tokens the 6 steps were fed
        for name, chunk in (("whole", None), ("chunks", 37)):
            sid = ("again", name)
            last = r.prefill(sid, prompt + generated, chunk_size=chunk, reuse_prefix=False)
            assert torch.equal(last.reshape(-1), steps[-1].reshape(-1)), f"recomputed {name}: the last row differs"
            r.free(sid)
        # and every decode row against the same positions of one prompt step
        r.start("rows", prompt + generated[:-1], reuse_prefix=False)
        (rows,) = r.step([("rows", prompt + generated[:-1])])
        for j, lg in enumerate(steps[:-1]):
            assert torch.equal(rows[len(prompt) + j], lg.reshape(-1)), f"decode step {j} differs from its prompt row"
    finally:
        for sid in ("seq", "rows"):
            if sid in r:
                r.free(sid)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma3", "qwen3_moe"])
def test_the_other_native_families_are_row_invariant_too(family, dtype, tmp_path, model_dir):
    """Per-head q/k norms (Qwen3), a sliding window of 8 keys on every layer (this Mistral; its prompt rows take the
    decode kernel, whose window the chunk kernel lacks), Gemma 3's local and global layers with their own rotary
    tables and Gemma's norms: chunked, cached and batched paths give the same bits."""
    from pdserve.engine.runner import PagedRunner
    from tinymodels import make_tiny

    r = PagedRunner(make_tiny(family, tmp_path, model_dir), dtype=getattr(torch, dtype), num_blocks=256)
    if not r.native_rows():
        pytest.skip(f"no native {dtype} decoder on this CPU")
    prompt = _prompt(r, 70, seed=3)
    ref = r.prefill("whole", prompt, reuse_prefix=False)
    assert torch.equal(r.prefill("chunks", prompt, chunk_size=17, reuse_prefix=False), ref)
    assert torch.equal(r.prefill("cached", prompt), ref)
    token = int(ref.argmax())
    alone = _decode(r, "whole", token, 2)
    r.prefill("other", _prompt(r, 40, seed=4), reuse_prefix=False)
    for width in (3, 16):
        fillers = [("f", width, k) for k in range(width - 1)]
        for f in fillers:
            r.fork("other", f)
        got = r.step([("chunks", [token])] + [(f, [9]) for f in fillers])[0][-1]
        assert torch.equal(got, alone[0]), f"batch of {width}"
        r.rollback("chunks", len(prompt))
        for f in fillers:
            r.free(f)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prefill_s_engine_and_decode_s_compute_a_prompt_to_the_same_bits(model_dir, dtype):
    """Which worker computes a prompt must not matter (conditional disaggregation hands some to decode): the two
    workers' engines, as they build them, give a prompt the same logits — prefill in its chunks, decode in its
    local chunks beside its own rows — and the KV they leave gives the next step the same logits."""
    from pdserve.config import DecodeConfig, PrefillConfig, load
    from pdserve.decode.worker import DecodeWorker
    from pdserve.prefill.worker import PrefillWorker

    common = ["--model", str(model_dir), "--dtype", dtype, "--kv-capacity-bytes", str(64 << 20)]
    prefill = PrefillWorker(load(PrefillConfig, common, environ={})).engine
    decode = DecodeWorker(load(DecodeConfig, [*common, "--no-spec-calibrate"], environ={})).engine
    if not decode.native_rows():
        pytest.skip(f"no native {dtype} decoder on this CPU")
    assert prefill.native_rows() == decode.native_rows(), "prefill does not run the decoder decode runs"
    prompt = _prompt(prefill, 200, seed=21)
    with torch.inference_mode():
        on_prefill = prefill.prefill("p", prompt, chunk_size=128, reuse_prefix=False)
        decode.prefill("other", _prompt(decode, 30, seed=22), reuse_prefix=False)
        decode.start("p", prompt, reuse_prefix=False)
        for i in range(0, len(prompt), 48):  # decode's local chunks, each beside another sequence's decode row
            logits = decode.step([("other", [7 + i]), ("p", prompt[i:i + 48])], last_only=[False, True])
        assert torch.equal(logits[1].reshape(-1), on_prefill.reshape(-1))
        token = int(on_prefill.argmax())
        assert torch.equal(prefill.step([("p", [token])])[0], decode.step([("p", [token])])[0])
