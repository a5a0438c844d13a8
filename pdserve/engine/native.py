"""Steps of Llama-style models on the CPU, bfloat16 or float32, one native call per decoder layer.

`NativeDecoder` hands an `HFPagedModel`'s decoder layers to `kernels/cpu_decoder.c` (bfloat16: weights packed
for its GEMV; float32: the model's own `[in, out]` weights, read in place) and runs a step of up to `max_rows`
rows (1024: `kernels/cpu_decoder.py`) through them, keeping from transformers only the embedding, the rotary
tables, the final norm (bfloat16) and the head.

Which models: an architecture whose decoder layer is exactly pre-norm attention and a SiLU-gated MLP
with transformers' Llama norm (`NATIVE_TYPES`; q/k/v biases allowed, as Qwen2 has; per-head q/k norms, as Qwen3
has; projections fused in the checkpoint, as Phi-3 has), full or sliding-window attention with an optional soft cap (no sinks), in bfloat16 or float32 on a CPU with AVX512-BF16 or AVX2 + FMA, the kernels
prebuilt or a C compiler present, and `PDSERVE_NATIVE_DECODE` not "0". `from_model` returns None (and says why at
debug level) for anything else, which keeps transformers' forward. The layers compute what transformers'
forward does up to the summation order of matmuls and reductions (tests/test_kernel_cpu_decoder.py), and that
order is fixed by a row's position alone: a sequence's logits are the same bits whatever its batch, its chunking,
its cached prefix or the thread count (tests/test_invariance.py).
"""
from __future__ import annotations

import ctypes
import logging

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pdserve.engine.cpustep import CpuLinear, FusedMember, FusedRMSNorm
from pdserve.kernels.cpu_decoder import (LayerWeights, float32_available, gemm_f32, gemv, library, max_rows, pack,
                                         rms_norm_f32)

log = logging.getLogger("pdserve.engine.native")

# config.model_type: pre-norm attention and a gated MLP. Llama's norms and SiLU (Qwen3: per-head q/k norms before the
# rotary; Phi-3: q/k/v and gate/up fused in the checkpoint), or Gemma's norms (1 + weight, scaled before rounding),
# GELU and norms of the attention's and MLP's outputs too (Gemma 2 and 3: sliding windows, soft caps, q/k norms)
# Qwen3-MoE: its sparse blocks as experts in C (router, top-k, each expert's gated MLP)
NATIVE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "qwen3_moe")
_LLAMA_NORMS = {f"{name}RMSNorm" for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Phi3")}
_GEMMA_NORMS = {"Gemma2RMSNorm", "Gemma3RMSNorm"}


def _norm_of(m) -> tuple[str, Tensor, float] | None:
    """(kind, weight, eps) of a norm the C layer computes: "llama" — `weight * (x.float() * rsqrt(mean(x^2) +
    eps)).to(dtype)`, as the model's own module (`LlamaRMSNorm`, ...) or a `cpustep.FusedRMSNorm` that replaced it
    (found equal to it bit for bit) — or "gemma" — `(x.float() * rsqrt(...) * (1 + weight.float())).to(dtype)`;
    None for any other."""
    if isinstance(m, FusedRMSNorm):
        return "llama", m.weight, m.eps
    name, weight = type(m).__name__, getattr(m, "weight", None)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not (isinstance(eps, float) and isinstance(weight, nn.Parameter) and weight.dim() == 1):
        return None
    if name in _LLAMA_NORMS:
        return "llama", weight, eps
    if name in _GEMMA_NORMS:
        return "gemma", weight, eps
    return None


def _layer_norms(layer) -> dict[str, object] | None:
    """A layer's norms by the C layer's names: ln1 (before attention), ln2 (before the MLP), and Gemma's post_attn
    and post_ffn (of the attention's and the MLP's outputs); None where the layer has another arrangement."""
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 2 and 3: four norms
        names = dict(ln1="input_layernorm", post_attn="post_attention_layernorm", ln2="pre_feedforward_layernorm",
                     post_ffn="post_feedforward_layernorm")
    else:
        names = dict(ln1="input_layernorm", ln2="post_attention_layernorm")
    found = {k: getattr(layer, v, None) for k, v in names.items()}
    return found if all(m is not None for m in found.values()) else None


def _activation(mlp, dtype: torch.dtype) -> str | None:
    """"silu" or "gelu" (the tanh approximation) by what the MLP's `act_fn` computes, bit for bit; else None."""
    act = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
    if act is None:
        return None
    x = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    with torch.inference_mode():
        y = act(x)
        if torch.equal(y, F.silu(x)):
            return "silu"
        if torch.equal(y, F.gelu(x, approximate="tanh")):
            return "gelu"
    return None


def _experts(mlp):
    """A sparse block the C layer computes — Qwen3-MoE's: a router (`gate.weight` [E, hidden], `top_k`,
    `norm_topk_prob`, its probabilities cast to the model's dtype) and experts as 3D weights (`gate_up_proj`
    [E, 2I, hidden], `down_proj` [E, hidden, I]) — as (router, experts); None for anything else (a dense MLP, a
    shared expert, another router)."""
    router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if type(router).__name__ != "Qwen3MoeTopKRouter" or type(experts).__name__ != "Qwen3MoeExperts":
        return None
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == down.dim() == 3):
        return None
    if hasattr(mlp, "shared_expert") or router.weight.shape != (gu.shape[0], gu.shape[2]):
        return None
    return router, experts


def _projections(layer) -> tuple[CpuLinear, CpuLinear, CpuLinear | None, CpuLinear | None] | str:
    """A layer's (q/k/v, o, gate/up, down) projections, each one CpuLinear (q/k/v's outputs q, k, v in that order,
    gate/up's gate then up): fused by `cpustep` from separate modules (Llama, Qwen, Gemma) or fused in the
    checkpoint (Phi-3's qkv_proj and gate_up_proj); gate/up and down None for a sparse block (`_experts`); else
    why not."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    q, gate = getattr(attn, "q_proj", None), getattr(mlp, "gate_proj", None)
    if isinstance(getattr(attn, "qkv_proj", None), CpuLinear):
        qkv = attn.qkv_proj
    elif isinstance(q, FusedMember) and q.first and isinstance(attn.v_proj, FusedMember) and attn.v_proj.last:
        qkv = q.group.linear
    else:
        return "a layer's q/k/v are not one fused projection"
    o = getattr(attn, "o_proj", None)
    if _experts(mlp) is not None:
        if not (isinstance(o, CpuLinear) and o.bias is None):
            return "a layer's o projection has a bias"
        return qkv, o, None, None
    if isinstance(getattr(mlp, "gate_up_proj", None), CpuLinear):
        gate_up = mlp.gate_up_proj
    elif isinstance(gate, FusedMember) and gate.first and isinstance(mlp.up_proj, FusedMember):
        gate_up = gate.group.linear
    else:
        return "a layer's gate/up are not one fused projection"
    o, down = getattr(attn, "o_proj", None), getattr(mlp, "down_proj", None)
    if not (isinstance(o, CpuLinear) and o.bias is None and isinstance(down, CpuLinear) and down.bias is None):
        return "a layer's o or down projection has a bias"
    if gate_up.bias is not None:
        return "a layer's gate/up projection has a bias"
    return qkv, o, gate_up, down


def _why_not(model) -> str | None:
    """None where `model` (an HFPagedModel) can run natively, else the reason."""
    cfg = model.config
    if cfg.model_type not in NATIVE_TYPES:
        return f"model type {cfg.model_type!r} is not one of {NATIVE_TYPES}"
    if getattr(cfg, "mlp_bias", False):
        return "its MLP has biases"
    if any(a.sinks for a in model.attention):
        return "a layer has attention sinks"
    if len({a.scaling for a in model.attention}) != 1:
        return "its layers scale attention differently"
    dtype, device = next(model.hf.parameters()).dtype, next(model.hf.parameters()).device
    if dtype not in (torch.bfloat16, torch.float32) or device.type != "cpu":
        return f"{dtype} on {device}: the native layers are bfloat16 or float32 on the CPU"
    if dtype == torch.float32 and library() is not None and not float32_available():
        return "the float32 layer is not built here (it needs AVX2 + FMA)"
    if model.head_dim > 512 or model.head_dim % 2:
        return f"head_dim {model.head_dim}"
    if getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        return "its rotary embedding covers part of each head"
    inner = getattr(model.hf, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return "its model has no embed_tokens, rotary_emb and norm to run around the layers"
    final = _norm_of(inner.norm)
    if final is None:
        return "its final norm is neither transformers' Llama norm nor Gemma's"
    kind, eps = final[0], final[2]
    nq, nkv = attn_q_kv(model)
    for layer in model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = _layer_norms(layer)
        if norms is None:
            return "a layer's norms are arranged otherwise"
        for name in ("q_norm", "k_norm"):  # per-head norms over head_dim (Qwen3, Gemma 3)
            if getattr(attn, name, None) is not None:
                norms[name] = getattr(attn, name)
        for name, m in norms.items():
            found = _norm_of(m)
            if found is None or found[0] != kind or found[2] != eps:
                return f"a layer's {name} is not a {kind} norm with the model's eps"
            if name in ("q_norm", "k_norm") and found[1].shape != (model.head_dim,):
                return f"a layer's {name} is not over head_dim"
        moe = _experts(mlp)
        if _activation(moe[1] if moe else mlp, dtype) is None:
            return "its MLP's activation is neither SiLU nor GELU (tanh)"
        parts = _projections(layer)
        if isinstance(parts, str):
            return parts
        if parts[0].out_features != nq + 2 * nkv:
            return "a layer's fused q/k/v projection is not of the config's size"
        if parts[2] is not None and parts[2].out_features != 2 * int(cfg.intermediate_size):
            return "a layer's fused gate/up projection is not of the config's size"
    return None


def attn_q_kv(model) -> tuple[int, int]:
    """The q and k (or v) widths of a layer's attention: heads x head_dim."""
    a = model.attention[0]
    return a.q_heads * a.head_dim, a.kv_heads * a.head_dim


class NativeDecoder:
    """An HFPagedModel's decoder layers packed for `pdserve_llama_layer`; `forward` is the model's step."""

    def __init__(self, model, lib: ctypes.CDLL):
        self.lib = lib
        self.hf = model.hf
        cfg = model.config
        a = model.attention[0]
        self.q_heads, self.kv_heads, self.head_dim, self.scale = a.q_heads, a.kv_heads, a.head_dim, a.scaling
        self.hidden = int(cfg.hidden_size)
        self.inter = int(cfg.intermediate_size)  # a dense layer's MLP width
        kind, _, self.eps = _norm_of(model.hf.model.norm)
        self.dtype = next(model.hf.parameters()).dtype
        f32 = self.dtype == torch.float32
        # float32 reads each projection's own weight_t [in, out] in place; bfloat16 packs a copy for its GEMV
        layout = (lambda w: w.detach().contiguous()) if f32 else pack

        def norm_weight(m) -> Tensor:  # as the C layer takes it: Gemma's as float32 1 + weight
            w = _norm_of(m)[1].detach()
            return (1.0 + w.float()).contiguous() if kind == "gemma" else w.contiguous()

        self._packed: list[Tensor] = []  # owns every buffer a layer's struct points at
        self.weights: list[LayerWeights] = []
        self.inters: list[int] = []  # each layer's MLP width (an expert's in a sparse block)
        for layer, spec in zip(model.layers, model.attention):
            attn = layer.self_attn
            qkv, o, gate_up, down = _projections(layer)
            bufs = {name: norm_weight(m) for name, m in _layer_norms(layer).items()}
            bufs.update(qkv=layout(qkv.weight_t), o=layout(o.weight_t))
            moe = {}
            if gate_up is None:  # a sparse block: the router and every expert in the kernel's layout, stacked
                router, experts = _experts(layer.mlp)
                per_gu = [layout(w.detach().t()) for w in experts.gate_up_proj]
                per_down = [layout(w.detach().t()) for w in experts.down_proj]
                bufs.update(router=layout(router.weight.detach().t()), experts_gate_up=torch.stack(per_gu),
                            experts_down=torch.stack(per_down))
                moe = dict(expert_gu_stride=per_gu[0].numel(), expert_down_stride=per_down[0].numel(),
                           n_experts=router.weight.shape[0], top_k=int(router.top_k),
                           norm_topk=int(bool(router.norm_topk_prob)))
                self.inters.append(int(experts.down_proj.shape[2]))
                gated = experts
            else:
                bufs.update(gate_up=layout(gate_up.weight_t), down=layout(down.weight_t))
                self.inters.append(self.inter)
                gated = layer.mlp
            if qkv.bias is not None:
                bufs["qkv_bias"] = qkv.bias.detach().contiguous()
            for name in ("q_norm", "k_norm"):
                if getattr(attn, name, None) is not None:
                    bufs[name] = norm_weight(getattr(attn, name))
            self._packed += bufs.values()
            self.weights.append(LayerWeights(**{k: v.data_ptr() for k, v in bufs.items()},
                                             window=spec.sliding_window or 0, softcap=spec.softcap or 0.0,
                                             gemma_norm=int(kind == "gemma"),
                                             gelu=int(_activation(gated, self.dtype) == "gelu"),
                                             **moe))
        # The head through the same GEMV: a vocabulary-wide head is a large part of a small step, and the GEMV
        # takes a fraction of oneDNN's bf16 matmul's time for it, at the price of one more copy of the head's
        # weights (docs/PERFORMANCE.md, "LM head"). In float32 the head's own weight_t, so its logits are
        # row-invariant too.
        head = self.hf.lm_head
        self.vocab = None
        if isinstance(head, CpuLinear) and head.weight_t.dtype == self.dtype and (f32 or head.weight_t.shape[0] % 2 == 0):
            self.vocab = int(head.weight_t.shape[1])
            self._head = layout(head.weight_t)
            self._head_bias = None if head.bias is None else head.bias.detach().to(self.dtype).contiguous()
        self._final_norm = (norm_weight(model.hf.model.norm), self.eps)
        self._logit_cap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2: tanh(logits / cap) * cap
        # rotary tables per layer type where the model keeps one per type (Gemma 3: local and global)
        rotary = model.hf.model.rotary_emb
        types = getattr(cfg, "layer_types", None)
        self._layer_types = (list(types) if types and "layer_type" in inspect.signature(rotary.forward).parameters
                             else None)
        nq, nkv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        widest = max(self.inters)
        if f32:
            self._layer = lib.pdserve_llama_layer_f32
            self._scratch_per_row = lib.pdserve_f32_scratch_bytes(1, self.hidden, widest, self.q_heads,
                                                                  self.kv_heads, self.head_dim)
        else:
            self._layer = lib.pdserve_llama_layer
            self._scratch_per_row = 2 * (2 * self.hidden + nq + 2 * nkv + nq + 3 * widest) + 4 * 2 * nq
        self._scratch = torch.empty(0, dtype=torch.uint8)

    @classmethod
    def from_model(cls, model) -> "NativeDecoder | None":
        why = _why_not(model)
        if why is None and library() is None:
            why = "the native kernel is not built here"
        if why is not None:
            log.debug("steps run transformers' forward: %s", why)
            return None
        return cls(model, library())

    def forward(self, input_ids: Tensor, positions: Tensor, kv: Tensor, batch, logits_index: Tensor,
                hooks=None) -> Tensor:
        """`HFPagedModel.forward`'s contract for a step of at most `max_rows` rows; `hooks` (the model) has its
        `before_layer(i)` / `after_layer(i)` called around each layer (`HFPagedModel.add_layer_hooks`)."""
        inner = self.hf.model
        rows = input_ids.shape[0]
        h = inner.embed_tokens(input_ids).contiguous()  # Gemma's module scales by sqrt(hidden) itself
        rope = {}  # cos, sin [rows, head_dim] per layer type
        for kind in (set(self._layer_types) if self._layer_types else [None]):
            cos, sin = (inner.rotary_emb(h[None], positions[None], kind) if kind else
                        inner.rotary_emb(h[None], positions[None]))
            rope[kind] = (cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous())
        need = rows * self._scratch_per_row + 256
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        b = batch
        slots = b.slot_mapping.to(torch.int64).contiguous()
        tables = b.block_tables.to(torch.int32).contiguous()
        lens = b.seq_lens.to(torch.int32).contiguous()
        starts = b.query_start.to(torch.int32).contiguous()
        num_blocks, _, _, block_size, _ = kv.shape[1:]
        s_block, s_kv, s_head, s_tok, _ = kv[0].stride()
        call = self._layer
        self.lib.pdserve_native_threads(torch.get_num_threads())  # the prefill worker's count grows on a lent core
        heads = (self.eps, self.q_heads, self.kv_heads, self.head_dim)
        tail = (s_kv, s_head, s_block, s_tok, num_blocks, slots.data_ptr(), tables.data_ptr(), tables.stride(0),
                lens.data_ptr(), starts.data_ptr(), tables.shape[0], block_size, self.scale, self._scratch.data_ptr())
        for i, w in enumerate(self.weights):
            if hooks is not None:
                hooks.before_layer(i)
            cos, sin = rope[self._layer_types[i] if self._layer_types else None]
            rc = call(h.data_ptr(), rows, self.hidden, self.inters[i], ctypes.byref(w), *heads, cos.data_ptr(),
                      sin.data_ptr(), kv[i].data_ptr(), *tail)
            if rc:
                if rc == -1:
                    raise MemoryError("native decoder layer: no memory for its scratch (attention scores, experts)")
                raise IndexError(f"block_tables of sequence {rc - 1} name a block outside the pool's {num_blocks}")
            if hooks is not None:
                hooks.after_layer(i)
        x = h.index_select(0, logits_index)
        if self.dtype == torch.float32:
            x = rms_norm_f32(x, *self._final_norm)
            logits = self.hf.lm_head(x) if self.vocab is None else gemm_f32(x, self._head, self._head_bias)
        else:
            x = inner.norm(x)
            logits = self.hf.lm_head(x) if self.vocab is None else gemv(x, self._head, self.vocab, self._head_bias)
        if self._logit_cap:  # in the model's dtype, as its CausalLM computes it
            logits = torch.tanh(logits / self._logit_cap) * self._logit_cap
        return logits.float()

    @property
    def max_rows(self) -> int:
        """Most rows of a step here, by the projection path the process uses (AMX or AVX512-BF16)."""
        return max_rows()

    def supports(self, kv: Tensor, rows: int) -> bool:
        """Whether a step of `rows` rows over the pool `kv` runs here: at most `max_rows`, a CPU pool of the
        layers' dtype."""
        return rows <= max_rows() and kv.dtype == self.dtype and kv.device.type == "cpu" and kv.stride(-1) == 1

    def release_layer_layouts(self) -> None:
        """Drop the decoder layers' extra CpuLinear layouts ("rows", "packed"): the steps they served run here
        now, and each is another copy of the weights (the head keeps its own)."""
        for w in self.hf.model.layers.modules():
            if isinstance(w, CpuLinear):
                w.weight_rows = w.weight_packed = None
