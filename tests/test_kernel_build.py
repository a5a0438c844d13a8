"""The native kernels' build: a source that cannot link or a cached library that cannot load leaves torch serving.

On a CPU without AVX-512 (a Zen 3 host) cpu_decoder.c once compiled to a library that called an undefined
`_mm_pause`: the build "succeeded", and every later `ctypes.CDLL` raised, so no bfloat16 engine could be built.
These run the real compiler and the real loader on sources and files written here.
"""
from __future__ import annotations

import logging
import shutil

import pytest

from pdserve.kernels import cpu_attention, cpu_decoder

needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")


@needs_cc
def test_a_source_calling_a_symbol_no_library_defines_fails_its_build_and_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "undefined.c"
    src.write_text("void nowhere_defined(void);\nint pdserve_probe(void) { nowhere_defined(); return 1; }\n")
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.cpu_attention"):
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
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.cpu_attention"):
        assert cpu_attention.build_library(src, "PDSERVE_TEST_PROBE") is None
    assert "loading" in caplog.text and "torch serves instead" in caplog.text


@needs_cc
def test_the_decoder_library_loads_on_this_cpu_whatever_its_instruction_set():
    """The real cpu_decoder.c on this machine's CPU: it builds and loads, and says whether its GEMV runs here."""
    lib = cpu_attention.build_library(cpu_decoder.SOURCE, "PDSERVE_NATIVE_DECODE_PROBE")
    assert lib is not None
    assert lib.pdserve_bf16_gemv_available() in (0, 1)
