"""PagedRunner on the real model: equal to Hugging Face's forward and generate, batched, speculative, chunked, cached, handed off."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pdserve.engine.blocks import OutOfBlocks
from pdserve.engine.runner import PagedRunner
from pdserve.runtime import ModelRunner

pytestmark = pytest.mark.model

LONG_PROMPT = (Path(__file__).parent / "data" / "long_prompt.txt").read_text()
NEW_TOKENS = 10
# Logits against Hugging Face's float32 forward: equal up to float32 rounding in another summation order (the
# native layers sum each projection as one FMA chain, MKL in blocks), relative to the logits' scale (~10-40).
RTOL = 1e-5


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= RTOL * scale, f"logits differ by {err:.3g} at a scale of {scale:.3g}"


@pytest.fixture(scope="module")
def hf(model_dir) -> ModelRunner:
    """Today's Hugging Face runtime: the oracle, and the other side of a handoff."""
    return ModelRunner(model_dir)


@pytest.fixture(scope="module")
def runner(model_dir) -> PagedRunner:
    return PagedRunner(model_dir, num_blocks=256)


@pytest.fixture(autouse=True)
def _free_what_a_test_left(request):
    """A test that fails midway leaves its sequences' blocks in the shared runner, and the tests after it
    would fail on them: record every sequence a test starts and free those it did not."""
    if "runner" not in request.fixturenames:
        yield
        return
    runner = request.getfixturevalue("runner")
    started = []
    recorded = (("start", 0), ("prefill", 0), ("import_kv", 0), ("fork", 1))  # method, its new sequence's arg
    for name, arg in recorded:
        method = getattr(runner, name)

        def recording(*a, _method=method, _arg=arg, **k):
            started.append(a[_arg])
            return _method(*a, **k)
        setattr(runner, name, recording)  # on the instance, over the class's method
    try:
        yield
    finally:
        for name, _ in recorded:
            delattr(runner, name)
    for seq_id in dict.fromkeys(started):
        if seq_id in runner:
            runner.free(seq_id)


@pytest.fixture(scope="module")
def prompts(hf) -> list[list[int]]:
    """Four prompts of different lengths (a chat turn, plain text, a long document over many blocks, one token)."""
    return [
        hf.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        hf.encode("The three primary colours are"),
        hf.encode(LONG_PROMPT)[:300] + hf.encode("\n\nIn one sentence, the text is about"),
        hf.encode("Hello"),
    ]


def greedy_alone(runner: PagedRunner, seq_id, prompt: list[int], n: int) -> list[int]:
    logits = runner.prefill(seq_id, prompt)
    out = [int(logits.argmax())]
    for _ in range(n - 1):
        (logits,) = runner.step([(seq_id, [out[-1]])])
        out.append(int(logits[-1].argmax()))
    return out


@pytest.fixture(scope="module")
def alone(runner, prompts) -> list[list[int]]:
    """Each prompt's greedy continuation, one sequence at a time (sequences freed afterwards)."""
    outs = []
    for i, p in enumerate(prompts):
        outs.append(greedy_alone(runner, ("alone", i), p, NEW_TOKENS))
        runner.free(("alone", i))
    return outs


def hf_logits(hf: ModelRunner, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf.model(input_ids=torch.tensor([ids])).logits[0].float()


def assert_pool_empty(runner: PagedRunner) -> None:
    assert runner.pool.utilization() == 0.0


def test_layout_matches_the_hf_runtime(runner, hf):
    assert runner.layout == hf.layout


def test_prefill_logits_equal_hf_forward(runner, hf, prompts):
    ids = prompts[2]
    expected = hf_logits(hf, ids)
    last = runner.prefill("p", ids, reuse_prefix=False)
    assert_logits_close(last, expected[-1])
    runner.free("p")
    # every position, through one step over the whole prompt
    assert runner.start("q", ids, reuse_prefix=False) == 0
    (all_logits,) = runner.step([("q", ids)])
    assert all_logits.shape == expected.shape
    assert_logits_close(all_logits, expected)
    runner.free("q")
    assert_pool_empty(runner)


def test_greedy_decode_equals_hf_generate(hf, prompts, alone):
    # No stop token: generate must run on past an end-of-turn exactly as our loop does (min_new_tokens
    # would instead mask the stop token and change the argmax).
    config = copy.deepcopy(hf.model.generation_config)
    config.update(eos_token_id=[], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    for prompt, ours in zip(prompts[:3], alone[:3]):
        with torch.inference_mode():
            out = hf.model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), generation_config=config
            )
        assert out[0, len(prompt):].tolist() == ours


def test_decode_at_a_long_context_equals_hf_forward(runner, hf):
    # ~1,000 cached tokens over 60+ blocks: decode steps read them through the batched decode path
    ids = hf.encode(LONG_PROMPT)[:1000]
    nxt = int(runner.prefill("long", ids, reuse_prefix=False).argmax())
    (ours,) = runner.step([("long", [nxt])])
    expected = hf_logits(hf, ids + [nxt])[-1]
    assert_logits_close(ours[-1], expected)
    runner.free("long")
    assert_pool_empty(runner)


def test_ragged_batch_equals_each_alone(runner, prompts, alone):
    ids = [("batch", i) for i in range(len(prompts))]
    outs = [[int(runner.prefill(sid, p).argmax())] for sid, p in zip(ids, prompts)]
    for _ in range(NEW_TOKENS - 1):
        logits = runner.step([(sid, [o[-1]]) for sid, o in zip(ids, outs)])
        assert [tuple(l.shape) for l in logits] == [(1, runner.vocab_size)] * len(ids)
        for o, l in zip(outs, logits):
            o.append(int(l[-1].argmax()))
    assert outs == alone
    for sid in ids:
        runner.free(sid)
    assert_pool_empty(runner)


def test_prefill_chunks_interleave_with_decode_in_one_step(runner, prompts, alone):
    # what a continuous-batching scheduler does: a long prompt's chunks ride along with decode steps
    long_prompt, short = prompts[2], prompts[0]
    out = [int(runner.prefill("dec", short).argmax())]
    assert runner.start("pre", long_prompt, reuse_prefix=False) == 0
    chunks = [long_prompt[i : i + 128] for i in range(0, len(long_prompt), 128)]
    assert len(chunks) == 3  # 3 steps of 3 decoded tokens: the NEW_TOKENS of `alone`
    for chunk in chunks:
        spec = [out[-1]] + alone[0][len(out) : len(out) + 2]  # the decode side verifies 2 (right) drafts
        dec, pre = runner.step([("dec", spec), ("pre", chunk)], last_only=[False, True])
        assert dec.shape[0] == 3 and pre.shape[0] == 1
        out.extend(int(x) for x in dec.argmax(-1))
    assert len(out) == 1 + 3 * len(chunks) and out == alone[0][: len(out)]
    assert int(pre[-1].argmax()) == alone[2][0]
    runner.free("dec")
    runner.free("pre")
    assert_pool_empty(runner)


def test_speculative_step_then_rollback_continues_identically(runner, prompts, alone):
    prompt, expected = prompts[0], alone[0]
    n_prompt = len(prompt)
    first = int(runner.prefill("spec", prompt).argmax())
    assert first == expected[0]
    # verify k=4 drafts: two right, then two wrong, in one forward (k+1 rows of logits)
    drafts = expected[1:3] + [0, 0]
    (logits,) = runner.step([("spec", [first] + drafts)])
    assert logits.shape[0] == 5
    assert [int(x) for x in logits[:3].argmax(-1)] == expected[1:4]
    # accepted: first + 2 drafts; the correction token is expected[3]; drop the 2 rejected
    runner.rollback("spec", n_prompt + 3)
    assert runner.num_tokens("spec") == n_prompt + 3
    out = expected[:4]
    for _ in range(NEW_TOKENS - 4):
        (l,) = runner.step([("spec", [out[-1]])])
        out.append(int(l[-1].argmax()))
    assert out == expected
    runner.free("spec")
    assert_pool_empty(runner)


def test_fork_shares_the_prompt_and_copies_on_write(runner, hf, prompts, alone):
    prompt = prompts[1]  # 5 tokens: the shared last block is partial
    first = int(runner.prefill("parent", prompt).argmax())
    runner.fork("parent", "child")
    used = runner.pool.utilization()
    other = 1234
    parent, child = runner.step([("parent", [first]), ("child", [other])])
    assert runner.pool.utilization() > used  # the child's write copied the shared block
    assert int(parent[-1].argmax()) == alone[1][1]
    expected = hf_logits(hf, prompt + [other])[-1]
    assert_logits_close(child[-1], expected)
    runner.free("parent")
    runner.free("child")
    assert_pool_empty(runner)


def assert_close_to_scale(ours: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    """Equal up to float32 rounding: the largest difference within `rel` of the reference's largest
    magnitude. Different matmul shapes (a chunk of 64 rows or the whole prompt) sum in a different
    order, by a different kernel on each CPU (AVX2, AVX-512), so an absolute bound holds on one CPU only."""
    err, scale = float((ours - ref).abs().max()), float(ref.abs().max())
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel:g} x max |value| {scale:.3g}"


def test_chunked_prefill_equals_one_shot(runner, prompts):
    ids = prompts[2]
    assert len(ids) > 3 * 64
    one = runner.prefill("one", ids, reuse_prefix=False)
    chunked = runner.prefill("chunked", ids, chunk_size=64, reuse_prefix=False)
    assert_close_to_scale(chunked, one, "last logits")
    a, b = runner.export_kv("one"), runner.export_kv("chunked")
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        assert_close_to_scale(y, x, f"KV of layer {i}")
    runner.free("one")
    runner.free("chunked")
    assert_pool_empty(runner)


def test_prefix_cache_hit_computes_only_the_rest(runner, hf, prompts, monkeypatch):
    prefix = hf.encode(LONG_PROMPT)[:200]
    first = prefix + hf.encode(" Question: who built the press?")
    second = prefix + hf.encode(" Question: what did scribes copy?")
    runner.prefill("first", first)
    runner.free("first")  # its full blocks stay cached

    computed = []
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda ids, *a, **k: computed.append(len(ids)) or forward(ids, *a, **k))
    assert runner.start("second", second) == 192  # 12 whole blocks of 16 of the 200 shared tokens
    (logits,) = runner.step([("second", second[192:])], last_only=True)
    assert computed == [len(second) - 192]
    monkeypatch.undo()

    expected = hf_logits(hf, second)[-1]
    assert_logits_close(logits[-1], expected)
    fresh = runner.prefill("fresh", second, reuse_prefix=False)
    assert_logits_close(logits[-1], fresh)
    # a prompt that is entirely cached still computes its last block (its logits are needed)
    runner.free("fresh")
    whole = second[:192]
    assert runner.start("whole", whole) == 176
    runner.free("whole")
    runner.free("second")
    assert_pool_empty(runner)


def test_kv_blocks_equal_between_paged_and_hf_runtimes(runner, hf, prompts, alone):
    prompt = prompts[1]
    logits, cache = hf.prefill(prompt)
    theirs = hf.cache_to_blocks(cache)
    runner.prefill("ours", prompt)
    ours = runner.export_kv("ours")
    assert ours.layout == theirs.layout and ours.num_tokens == theirs.num_tokens == len(prompt)
    for a, b in zip(ours.layers, theirs.layers):
        assert a.shape == b.shape
        # the same K/V up to float32 rounding: the two sides run different BLAS kernels (our projections
        # multiply by transposed weights), whose summation order differs in the last bits — so the error
        # is bounded relative to the values' scale (|K| reaches ~20 here), 1e-5 of it
        err = (a - b).abs().max()
        assert err <= 1e-5 * b.abs().max(), err
    # and the paged runner's KV continues in the HF runtime
    cache = hf.blocks_to_cache(ours)
    nxt = hf.forward([alone[1][0]], cache)[-1]
    assert int(nxt.argmax()) == alone[1][1]
    runner.free("ours")
    assert_pool_empty(runner)


def test_export_import_into_a_fresh_runner_continues_identically(runner, model_dir, hf, prompts, alone):
    prompt, expected = prompts[2], alone[2]
    first = int(runner.prefill("src", prompt).argmax())
    kv = runner.export_kv("src")
    runner.free("src")

    fresh = PagedRunner(model_dir, num_blocks=40)
    fresh.import_kv("dst", kv, token_ids=prompt)
    out = [first]
    for _ in range(NEW_TOKENS - 1):
        (l,) = fresh.step([("dst", [out[-1]])])
        out.append(int(l[-1].argmax()))
    assert out == expected
    # the imported prompt's full blocks serve the prefix cache
    assert fresh.pool.match_prefix(prompt)[1] == len(prompt) // 16 * 16

    # a KV made by the HF runtime lands too
    _, cache = hf.prefill(prompts[1])
    fresh.import_kv("from-hf", hf.cache_to_blocks(cache))
    (l,) = fresh.step([("from-hf", [alone[1][0]])])
    assert int(l[-1].argmax()) == alone[1][1]

    # a step that does not fit raises OutOfBlocks and leaves every sequence as it was
    before = {sid: fresh.num_tokens(sid) for sid in ("dst", "from-hf")}
    free = fresh.pool.num_free
    with pytest.raises(OutOfBlocks):
        fresh.step([("dst", [1]), ("from-hf", [1] * (16 * (free + 1)))])
    assert {sid: fresh.num_tokens(sid) for sid in before} == before
    assert fresh.pool.num_free == free
    # a forward that fails leaves them as they were too
    def broken(*a, **k):
        raise RuntimeError("device lost")
    fresh.model.forward = broken
    with pytest.raises(RuntimeError, match="device lost"):
        fresh.step([("dst", [1]), ("from-hf", [1, 2])])
    assert {sid: fresh.num_tokens(sid) for sid in before} == before
    del fresh.model.forward
    fresh.free("dst")
    fresh.free("from-hf")
    assert fresh.pool.utilization() == 0.0


def test_bfloat16_pool_matches_the_hf_runtime_in_bfloat16(model_dir, hf, prompts):
    hf16 = ModelRunner(model_dir, dtype=torch.bfloat16)
    ours = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=16)
    assert ours.layout == hf16.layout and ours.layout.dtype == "bfloat16"
    prompt = prompts[0]
    logits, cache = hf16.prefill(prompt)
    theirs = hf16.cache_to_blocks(cache)
    mine = ours.prefill("a", prompt)
    kv = ours.export_kv("a")
    assert kv.layers[0].dtype == torch.bfloat16
    # Two bf16 runtimes round differently, so their KV is close, not equal. The scale of "close" is
    # bf16 rounding itself: per layer, ours differs from HF's bf16 KV (and from the fp32 KV) by no
    # more than HF's bf16 KV differs from the fp32 KV, with a 25% margin.
    exact = hf.cache_to_blocks(hf.prefill(prompt)[1])
    norm = torch.linalg.vector_norm
    for i, (a, b, c) in enumerate(zip(kv.layers, theirs.layers, exact.layers)):
        a, b = a.float(), b.float()
        bf16_error = norm(b - c)
        assert norm(a - b) <= 1.25 * bf16_error, f"layer {i}"
        assert norm(a - c) <= 1.25 * bf16_error, f"layer {i}"
    theirs_out, mine_out = [int(logits.argmax())], [int(mine.argmax())]
    ours.import_kv("from-hf", theirs)  # and the HF runtime's bf16 KV lands in the pool
    from_hf = [theirs_out[0]]
    for _ in range(NEW_TOKENS - 1):
        theirs_out.append(int(hf16.forward([theirs_out[-1]], cache)[-1].argmax()))
        a, b = ours.step([("a", [mine_out[-1]]), ("from-hf", [from_hf[-1]])])
        mine_out.append(int(a[-1].argmax()))
        from_hf.append(int(b[-1].argmax()))
    assert mine_out == theirs_out == from_hf


def test_without_prefix_cache_decode_keeps_blocks_consecutive_and_frees_them_outright(model_dir, runner, prompts, alone):
    # what decode workers run: an imported prompt plus its continuation, decoded in a batch beside another
    # sequence, stays one run of blocks (so attention reads it in place), gives the same tokens, and
    # leaves nothing cached behind
    kv_src = [(i, runner.prefill(("src", i), prompts[i])) for i in (0, 2)]
    kvs = {i: runner.export_kv(("src", i)) for i, _ in kv_src}
    for i, _ in kv_src:
        runner.free(("src", i))
    dec = PagedRunner(model_dir, num_blocks=64, prefix_cache=False)
    out = {}
    for i, logits in kv_src:
        dec.import_kv(i, kvs[i], token_ids=prompts[i])
        out[i] = [int(logits.argmax())]
    for _ in range(NEW_TOKENS - 1):
        logits = dec.step([(i, [out[i][-1]]) for i in out])
        for i, l in zip(out, logits):
            out[i].append(int(l[-1].argmax()))
    for i in out:
        assert out[i] == alone[i]
        table = dec.pool.block_table(i)
        assert table == list(range(table[0], table[0] + len(table)))
        dec.free(i)
    assert dec.pool.num_cached == 0 and dec.cached_hashes() == [] and dec.pool.num_free == 64


def test_small_steps_use_the_cpu_weight_layouts(model_dir):
    """Where transformers' forward serves (a model or CPU without the native layers): one row and more than 12
    multiply the transposed weight; two and three rows the `[out, in]` copy; four to twelve oneDNN's packed copy
    (see `cpustep.CpuLinear`). Each copy holds the same values, and the tied output projection's `[out, in]` copy
    is the embedding table itself. A prefill engine keeps none; nor does a model the native layers serve."""
    from pdserve.engine.cpustep import PACK_ROWS_HINT, CpuLinear

    native = PagedRunner(model_dir, num_blocks=8)
    if native.model.native is not None:  # its layers' extra copies went with the layouts they served
        assert all(m.weight_rows is None and m.weight_packed is None
                   for m in native.model.layers.modules() if isinstance(m, CpuLinear))
    del native
    runner = PagedRunner(model_dir, num_blocks=8, native_layers=False)
    hf = runner.model.hf
    lin = hf.model.layers[0].mlp.gate_proj.fused  # gate and up in one matmul
    assert isinstance(lin, CpuLinear) and lin.out_features == 2 * hf.config.intermediate_size
    assert lin.weight_rows is not None and torch.equal(lin.weight_rows, lin.weight_t.t())
    head = hf.get_output_embeddings()
    assert head.weight_rows.data_ptr() == hf.get_input_embeddings().weight.data_ptr(), "tied: no second copy"
    x = torch.randn(16, lin.in_features)
    for rows in (1, 2, 3, 4, 9, 12, 13, 16):  # the copies agree with the parameter
        torch.testing.assert_close(lin(x[:rows]), x[:rows] @ lin.weight_t, rtol=1e-4, atol=1e-4)
    original = lin.weight_rows, lin.weight_packed
    try:  # tell the paths apart: rows copy doubled, packed copy tripled
        lin.weight_rows = original[0] * 2
        lin.weight_packed = torch.ops.mkldnn._reorder_linear_weight(original[0] * 3, PACK_ROWS_HINT)
        for rows, factor in ((1, 1), (2, 2), (3, 2), (4, 3), (12, 3), (13, 1)):
            want = (x[:rows] @ lin.weight_t) * factor
            torch.testing.assert_close(lin(x[:rows]), want, rtol=1e-4, atol=1e-3)
    finally:
        lin.weight_rows, lin.weight_packed = original
    prefill = PagedRunner(model_dir, num_blocks=8, small_step_weights=False)
    assert all(m.weight_rows is None and m.weight_packed is None
               for m in prefill.model.modules() if isinstance(m, CpuLinear))
