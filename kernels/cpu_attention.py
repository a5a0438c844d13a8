"""Paged attention on the CPU in one native call per layer (`cpu_attention.c`), built once per machine.

The torch reference (`paged_attention.paged_attention_reference`) gathers and widens every sequence's K
and V before its matmuls: with a bfloat16 pool that is two copies of the whole context per layer per step,
plus 8-10 small ops per sequence, which at batch 16 cost a third of a decode step on a 2-core CPU. The
native kernel reads each key and value row once, in place, for all the query rows of its KV head.

It is compiled at first use with the machine's C compiler (`$CC`, else `cc`; `-O3 -march=native`, or the
`-march` target in `$PDSERVE_NATIVE_MARCH`, such as x86-64-v3 for the AVX2 kernels on a CPU that has more; no
fast-math; glibc's vector `expf` where it links) into the cache (`~/.cache/pdserve/kernels`, keyed by the
sources, the flags and the CPU's flags; `build_library`, which `cpu_decoder` shares), loaded with ctypes, and called with the tensors' pointers and strides. Where there is no
compiler, the build fails, or `PDSERVE_CPU_ATTENTION=0` is set, `available()` is False and callers use
the reference. Pools of float32 or bfloat16 (what the engine allocates on a CPU); anything else goes to
the reference too.

Prompt chunks (more query rows than `paged_attention.NATIVE_MAX_ROWS`) in bfloat16 take a second kernel,
`cpu_chunk_attention.c` (`chunk_attention_cpu`), where the CPU has AVX512-BF16: SDPA's CPU flash kernel,
which the reference calls for them, ran a 256-token chunk at a fifth of the speed of the projections.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdserve.modelstore import cache_dir

log = logging.getLogger("pdserve.kernels.cpu_attention")

SOURCE = Path(__file__).with_name("cpu_attention.c")
# -z defs: a symbol no library defines fails the build here (and torch serves), not every later load
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11", "-Wl,-z,defs")
# PDSERVE_NATIVE_MARCH: another target for -march (x86-64-v3: the AVX2 + FMA kernels on a CPU that has more,
# to measure or test them there); native by default
MARCH_ENV = "PDSERVE_NATIVE_MARCH"
VARIANTS = (("-DPDSERVE_LIBMVEC", "-lmvec"), ())
KV_DTYPES = (torch.float32, torch.bfloat16)

_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# what each x86-64 level needs of /proc/cpuinfo's flags, so a forced level the CPU lacks is refused, not a SIGILL
LEVEL_FLAGS = {"x86-64-v2": ("sse4_2", "popcnt", "ssse3"), "x86-64-v3": ("avx2", "fma", "f16c", "bmi2", "movbe"),
               "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")}


def _lacking(march: str) -> list[str]:
    """The CPU flags x86-64 level `march` (and the levels below it) needs that this CPU lacks; [] for others."""
    if march not in LEVEL_FLAGS:
        return []
    levels = list(LEVEL_FLAGS)
    have = set(_cpu_flags().split())
    return [f for level in levels[:levels.index(march) + 1] for f in LEVEL_FLAGS[level] if f not in have]


def flags() -> tuple[str, ...]:
    """The compiler flags of every native kernel: `FLAGS`, with `$PDSERVE_NATIVE_MARCH` for -march where set."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def library_path(compiler: str, source: Path = SOURCE) -> Path:
    """Where the build of `source` (and the C files beside it, which it may include) is cached: keyed by
    their text, the compiler, the flags and the CPU's flags."""
    texts = [p.read_text() for p in sorted(source.parent.glob("*.c"))]
    key = hashlib.sha256("\0".join([source.name, *texts, compiler, *flags(), *map(" ".join, VARIANTS),
                                    platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{key}.so"


def build_library(source: Path, switch: str) -> ctypes.CDLL | None:
    """Compile `source` once per machine into the cache and load it; None where `$switch` is "0", there is
    no C compiler, or the build fails (logged: callers serve with torch instead)."""
    if os.environ.get(switch, "1") == "0":
        return None
    march = os.environ.get(MARCH_ENV, "").strip()
    lacking = _lacking(march)
    if lacking:
        log.warning("%s=%s but this CPU lacks %s: %s is not built, torch serves instead", MARCH_ENV, march,
                    " ".join(lacking), source.name)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        log.info("no C compiler: %s is not built, torch serves instead", source.name)
        return None
    path = library_path(compiler, source)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # built beside its final name and renamed: processes starting together never load a half-written file
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
        os.close(fd)
        try:
            for extra in VARIANTS:  # glibc's vector exp where it links, else scalar expf
                r = subprocess.run([compiler, *flags(), *extra, "-I", str(source.parent), "-o", tmp, str(source), "-lm"],
                                   capture_output=True, text=True, timeout=120)
                if r.returncode == 0:
                    break
            if r.returncode != 0:
                log.warning("building %s failed (%s): torch serves instead\n%s", source.name, compiler, r.stderr[-2000:])
                return None
            os.replace(tmp, path)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("building %s failed (%s): torch serves instead", source.name, e)
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:  # a build that links but cannot load here: serve with torch, as for a failed build
        log.warning("loading %s failed (%s): torch serves instead", path.name, e)
        return None


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
    split over two threads a 256-token chunk of SmolLM2 went from 0.70 ms a layer to 0.60 with OpenMP's
    threads set passive and to 0.83 with them spinning (torch's, between its own ops)."""
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
