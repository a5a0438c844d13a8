"""Our own Llama forward over a ragged batch and a paged KV pool (gpt-fast style: one dataclass of shapes, small modules).

A step's input is the new tokens of several sequences concatenated, `[T]`, with their absolute
positions `[T]`. Each layer writes the new K/V into the pool at the step's slot mapping and then
attends, causally, over each sequence's block table (`pdserve.kernels.paged_attention`). Logits
are computed only for the rows asked for (the last token of each sequence for decode, all k+1
for speculative verification) — the vocabulary projection is the largest matmul of a small model.

Weights load straight from the checkpoint folder's safetensors (Hugging Face Llama names).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from pdserve.kernels.paged_attention import paged_attention, write_kv


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
            raise ValueError(f"the paged engine runs Llama models; this checkpoint is {cfg.get('model_type')!r} {archs}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported by the paged engine (only 'default')")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("Llama checkpoints with attention/MLP biases are not supported by the paged engine")
        n_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
        )


@dataclass
class PagedBatch:
    """Where a ragged step reads and writes KV (S sequences, T new tokens in all)."""

    slot_mapping: Tensor  # [T] int64: pool slot (block * block_size + offset) of each new token
    block_tables: Tensor  # [S, max_blocks] int32
    seq_lens: Tensor  # [S] int32: cached tokens per sequence, this step's included
    query_start: Tensor  # [S+1] int32: sequence s's new tokens are rows query_start[s]:query_start[s+1]
    runs: list[int] | None = None  # per sequence: its first block if its blocks are consecutive, else -1 (a hint)


PACK_ROWS_HINT = 16  # the row count oneDNN lays the packed weights out for; its speed is flat from 4 rows to this

# The weight layouts a CPU step may multiply by: "t" is `x @ W_t` on `[in, out]` (the parameter),
# "rows" `F.linear` on `[out, in]`, "packed" oneDNN's prepacked layout.
LAYOUTS = ("t", "rows", "packed")


def default_step_plan() -> tuple[str, ...]:
    """Layout per row count (index = rows) before a calibration says otherwise: `F.linear` for two and
    three rows, oneDNN packed for 4-12, `x @ W_t` elsewhere. `pdserve.engine.calibrate` replaces it with
    what measures fastest on the machine at hand (which layout wins depends on the CPU)."""
    return ("t", "t", "rows", "rows") + ("packed",) * 9


class Linear(nn.Module):
    """``x @ W.T`` (no bias), with the weight in the layout the CPU's BLAS runs fastest for the row count.

    `weight_t` `[in, out]` contiguous is the parameter. On the CPU (`Transformer.add_cpu_layouts`) a
    module may also hold `weight_rows` (`[out, in]`) and `weight_packed` (oneDNN's layout): a speculative
    step at batch 1 feeds k + 1 = 2-9 rows, where MKL is slow with `[in, out]` and another layout can
    bring the step's cost close to a one-row step's. `plan[rows]` names the layout (`LAYOUTS`) for a
    step of that many rows (`x @ W_t` past the plan's end or where the layout is absent); the model
    sets it for all its modules (`Transformer.set_step_plan`). Decode's `--no-cpu-weight-layouts` leaves
    the extra layouts out, which is how to measure what they buy on a given CPU.
    """

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(d_in, d_out))
        self.weight_rows: Tensor | None = None
        self.weight_packed: Tensor | None = None
        self.plan: tuple[str, ...] = default_step_plan()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        choice = self.plan[rows] if rows < len(self.plan) else "t"
        if choice == "rows" and self.weight_rows is not None:
            return F.linear(x, self.weight_rows)
        if choice == "packed" and self.weight_packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight_packed, None, "none", [], "")
        return x @ self.weight_t


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # one fused op, the same float32 arithmetic as below (tests compare them)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Hugging Face's order for half types: normalise in float32, round to x's dtype, then scale
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """Hugging Face's ``x * cos + rotate_half(x) * sin`` for x `[T, heads, head_dim]`, in 4 ops instead of 7.

    rotate_half(x) = cat(-x2, x1) = roll(x, head_dim / 2) * [-1.., +1..], so with the sign folded
    into sin_rot = cat(-sin1, sin2) (see `_rope`) the result is bitwise the same. cos, sin_rot: `[T, 1, head_dim]`.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_rot


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, attention_impl: str):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = Linear(args.dim, self.q_size + 2 * self.kv_size)
        self.wo = Linear(self.q_size, args.dim)
        self.scale = args.head_dim**-0.5
        self.impl = attention_impl

    def forward(self, x: Tensor, cos: Tensor, sin_rot: Tensor, kv_pool: Tensor, batch: PagedBatch) -> Tensor:
        t = x.shape[0]
        qk, v = self.wqkv(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # queries and keys rotated together: [T, q_heads + kv_heads, head_dim]
        qk = apply_rope(qk.view(t, self.n_heads + self.n_kv_heads, self.head_dim), cos, sin_rot)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        v = v.view(t, self.n_kv_heads, self.head_dim)
        write_kv(kv_pool, batch.slot_mapping, k, v)
        y = paged_attention(
            q, kv_pool, batch.block_tables, batch.seq_lens, batch.query_start, self.scale, impl=self.impl, runs=batch.runs
        )
        return self.wo(y.reshape(t, self.q_size))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden = args.intermediate_size
        self.w13 = Linear(args.dim, 2 * args.intermediate_size)  # gate and up, fused
        self.w2 = Linear(args.intermediate_size, args.dim)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, attention_impl: str):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, attention_impl)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin_rot: Tensor, kv_pool: Tensor, batch: PagedBatch) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin_rot, kv_pool, batch)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, attention_impl: str = "reference"):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, attention_impl) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size)  # a copy of the embedding when tied (stored transposed)
        cos, sin_rot = _rope(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin_rot", sin_rot, persistent=False)

    def forward(self, input_ids: Tensor, positions: Tensor, kv: Tensor, batch: PagedBatch, logits_index: Tensor) -> Tensor:
        """One ragged step.

        input_ids `[T]` int64, positions `[T]` int64 (absolute, < max_position), kv the pool
        `[n_layers, num_blocks, 2, kv_heads, block_size, head_dim]` (written in place at
        `batch.slot_mapping`), logits_index `[N]` int64 rows of the T to project.
        Returns logits `[N, vocab]` float32.
        """
        x = self.tok_embeddings(input_ids)
        dtype = x.dtype
        cos = self.rope_cos[positions].to(dtype).unsqueeze(1)
        sin_rot = self.rope_sin_rot[positions].to(dtype).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin_rot, kv[i], batch)
        x = self.norm(x[logits_index])
        return self.output(x).float()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        attention_impl: str = "reference", small_step_weights: bool = True) -> "Transformer":
        """Build from a Hugging Face Llama checkpoint folder (config.json + *.safetensors).

        `small_step_weights`: on the CPU, also keep the weight layouts that make steps of 2-12 rows faster
        (see `Linear`); a worker that never runs such steps (prefill) leaves them out."""
        model_dir = Path(model_dir)
        args = ModelArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
        hf: dict[str, Tensor] = {}
        for f in files:
            hf.update(load_file(str(f)))
        with torch.device("meta"):
            model = cls(args, attention_impl)
        state = _from_hf_names(hf, args)
        model.load_state_dict(state, strict=True, assign=True)  # the rope tables are non-persistent buffers
        cos, sin_rot = _rope(args)  # computed in float32 on the host, like Hugging Face's rotary embedding
        model.register_buffer("rope_cos", cos, persistent=False)
        model.register_buffer("rope_sin_rot", sin_rot, persistent=False)
        model = model.to(device=device, dtype=dtype).eval()
        if small_step_weights and model.tok_embeddings.weight.device.type == "cpu":
            model.add_cpu_layouts()
        return model

    def add_cpu_layouts(self) -> None:
        """Extra weight layouts for the CPU's BLAS (see `Linear`): the `[out, in]` copy for two- and three-row
        steps (the tied output projection uses the embedding table itself), and oneDNN's prepacked copy for
        four rows or more (float32 only, where oneDNN is built in)."""
        packed = torch.backends.mkldnn.is_available() and self.tok_embeddings.weight.dtype == torch.float32
        tied = self.args.tie_embeddings
        for mod in self.modules():
            if not isinstance(mod, Linear):
                continue
            w = self.tok_embeddings.weight.detach() if mod is self.output and tied else \
                mod.weight_t.detach().t().contiguous()
            mod.weight_rows = w
            if packed:
                try:
                    mod.weight_packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
                except (RuntimeError, AttributeError):  # an oneDNN without the op: BLAS it is
                    mod.weight_packed = None

    def step_layouts(self) -> tuple[str, ...]:
        """The layouts (`LAYOUTS`) this model's projections hold: always "t", plus the CPU copies it keeps."""
        mods = [m for m in self.modules() if isinstance(m, Linear)]
        have = ["t"]
        if mods and all(m.weight_rows is not None for m in mods):
            have.append("rows")
        if mods and all(m.weight_packed is not None for m in mods):
            have.append("packed")
        return tuple(have)

    def set_step_plan(self, plan: tuple[str, ...] | list[str]) -> None:
        """Use layout `plan[rows]` for steps of `rows` rows (see `Linear`); unknown names are refused."""
        bad = sorted(set(plan) - set(LAYOUTS))
        if bad:
            raise ValueError(f"unknown weight layout(s) {bad} in a step plan; known: {', '.join(LAYOUTS)}")
        plan = tuple(plan)
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.plan = plan

    def release_unplanned_layouts(self) -> None:
        """Drop the CPU weight copies the step plan never uses: a layout that measured slower than the others
        at every row count is memory spent for nothing."""
        for mod in self.modules():
            if isinstance(mod, Linear):
                if "rows" not in mod.plan:
                    mod.weight_rows = None
                if "packed" not in mod.plan:
                    mod.weight_packed = None


def _rope(args: ModelArgs) -> tuple[Tensor, Tensor]:
    """cos, sin_rot tables `[max_position, head_dim]`: Hugging Face's cos and sin (rotate_half order), with
    the first half of sin negated for `apply_rope`."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    freqs = torch.outer(torch.arange(args.max_position, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    return emb.cos(), torch.cat((-sin[:, : args.head_dim // 2], sin[:, args.head_dim // 2 :]), dim=-1)


def _from_hf_names(hf: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Hugging Face Llama parameter names → ours (q/k/v and gate/up fused; projections transposed, see `Linear`)."""

    def t(w: Tensor) -> Tensor:
        return w.t().contiguous()

    out = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "output.weight_t": t(hf["model.embed_tokens.weight"] if args.tie_embeddings else hf["lm_head.weight"]),
    }
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attention_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.attention.wqkv.weight_t"] = t(torch.cat(
            [hf[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")], dim=0
        ))
        out[f"layers.{i}.attention.wo.weight_t"] = t(hf[p + "self_attn.o_proj.weight"])
        out[f"layers.{i}.feed_forward.w13.weight_t"] = t(torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
        ))
        out[f"layers.{i}.feed_forward.w2.weight_t"] = t(hf[p + "mlp.down_proj.weight"])
    return out
