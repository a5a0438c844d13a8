"""The CPU step's substitutions in a transformers model compute what the model's own modules compute.

`cpustep` replaces projections (transposed weights, q/k/v and gate/up fused), RMSNorms (one fused op) and
the rotary embedding (4 ops instead of 7), and binds forwards past pass-through wrappers. Each must leave
the model's output unchanged: checked on tiny random models built from transformers' config classes,
against an untouched copy of the same model, bit for bit where the arithmetic is the same.
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch
import transformers as t
from torch import nn

from pdserve.engine import cpustep
from pdserve.engine.cpustep import CpuLinear, FusedMember, FusedRMSNorm


def tiny(cls, cfg_cls, **kw):
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    return cls(cfg).eval()


@pytest.mark.parametrize("cls,cfg_cls,extra", [
    (t.Qwen2ForCausalLM, t.Qwen2Config, {}),  # q/k/v biases
    (t.LlamaForCausalLM, t.LlamaConfig, {"tie_word_embeddings": True}),
    (t.GemmaForCausalLM, t.GemmaConfig, {"head_dim": 16}),  # a (1 + weight) norm
    (t.Phi3ForCausalLM, t.Phi3Config, {"partial_rotary_factor": 0.5}),  # fused qkv already; a partial rotary
], ids=["qwen2", "llama", "gemma", "phi3"])
def test_the_cpu_step_computes_what_the_model_computes(cls, cfg_cls, extra):
    model = tiny(cls, cfg_cls, **extra)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(ids).logits
        cpustep.adapt_linears(model)
        cpustep.add_small_step_layouts(model)
        norms = cpustep.fuse_rms_norms(model)
        cpustep.fast_rotary(model)
        cpustep.unwrap_forwards(model)
        for rows in (1, 2, 5, 11):  # each weight layout's row range
            torch.testing.assert_close(model(ids[:, :rows]).logits, ref(ids[:, :rows]).logits, rtol=1e-5, atol=1e-5)
        got = model(ids).logits
    assert not any(type(m) is nn.Linear for m in model.modules())
    if cls is t.GemmaForCausalLM:
        assert norms == 0  # its norm scales by 1 + weight: not F.rms_norm, kept
    else:
        assert norms == 2 * 2 + 1  # two per layer and the final one
    if cls is t.LlamaForCausalLM:
        assert torch.equal(got, want)  # the same float32 arithmetic, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_weight_layout_computes_the_linear_at_every_row_count(dtype):
    """Whichever layout a plan names for whichever row count, a projection computes nn.Linear's product
    (relative to its scale: the layouts' kernels sum in other orders); layouts a module lacks fall back to
    x @ W_t."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 160).to(dtype)
    mod = cpustep._cpu_linear(lin)
    holder = nn.Sequential(mod)
    cpustep.add_small_step_layouts(holder)
    assert mod.weight_rows is not None
    layouts = ["t", "rows"] + (["packed"] if mod.weight_packed is not None else [])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    plan = cpustep.StepPlan()
    mod.plan = plan
    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 13):
            x = torch.randn(1, rows, 96).to(dtype)
            want = lin(x).float()
            for name in layouts:
                plan.by_rows = (name,) * 6
                got = mod(x).float()
                assert got.shape == want.shape
                assert (got - want).abs().max() <= tol * want.abs().max(), (name, rows)
        plan.by_rows = ("packed",) * 2
        mod.weight_packed = None  # released: the plan's layout is gone, x @ W_t computes it
        x = torch.randn(1, 1, 96).to(dtype)
        assert torch.equal(mod(x), torch.mm(x.reshape(1, -1), mod.weight_t).view(1, 1, -1) + mod.bias)


def test_row_counts_past_the_plan_take_its_last_layout():
    """A batched step is larger than any size a calibration measured: it takes the layout of the largest one
    (its last entry), not "t". Seen through an `[out, in]` copy made different on purpose: only the "rows"
    layout reads it."""
    torch.manual_seed(0)
    mod = cpustep._cpu_linear(nn.Linear(32, 48, bias=False))
    mod.weight_rows = -mod.weight_t.t().contiguous()
    mod.plan = cpustep.StepPlan()
    x = torch.randn(1, 7, 32)
    with torch.inference_mode():
        t_out = torch.mm(x.reshape(7, -1), mod.weight_t).view(1, 7, -1)
        mod.plan.by_rows = ("t", "t", "rows")  # measured up to 2 rows; the largest took "rows"
        assert torch.allclose(mod(x), -t_out, rtol=1e-5, atol=1e-5)
        mod.plan.by_rows = ("rows", "rows", "t")
        assert torch.equal(mod(x), t_out)


def test_fused_projections_share_one_matmul_and_stay_right_when_called_apart():
    model = tiny(t.Qwen2ForCausalLM, t.Qwen2Config)
    attn = model.model.layers[0].self_attn
    q, k, v = (copy.deepcopy(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj"))
    cpustep.adapt_linears(model)
    assert all(isinstance(getattr(attn, n), FusedMember) for n in ("q_proj", "k_proj", "v_proj"))
    assert isinstance(attn.q_proj.fused, CpuLinear) and attn.q_proj.fused.out_features == 64 + 2 * 32
    x, other = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    with torch.inference_mode():
        calls = []
        orig = attn.q_proj.fused.forward
        attn.q_proj.fused.forward = lambda y: calls.append(y) or orig(y)
        got = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        assert len(calls) == 1  # one matmul for the three
        for a, lin in zip(got, (q, k, v)):
            torch.testing.assert_close(a, lin(x), rtol=1e-6, atol=1e-6)
        # out of order, or on another tensor: each computes its own columns
        torch.testing.assert_close(attn.v_proj(other), v(other), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(attn.k_proj(other), k(other), rtol=1e-6, atol=1e-6)
    assert torch.equal(attn.k_proj.weight, k.weight)  # model code that reads a projection's weight sees it


def test_fast_rotary_is_bitwise_the_models_and_leaves_other_shapes_to_it():
    # Phi-3's function also rotates part of a head (partial_rotary_factor): the shape FastRotary leaves to it
    model = tiny(t.Phi3ForCausalLM, t.Phi3Config, partial_rotary_factor=0.5)
    mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = getattr(mod.apply_rotary_pos_emb, "original", mod.apply_rotary_pos_emb)  # installed by an engine
    mod.apply_rotary_pos_emb = original
    try:
        assert type(model).__module__ in cpustep.fast_rotary(model)
        fast = mod.apply_rotary_pos_emb
        assert isinstance(fast, cpustep.FastRotary) and fast.original is original
        g = torch.Generator().manual_seed(3)
        for dtype in (torch.float32, torch.bfloat16):
            q, k = torch.randn(1, 4, 6, 16, generator=g).to(dtype), torch.randn(1, 2, 6, 16, generator=g).to(dtype)
            cos, sin = torch.randn(1, 6, 16, generator=g).to(dtype), torch.randn(1, 6, 16, generator=g).to(dtype)
            for a, b in zip(fast(q, k, cos, sin), original(q, k, cos, sin)):
                assert torch.equal(a, b)
        half = torch.randn(1, 6, 8, generator=g)  # rotary over half the head
        q, k = q.float(), k.float()
        for a, b in zip(fast(q, k, half, half), original(q, k, half, half)):
            assert torch.equal(a, b)
    finally:
        mod.apply_rotary_pos_emb = original


def test_only_norms_that_equal_f_rms_norm_are_fused():
    class OffsetRMSNorm(nn.Module):  # named like one, computes something else: kept
        def __init__(self, dim):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(dim)), 1e-6

        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) + 1e-3

    model = tiny(t.LlamaForCausalLM, t.LlamaConfig)
    model.model.norm = OffsetRMSNorm(64)
    assert cpustep.fuse_rms_norms(model) == 4  # the layers' norms, not the odd one
    assert isinstance(model.model.layers[0].input_layernorm, FusedRMSNorm)
    assert isinstance(model.model.norm, OffsetRMSNorm)


def test_a_bfloat16_llama_norm_is_fused_in_its_upcast_form_bit_for_bit():
    """In bfloat16 transformers' Llama norm normalises in float32 and scales in bfloat16: not `F.rms_norm` in
    bfloat16, but `FusedRMSNorm`'s upcast form, which must give the model's own logits bit for bit."""
    model = tiny(t.LlamaForCausalLM, t.LlamaConfig).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for m in model.modules():  # a trained model's norm weights (a fresh one's are ones, where both forms agree)
        if "RMSNorm" in type(m).__name__:
            m.weight.data = (1 + torch.randn(m.weight.shape, generator=gen)).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert cpustep.fuse_rms_norms(model) == 2 * 2 + 1
        assert all(m.upcast for m in model.modules() if isinstance(m, FusedRMSNorm))
        assert torch.equal(model(ids).logits, ref(ids).logits)
