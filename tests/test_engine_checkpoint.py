"""What a checkpoint is, before it loads: `inspect_checkpoint`, clear refusals of what cannot serve, dtype auto.

Checkpoints are tiny random-weight models saved from transformers' own config classes; the refusals are
of real configurations (an encoder, an encoder-decoder, a multimodal model, attention kinds paged
attention has not got, a folder without weights), each named with its architecture and what is missing.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
import transformers as t

from pdserve import checkpoint
from pdserve.checkpoint import UnsupportedModel, inspect_checkpoint, resolve_dtype
from tinymodels import make_tiny

V = 512


def save(model_cls, cfg, path):
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-inspect")


@pytest.mark.model  # the default model's tokenizer
def test_a_servable_checkpoint_is_described_from_its_files(tiny_root, model_dir):
    path = make_tiny("gemma3", tiny_root, model_dir)
    info = inspect_checkpoint(path)
    assert info.supported and info.reason is None
    assert info.architecture == "Gemma3ForCausalLM" and info.model_type == "gemma3_text"
    assert info.layer_windows == (8, 8, 0, 8) and info.num_layers == 4
    assert (info.kv_heads, info.head_dim, info.max_context) == (1, 16, 512)
    # the tokenizer fingerprint follows the files that decide token ids, not the folder
    same = make_tiny("qwen3", tiny_root, model_dir)
    assert inspect_checkpoint(same).tokenizer_fingerprint == info.tokenizer_fingerprint is not None
    other = tiny_root / "other-tokenizer"
    shutil.copytree(same, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 49152, "content": "<|extra|>"})
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert inspect_checkpoint(other).tokenizer_fingerprint != info.tokenizer_fingerprint


@pytest.mark.parametrize("kind,make,reason", [
    ("encoder", lambda p: save(t.BertForMaskedLM, t.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, intermediate_size=64), p),
     r"BertForMaskedLM \(bert\) is not a causal language model"),
    ("encoder-decoder", lambda p: save(t.T5ForConditionalGeneration, t.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2), p),
     "T5ForConditionalGeneration is an encoder-decoder model"),
    ("multimodal", lambda p: save(t.LlavaForConditionalGeneration, t.LlavaConfig(
        text_config=t.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64),
        vision_config=t.CLIPVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, image_size=32, patch_size=8)), p),
     "LlavaForConditionalGeneration is multimodal"),
    ("other attention", lambda p: save(t.Qwen3NextForCausalLM, t.Qwen3NextConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, moe_intermediate_size=32, num_experts=2, num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"]), p),
     "Qwen3NextForCausalLM has linear_attention layers"),
])
def test_what_cannot_serve_is_refused_naming_the_architecture_and_the_missing_piece(tmp_path, kind, make, reason):
    path = make(tmp_path / kind.replace(" ", "-"))
    info = inspect_checkpoint(path)
    assert not info.supported
    assert re.search(reason, info.reason), info.reason


def test_a_folder_without_weights_is_refused(tmp_path):
    t.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64).save_pretrained(tmp_path)
    info = inspect_checkpoint(tmp_path)
    assert not info.supported and "no weights" in info.reason and "LlamaForCausalLM" in info.reason
    assert not inspect_checkpoint(tmp_path / "nowhere").supported


def test_a_worker_refuses_an_unservable_checkpoint_in_one_line(tmp_path):
    """No stack trace: the worker says which checkpoint and why, and exits with 2."""
    path = save(t.BertForMaskedLM, t.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=64), tmp_path / "bert")
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "prefill", "--model", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "BertForMaskedLM (bert) is not a causal language model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dtype_auto_is_bf16_only_where_the_device_runs_it_natively(monkeypatch):
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bfloat16") is torch.bfloat16
    monkeypatch.setattr(checkpoint, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu", "bfloat16") is torch.float32  # emulated bf16 is slower than float32
    monkeypatch.setattr(checkpoint, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu", "float32") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'fp64'"):
        resolve_dtype("fp64")
