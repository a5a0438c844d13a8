"""Tiny random-weight checkpoints of transformers' decoder-only families, built from transformers' own config
classes (nothing downloaded), with the default model's tokenizer (vocab_size set to match it).

Each family is small enough to load in a second and exercises what sets it apart: tied or untied
embeddings, projection biases, q/k norms, sliding windows (on every layer, or alternating with full
attention), logit soft caps, attention sinks, mixtures of experts. Windows are a few tokens, so a
prompt of a few dozen tokens spans several of them. Weights are drawn wider than the configs'
defaults so the logits have clear winners: greedy comparisons then test the computation, not ties.
"""
from __future__ import annotations

import json
import zlib
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
WINDOW = 8  # tokens a sliding-window layer sees

# A chat template that shows tools, tool calls and system prompts to the model (Qwen's style, abridged),
# for the families whose serving tests check that the front passes them through.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}
{% endif %}# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}{%- for message in messages %}{% if message['role'] != 'system' %}<|im_start|>{{ message['role'] }}
{% if message['content'] %}{{ message['content'] }}{% endif %}{% if message.tool_calls %}{% for call in message.tool_calls %}\
<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}\
{% endif %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS_TEMPLATE_FAMILIES = ("qwen2",)


def _configs(vocab: int, hidden: int = 64, layers: int | None = None) -> dict:
    """Each family's config at `hidden` width (heads of 16 dims) and its own layer count, or `layers` for all."""
    import transformers as t

    heads = hidden // 16
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                  num_key_value_heads=heads // 2, head_dim=16, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2)
    n = (lambda own: layers or own)
    return {
        "llama": t.LlamaConfig(**common, num_hidden_layers=n(3), tie_word_embeddings=True),
        "qwen2": t.Qwen2Config(**common, num_hidden_layers=n(3), tie_word_embeddings=False),  # q/k/v biases
        "qwen3": t.Qwen3Config(**common, num_hidden_layers=n(3), tie_word_embeddings=False),  # q/k norms
        "mistral": t.MistralConfig(**common, num_hidden_layers=n(3), sliding_window=WINDOW),  # every layer sliding
        "gemma3": t.Gemma3TextConfig(**{**common, "num_key_value_heads": 1}, num_hidden_layers=n(4),  # MQA
                                     sliding_window=WINDOW, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                                     layer_types=[("sliding_attention", "sliding_attention", "full_attention",
                                                   "sliding_attention")[i % 4] for i in range(n(4))]),
        "gemma2": t.Gemma2Config(**common, num_hidden_layers=n(2), sliding_window=WINDOW, query_pre_attn_scalar=16,
                                 attn_logit_softcapping=5.0, final_logit_softcapping=30.0),  # attention soft cap
        "phi3": t.Phi3Config(**{k: v for k, v in common.items() if k != "head_dim"}, num_hidden_layers=n(3)),
        "qwen3_moe": t.Qwen3MoeConfig(**{**common, "intermediate_size": 3 * hidden // 2}, num_hidden_layers=n(2),
                                      moe_intermediate_size=hidden // 2, num_local_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=True),  # as Qwen3-30B-A3B: the k probabilities renormalised
        "gpt_oss": t.GptOssConfig(**common, num_hidden_layers=n(2), num_local_experts=4, num_experts_per_tok=2,
                                  sliding_window=WINDOW,
                                  layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(n(2))],
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    }


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma2", "phi3", "qwen3_moe", "gpt_oss")


def make_tiny(family: str, root: Path, tokenizer_dir: Path, *, hidden: int = 64, layers: int | None = None) -> Path:
    """Save the tiny `family` checkpoint (float32) with `tokenizer_dir`'s tokenizer under root/family; returns it.

    `hidden` and `layers` size it (benchmarks compare families at one size); the tests use the defaults."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(root) / (family if (hidden, layers) == (64, None) else f"{family}-{hidden}x{layers}")
    if (out / "config.json").is_file():
        return out
    tok = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + len([t for t in tok.get("added_tokens", []) if t["id"] >= len(tok["model"]["vocab"])])
    cfg = _configs(vocab, hidden, layers)[family]
    torch.manual_seed(zlib.crc32(family.encode()))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # wide weights: confident logits
                p.normal_(0.0, 0.2 if "embed" in name else 0.15)
            elif "sinks" in name:
                p.normal_(0.0, 1.0)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, tmp / name)
    if family in TOOLS_TEMPLATE_FAMILIES:
        (tmp / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    tmp.rename(out)
    return out


def set_stop_tokens(path: Path, eos_ids: list[int]) -> None:
    """List several stop tokens in the checkpoint's generation config (as Llama 3 does)."""
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=1, eos_token_id=eos_ids, pad_token_id=eos_ids[0]).save_pretrained(path)
