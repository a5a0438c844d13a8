"""Every decoder-only family on the paged engine, against transformers' own `generate`.

Tiny random-weight checkpoints (tests/tinymodels.py: Llama, Qwen2, Qwen3, Mistral, Gemma 3, Gemma 2,
Phi-3, Qwen3-MoE, GPT-OSS) run through `PagedRunner` — the checkpoint's transformers implementation
with pdserve's paged attention — alone, in ragged batches, speculatively with rollback, and handed off
(a sliding-window layer ships only its window) into a second engine whose pool holds NaN everywhere
the handoff did not write. Greedy tokens must equal `generate`'s, token for token.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pdserve.checkpoint import inspect_checkpoint, layer_windows
from pdserve.engine.runner import PagedRunner
from tinymodels import FAMILIES, make_tiny

pytestmark = pytest.mark.model  # the default model's tokenizer
NEW = 10
BLOCK = 4  # small blocks: a prompt of a few dozen tokens spans many, a window several


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def prompts(tok) -> list[list[int]]:
    texts = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.",
             "Once upon a time", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints the sum of two numbers"]
    return [tok.encode(t) for t in texts]


def greedy(runner: PagedRunner, seq, ids: list[int], n: int) -> list[int]:
    out = [int(runner.prefill(seq, ids).argmax())]
    while len(out) < n:
        (logits,) = runner.step([(seq, [out[-1]])])
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_family_equals_generate_alone_batched_speculative_and_handed_off(family, tiny_root, model_dir):
    from transformers import AutoTokenizer

    path = make_tiny(family, tiny_root, model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = prompts(tok)
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                            pad_token_id=2)[0, len(p):].tolist() for p in ps]

    runner = PagedRunner(path, num_blocks=128, block_size=BLOCK)
    windows = layer_windows(AutoConfig.from_pretrained(path))
    assert tuple(runner.layout.window(i) for i in range(len(windows))) == windows == inspect_checkpoint(path).layer_windows
    assert (family in ("mistral", "gemma3", "gemma2", "gpt_oss")) == any(windows)

    # alone
    for i, p in enumerate(ps):
        assert greedy(runner, ("alone", i), p, NEW) == want[i], f"{family} prompt {i}"
        runner.free(("alone", i))

    # one ragged batch: all prompts' prefill in one step, then decode together
    seqs = [("batch", i) for i in range(len(ps))]
    for s, p in zip(seqs, ps):
        runner.start(s, p, reuse_prefix=False)
    firsts = runner.step(list(zip(seqs, ps)), last_only=True)
    outs = [[int(f[-1].argmax())] for f in firsts]
    while len(outs[0]) < NEW:
        logits = runner.step([(s, [o[-1]]) for s, o in zip(seqs, outs)])
        for o, lg in zip(outs, logits):
            o.append(int(lg[-1].argmax()))
    assert outs == want
    for s in seqs:
        runner.free(s)

    # speculative: verify 3 right drafts and a wrong one in one step, roll back the rejected, continue
    p, w = ps[0], want[0]
    runner.prefill("spec", p)
    wrong = (w[4] + 1) % runner.vocab_size
    (rows,) = runner.step([("spec", [w[0], w[1], w[2], w[3], wrong])])
    assert [int(r.argmax()) for r in rows[:4]] == w[1:5]
    runner.rollback("spec", len(p) + 4)
    out = w[:5]
    while len(out) < NEW:
        (lg,) = runner.step([("spec", [out[-1]])])
        out.append(int(lg[-1].argmax()))
    assert out == w
    runner.free("spec")

    # handoff: the KV a handoff carries, into an engine whose pool is NaN wherever the handoff wrote nothing
    runner.prefill("src", p)
    full = runner.export_kv("src")
    kv = full.for_handoff()
    assert kv.nbytes == runner.layout.payload_bytes(len(p))
    if any(windows):
        assert kv.nbytes < full.nbytes  # the windowed layers ship only their window's blocks
    receiver = PagedRunner(path, num_blocks=64, block_size=BLOCK, prefix_cache=False)
    receiver.pool.kv.fill_(float("nan"))
    receiver.import_kv("dst", kv, p)
    out = [w[0]]
    while len(out) < NEW:
        (lg,) = receiver.step([("dst", [out[-1]])])
        assert not lg.isnan().any()
        out.append(int(lg[-1].argmax()))
    assert out == w


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gpt_oss"])
def test_a_sliding_window_draft_model_rolls_back_past_its_window(family, tiny_root, model_dir):
    """The draft-model drafter's own transformers cache keeps what `crop` rolls back on sliding-window layers:
    the model as its own draft proposes exactly its greedy continuation, step after step, long past the window."""
    from transformers import AutoTokenizer

    from pdserve.decode.drafters import DraftModelDrafter

    path = make_tiny(family, tiny_root, model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    drafter = DraftModelDrafter(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    ctx = prompts(tok)[0]
    for _ in range(4):  # each step: 4 proposed, 2 accepted and a correction, the rest rolled back
        proposal = drafter.propose_now("r", ctx, 4).token_ids
        with torch.inference_mode():
            want = hf.generate(torch.tensor([ctx]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                               pad_token_id=2)[0, len(ctx):].tolist()
        assert proposal == want
        new = proposal[:2] + [(proposal[2] + 1) % 1000]
        drafter.feedback("r", 2, new)
        ctx = ctx + new
    assert len(ctx) > 2 * 8  # well past the 8-token window


def test_a_sharded_checkpoint_serves_like_the_single_file(tiny_root, model_dir, tmp_path):
    """Sharded safetensors (an index and several files, as large checkpoints ship) load into the paged engine
    whole: the same greedy tokens as `generate`."""
    import shutil

    from transformers import AutoTokenizer

    path = make_tiny("qwen3_moe", tiny_root, model_dir)
    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.save_pretrained(sharded, max_shard_size="200KB")
    for f in path.iterdir():
        if not (sharded / f.name).exists() and not f.name.startswith(("model", "pdserve-")):
            shutil.copy(f, sharded / f.name)
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()

    p = prompts(AutoTokenizer.from_pretrained(sharded))[0]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           pad_token_id=2)[0, len(p):].tolist()
    assert greedy(PagedRunner(sharded, num_blocks=64, block_size=BLOCK), "s", p, NEW) == want
