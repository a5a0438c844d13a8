"""Any decoder-only model transformers implements, run over pdserve's paged KV (vLLM's "Transformers modeling backend").

transformers computes the model — embeddings, norms, rotary embeddings, q/k norms, projections with or
without biases, mixtures of experts, the head and its soft cap — and calls its attention interface with
each layer's queries, keys and values (after rotary embedding and q/k norms). pdserve registers its
own attention there: it writes the new K/V into the block pool at the step's slot mapping and attends
over each sequence's block table (`pdserve.kernels.paged_attention`), with the layer's sliding window,
attention sinks and logit soft cap. transformers builds no mask for an attention it does not know
(`masking_utils` skips mask creation for unregistered implementations), so none is computed.

A ragged step is ONE packed sequence of all the batch's new tokens, `input_ids [1, T]` with their
absolute `position_ids [1, T]` and `use_cache=False`; the step's paged metadata reaches the attention
function as the `pdserve_step` keyword, which transformers forwards from the model's call down to
attention. Logits are computed only for the rows asked for (`logits_to_keep` with an index tensor).

At load, one probing forward records what each layer's attention is handed (head counts, head dim,
scale, window, soft cap, sinks) and refuses by name what paged attention cannot honour (an explicit
mask or position bias, bidirectional attention, keys and values of different widths).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from pdserve.checkpoint import UnsupportedModel, layer_windows, max_context
from pdserve.engine.cpustep import LAYOUTS, CpuLinear, StepPlan
from pdserve.kernels.paged_attention import paged_attention, write_kv

ATTENTION = "pdserve_paged"


@dataclass
class PagedBatch:
    """Where a ragged step reads and writes KV (S sequences, T new tokens in all)."""

    slot_mapping: Tensor  # [T] int64: pool slot (block * block_size + offset) of each new token
    block_tables: Tensor  # [S, max_blocks] int32
    seq_lens: Tensor  # [S] int32: cached tokens per sequence, this step's included
    query_start: Tensor  # [S+1] int32: sequence s's new tokens are rows query_start[s]:query_start[s+1]
    runs: list[int] | None = None  # per sequence: its first block if its blocks are consecutive, else -1 (a hint)


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention is handed by its transformers model (recorded by the probing forward)."""

    layer: int
    q_heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None
    softcap: float | None
    sinks: bool


@dataclass
class _Step:
    """One forward's context, handed to every layer's attention as the `pdserve_step` keyword."""

    kv: Tensor | None  # the pool [n_layers, num_blocks, 2, kv_heads, block_size, head_dim]; None when probing
    batch: PagedBatch | None
    impl: str
    probe: dict[int, LayerAttention] | None = None


def _paged_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                             scaling: float | None = None, dropout: float = 0.0, *, pdserve_step: _Step | None = None,
                             sliding_window: int | None = None, softcap: float | None = None,
                             s_aux: Tensor | None = None, sinks: Tensor | None = None, is_causal: bool | None = None,
                             position_bias=None, **_) -> tuple[Tensor, None]:
    """transformers' attention interface: query `[1, q_heads, T, D]`, key/value `[1, kv_heads, T, D]` (this
    step's tokens, after rotary embedding) → `([1, T, q_heads, D], None)`."""
    step = pdserve_step
    if step is None:
        raise RuntimeError(f"{type(module).__name__}: pdserve's paged attention was called without a paged step "
                           "(the model is run by pdserve.engine, not directly)")
    layer = getattr(module, "layer_idx", None)
    sink = s_aux if s_aux is not None else sinks
    if step.probe is not None:
        _record(step.probe, module, layer, query, key, value, attention_mask, scaling, sliding_window, softcap, sink,
                is_causal, position_bias)
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[3]), None
    q = query[0].transpose(0, 1)  # [T, q_heads, D]
    pool = step.kv[layer]
    write_kv(pool, step.batch.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    b = step.batch
    out = paged_attention(q, pool, b.block_tables, b.seq_lens, b.query_start,
                          module.head_dim ** -0.5 if scaling is None else scaling, impl=step.impl, runs=b.runs,
                          sliding_window=sliding_window, sinks=sink, softcap=softcap)
    return out.unsqueeze(0), None


def _record(probe, module, layer, query, key, value, attention_mask, scaling, sliding_window, softcap, sink, is_causal,
            position_bias) -> None:
    name = type(module).__name__
    if layer is None:
        raise UnsupportedModel(f"{name} has no layer_idx: pdserve cannot tell which layer's KV it holds")
    if attention_mask is not None or position_bias is not None:
        raise UnsupportedModel(f"{name} (layer {layer}) adds its own attention mask or position bias; paged attention "
                               "is causal, with an optional sliding window, sinks and soft cap, and nothing else")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedModel(f"{name} (layer {layer}) attends bidirectionally (an encoder): pdserve serves causal "
                               "decoder-only models")
    if key.shape[-1] != value.shape[-1] or query.shape[-1] != key.shape[-1]:
        raise UnsupportedModel(f"{name} (layer {layer}) has query/key/value widths {query.shape[-1]}/{key.shape[-1]}/"
                               f"{value.shape[-1]}; the paged KV pool holds one head_dim for keys and values")
    if layer in probe:
        raise UnsupportedModel(f"{name}: layer {layer}'s attention ran twice in one forward (shared KV layers)")
    probe[layer] = LayerAttention(
        layer=layer, q_heads=query.shape[1], kv_heads=key.shape[1], head_dim=key.shape[-1],
        scaling=float(module.head_dim ** -0.5 if scaling is None else scaling),
        sliding_window=int(sliding_window) if sliding_window else None,
        softcap=float(softcap) if softcap else None, sinks=sink is not None)


AttentionInterface.register(ATTENTION, _paged_attention_forward)


class HFPagedModel(nn.Module):
    """A transformers causal LM whose attention reads and writes a paged KV pool.

    `layers` are the model's decoder layers (hooks on them see each layer's KV written); `attention`
    is what each layer's attention is handed, from the probing forward.
    """

    def __init__(self, hf: nn.Module, attention_impl: str = "reference"):
        super().__init__()
        self.hf = hf
        self.config = hf.config.get_text_config()
        self.attention_impl = attention_impl
        self.layers = _decoder_layers(hf)
        self.attention = self._probe()
        self._plan = StepPlan()  # shared by every CpuLinear (CPU models): empty until a calibration sets it
        for m in self._cpu_linears():
            m.plan = self._plan
        self.native = None  # a NativeDecoder (engine/native.py) for bfloat16 or float32 CPU steps, if set
        self._before_layer: list = []  # add_layer_hooks: callables of the layer index, either path calls them
        self._after_layer: list = []
        self._own_hooks = 0  # module hooks per layer that are add_layer_hooks' dispatchers, not someone else's
        self.vocab_size = int(self.config.vocab_size)
        self.max_context = max_context(self.config)
        arch = type(hf).__name__
        shapes = {(a.kv_heads, a.head_dim) for a in self.attention}
        if len(shapes) != 1:
            raise UnsupportedModel(f"{arch}: layers differ in KV heads x head dim {sorted(shapes)}; one paged pool "
                                   "holds one shape for every layer")
        (self.kv_heads, self.head_dim), = shapes
        self.layer_windows = tuple(a.sliding_window or 0 for a in self.attention)
        expected = layer_windows(self.config)
        if self.layer_windows != expected:
            i = next(i for i, (a, b) in enumerate(zip(self.layer_windows, expected)) if a != b)
            raise UnsupportedModel(f"{arch}: layer {i}'s attention is handed sliding window {self.layer_windows[i]}, "
                                   f"its config says {expected[i]} (0 = full): pdserve cannot tell which KV it keeps")

    @torch.inference_mode()
    def _probe(self) -> list[LayerAttention]:
        seen: dict[int, LayerAttention] = {}
        device = next(self.hf.parameters()).device
        try:
            self.hf(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                    position_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False,
                    logits_to_keep=1, pdserve_step=_Step(None, None, self.attention_impl, probe=seen))
        except UnsupportedModel:
            raise
        except Exception as e:  # model code that cannot run as one packed sequence without a cache
            raise UnsupportedModel(f"{type(self.hf).__name__}: its forward fails under paged attention "
                                   f"({type(e).__name__}: {e})") from e
        n = len(self.layers)
        if sorted(seen) != list(range(n)):
            raise UnsupportedModel(f"{type(self.hf).__name__}: attention ran for layers {sorted(seen)} of {n}; pdserve "
                                   "needs one attention per decoder layer")
        return [seen[i] for i in range(n)]

    def _cpu_linears(self) -> list[CpuLinear]:
        return [m for m in self.hf.modules() if isinstance(m, CpuLinear)]

    def step_layouts(self) -> tuple[str, ...]:
        """The weight layouts a step calibration (`engine.calibrate`) may choose between (`cpustep.LAYOUTS`
        that the projections hold): "t" always; "rows" and "packed" where the CPU model keeps them
        (`small_step_weights`; packed for float32 with oneDNN)."""
        mods = self._cpu_linears()
        held = {"t": True, "rows": any(m.weight_rows is not None for m in mods),
                "packed": any(m.weight_packed is not None for m in mods)}
        return tuple(name for name in LAYOUTS if held[name])

    @property
    def step_plan(self) -> tuple[str, ...]:
        """The layout per row count (index = rows) the projections follow; () for their default rule."""
        return self._plan.by_rows

    def set_step_plan(self, plan: tuple[str, ...]) -> None:
        """Take a calibration's plan (a layout per row count, index = rows; rows past it use "t"); names
        other than `step_layouts()` are refused."""
        unknown = sorted(set(plan) - set(self.step_layouts()))
        if unknown:
            raise ValueError(f"unknown weight layout(s) {unknown}; this model offers {self.step_layouts()}")
        self._plan.by_rows = tuple(plan)

    def release_unplanned_layouts(self) -> None:
        """Drop the weight copies the plan never uses (each extra layout is another copy of the weights):
        "rows" and "packed" stay only where a row count of the plan takes them."""
        used = set(self._plan.by_rows)
        for m in self._cpu_linears():
            if "rows" not in used:
                m.weight_rows = None
            if "packed" not in used:
                m.weight_packed = None

    def add_layer_hooks(self, before=None, after=None) -> None:
        """Callbacks around every decoder layer of every step, on whichever path computes it: `before(i)` ahead of
        layer i (an exception stops the step; the runner then leaves its sequences as they were), `after(i)` once
        layer i's KV is in the pool. Unlike module hooks, which transformers' layers alone can see (a step with
        one keeps transformers' forward), these leave the native CPU decoder in use (the prefill worker's layer
        streaming and pre-positioning yield). Called in the order added."""
        if not self._own_hooks:
            for i, layer in enumerate(self.layers):
                layer.register_forward_pre_hook(lambda m, a, i=i: self.before_layer(i))
                layer.register_forward_hook(lambda m, a, o, i=i: self.after_layer(i))
            self._own_hooks = 1
        if before is not None:
            self._before_layer.append(before)
        if after is not None:
            self._after_layer.append(after)

    def before_layer(self, i: int) -> None:
        for f in self._before_layer:
            f(i)

    def after_layer(self, i: int) -> None:
        for f in self._after_layer:
            f(i)

    def _foreign_hooks(self) -> bool:
        """Whether a module hook other than `add_layer_hooks`' own sits on a decoder layer."""
        own = self._own_hooks
        return any(len(layer._forward_hooks) > own or len(layer._forward_pre_hooks) > own for layer in self.layers)

    def forward(self, input_ids: Tensor, positions: Tensor, kv: Tensor, batch: PagedBatch, logits_index: Tensor) -> Tensor:
        """One ragged step.

        input_ids `[T]` int64, positions `[T]` int64 (absolute), kv the pool
        `[n_layers, num_blocks, 2, kv_heads, block_size, head_dim]` (written in place at
        `batch.slot_mapping`), logits_index `[N]` int64 rows of the T to project.
        Returns logits `[N, vocab]` float32.
        """
        native = self.native
        if native is not None and not self._foreign_hooks():
            # a module hook sees transformers' layers only; add_layer_hooks' callbacks the native layers call too
            if native.supports(kv, input_ids.shape[0]):
                return native.forward(input_ids, positions, kv, batch, logits_index, self)
            if native.supports(kv, 1) and not (self._before_layer or self._after_layer):
                # more rows than a native call takes: in consecutive calls (each row's arithmetic is fixed by its
                # position, so its logits do not change), not transformers' forward, whose GEMMs round by row
                # count. Not with layer callbacks: a layer's KV would be streamed before all its rows exist.
                return self._native_in_parts(input_ids, positions, kv, batch, logits_index)
        out = self.hf(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                      logits_to_keep=logits_index, pdserve_step=_Step(kv, batch, self.attention_impl))
        return out.logits[0].float()

    def _native_in_parts(self, input_ids: Tensor, positions: Tensor, kv: Tensor, batch: PagedBatch,
                         logits_index: Tensor) -> Tensor:
        """`forward` through the native layers in calls of at most `max_rows` rows, in row order: a part sees
        its sequences as ending at its last row (seq_lens cut back), so later parts read the KV earlier ones
        wrote. logits_index must be ascending (as `PagedRunner.step` makes it)."""
        native, rows = self.native, input_ids.shape[0]
        qs = batch.query_start.to(torch.int64)
        lens = batch.seq_lens.to(torch.int64)
        out = []
        for a in range(0, rows, native.max_rows):
            b = min(rows, a + native.max_rows)
            start, end = qs[:-1].clamp(a, b), qs[1:].clamp(a, b)
            part = PagedBatch(
                slot_mapping=batch.slot_mapping[a:b], block_tables=batch.block_tables,
                seq_lens=(lens - (qs[1:] - end)).to(batch.seq_lens.dtype),
                query_start=torch.cat([start[:1], end]).sub(a).to(batch.query_start.dtype), runs=batch.runs)
            keep = logits_index[(logits_index >= a) & (logits_index < b)] - a
            out.append(native.forward(input_ids[a:b], positions[a:b], kv, part, keep, self))
        return torch.cat(out)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", attention_impl: str = "reference",
                        small_step_weights: bool = True, native_layers: bool = True) -> "HFPagedModel":
        """Load a checkpoint folder with transformers (its own architecture class, our dtype and device).

        On the CPU the projections become `linear.CpuLinear`s (q/k/v and gate/up fused); with
        `small_step_weights` they also keep the layouts for steps of 2-12 rows (a prefill worker never runs
        such steps). With `native_layers` (the default) a bfloat16 or float32 model on the CPU runs the native
        decoder where it covers the model (`engine.native`), and the layouts its layers no longer need go;
        without, transformers' forward always serves (a reference to compare with)."""
        from transformers import AutoModelForCausalLM

        try:
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=ATTENTION)
        except (KeyError, ValueError, NotImplementedError) as e:  # a model that hard-codes its attention choices
            arch = _architecture(model_dir)
            raise UnsupportedModel(f"{arch}: transformers cannot build it with a registered attention "
                                   f"implementation ({type(e).__name__}: {e})") from e
        hf = hf.to(device).eval()
        if torch.device(device).type == "cpu":
            from pdserve.engine.cpustep import (
                add_small_step_layouts, adapt_linears, fast_rotary, fuse_rms_norms, unwrap_forwards,
            )

            head, embed = hf.get_output_embeddings(), hf.get_input_embeddings()
            tied = head is not None and embed is not None and head.weight is embed.weight
            adapt_linears(hf)
            fuse_rms_norms(hf)
            fast_rotary(hf)
            unwrap_forwards(hf)
            if small_step_weights:
                # a tied head's [out, in] layout is the embedding table itself
                add_small_step_layouts(hf, {hf.get_output_embeddings(): embed.weight.detach()} if tied else None)
        model = cls(hf, attention_impl)
        if torch.device(device).type == "cpu" and native_layers and dtype in (torch.bfloat16, torch.float32):
            from pdserve.engine.native import NativeDecoder

            model.native = NativeDecoder.from_model(model)
            if model.native is not None:
                model.native.release_layer_layouts()
        return model


def _architecture(model_dir) -> str:
    import json

    try:
        return (json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or ["?"])[0]
    except (OSError, ValueError):
        return str(model_dir)


def _decoder_layers(hf: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: the ModuleList as long as the config's layer count."""
    n = hf.config.get_text_config().num_hidden_layers
    lists = [m for m in hf.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not lists:
        raise UnsupportedModel(f"{type(hf).__name__}: no list of {n} decoder layers found")
    return lists[0]
