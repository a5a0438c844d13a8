"""create_engine: which engine serves which model, and both engines answer the `Engine` calls alike (real model)."""
from __future__ import annotations

import json
import shutil

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
def other_family(tmp_path_factory, model_dir) -> ModelRunner:
    """A checkpoint folder of a family the paged engine does not implement (Qwen2: config and
    tokenizer only, which is all choosing an engine reads; weights load on first forward)."""
    from transformers import Qwen2Config

    folder = tmp_path_factory.mktemp("qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, folder / name)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")  # the fingerprint reads the weights' bytes
    return ModelRunner(folder)


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


def test_other_families_fall_back_to_dense_and_paged_says_why_not(other_family):
    assert other_family.config.model_type == "qwen2"
    engine = create_engine(other_family, kv_capacity_bytes=CAPACITY)
    assert isinstance(engine, DenseEngine) and engine.layout == other_family.layout
    with pytest.raises(EngineUnavailable, match="qwen2 is not one"):
        create_engine(other_family, kind="paged", kv_capacity_bytes=CAPACITY)


def test_an_unknown_engine_is_refused_by_name(runner):
    with pytest.raises(EngineUnavailable, match="unknown engine 'fast'.*auto, paged, dense"):
        create_engine(runner, kind="fast", kv_capacity_bytes=CAPACITY)
