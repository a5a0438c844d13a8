"""The native decoder layers (`cpu_decoder.c`), bfloat16 and float32: their build, weight packing and GEMV.

At one to a few rows a transformers decoder layer is some forty torch ops and their Python around
matmuls that are themselves short, and the ops cost more than the matmuls (docs/PERFORMANCE.md, "Native
decoder layer"). `pdserve_llama_layer` runs a Llama-style layer's whole forward in C — norms, projections
(AVX512-BF16 GEMVs over weights packed for them, `pack`; on a CPU without it, AVX2 + FMA GEMVs that widen
the same packed weights in registers; or AMX tiles over the same packing where the CPU has them),
rotary embedding (the model's own cos/sin tables), the K/V write, paged attention, SiLU. `pdserve_llama_layer_f32`
is the same layer for float32 models over float32 pools (AVX2 + FMA or AVX-512), reading the model's own weights
in place. Which models it serves and how a step calls it: `pdserve.engine.native`. Built like the attention kernel
(`cpu_attention.build_library`); `PDSERVE_NATIVE_DECODE=0` leaves it unbuilt, as does a CPU or compiler
with neither AVX512-BF16 nor AVX2 + FMA.
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from pdserve.kernels.cpu_attention import build_library

log = logging.getLogger("pdserve.kernels.cpu_decoder")

SOURCE = Path(__file__).with_name("cpu_decoder.c")
# Steps of more rows run transformers' forward. On AVX512-BF16 the packed GEMV runs at the core's bf16 peak from 16
# rows up, faster than oneDNN's matmul, so the native layer stays cheaper through prompts too. On AMX tiles the
# native layer stays cheaper than oneDNN's through prefill's whole default step (512 tokens,
# `PrefillConfig.max_batch_tokens`) and past it (docs/PERFORMANCE.md, "Native step size"). The layer splits over
# the threads the process may use (`set_threads`, and a lender's: `set_lender`), so a prefill step on decode's
# lent core runs natively on both.
MAX_ROWS = 1024
AMX_MAX_ROWS = 1024

_lib: ctypes.CDLL | None = None
_tried = False


class LayerWeights(ctypes.Structure):
    """The pointers of one layer's weights, as `pdserve_llama_layer` and `pdserve_llama_layer_f32` take them
    (`struct layer_weights`, `struct f32_layer_weights`: packed bfloat16, or float32 `[in, out]` in place)."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("ln1", "qkv", "qkv_bias", "o", "ln2", "gate_up", "down",
                                                        "q_norm", "k_norm", "sinks", "post_attn", "post_ffn")),
                ("window", ctypes.c_int), ("softcap", ctypes.c_float), ("gemma_norm", ctypes.c_int),
                ("gelu", ctypes.c_int),
                *((name, ctypes.c_void_p) for name in ("router", "experts_gate_up", "experts_down")),
                ("expert_gu_stride", ctypes.c_int64), ("expert_down_stride", ctypes.c_int64),
                ("n_experts", ctypes.c_int), ("top_k", ctypes.c_int), ("norm_topk", ctypes.c_int)]


def library() -> ctypes.CDLL | None:
    """The built kernel (built now if it was not tried yet), or None (no compiler, a CPU with neither
    AVX512-BF16 nor AVX2 + FMA, switched off)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        lib = build_library(SOURCE, "PDSERVE_NATIVE_DECODE")
        if lib is not None and lib.pdserve_bf16_gemv_available():
            p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
            lib.pdserve_pack_bf16.argtypes = [p, p, i32, i32]
            lib.pdserve_bf16_gemv.argtypes = [p, i32, p, i32, i32, p, p]
            lib.pdserve_llama_layer.argtypes = [p, i32, i32, i32, p, f32, i32, i32, i32, p, p, p, i64, i64, i64, i64,
                                                i64, p, p, i64, p, p, i32, i32, f32, p]
            lib.pdserve_llama_layer.restype = ctypes.c_int
            lib.pdserve_llama_layer_f32.argtypes = lib.pdserve_llama_layer.argtypes
            lib.pdserve_llama_layer_f32.restype = ctypes.c_int
            lib.pdserve_f32_layer_available.restype = i32
            lib.pdserve_f32_scratch_bytes.argtypes = [i32] * 6
            lib.pdserve_f32_scratch_bytes.restype = i64
            lib.pdserve_f32_gemm.argtypes = [p, i32, p, i32, i32, p, p]
            lib.pdserve_f32_rms_norm.argtypes = [p, i32, p, f32, i32, p]
            lib.pdserve_use_amx.argtypes = [i32]
            lib.pdserve_use_amx.restype = i32
            lib.pdserve_native_threads.argtypes = [i32]
            lib.pdserve_native_threads.restype = i32
            lib.pdserve_native_lender.argtypes = [p]
            lib.pdserve_native_lender.restype = None
            lib.pdserve_native_threads_in_use.restype = i32
            lib.pdserve_native_isa.restype = ctypes.c_char_p
            lib.pdserve_use_amx(int(os.environ.get("PDSERVE_NATIVE_AMX", "1") != "0"))
            log.info("native steps on %s (bfloat16%s)", lib.pdserve_native_isa().decode(),
                     " and float32" if lib.pdserve_f32_layer_available() else "")
            _lib = lib
        elif lib is not None:
            log.info("this CPU (or compiler) has neither AVX512-BF16 nor AVX2 with FMA: bfloat16 steps run "
                     "transformers' forward")
    return _lib


def use_amx(on: bool) -> bool:
    """Every native projection of this process on AMX tiles (where the CPU has them and Linux grants this
    process their state) or on AVX512-BF16; returns whether AMX is now in use. Set once, before serving: the
    two round differently, and a sequence's logits must not depend on when it was computed. The default is
    AMX where it runs (`PDSERVE_NATIVE_AMX=0`: AVX512-BF16)."""
    return bool(library().pdserve_use_amx(int(bool(on))))


def set_threads(n: int) -> int:
    """The threads native steps (and `gemv`) use from now on, this one included; returns the count in force.
    Which thread computes what never changes a result: a step's logits are the same on any count."""
    return int(library().pdserve_native_threads(int(n)))


def set_lender(address: int | None) -> None:
    """Add, at every phase of every native layer, the threads another process lends now: `address` is an
    int32 in memory shared with it (`CpuLease.idle_word`), read as it changes; None stops reading it (call
    that before the memory goes away)."""
    library().pdserve_native_lender(address or None)


def threads_in_use() -> int:
    """The threads a native phase would use now: `set_threads`'s count plus what a lender lends."""
    return int(library().pdserve_native_threads_in_use())


def isa() -> str:
    """What the native projections run on here: "amx", "avx512-bf16", "avx2-fma", or "" (not built)."""
    lib = library()
    return "" if lib is None else lib.pdserve_native_isa().decode()


def max_rows() -> int:
    """Most rows of a native step on the path this process uses (`MAX_ROWS`, `AMX_MAX_ROWS`)."""
    lib = library()
    if lib is None:
        return 0
    return AMX_MAX_ROWS if lib.pdserve_use_amx(-1) else MAX_ROWS


def pack(weight_t: Tensor) -> Tensor:
    """A projection's weight `[in, out]` (CpuLinear's `weight_t`) in the GEMV's layout (`cpu_decoder.c`)."""
    w = weight_t.t().contiguous()
    n, k = w.shape
    out = torch.empty(((n + 31) // 32) * 32 * k, dtype=torch.bfloat16)
    library().pdserve_pack_bf16(w.data_ptr(), out.data_ptr(), n, k)
    return out


def float32_available() -> bool:
    """Whether the float32 layer (`pdserve_llama_layer_f32`, AVX2 + FMA or AVX-512) is built here."""
    lib = library()
    return lib is not None and bool(lib.pdserve_f32_layer_available())


def gemm_f32(x: Tensor, weight_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x [rows, k] @ weight_t [k, n] (+ bias)` in float32 by the native kernel: each output one FMA chain over
    k in order, whatever the row count (the float32 layer's projections and head)."""
    x, weight_t = x.contiguous(), weight_t.contiguous()
    (rows, k), n = x.shape, weight_t.shape[1]
    y = torch.empty(rows, n, dtype=torch.float32)
    library().pdserve_f32_gemm(x.data_ptr(), rows, weight_t.data_ptr(), n, k,
                               None if bias is None else bias.contiguous().data_ptr(), y.data_ptr())
    return y


def rms_norm_f32(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' Llama norm of each row of `x [rows, n]` in float32, its sum of squares in the layer's order."""
    x = x.contiguous()
    y = torch.empty_like(x)
    library().pdserve_f32_rms_norm(x.data_ptr(), x.shape[0], weight.contiguous().data_ptr(), eps, x.shape[1],
                                   y.data_ptr())
    return y


def gemv(x: Tensor, packed: Tensor, n: int, bias: Tensor | None = None) -> Tensor:
    """`x [rows, k] @ W.T (+ bias)` in bfloat16 by the native GEMV (for tests and benchmarks)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    library().pdserve_bf16_gemv(x.data_ptr(), x.shape[0], packed.data_ptr(), n, x.shape[1],
                                None if bias is None else bias.data_ptr(), y.data_ptr())
    return y
