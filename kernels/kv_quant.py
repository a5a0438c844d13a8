"""KV compression on the wire: gather KV-cache blocks, quantise to int8 / fp8 (e4m3) with per-group scales.

A KV block pool is ``kv [num_blocks, 2, kv_heads, block_size, head_dim]`` (2 = K and V) in float32,
bfloat16 or float16. One quantisation group is one (block, K/V, head) tile of block_size x head_dim
values, with one float32 scale = absmax / QMAX (QMAX = 127 for int8, 448 for fp8 e4m3). An all-zero
group has scale 0 and quantises to zeros (no NaN).

``pack(kv, block_ids [n] int64, fmt)`` -> ``(payload, scales)``:
    payload  uint8 [n * 2 * kv_heads * block_size * head_dim], contiguous, one byte per value, laid out
             [n, 2, kv_heads, block_size, head_dim] in block_ids order;
    scales   float32 [n, 2, kv_heads].
``unpack(payload, scales, kv_out, block_ids, fmt)`` dequantises (q * scale, then kv_out's dtype) and
scatters into ``kv_out`` at block_ids, in place.

int8 rounds half away from zero and clamps to [-127, 127]; fp8 clamps to [-448, 448] and rounds to
nearest even (the hardware conversion). The Triton kernels (one launch each, one program per group)
and the plain-torch references compute the same arithmetic (x * (QMAX / absmax) with IEEE division),
so int8 payloads are byte-identical and dequantised values equal.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["pack", "unpack", "pack_reference", "unpack_reference", "pack_triton", "unpack_triton",
           "FORMATS", "payload_bytes"]

QMAX = {"int8": 127.0, "fp8": 448.0}
FORMATS = tuple(f for f in QMAX if f != "fp8" or hasattr(torch, "float8_e4m3fn"))


def _wire_dtype(fmt: str) -> torch.dtype:
    if fmt not in QMAX:
        raise ValueError(f"KV wire format must be one of {sorted(QMAX)}, got {fmt!r}")
    if fmt == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("fp8 KV compression needs torch.float8_e4m3fn (torch >= 2.1)")
        return torch.float8_e4m3fn
    return torch.int8


def _check_pool(kv: torch.Tensor, block_ids: torch.Tensor) -> tuple[int, int, int, int]:
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV pool must be [num_blocks, 2, kv_heads, block_size, head_dim], got {tuple(kv.shape)}")
    if kv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"KV pool dtype must be float32, bfloat16 or float16, got {kv.dtype}")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    if block_ids.numel() and (int(block_ids.min()) < 0 or int(block_ids.max()) >= kv.shape[0]):
        raise ValueError(f"block_ids out of range for a pool of {kv.shape[0]} blocks")
    _, _, heads, block_size, head_dim = kv.shape
    return block_ids.numel(), heads, block_size, head_dim


def payload_bytes(num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> int:
    """Bytes on the wire for n blocks: one byte per value plus a float32 scale per (block, K/V, head)."""
    return num_blocks * 2 * kv_heads * (block_size * head_dim + 4)


# --------------------------------------------------------------------------------------------------
# References (plain torch)
# --------------------------------------------------------------------------------------------------


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    return torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5))


def pack_reference(kv: torch.Tensor, block_ids: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`pack`."""
    wire = _wire_dtype(fmt)
    n, heads, block_size, head_dim = _check_pool(kv, block_ids)
    qmax = QMAX[fmt]
    x = kv[block_ids.to(device=kv.device, dtype=torch.int64)].float().reshape(n, 2, heads, block_size * head_dim)
    amax = x.abs().amax(dim=-1) if x.numel() else torch.zeros(n, 2, heads, device=kv.device)
    # tensor / tensor: torch turns `scalar / tensor` into reciprocal-times, which is not the IEEE quotient
    qmax_t = torch.full_like(amax, qmax)
    scales = amax / qmax_t
    inv = torch.where(amax > 0, qmax_t / amax, torch.zeros_like(amax))
    y = x * inv[..., None]
    if fmt == "int8":
        q = _round_half_away(y).clamp(-127, 127).to(torch.int8)
    else:
        q = y.clamp(-448.0, 448.0).to(wire)
    return q.reshape(-1).view(torch.uint8), scales


def unpack_reference(payload: torch.Tensor, scales: torch.Tensor, kv_out: torch.Tensor, block_ids: torch.Tensor,
                     fmt: str = "int8") -> None:
    """Plain-torch :func:`unpack`."""
    wire = _wire_dtype(fmt)
    n, heads, block_size, head_dim = _check_pool(kv_out, block_ids)
    _check_payload(payload, scales, n, heads, block_size, head_dim)
    q = payload.view(wire).float().reshape(n, 2, heads, block_size, head_dim)
    kv_out[block_ids.to(device=kv_out.device, dtype=torch.int64)] = (q * scales.float()[..., None, None]).to(kv_out.dtype)


def _check_payload(payload, scales, n, heads, block_size, head_dim):
    expect = n * 2 * heads * block_size * head_dim
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expect:
        raise ValueError(f"payload must be uint8 [{expect}] for {n} blocks of [2, {heads}, {block_size}, {head_dim}], "
                         f"got {payload.dtype} {tuple(payload.shape)}")
    if tuple(scales.shape) != (n, 2, heads):
        raise ValueError(f"scales must be [{n}, 2, {heads}], got {tuple(scales.shape)}")


# --------------------------------------------------------------------------------------------------
# Triton kernels: one program per (block, K/V, head) group
# --------------------------------------------------------------------------------------------------


@triton.jit
def _round_to_e4m3(y):
    # Round-to-nearest-even onto the e4m3 grid in float32, so the cast that follows is exact. The
    # hardware conversion rounds the same way; Triton's interpreter does not (it drops the carry into
    # the exponent), and the kernel must give the same bytes in both.
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: quantum of 2^-6
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): 3 mantissa bits
    t = a * ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # a / quantum, exact
    r = tl.floor(t + 0.5)
    r = tl.where(((r - t) == 0.5) & ((r.to(tl.int32) & 1) == 1), r - 1.0, r)  # ties to even
    rounded = r * quantum
    return tl.where(bits < 0, -rounded, rounded)


@triton.jit
def _round_to_bf16(x):
    # float32 -> nearest-even bfloat16 value, still in float32: exact to cast (the interpreter truncates)
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pack_kernel(kv_ptr, block_ids_ptr, payload_ptr, scales_ptr,
                 s_block, s_kv, s_head, s_tok, s_dim, HEADS, HEAD_DIM, GROUP,
                 QMAX: tl.constexpr, IS_FP8: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    i = g // (2 * HEADS)
    which = (g // HEADS) % 2
    h = g % HEADS
    blk = tl.load(block_ids_ptr + i)
    base = kv_ptr + blk * s_block + which * s_kv + h * s_head
    amax = tl.full([], 0.0, tl.float32)
    for start in range(0, GROUP, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < GROUP
        x = tl.load(base + (offs // HEAD_DIM) * s_tok + (offs % HEAD_DIM) * s_dim, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    # IEEE division (div_rn), as torch: the GPU's default fp32 '/' is approximate and would change bytes
    tl.store(scales_ptr + g, tl.math.div_rn(amax, QMAX))
    inv = tl.where(amax > 0.0, tl.math.div_rn(QMAX, tl.where(amax > 0.0, amax, 1.0)), 0.0)
    out = payload_ptr + g * GROUP
    for start in range(0, GROUP, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < GROUP
        x = tl.load(base + (offs // HEAD_DIM) * s_tok + (offs % HEAD_DIM) * s_dim, mask=mask, other=0.0).to(tl.float32)
        y = x * inv
        if IS_FP8:
            q = _round_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0)).to(tl.float8e4nv)
        else:
            r = tl.where(y >= 0.0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
            q = tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)
        tl.store(out + offs, q, mask=mask)


@triton.jit
def _unpack_kernel(payload_ptr, scales_ptr, kv_ptr, block_ids_ptr,
                   s_block, s_kv, s_head, s_tok, s_dim, HEADS, HEAD_DIM, GROUP,
                   OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    i = g // (2 * HEADS)
    which = (g // HEADS) % 2
    h = g % HEADS
    blk = tl.load(block_ids_ptr + i)
    base = kv_ptr + blk * s_block + which * s_kv + h * s_head
    scale = tl.load(scales_ptr + g)
    src = payload_ptr + g * GROUP
    for start in range(0, GROUP, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < GROUP
        x = tl.load(src + offs, mask=mask).to(tl.float32) * scale
        if OUT_BF16:
            x = _round_to_bf16(x)
        tl.store(base + (offs // HEAD_DIM) * s_tok + (offs % HEAD_DIM) * s_dim,
                 x.to(kv_ptr.dtype.element_ty), mask=mask)


def _block_for(group: int) -> int:
    return min(triton.next_power_of_2(max(group, 16)), 4096)


def pack_triton(kv: torch.Tensor, block_ids: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack` as one Triton launch (grid: n * 2 * kv_heads)."""
    wire = _wire_dtype(fmt)
    n, heads, block_size, head_dim = _check_pool(kv, block_ids)
    group = block_size * head_dim
    payload = torch.empty(n * 2 * heads * group, dtype=torch.uint8, device=kv.device)
    scales = torch.empty(n, 2, heads, dtype=torch.float32, device=kv.device)
    if n == 0:
        return payload, scales
    ids = block_ids.to(device=kv.device, dtype=torch.int64).contiguous()
    _pack_kernel[(n * 2 * heads,)](
        kv, ids, payload.view(wire), scales, *kv.stride(), heads, head_dim, group,
        QMAX=QMAX[fmt], IS_FP8=fmt == "fp8", BLOCK=_block_for(group),
        enable_fp_fusion=False,  # x * inv + 0.5 as an FMA would round differently from torch's two ops
    )
    return payload, scales


def unpack_triton(payload: torch.Tensor, scales: torch.Tensor, kv_out: torch.Tensor, block_ids: torch.Tensor,
                  fmt: str = "int8") -> None:
    """:func:`unpack` as one Triton launch (grid: n * 2 * kv_heads)."""
    wire = _wire_dtype(fmt)
    n, heads, block_size, head_dim = _check_pool(kv_out, block_ids)
    _check_payload(payload, scales, n, heads, block_size, head_dim)
    if n == 0:
        return
    group = block_size * head_dim
    ids = block_ids.to(device=kv_out.device, dtype=torch.int64).contiguous()
    _unpack_kernel[(n * 2 * heads,)](
        payload.view(wire), scales.float().contiguous(), kv_out, ids, *kv_out.stride(), heads, head_dim, group,
        OUT_BF16=kv_out.dtype == torch.bfloat16, BLOCK=_block_for(group), enable_fp_fusion=False,
    )


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pack(kv: torch.Tensor, block_ids: torch.Tensor, fmt: str = "int8", *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``kv[block_ids]`` and quantise: -> (payload uint8 [n*2*H*bs*D], scales float32 [n, 2, H]).

    ``impl``: "triton", "reference", or "auto" (Triton on CUDA or under TRITON_INTERPRET=1).
    """
    if impl == "auto":
        impl = "triton" if _use_triton(kv) else "reference"
    if impl == "triton":
        return pack_triton(kv, block_ids, fmt)
    if impl == "reference":
        return pack_reference(kv, block_ids, fmt)
    raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")


def unpack(payload: torch.Tensor, scales: torch.Tensor, kv_out: torch.Tensor, block_ids: torch.Tensor,
           fmt: str = "int8", *, impl: str = "auto") -> None:
    """Dequantise ``payload`` and scatter it into ``kv_out[block_ids]`` (in kv_out's dtype), in place."""
    if impl == "auto":
        impl = "triton" if _use_triton(kv_out) else "reference"
    if impl == "triton":
        return unpack_triton(payload, scales, kv_out, block_ids, fmt)
    if impl == "reference":
        return unpack_reference(payload, scales, kv_out, block_ids, fmt)
    raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
