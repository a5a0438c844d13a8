"""create_engine: which engine serves which model, and both engines answer the `Engine` calls alike (real model)."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import Engine, EngineUnavailable, create_engine
from pdserve.engine.dense import DenseEngine
from pdserve.engine.runner import PagedRunner
from pdserve.runtime import ModelRunner

pytestmark = pytest.mark.model

CAPACITY = 64 << 20


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-factory")


def test_llama_gets_the_paged_engine_sized_by_capacity(runner):
    engine = create_engine(runner, kv_capacity_bytes=CAPACITY, prefix_cache=False)
    assert isinstance(engine, PagedRunner) and isinstance(engine, Engine)
    assert engine.layout == runner.layout
    assert engine.pool.num_blocks == CAPACITY // (runner.layout.block_bytes * runner.layout.num_layers)
    assert engine.prefix_cache is False


def test_paged_and_dense_engines_decode_alike(runner):
    """The same calls on both engines give the same greedy tokens: the workers need not know which they drive."""
    prompt = runner.encode("The three primary colours are")
    outputs = []
    for kind in ("paged", "dense"):
        engine = create_engine(runner, kind=kind, kv_capacity_bytes=CAPACITY)
        assert isinstance(engine, PagedRunner if kind == "paged" else DenseEngine)
        assert isinstance(engine, Engine)
        assert engine.can_admit(len(prompt) + 8)
        tokens = [int(torch.argmax(engine.prefill("s", prompt)))]
        for _ in range(5):
            (logits,) = engine.step([("s", tokens[-1:])], last_only=True)
            tokens.append(int(torch.argmax(logits[-1])))
        assert "s" in engine and engine.num_tokens("s") == len(prompt) + 5
        assert engine.export_kv("s").num_tokens == len(prompt) + 5
        engine.rollback("s", len(prompt))
        assert engine.num_tokens("s") == len(prompt)
        engine.free("s")
        assert "s" not in engine
        outputs.append(tokens)
    assert outputs[0] == outputs[1]


def test_both_engines_offer_the_whole_protocol_the_workers_call(runner):
    """The workers call forks, step layouts and layer hooks on any engine, never probing it: each engine answers
    them, a fork decodes as its parent does, and an engine without layer callbacks says so and refuses them."""
    prompt = runner.encode("Name a colour:")
    for kind in ("paged", "dense"):
        engine = create_engine(runner, kind=kind, kv_capacity_bytes=CAPACITY)
        assert engine.device == runner.device and engine.vocab_size == runner.vocab_size
        assert "t" in engine.step_layouts()
        engine.set_step_plan(("t",) * 4)
        engine.release_unplanned_layouts()
        engine.prefill("p", prompt)
        engine.fork("p", "c")
        with pytest.raises(KeyError):
            engine.fork("p", "c")
        assert engine.num_tokens("c") == engine.num_tokens("p") == len(prompt)
        a, b = engine.step([("p", [42]), ("c", [42])], last_only=True)
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same KV, the same token: the same logits
        engine.free("p")
        (after,) = engine.step([("c", [7])], last_only=True)  # the child outlives its parent
        assert torch.isfinite(after).all()
        engine.free("c")
        seen = []
        if kind == "paged":
            assert engine.layer_hooks
            engine.add_layer_hooks(before=seen.append)
            engine.prefill("h", prompt)
            assert seen == list(range(runner.layout.num_layers))
        else:
            assert not engine.layer_hooks
            with pytest.raises(NotImplementedError, match="layer_hooks is False"):
                engine.add_layer_hooks(before=seen.append)
            with pytest.raises(ValueError, match="unknown weight layout"):
                engine.set_step_plan(("packed",))


def test_every_family_gets_the_paged_engine_and_dense_is_for_full_attention_only(tiny_root, model_dir):
    from tinymodels import make_tiny

    qwen2 = ModelRunner(make_tiny("qwen2", tiny_root, model_dir))
    engine = create_engine(qwen2, kv_capacity_bytes=CAPACITY)
    assert isinstance(engine, PagedRunner) and engine.layout == qwen2.layout
    assert isinstance(create_engine(qwen2, kind="dense", kv_capacity_bytes=CAPACITY), DenseEngine)
    mistral = ModelRunner(make_tiny("mistral", tiny_root, model_dir))
    assert mistral.layout.layer_windows == (8, 8, 8)
    assert create_engine(mistral, kv_capacity_bytes=CAPACITY).layout == mistral.layout
    with pytest.raises(EngineUnavailable, match="full-attention models; mistral has sliding-window layers"):
        create_engine(mistral, kind="dense", kv_capacity_bytes=CAPACITY)


def test_an_unknown_engine_is_refused_by_name(runner):
    with pytest.raises(EngineUnavailable, match="unknown engine 'fast'.*auto, paged, dense"):
        create_engine(runner, kind="fast", kv_capacity_bytes=CAPACITY)
