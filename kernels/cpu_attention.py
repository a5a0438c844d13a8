"""Paged attention on the CPU in one native call per layer (`cpu_attention.c`), built once per machine.

The torch reference (`paged_attention.paged_attention_reference`) gathers and widens every sequence's K
and V before its matmuls: with a bfloat16 pool that is two copies of the whole context per layer per step,
plus 8-10 small ops per sequence, a large share of a batched decode step (docs/PERFORMANCE.md, "Decode
attention"). The native kernel reads each key and value row once, in place, for all the query rows of its
KV head.

It is compiled at first use with the machine's C compiler (`$CC`, else `cc`; `-O3 -march=native`, or the
`-march` target in `$PDSERVE_NATIVE_MARCH`, such as x86-64-v3 for the AVX2 kernels on a CPU that has more; no
fast-math; glibc's vector `expf` where it links) into the cache (`~/.cache/pdserve/kernels`, keyed by the
sources, the flags and the CPU's flags; `build_library`, which `cpu_decoder` shares), loaded with ctypes, and called with the tensors' pointers and strides. Where there is no
compiler, the build fails, or `PDSERVE_CPU_ATTENTION=0` is set, `available()` is False and callers use
the reference. Pools of float32 or bfloat16 (what the engine allocates on a CPU); anything else goes to
the reference too.

Prompt chunks (more query rows than `paged_attention.NATIVE_MAX_ROWS`) in bfloat16 take a second kernel,
`cpu_chunk_attention.c` (`chunk_attention_cpu`), where the CPU has AVX512-BF16: SDPA's CPU flash kernel,
which the reference calls for them, runs a chunk far below the projections' speed (docs/PERFORMANCE.md,
"Prompt-chunk attention").
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

# the build machinery lives in native_build (torch-free, for the image's compiler stage); named here too
from pdserve.kernels.native_build import (FLAGS, MARCH_ENV, PREBUILT, PREBUILT_ENV, build_library,  # noqa: F401
                                          compile_library, flags, library_path, prebuilt_dir, prebuilt_name,
                                          runnable_variants, source_key)

SOURCE = Path(__file__).with_name("cpu_attention.c")
KV_DTYPES = (torch.float32, torch.bfloat16)

_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> ctypes.CDLL | None:
    lib = build_library(SOURCE, "PDSERVE_CPU_ATTENTION")
    if lib is None:
        return None
    fn = lib.pdserve_paged_attention
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    fn.argtypes = [p, p, p, i32, i64, i64, i64, i64, i64, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32, f32, p]
    fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the native kernel is built (building it now if it was not tried yet)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        _lib = _build()
    return _lib is not None


def supports(q: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """Whether these inputs go to the native kernel: CPU tensors, a float32 or bfloat16 pool whose rows
    (head_dim) are contiguous, and the kernel built."""
    return (q.device.type == "cpu" and kv_pool.device.type == "cpu" and kv_pool.dtype in KV_DTYPES
            and kv_pool.stride(-1) == 1 and available())


def paged_attention_cpu(q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                        sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """`paged_attention`'s contract (inputs already checked by it), computed by the native kernel."""
    _, q_heads, head_dim = q.shape
    num_blocks, _, kv_heads, block_size, _ = kv_pool.shape
    qf = q.to(torch.float32).contiguous()
    out = torch.empty_like(qf)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start.to(torch.int32).contiguous()
    sink = None if sinks is None else sinks.to(torch.float32).contiguous()
    s_block, s_kv, s_head, s_tok, _ = kv_pool.stride()
    rc = _lib.pdserve_paged_attention(
        qf.data_ptr(), out.data_ptr(), kv_pool.data_ptr(), int(kv_pool.dtype == torch.bfloat16), s_kv, s_head, s_block,
        s_tok, num_blocks, tables.data_ptr(), tables.stride(0), lens.data_ptr(), starts.data_ptr(), tables.shape[0],
        q_heads, kv_heads, head_dim, block_size, float(scale), int(sliding_window or 0), float(softcap or 0.0),
        None if sink is None else sink.data_ptr())
    if rc == -1:
        raise MemoryError("CPU paged attention: no memory for the scores")
    if rc > 0:
        raise IndexError(f"block_tables of sequence {rc - 1} name a block outside the pool's {num_blocks}")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


# -- prompt chunks (`cpu_chunk_attention.c`) -------------------------------------------------------

CHUNK_SOURCE = Path(__file__).with_name("cpu_chunk_attention.c")
_chunk_lib: ctypes.CDLL | None = None
_chunk_tried = False


def _build_chunk() -> ctypes.CDLL | None:
    lib = build_library(CHUNK_SOURCE, "PDSERVE_CPU_ATTENTION")
    if lib is None or not lib.pdserve_chunk_attention_supported():
        return None  # no AVX512-BF16 on this CPU: SDPA serves prompt chunks
    fn = lib.pdserve_chunk_attention
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    fn.argtypes = [p, p, p, i64, i64, i64, i64, i64, p, i32, i32, i32, i32, i32, i32, f32, i32, i32]
    fn.restype = ctypes.c_int
    return lib


def chunk_supports(q: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """Whether a prompt chunk of these inputs goes to the native chunk kernel: bfloat16 queries and pool on
    the CPU, head_dim a multiple of 32 up to 256, rows contiguous, and the kernel built with AVX512-BF16."""
    global _chunk_lib, _chunk_tried
    if not (q.device.type == "cpu" and q.dtype == torch.bfloat16 and kv_pool.dtype == torch.bfloat16
            and kv_pool.stride(-1) == 1 and q.shape[-1] % 32 == 0 and q.shape[-1] <= 256):
        return False
    if not _chunk_tried:
        _chunk_tried = True
        _chunk_lib = _build_chunk()
    return _chunk_lib is not None


def chunk_attention_cpu(q: torch.Tensor, kv_pool: torch.Tensor, table: torch.Tensor, length: int,
                        scale: float) -> torch.Tensor:
    """Causal attention of one sequence's chunk q [n, q_heads, D] (its last n positions of `length`) over
    the pool, full attention (no window, soft cap or sinks) -> [n, q_heads, D] in q's dtype.

    One thread. The C call takes a range of its (KV head, query tile) items so that it could be split, but
    a second thread gains little with OpenMP's threads set passive and loses with them spinning (torch's,
    between its own ops) (docs/PERFORMANCE.md, "Prompt-chunk attention")."""
    n, q_heads, head_dim = q.shape
    num_blocks, _, kv_heads, block_size, _ = kv_pool.shape
    qc = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    tab = table.to(torch.int32).contiguous()
    s_block, s_kv, s_head, s_tok, _ = kv_pool.stride()
    items = kv_heads * -(-n // 16)
    args = (qc.data_ptr(), out.data_ptr(), kv_pool.data_ptr(), s_kv, s_head, s_block, s_tok, num_blocks,
            tab.data_ptr(), length, n, q_heads, kv_heads, head_dim, block_size, float(scale))
    rc = _chunk_lib.pdserve_chunk_attention(*args, 0, items)
    if rc == -1:
        raise MemoryError("CPU chunk attention: no memory for the scores")
    if rc == 1:
        raise IndexError(f"the block table names a block outside the pool's {num_blocks}")
    if rc != 0:
        raise ValueError(f"CPU chunk attention refused head_dim {head_dim} (rc {rc})")
    return out.to(q.dtype)
