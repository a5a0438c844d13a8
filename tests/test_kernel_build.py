"""The native kernels' build: a source that cannot link or a cached library that cannot load leaves torch serving.

On a CPU without AVX-512 (a Zen 3 host) cpu_decoder.c once compiled to a library that called an undefined
`_mm_pause`: the build "succeeded", and every later `ctypes.CDLL` raised, so no bfloat16 engine could be built.
These run the real compiler and the real loader on sources and files written here.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels import cpu_attention, cpu_decoder, native_build

needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")


@needs_cc
def test_a_source_calling_a_symbol_no_library_defines_fails_its_build_and_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "undefined.c"
    src.write_text("void nowhere_defined(void);\nint pdserve_probe(void) { nowhere_defined(); return 1; }\n")
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.native_build"):
        assert cpu_attention.build_library(src, "PDSERVE_TEST_PROBE") is None
    assert "building undefined.c failed" in caplog.text
    assert "nowhere_defined" in caplog.text  # the linker's own words say which symbol
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))  # nothing half-built is left to load later


@needs_cc
def test_a_cached_library_that_cannot_load_is_logged_and_torch_serves(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "fine.c"
    src.write_text("int pdserve_probe(void) { return 7; }\n")
    compiler = shutil.which("cc") or shutil.which("gcc")
    path = cpu_attention.library_path(compiler, src)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an ELF file")  # what a truncated or foreign cached build looks like to the loader
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.native_build"):
        assert cpu_attention.build_library(src, "PDSERVE_TEST_PROBE") is None
    assert "loading" in caplog.text and "torch serves instead" in caplog.text


@needs_cc
def test_the_decoder_library_loads_on_this_cpu_whatever_its_instruction_set():
    """The real cpu_decoder.c on this machine's CPU: it builds and loads, and says whether its GEMV runs here."""
    lib = cpu_attention.build_library(cpu_decoder.SOURCE, "PDSERVE_NATIVE_DECODE_PROBE")
    assert lib is not None
    assert lib.pdserve_bf16_gemv_available() in (0, 1)


@needs_cc
@pytest.mark.skipif(platform.machine() != "x86_64" or bool(native_build._lacking("x86-64-v3")),
                    reason="needs an x86-64 CPU with AVX2 + FMA")
def test_a_machine_without_a_compiler_serves_the_prebuilt_kernels_of_its_cpu(tmp_path):
    """The worker image's case: libraries built ahead of time (`python -m pdserve.kernels.prebuild`), then a
    process with no compiler anywhere on its PATH and an empty cache loads the best variant its CPU runs
    (here the only one built, x86-64-v3, so the check holds on an AVX-512 CPU too) and compiles nothing. The
    libraries are built as the Dockerfile's compiler stage builds them: the script from the sources, by a
    Python without site-packages (no pdserve, no torch), and named with the key the installed package reads."""
    from pdserve.kernels.prebuild import SOURCES

    out = tmp_path / "prebuilt"
    script = Path(cpu_attention.__file__).with_name("prebuild.py")
    r = subprocess.run([sys.executable, "-S", "-E", str(script), "--out", str(out), "--variants", "x86-64-v3"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    built = sorted(out.iterdir())
    assert [p.name for p in built] == sorted(cpu_attention.prebuilt_name(s, "x86-64-v3") for s in SOURCES)
    cache = tmp_path / "cache"
    child = ("import json, logging; logging.basicConfig(level=logging.INFO); from pdserve.kernels import cpu_attention, cpu_decoder, cpu_sampling; "
             "from pdserve.introspect import EngineCollector; "
             "a, i, s = cpu_attention.available(), cpu_decoder.isa(), cpu_sampling.library() is not None; "
             "print(json.dumps([a, i, s, next(EngineCollector().collect()).samples[0].labels]))")
    env = dict(os.environ, PATH=str(tmp_path / "no-bin"), CC="", PDSERVE_KERNELS_DIR=str(out),
               PDSERVE_CACHE=str(cache))
    env.pop("PDSERVE_NATIVE_MARCH", None)
    r = subprocess.run([sys.executable, "-P", "-c", child], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [
        True, "avx2-fma", True, {"kernels": "prebuilt", "isa": "x86-64-v3", "decoder": "avx2-fma"}]
    assert "prebuilt for x86-64-v3" in r.stderr
    assert not list(cache.rglob("*.so")), "it compiled instead of loading the prebuilt libraries"
    # a prebuilt library of other sources (its key differs) is not loaded: without a compiler, torch serves
    for p in built:
        p.rename(p.with_name(p.name[:-len(".so") - 16] + "0" * 16 + ".so"))
    r = subprocess.run([sys.executable, "-P", "-c", child], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [
        False, "", False, {"kernels": "torch", "isa": "", "decoder": ""}]
