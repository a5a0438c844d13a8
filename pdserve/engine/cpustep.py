"""CPU weight layouts for a transformers model's projections, and q/k/v and gate/up fused into one matmul each.

transformers' modules call `nn.Linear`s (`F.linear`, weight `[out, in]`). On the CPU a step's cost is
mostly these matmuls at a handful of rows, where the layout of the weight decides the speed (see
`CpuLinear`), and a layer's q, k and v projections (and an MLP's gate and up) read the same input: one
matmul over their weights side by side costs less than three. `adapt_linears` replaces every `nn.Linear`
of a model in place: the weight is transposed (one copy: the original goes), and the projections of
one input are fused where the module calls them in turn on the same tensor (`FusedGroup`). Nothing
here runs on a GPU, where the model keeps transformers' own modules and memory belongs to the KV cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACK_ROWS_HINT = 16  # the row count oneDNN lays the packed weights out for; its speed is flat from 4 rows to this

# sibling projections that read one input, in the order transformers' modules call them
FUSIBLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


LAYOUTS = ("t", "rows", "packed")  # x @ W_t; F.linear on [out, in]; oneDNN's prepacked weight


class StepPlan:
    """The weight layout for a step of N rows, one plan shared by every `CpuLinear` of a model.

    `by_rows[n]` names the layout (`LAYOUTS`) of an n-row step: what a step calibration measured fastest
    on this machine (`pdserve.engine.calibrate`). Empty (no calibration), every module follows
    `CpuLinear.default_layout`; set, rows past its end take its last entry (the largest size measured: the
    layouts' ranking settles once a step is compute-bound, and a batched step is past any fixed list).
    """

    __slots__ = ("by_rows",)

    def __init__(self) -> None:
        self.by_rows: tuple[str, ...] = ()


class CpuLinear(nn.Module):
    """``x @ W.T + b``, with the weight in the layout the CPU's BLAS runs fastest for the row count.

    `weight_t` `[in, out]` contiguous is the parameter: one row (batch-1 decode) and more than
    `PACKED_MAX_ROWS` rows (prefill, big batches) multiply it, where `x @ W_t` is faster than
    `F.linear` on `[out, in]`. Between those sizes MKL is slow with it, and a speculative step at
    batch 1 feeds k + 1 = 2-9 rows: there `F.linear` on `[out, in]` wins for two and three rows,
    and oneDNN's packed layout, whose time hardly grows with the rows, for more (docs/PERFORMANCE.md,
    "CPU weight layouts").

    So a module may also hold `weight_rows` (`[out, in]`) and `weight_packed` (oneDNN's layout): see
    `add_small_step_layouts`. Which one a step of n rows uses is its `plan`'s choice, measured on the
    machine it runs on, because other CPUs rank the layouts otherwise (same section); without a plan,
    `default_layout`, the ranking above.
    """

    ROW_MAJOR_ROWS = (2, 3)
    PACKED_MAX_ROWS = 12

    def __init__(self, weight_t: Tensor, bias: Tensor | None):
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.weight_rows: Tensor | None = None
        self.weight_packed: Tensor | None = None
        self.plan: StepPlan | None = None

    @property
    def weight(self) -> Tensor:
        """`[out, in]`, as `nn.Linear` has it (a view), for model code that reads it."""
        return self.weight_t.t()

    @property
    def in_features(self) -> int:
        return self.weight_t.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight_t.shape[1]

    def default_layout(self, rows: int) -> str:
        """The layout of an n-row step without a plan: `[out, in]` for `ROW_MAJOR_ROWS`, packed up to
        `PACKED_MAX_ROWS`, else (and where this module lacks that layout) "t"."""
        if self.weight_rows is not None and rows in self.ROW_MAJOR_ROWS:
            return "rows"
        if self.weight_packed is not None and 2 <= rows <= self.PACKED_MAX_ROWS:
            return "packed"
        return "t"

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        plan = self.plan.by_rows if self.plan is not None else ()
        layout = plan[min(rows, len(plan) - 1)] if plan else self.default_layout(rows)
        if layout == "packed" and self.weight_packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1).contiguous(), self.weight_packed, self.bias,
                                                   "none", [], "")
            return y.view(*x.shape[:-1], -1)
        if layout == "rows" and self.weight_rows is not None:
            return F.linear(x, self.weight_rows, self.bias)
        # one mm on the rows as a matrix: `x @ weight_t` on [1, T, in] costs two more reshaping ops a call
        y = torch.mm(x.reshape(rows, -1), self.weight_t)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], -1)

    __call__ = forward  # no hooks on a projection: skip nn.Module's call machinery


class FusedGroup:
    """Sibling projections of one input computed by one matmul (`linear`, their weights side by side): the
    first member computes all of them and keeps the result for the others, which return their columns of it
    when they are called with that same tensor, and compute their own otherwise (always correct; the model
    code does not change a tensor in place between its projections)."""

    def __init__(self, linear: CpuLinear):
        self.linear = linear
        self.x: Tensor | None = None
        self.y: Tensor | None = None


class FusedMember(nn.Module):
    """One projection of a `FusedGroup`: columns lo:hi of its output. The first member holds the weights."""

    def __init__(self, group: FusedGroup, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.group, self.lo, self.hi, self.first, self.last = group, lo, hi, first, last
        if first:
            self.fused = group.linear  # registered once, so the weights count (and move) once

    @property
    def weight(self) -> Tensor:
        """This projection's `[out, in]` rows of the group's weight (a view), for model code that reads it."""
        return self.group.linear.weight_t[:, self.lo:self.hi].t()

    def forward(self, x: Tensor) -> Tensor:
        g = self.group
        if self.first:
            g.x, g.y = x, g.linear.forward(x)
            return g.y[..., : self.hi]
        if g.x is x:
            y = g.y[..., self.lo:self.hi]
            if self.last:  # drop the references
                g.x = g.y = None
            return y
        lin = g.linear
        y = x @ lin.weight_t[:, self.lo:self.hi]
        return y if lin.bias is None else y + lin.bias[self.lo:self.hi]

    __call__ = forward  # no hooks on a projection: skip nn.Module's call machinery (a step makes 5 such calls a layer)


def _cpu_linear(lin: nn.Linear) -> CpuLinear:
    return CpuLinear(lin.weight.detach().t().contiguous(), None if lin.bias is None else lin.bias.detach())


def adapt_linears(model: nn.Module, *, skip: tuple[nn.Module, ...] = ()) -> None:
    """Replace every `nn.Linear` under `model` (except those in `skip`) by a `CpuLinear`, fusing the
    `FUSIBLE` siblings of one parent into one `FusedGroup` (same input width, all biased or none)."""
    for parent in list(model.modules()):
        children = dict(parent.named_children())
        for names in FUSIBLE:
            lins = [children.get(n) for n in names]
            if not all(type(m) is nn.Linear and m not in skip for m in lins):
                continue
            if len({m.in_features for m in lins}) != 1 or len({m.bias is None for m in lins}) != 1:
                continue
            w = torch.cat([m.weight.detach() for m in lins]).t().contiguous()
            b = None if lins[0].bias is None else torch.cat([m.bias.detach() for m in lins])
            group = FusedGroup(CpuLinear(w, b))
            lo = 0
            for i, (n, m) in enumerate(zip(names, lins)):
                setattr(parent, n, FusedMember(group, lo, lo + m.out_features, first=i == 0, last=i == len(names) - 1))
                lo += m.out_features
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child not in skip:
                setattr(parent, name, _cpu_linear(child))


PACKED_DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN's prepacked linear takes on the CPU


def add_small_step_layouts(model: nn.Module, rows_weight: dict[CpuLinear, Tensor] | None = None) -> None:
    """The extra layouts of `CpuLinear` for small steps: the `[out, in]` copy (or the tensor given in
    `rows_weight`, e.g. a tied embedding table that already is one) and oneDNN's prepacked copy (float32 and
    bfloat16, where oneDNN is built in). A step calibration keeps those its plan uses."""
    rows_weight = rows_weight or {}
    for mod in model.modules():
        if not isinstance(mod, CpuLinear):
            continue
        w = rows_weight.get(mod)
        w = mod.weight_t.detach().t().contiguous() if w is None else w
        mod.weight_rows = w
        if torch.backends.mkldnn.is_available() and w.dtype in PACKED_DTYPES:
            try:
                mod.weight_packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
            except (RuntimeError, AttributeError):  # an oneDNN without the op: BLAS it is
                mod.weight_packed = None


class FusedRMSNorm(nn.Module):
    """`F.rms_norm` (one fused op) in place of a model's RMSNorm module, sharing its weight.

    `upcast`: the form of transformers' Llama-style norms in half precision, which normalise in float32 and
    scale in the input's dtype: ``weight * rms_norm(x.float()).to(x.dtype)`` (4 ops instead of 8).
    """

    def __init__(self, weight: nn.Parameter, eps: float, upcast: bool = False):
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.upcast = upcast

    def forward(self, x: Tensor) -> Tensor:
        if self.upcast:
            return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    __call__ = forward  # no hooks on a norm: skip nn.Module's call machinery


def fuse_rms_norms(model: nn.Module) -> int:
    """Replace each RMSNorm module that computes exactly `F.rms_norm` by a `FusedRMSNorm`; returns how many.

    A norm qualifies by what it computes, not by its name: on a random input its output must equal one of
    `FusedRMSNorm`'s two forms bit for bit (Llama's norm in float32 equals `F.rms_norm`; in bfloat16 it
    normalises in float32 and scales in bfloat16, the `upcast` form; Gemma's `1 + weight` norm equals
    neither and keeps its own module). A step runs two norms per layer (more with q/k norms), each six to
    eight small ops unfused.
    """
    count = 0
    gen = torch.Generator().manual_seed(0)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, FusedRMSNorm) or "RMSNorm" not in type(child).__name__:
                continue
            weight = getattr(child, "weight", None)
            eps = getattr(child, "variance_epsilon", getattr(child, "eps", None))
            if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
                continue
            x = (torch.randn(3, weight.shape[0], generator=gen) * 3).to(weight.device, weight.dtype)
            with torch.inference_mode():
                want = child(x)
                fused = next((f for f in (FusedRMSNorm(weight, eps), FusedRMSNorm(weight, eps, upcast=True))
                              if want.dtype == x.dtype and torch.equal(want, f(x))), None)
            if fused is None:
                continue
            setattr(parent, name, fused)
            count += 1
    return count


class FastRotary:
    """A modeling module's `apply_rotary_pos_emb(q, k, cos, sin)` in 4 ops per tensor instead of 7.

    rotate_half(x) = cat(-x2, x1) = roll(x, head_dim / 2) * [-1.., +1..], so with the sign folded into
    sin_rot = cat(-sin1, sin2) — computed once per forward, as every layer gets the same cos and sin —
    ``x * cos + roll(x) * sin_rot`` is bitwise ``x * cos + rotate_half(x) * sin``. Calls of another shape
    (a partial rotary dim, other broadcast dims) go to the module's own function.
    """

    def __init__(self, original):
        self.original = original
        self._tables: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # (cos, sin, cos', sin_rot'), newest last

    def __call__(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *args, **kwargs):
        d = q.shape[-1]
        if args or kwargs or cos.dim() != 3 or cos.shape[-1] != d or k.shape[-1] != d or d % 2:
            return self.original(q, k, cos, sin, *args, **kwargs)
        for c, s, cu, su in self._tables:
            if c is cos and s is sin:
                break
        else:
            h = d // 2
            cu, su = cos.unsqueeze(1), torch.cat((-sin[..., :h], sin[..., h:]), dim=-1).unsqueeze(1)
            self._tables = [*self._tables[-3:], (cos, sin, cu, su)]  # a few: models with local and global tables
        h = d // 2
        return q * cu + q.roll(h, -1) * su, k * cu + k.roll(h, -1) * su


def fast_rotary(model: nn.Module) -> list[str]:
    """Install `FastRotary` in the modeling modules of `model`'s classes whose `apply_rotary_pos_emb` it equals
    bit for bit on random inputs (checked here, per module); returns those modules' names.

    The function is a module global that every attention forward of that architecture calls, so the
    replacement is process-wide; it computes what the original does, which is why it may be.
    """
    import sys

    done = []
    gen = torch.Generator().manual_seed(0)
    for name in sorted({type(m).__module__ for m in model.modules()}):
        mod = sys.modules.get(name)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or isinstance(fn, FastRotary):
            done += [name] if fn is not None else []
            continue
        fast = FastRotary(fn)
        q, k = torch.randn(1, 4, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
        cos, sin = torch.randn(1, 5, 8, generator=gen), torch.randn(1, 5, 8, generator=gen)
        try:
            want = fn(q, k, cos, sin)
        except Exception:  # a signature of its own: leave it alone
            continue
        got = fast(q, k, cos, sin)
        if all(torch.equal(a, b) for a, b in zip(want, got)):
            mod.apply_rotary_pos_emb = fast
            done.append(name)
    return done


# wrappers around transformers' forwards that do nothing when pdserve steps a model: renamed-keyword checks
# (pdserve passes none of the old names) and gradient checkpointing (never in inference)
_PASS_THROUGH = ("utils/deprecation.py", "transformers/modeling_layers.py")


def unwrap_forwards(model: nn.Module) -> int:
    """Bind each module's forward past transformers' pass-through wrappers (`_PASS_THROUGH`), per instance: two
    Python calls fewer per layer per step. Returns how many modules were unwrapped."""
    count = 0
    for m in model.modules():
        fn = inner = type(m).forward
        while getattr(inner, "__wrapped__", None) is not None and inner.__code__.co_filename.endswith(_PASS_THROUGH):
            inner = inner.__wrapped__
        if inner is not fn:
            m.forward = inner.__get__(m)
            count += 1
    return count
