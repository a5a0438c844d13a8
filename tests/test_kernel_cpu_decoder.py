"""The native decoder layers (`kernels/cpu_decoder.c`) against transformers' forward, bfloat16 and float32.

Two bfloat16 computations of one model round differently (here the matmuls sum in another order), so
they are compared by how far each is from the float32 forward: the native step must be as close to
float32 as transformers' own bfloat16 step is (within 1.5x, in the mean over 25 forwards), on the real
model and on tiny Llama and Qwen2 checkpoints (q/k/v biases), for one-row, verification-sized and batched
ragged steps. The GEMV is
checked against a float32 matmul of the same bfloat16 numbers. The "vector" path is AVX512-BF16 where the CPU
has it, else AVX2 + FMA (the same packed weights widened in registers); "amx" runs where AMX does. Everything
is skipped on a CPU with neither (or without a C compiler), where the engine keeps transformers' forward.

The float32 layer computes transformers' float32 forward in another summation order (each output one FMA chain
over its inputs): its logits are compared with transformers' float32 ones relative to their scale, and its greedy
tokens must be theirs.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.runner import PagedRunner
from pdserve.kernels import cpu_decoder
from tinymodels import make_tiny

@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


needs_native = pytest.mark.skipif(cpu_decoder.library() is None,
                                  reason="no AVX512-BF16 or AVX2 + FMA, or no C compiler: the native decoder is not built here")


def _has_amx() -> bool:
    if cpu_decoder.library() is None:
        return False
    had = cpu_decoder.use_amx(True)
    cpu_decoder.use_amx(had)
    return had


@pytest.fixture(params=["vector", "amx"])
def projection_path(request):
    """Each GEMV path this CPU has, the process's choice restored after (AMX is the default where it runs)."""
    if request.param == "amx" and not _has_amx():
        pytest.skip("no AMX here (or Linux refused this process its tile state)")
    before = cpu_decoder.use_amx(True)
    assert cpu_decoder.use_amx(request.param == "amx") == (request.param == "amx")
    yield request.param
    cpu_decoder.use_amx(before)


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 17, 40, 64])
@pytest.mark.parametrize("n,k,bias", [(96, 64, False), (40, 32, True), (300, 130, False), (200, 576, True)])
def test_gemv_computes_the_bfloat16_product(rows, n, k, bias, projection_path):
    """Both paths against a float32 product of the same numbers: row counts past a tile (16), a pass (8) and
    AMX's 32-row block, output counts past a group (32) and a block (64), and an input count that is no
    multiple of 32 (130: AMX hands it to the AVX512 GEMV)."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    packed = cpu_decoder.pack(w.t().contiguous())
    got = cpu_decoder.gemv(x, packed, n, b).float()
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    assert got.shape == (rows, n)
    # one bfloat16 rounding of the float32 sum: half a unit in the 8th bit of each output
    assert ((got - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()
    # a row's result never depends on the rows beside it (a sequence's logits on its batch): the first row sits
    # in AMX's 32-row blocks where there are 32 rows, the last in its 16-row tail
    assert torch.equal(cpu_decoder.gemv(x[-1:], packed, n, b).float(), got[-1:])
    assert torch.equal(cpu_decoder.gemv(x[:1], packed, n, b).float(), got[:1])


needs_float32 = pytest.mark.skipif(not cpu_decoder.float32_available(),
                                   reason="no AVX2 + FMA, or no C compiler: the float32 layer is not built here")


@needs_float32
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 33])
@pytest.mark.parametrize("n,k,bias", [(128, 64, False), (40, 33, True), (300, 130, False), (960, 576, True)])
def test_the_float32_gemm_is_the_product_and_a_row_never_depends_on_its_neighbours(rows, n, k, bias):
    """Output counts under, past and between the wide (128 or 32 outputs) and narrow tiles, odd input counts, row
    counts past a pass (3) and a narrow tile's rows (8 or 6); against a float64 product of the same numbers, and
    every row bit for bit the same computed alone."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(k, n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = cpu_decoder.gemm_f32(x, w, b)
    want = x.double() @ w.double() + (b.double() if bias else 0)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # float32 sums of k products: a few units in the last place of the largest partial sum
    scale = (x.double().abs() @ w.double().abs()) + (b.double().abs() if bias else 0)
    assert ((got.double() - want).abs() <= scale * k * 2 ** -23).all()
    for r in range(rows):
        assert torch.equal(cpu_decoder.gemm_f32(x[r:r + 1], w, b), got[r:r + 1]), f"row {r} of {rows}"


def _float32_runners(model_dir):
    """The native float32 layers, and transformers' own float32 forward (native_layers off), over the same
    checkpoint."""
    native = PagedRunner(model_dir, dtype=torch.float32, num_blocks=64, prefix_cache=False)
    exact = PagedRunner(model_dir, dtype=torch.float32, num_blocks=64, prefix_cache=False, native_layers=False)
    assert native.model.native is not None and exact.model.native is None
    return native, exact


def _compare_float32(model_dir, prompts: list[list[int]], text_ids: list[int]):
    """Prompts, then 24 steps of real text (one row, a verification, a ragged batch): every logit within 1e-5 of
    the float32 logits' scale (a wrong rotary, norm or bias is 10-100%), every greedy token the same."""
    native, exact = _float32_runners(model_dir)
    at, worst = 0, 0.0

    def check(got, want):
        nonlocal worst
        err = float((got - want).abs().max() / want.abs().max())
        worst = max(worst, err)
        assert err <= 1e-5, f"float32 logits differ by {err:.2g} of their scale"
        assert torch.equal(got.argmax(-1), want.argmax(-1))

    with torch.inference_mode():
        check(*(torch.stack([r.prefill(i, p) for i, p in enumerate(prompts)]) for r in (native, exact)))
        for shape in _STEP_SHAPES:
            batch = []
            for i, n in enumerate(shape):
                batch.append((i, [text_ids[(at + j) % len(text_ids)] for j in range(n)]))
                at += n
            check(*(torch.cat(r.step(batch)) for r in (native, exact)))
            for r in (native, exact):
                for i, p in enumerate(prompts):
                    r.rollback(i, len(p))
    return worst


def _runners(model_dir):
    native = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=64, prefix_cache=False)
    torch_bf16 = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=64, prefix_cache=False,
                             native_layers=False)
    # the reference: transformers' own float32 forward
    exact = PagedRunner(model_dir, dtype=torch.float32, num_blocks=64, prefix_cache=False, native_layers=False)
    return native, torch_bf16, exact


# text the steps feed, so their tokens are a continuation's, not arbitrary ids
_STEP_TEXT = ("The river ran north past the old mill, where the miller's daughter kept the accounts and "
              "the keys. def mean(xs):\n    return sum(xs) / len(xs)\nIn the spring the roads flooded, and "
              "the carts waited at the ford for the water to fall. Paris, Rome and Madrid are capitals.")
# one row, a verification, a ragged batch: each shape several times over different text
_STEP_SHAPES = [[1], [4], [1, 2, 5], [1], [5], [2, 1, 4]] * 4


def _compare(model_dir, prompts: list[list[int]], text_ids: list[int]):
    """Logits of prompts (prefilled natively where they are short) and then of 24 steps of real text: one
    row, a verification, a ragged batch. Each bfloat16 path's distance from float32, relative to the float32
    logits' norm, is chaotic step by step (a rounding either way early on grows through the layers: steps
    here ranged from transformers' path 3x nearer float32 than the native to the native 2x nearer, and four
    steps once put the native's mean at 2.4x), so they are compared over many steps: the native path's mean
    error within 1.5x of transformers' bfloat16 error (here 0.95x on the real model, 1.0x on tiny ones),
    none past 15% of the logits (a wrong rotary, norm or bias is 30-100%), and their greedy tokens mostly
    the same."""
    native, torch_bf16, exact = _runners(model_dir)
    assert native.model.native is not None and torch_bf16.model.native is None and exact.model.native is None
    norm = torch.linalg.vector_norm
    errors, agree = {"native": [], "torch": []}, []

    def record(got, ref, want):
        errors["native"].append(float(norm(got - want) / norm(want)))
        errors["torch"].append(float(norm(ref - want) / norm(want)))
        agree.extend((got.argmax(-1) == ref.argmax(-1)).tolist())

    at = 0
    with torch.inference_mode():
        record(*(torch.stack([r.prefill(i, p) for i, p in enumerate(prompts)]) for r in (native, torch_bf16, exact)))
        for shape in _STEP_SHAPES:
            batch = []
            for i, n in enumerate(shape):
                batch.append((i, [text_ids[(at + j) % len(text_ids)] for j in range(n)]))
                at += n
            record(*(torch.cat(r.step(batch)) for r in (native, torch_bf16, exact)))
            for r in (native, torch_bf16, exact):
                for i, p in enumerate(prompts):
                    r.rollback(i, len(p))
    mean = {k: sum(v) / len(v) for k, v in errors.items()}
    assert mean["native"] <= 1.5 * mean["torch"], errors
    assert max(errors["native"]) <= 0.15, errors
    assert sum(agree) >= 0.8 * len(agree), agree


@needs_native
def test_native_steps_of_the_real_model_are_as_close_to_float32_as_transformers_bfloat16(model_dir, tokenizer,
                                                                                       projection_path):
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):\n    return",
                                             "Once upon a time, in a land far away, there lived a")]
    _compare(model_dir, prompts, tokenizer.encode(_STEP_TEXT))


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe"])
def test_native_steps_of_tiny_families(family, tmp_path, model_dir, tokenizer, projection_path):
    """q/k/v biases (Qwen2), per-head q/k norms (Qwen3), a sliding window of 8 keys on every layer (this Mistral),
    q/k/v and gate/up fused in the checkpoint (Phi-3):
    prompts of 9-14 tokens and 24 steps cross the window many times."""
    ckpt = make_tiny(family, tmp_path, model_dir)
    _compare(ckpt, [tokenizer.encode("The quick brown fox jumps over the lazy dog")[:9],
                    tokenizer.encode("Once upon a time"), tokenizer.encode("def add(a, b):\n    return a + b")],
             tokenizer.encode(_STEP_TEXT))


@needs_float32
def test_native_float32_steps_of_the_real_model_are_transformers_float32_to_rounding(model_dir, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):\n    return",
                                             "Once upon a time, in a land far away, there lived a")]
    _compare_float32(model_dir, prompts, tokenizer.encode(_STEP_TEXT))


@needs_float32
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe"])
def test_native_float32_steps_of_tiny_families(family, tmp_path, model_dir, tokenizer):
    ckpt = make_tiny(family, tmp_path, model_dir)
    _compare_float32(ckpt, [tokenizer.encode("The quick brown fox jumps over the lazy dog")[:9],
                            tokenizer.encode("Once upon a time"), tokenizer.encode("def add(a, b):\n    return a + b")],
                     tokenizer.encode(_STEP_TEXT))


@needs_native
@pytest.mark.parametrize("family", ["gpt_oss"])
def test_models_the_layer_does_not_compute_keep_transformers_forward(family, tmp_path, model_dir):
    """Sinks, biased experts and a clamped SwiGLU (gpt-oss): refused by structure, not run wrong."""
    r = PagedRunner(make_tiny(family, tmp_path, model_dir), dtype=torch.bfloat16, num_blocks=16)
    assert r.model.native is None


@needs_native
def test_module_hooks_go_to_transformers_and_large_steps_run_natively_in_parts(model_dir, tokenizer):
    """A module hook on a layer sees transformers' layers only: such a step keeps transformers' forward. A step of
    more rows than a native call takes runs natively in consecutive calls (seen by the native forward's calls),
    and its logits are those of the same prompt computed in chunks."""
    r = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=256)
    calls = []
    native_forward = r.model.native.forward
    r.model.native.forward = lambda *a: calls.append(a[0].shape[0]) or native_forward(*a)
    ids = tokenizer.encode("Once upon a time, in a land far away, there lived a king who had three daughters. "
                           * (16 if cpu_decoder.max_rows() < 256 else 60))
    top = cpu_decoder.max_rows()
    assert len(ids) > top
    with torch.inference_mode():
        whole = r.prefill("a", ids, reuse_prefix=False)
        assert calls == [top, len(ids) - top]
        chunked = r.prefill("b", ids, chunk_size=100, reuse_prefix=False)
        assert torch.equal(whole, chunked)
        calls.clear()
        r.step([("a", [5])])
        assert calls == [1]
        handle = r.model.layers[0].register_forward_hook(lambda *a: None)
        r.step([("a", [6])])
        handle.remove()
        assert calls == [1]


@needs_native
def test_layer_callbacks_run_on_the_native_path_and_one_that_raises_leaves_the_sequence(model_dir, tokenizer):
    """`add_layer_hooks` (the prefill worker's layer streaming and pre-positioning yield) runs on either path:
    the step stays native, `before(i)` comes ahead of layer i and `after(i)` once its KV is written (seen
    by exporting that layer's KV from inside the callback: it equals the KV at the end of the step), in
    the order added; an exception from `before` stops the step and leaves the sequence as it was."""
    r = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=64, prefix_cache=False)
    native_calls, seen, exported = [], [], {}
    native_forward = r.model.native.forward
    r.model.native.forward = lambda *a: native_calls.append(a[0].shape[0]) or native_forward(*a)
    armed = {"stop_at": None}

    def before(i):
        seen.append(("before", i))
        if armed["stop_at"] == i:
            raise RuntimeError("stop")

    r.model.add_layer_hooks(before=before, after=lambda i: seen.append(("after", i)))
    r.model.add_layer_hooks(after=lambda i: exported.setdefault(i, r.export_layer("p", i)))
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    n = len(r.model.layers)
    with torch.inference_mode():
        r.prefill("p", ids)
        assert native_calls == [len(ids)]
        assert seen == [(k, i) for i in range(n) for k in ("before", "after")]
        for i in (0, n // 2, n - 1):  # what after(i) saw of layer i is the step's final KV of it
            assert torch.equal(exported[i], r.export_layer("p", i))
        seen.clear()
        armed["stop_at"] = 3
        with pytest.raises(RuntimeError, match="stop"):
            r.step([("p", [5, 6])])
        assert seen[-1] == ("before", 3) and len(seen) == 7
        assert r.num_tokens("p") == len(ids)


@needs_native
def test_a_block_table_outside_the_pool_is_an_error_not_a_read(model_dir):
    from pdserve.engine.hfmodel import PagedBatch

    r = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=16, prefix_cache=False)
    kv = r.pool.kv
    batch = PagedBatch(slot_mapping=torch.tensor([3]), block_tables=torch.tensor([[0, 99]], dtype=torch.int32),
                       seq_lens=torch.tensor([20], dtype=torch.int32), query_start=torch.tensor([0, 1], dtype=torch.int32))
    with torch.inference_mode(), pytest.raises(IndexError, match="sequence 0 name a block outside the pool's 16"):
        r.model.native.forward(torch.tensor([5]), torch.tensor([19]), kv, batch, torch.tensor([0]))


@needs_native
def test_the_native_step_runs_the_head_through_the_gemv(model_dir):
    """The head (49152 x 576 on SmolLM2) is the GEMV's too: the logits of a native step are the GEMV of the
    final norm's output, and as near transformers' bfloat16 head as two bfloat16 roundings allow."""
    native = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=64, prefix_cache=False).model.native
    assert native is not None and native.vocab == native.hf.lm_head.weight_t.shape[1]
    x = torch.randn(5, native.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = cpu_decoder.gemv(x, native._head, native.vocab, native._head_bias)
    want = native.hf.lm_head(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2 ** -7


@needs_native
def test_a_prompt_chunk_beside_a_native_step_goes_apart_and_a_failed_step_feeds_it_again(model_dir):
    """Decode computes an uncomputed prompt's chunk in its step (`DecodeWorker._forward_and_verify`). Where the
    running rows alone take the native decoder and the chunk would push the step past it, the chunk is its
    own forward: the running rows then compute exactly what a step without the chunk computes, and the
    prompt's KV grows by the chunk. If the step fails (out of blocks), the chunk is undone too, so that it
    is fed again and never twice."""
    from types import SimpleNamespace

    from pdserve.basetypes import KVLayout, SamplingParams
    from pdserve.decode.worker import DecodeWorker, EventSeq, Sequence
    from pdserve.engine import OutOfBlocks
    from pdserve.kvtransfer.protocol import HandoffOffer

    def seq(key, prompt, runner):
        layout = KVLayout(model_fingerprint="0" * 16, num_layers=30, kv_heads=3, head_dim=64, dtype="bfloat16",
                          block_size=16)
        offer = HandoffOffer(request_id=key, sender_id="p", sender_generation=1, layout=layout,
                             num_tokens=len(prompt), kv_bytes=0, prompt_token_ids=prompt, generated_token_ids=[],
                             sampling=SamplingParams(max_tokens=8, temperature=0), seed=0, next_seq=0)
        return Sequence(offer, stream=None, events=EventSeq(0))

    gen = torch.Generator().manual_seed(7)
    # two of them end on a block boundary once prefilled: their next token needs a new block
    running = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (49, 40, 33, 45)]
    fast = cpu_decoder.max_rows()  # 1024
    assert fast % 16 == 0
    prompt = torch.randint(100, 20000, (2 * fast + 12,), generator=gen).tolist()
    outs = []
    for with_chunk in (False, True):
        runner = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=max(64, 3 * fast // 16 + 32),
                             prefix_cache=False)
        assert runner.native_rows() == fast
        batch = [seq(f"r{i}", p, runner) for i, p in enumerate(running)]
        for s in batch:
            runner.prefill(s.key, s.offer.prompt_token_ids[:-1])
        local = seq("local", prompt, runner)
        worker = SimpleNamespace(engine=runner)
        chunk = (local, prompt[:fast]) if with_chunk else None  # 4 rows + the chunk > fast: apart
        outs.append(DecodeWorker._forward_and_verify(worker, batch, [None] * 4, chunk))
        if not with_chunk:
            continue
        assert runner.num_tokens("local") == fast
        for s in batch:
            runner.rollback(s.key, len(s.offer.prompt_token_ids) - 1)  # as before the step
        i = 0
        room = fast // 16  # the next chunk's blocks, none for the rows' growth
        while runner.pool.num_free > room:
            runner.prefill(f"fill{i}", [5] * 16)
            i += 1
        with pytest.raises(OutOfBlocks):
            DecodeWorker._forward_and_verify(worker, batch, [None] * 4, (local, prompt[fast:2 * fast]))
        assert runner.num_tokens("local") == fast  # the chunk computed first was undone with the step
        assert runner.pool.num_free == room
    assert outs[0] == outs[1]  # the running rows' tokens are those of a step without the chunk


@needs_native
def test_native_steps_compute_the_same_on_any_thread_count(model_dir, projection_path):
    """A native step split over threads (`pdserve_native_threads`: the prefill worker's count grows on a lent
    core, decode's by what prefill lends) computes each output exactly as one thread does: logits and the KV
    written, bit for bit, for a ragged decode batch, two prompt chunks of different lengths in one step (the
    chunk attention kernel, each sequence's heads packed at its own length, one of them past a cached prefix)
    and a prompt beside decode rows; three threads on this 2-core machine included (oversubscribed: a helper
    the scheduler delays takes fewer items, none is lost)."""
    gen = torch.Generator().manual_seed(11)
    contexts = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (37, 16, 70)]
    prompts = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (48, 21)]
    steps = [[("c0", [5]), ("c1", [6, 7, 8]), ("c2", [9])],
             [("p0", prompts[0]), ("p1", prompts[1])],
             [("c0", [11]), ("p2", prompts[1][:17]), ("c2", [12, 13])],
             [("c1", [14]), ("c2", [15])]]
    results = []
    for threads in (1, 2, 3):
        runner = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=64, prefix_cache=False)
        assert runner.model.native is not None
        for i, c in enumerate(contexts):
            runner.prefill(f"c{i}", c)
        runner.prefill("p1", prompts[0][:16])  # p1's chunk follows a 16-token prefix
        runner.prefill("p0", [3])
        runner.prefill("p2", [4])
        torch.set_num_threads(threads)
        try:
            native = [b for b in steps if sum(len(t) for _, t in b) <= runner.native_rows()]  # 1024 rows
            logits = [torch.cat(runner.step(batch)) for batch in native]
            assert cpu_decoder.threads_in_use() == threads
        finally:
            torch.set_num_threads(1)
        kv = runner.pool.kv.clone()
        results.append((logits, kv))
    for logits, kv in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], logits))
        assert torch.equal(results[0][1], kv)


@needs_native
def test_a_native_verification_row_is_bit_for_bit_the_one_row_step_at_its_position(model_dir):
    """Speculation's k + 1 rows of one sequence are scored as the one-row steps they stand for: the native
    layer's decode attention (bfloat16 queries, `vdpbf16ps` scores) computes a key's score the same whether it
    falls in a full run of 16 keys or in the run's tail, so accepting a draft never changes a token. Contexts
    that put the rows on both sides of a 16-key boundary, and one well past it."""
    runner = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=64, prefix_cache=False)
    assert runner.model.native is not None
    gen = torch.Generator().manual_seed(5)
    draft = torch.randint(100, 20000, (7,), generator=gen).tolist()
    for n in (13, 45, 250):
        context = torch.randint(100, 20000, (n,), generator=gen).tolist()
        runner.prefill("s", context)
        one = [runner.step([("s", [t])])[0][-1].clone() for t in draft]
        runner.rollback("s", n)
        (rows,) = runner.step([("s", draft)])
        for j, expected in enumerate(one):
            assert torch.equal(rows[j], expected), f"context {n}, row {j}"
        runner.free("s")
