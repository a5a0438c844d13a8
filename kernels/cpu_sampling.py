"""The native half of sampling (`cpu_sampling.c`): the Exp(1) noise of a position, and the plain race on CPU rows.

Built like the attention kernel (`cpu_attention.build_library`) and loaded with ctypes; None where there is no
C compiler or `PDSERVE_CPU_SAMPLING=0`: `pdserve.sampling` then computes the same noise with torch (the same
bits: `exp_noise_torch`) and draws with torch.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels.cpu_attention import build_library

SOURCE = Path(__file__).with_name("cpu_sampling.c")

_lib: ctypes.CDLL | None = None
_tried = False


def library() -> ctypes.CDLL | None:
    """The built kernel (built now if it was not tried yet), or None."""
    global _lib, _tried
    if not _tried:
        _tried = True
        lib = build_library(SOURCE, "PDSERVE_CPU_SAMPLING")
        if lib is not None:
            p, i32, i64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
            lib.pdserve_exp_noise.argtypes = [u64, i32, p]
            lib.pdserve_exp_noise.restype = None
            lib.pdserve_sample_race.argtypes = [p, i64, i32, i32, p, p, p, p]
            lib.pdserve_sample_race.restype = i32
        _lib = lib
    return _lib


def exp_noise(key: int, n: int) -> torch.Tensor:
    """Exp(1) noise `[n]` float32 under the 64-bit `key` (`cpu_sampling.c`)."""
    out = torch.empty(n, dtype=torch.float32)
    library().pdserve_exp_noise(key, n, out.data_ptr())
    return out


def race(logits: torch.Tensor, temperature: torch.Tensor, keys: list[int]) -> list[int]:
    """argmax(softmax(logits / T) / E) per row of `logits` `[rows, vocab]` (temperature `[rows]`, all > 0; E the
    noise of `keys[r]`); raises ValueError for a row without a finite logit (the caller draws it with torch)."""
    x = logits.to(torch.float32).contiguous()
    rows, vocab = x.shape
    t = temperature.to(torch.float32).contiguous()
    k = torch.tensor(keys, dtype=torch.int64)  # keys are under 2^63
    out = torch.empty(rows, dtype=torch.int64)
    scratch = torch.empty(vocab, dtype=torch.float32)
    rc = library().pdserve_sample_race(x.data_ptr(), vocab, rows, vocab, t.data_ptr(), k.data_ptr(),
                                       scratch.data_ptr(), out.data_ptr())
    if rc:
        raise ValueError(f"row {rc - 1} has no finite scaled logit")
    return out.tolist()
