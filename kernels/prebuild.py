"""Build the native kernels ahead of time, once per instruction-set level, for machines with no compiler.

    python -m pdserve.kernels.prebuild [--out DIR] [--variants amx avx512-bf16 x86-64-v4 x86-64-v3]
    python kernels/prebuild.py --out DIR     # from the sources, with no pdserve installed (the Dockerfile)

Each C kernel (`SOURCES`) is compiled for each variant of `native_build.PREBUILT` into DIR (default: the
package's `kernels/prebuilt/`, where an installed pdserve looks; `$PDSERVE_KERNELS_DIR` points a process at
another), named by the sources' key, so a library built from other sources is never loaded. At run time
`build_library` loads the best variant the CPU has, before trying a compiler (`-march=native` stays for who
asks: `PDSERVE_NATIVE_MARCH=native`). Run where the image or wheel is built: its compiler need not run on a
CPU of each level, only know them (gcc 12 does).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

try:
    from pdserve.kernels import native_build
except ImportError:  # run as a script from the sources (the image's compiler stage: no pdserve, no torch)
    import native_build

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_attention.c", HERE / "cpu_chunk_attention.c", HERE / "cpu_decoder.c", HERE / "cpu_sampling.c")


def prebuild(out: Path, variants: list[str] | None = None, compiler: str | None = None) -> list[Path]:
    """Every source for every variant (all of `PREBUILT` by default) into `out`; returns the libraries built.
    Raises RuntimeError naming the source and variant whose build failed."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler ($CC, cc or gcc)")
    targets = {name: target for name, target, _, _ in native_build.PREBUILT}
    unknown = [v for v in variants or [] if v not in targets]
    if unknown:
        raise RuntimeError(f"unknown variants {unknown}: the variants are {list(targets)}")
    built = []
    for variant in variants or list(targets):
        for source in SOURCES:
            dest = out / native_build.prebuilt_name(source, variant)
            error = native_build.compile_library(compiler, source, targets[variant], dest)
            if error is not None:
                raise RuntimeError(f"building {source.name} for {variant} failed:\n{error}")
            built.append(dest)
    return built


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=native_build.prebuilt_dir())
    p.add_argument("--variants", nargs="+", default=None)
    args = p.parse_args(argv)
    try:
        built = prebuild(args.out, args.variants)
    except RuntimeError as e:
        print(f"prebuild: {e}", file=sys.stderr)
        return 1
    for path in built:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
