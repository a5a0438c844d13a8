"""How the native kernels are built and found: prebuilt per instruction-set level, else compiled here.

No torch and nothing of pdserve at import, so the image's compiler stage runs `prebuild.py` beside this file
with a bare Python. `build_library(source, switch)` returns the loaded library of one C kernel, or None (torch
serves then): first the best prebuilt variant this CPU runs (`PREBUILT`, from `prebuilt_dir()`, named by the
sources' key so a library of other sources is never loaded), then a build with the machine's compiler into
the cache (`-march=native`, or `$PDSERVE_NATIVE_MARCH`, which skips the prebuilt libraries). `engine_info()`
says what serves, for logs and the `pdserve_engine_info` metric.
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

log = logging.getLogger("pdserve.kernels.native_build")

# -z defs: a symbol no library defines fails the build here (and torch serves), not every later load
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11", "-Wl,-z,defs")
# PDSERVE_NATIVE_MARCH: another target for -march (x86-64-v3: the AVX2 + FMA kernels on a CPU that has more,
# to measure or test them there); native by default
MARCH_ENV = "PDSERVE_NATIVE_MARCH"
VARIANTS = (("-DPDSERVE_LIBMVEC", "-lmvec"), ())
# source file name -> ("prebuilt", variant) or ("compiled", march): what build_library loaded
LOADED: dict[str, tuple[str, str]] = {}


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


def library_path(compiler: str, source: Path) -> Path:
    """Where the build of `source` (and the C files beside it, which it may include) is cached: keyed by
    their text, the compiler, the flags and the CPU's flags."""
    texts = [p.read_text() for p in sorted(source.parent.glob("*.c"))]
    key = hashlib.sha256("\0".join([source.name, *texts, compiler, *flags(), *map(" ".join, VARIANTS),
                                    platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    from pdserve.modelstore import cache_dir  # here: the image's compiler stage runs this module without pdserve

    return cache_dir() / "kernels" / f"{source.stem}-{key}.so"


# Prebuilt libraries (`python -m pdserve.kernels.prebuild`, run where the image or wheel is built), best
# first: name, the compiler's target flags, and what /proc/cpuinfo must show beyond the x86-64 level named.
PREBUILT = (
    ("amx", ("-march=sapphirerapids",), "x86-64-v4", ("amx_tile", "amx_bf16", "avx512_bf16", "avx512_fp16")),
    ("avx512-bf16", ("-march=x86-64-v4", "-mavx512bf16"), "x86-64-v4", ("avx512_bf16",)),
    ("x86-64-v4", ("-march=x86-64-v4",), "x86-64-v4", ()),
    ("x86-64-v3", ("-march=x86-64-v3",), "x86-64-v3", ()),
)
PREBUILT_ENV = "PDSERVE_KERNELS_DIR"  # where prebuilt libraries are looked for; else the package's prebuilt/


def prebuilt_dir() -> Path:
    return Path(os.environ.get(PREBUILT_ENV) or Path(__file__).with_name("prebuilt"))


def source_key(source: Path) -> str:
    """The prebuilt libraries' key: the C sources' text (a library built from other sources is never loaded)."""
    texts = [p.read_text() for p in sorted(source.parent.glob("*.c"))]
    return hashlib.sha256("\0".join([source.name, *texts, *FLAGS, *map(" ".join, VARIANTS)]).encode()).hexdigest()[:16]


def prebuilt_name(source: Path, variant: str) -> str:
    return f"{source.stem}-{variant}-{source_key(source)}.so"


def runnable_variants() -> list[str]:
    """The prebuilt variants this CPU runs, best first ([] off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    have = set(_cpu_flags().split())
    return [name for name, _, level, extra in PREBUILT if not _lacking(level) and all(f in have for f in extra)]


def compile_library(compiler: str, source: Path, target: tuple[str, ...], dest: Path) -> str | None:
    """Build `source` for `target` (-march flags) into `dest`, atomically; None, or the compiler's complaint."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # built beside its final name and renamed: processes starting together never load a half-written file
    fd, tmp = tempfile.mkstemp(dir=dest.parent, suffix=".so")
    os.close(fd)
    base = tuple(f for f in FLAGS if not f.startswith("-march="))
    try:
        for extra in VARIANTS:  # glibc's vector exp where it links, else scalar expf
            r = subprocess.run([compiler, *target, *base, *extra, "-I", str(source.parent), "-o", tmp, str(source),
                                "-lm"], capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                os.replace(tmp, dest)
                return None
        return r.stderr[-2000:] or f"exit status {r.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_prebuilt(source: Path) -> ctypes.CDLL | None:
    for variant in runnable_variants():
        path = prebuilt_dir() / prebuilt_name(source, variant)
        if path.exists():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                log.warning("loading prebuilt %s failed (%s)", path.name, e)
                continue
            log.info("%s: prebuilt for %s", source.name, variant)
            LOADED[source.name] = ("prebuilt", variant)
            return lib
    return None


def build_library(source: Path, switch: str) -> ctypes.CDLL | None:
    """`source`'s library: prebuilt for the best instruction set this CPU has (`PREBUILT`, no compiler
    needed), else compiled once per machine into the cache; None where `$switch` is "0", or with neither a
    prebuilt library nor a C compiler, or when the build fails (logged: callers serve with torch instead).
    `$PDSERVE_NATIVE_MARCH` skips the prebuilt libraries and compiles for that target."""
    if os.environ.get(switch, "1") == "0":
        return None
    march = os.environ.get(MARCH_ENV, "").strip()
    lacking = _lacking(march)
    if lacking:
        log.warning("%s=%s but this CPU lacks %s: %s is not built, torch serves instead", MARCH_ENV, march,
                    " ".join(lacking), source.name)
        return None
    if not march:
        lib = _load_prebuilt(source)
        if lib is not None:
            return lib
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        log.info("no C compiler and no prebuilt library for this CPU: %s is not built, torch serves instead",
                 source.name)
        return None
    path = library_path(compiler, source)
    if not path.exists():
        error = compile_library(compiler, source, tuple(f for f in flags() if f.startswith("-march=")), path)
        if error is not None:
            log.warning("building %s failed (%s): torch serves instead\n%s", source.name, compiler, error)
            return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:  # a build that links but cannot load here: serve with torch, as for a failed build
        log.warning("loading %s failed (%s): torch serves instead", path.name, e)
        return None
    log.info("%s: compiled for -march=%s", source.name, march or "native")
    LOADED[source.name] = ("compiled", march or "native")
    return lib


def engine_info() -> dict[str, str]:
    """What the native kernels loaded so far are: `kernels` "prebuilt", "compiled" or "torch" (none loaded,
    or some mixed), `isa` the variant or -march they were built for ("" for torch)."""
    kinds = set(LOADED.values())
    if len(kinds) != 1:
        return {"kernels": "torch" if not kinds else "mixed", "isa": ",".join(sorted({v for _, v in kinds}))}
    kind, isa = kinds.pop()
    return {"kernels": kind, "isa": isa}
