"""Shared fixtures: a real NATS server, the real default model, one torch thread, Triton's interpreter."""
from __future__ import annotations

import os
import sys
from pathlib import Path

# The checkout's bench/ scripts are importable from tests (`from bench.sse import ...`). Appended, not
# prepended: the checkout's operator/ folder must never shadow the standard library's `operator`.
sys.path.append(str(Path(__file__).resolve().parents[1]))

# Kernels run on the CPU through Triton's interpreter; it must be set before kernel modules import.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One torch thread: on these 2-core machines two threads made small matmuls slower under load.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Served output is compared token for token with float32 references (`transformers` in float32): every worker
# the tests start serves float32. `dtype: auto` would pick bfloat16 on a CPU with AVX512-BF16 or AMX, whose
# answers part from a float32 reference where two logits nearly tie, so the suite would pass or fail by the CPU it
# runs on. What `dtype: auto` serves is tested on its own (tests/test_same_answer_e2e.py).
os.environ.setdefault("PDSERVE_DTYPE", "float32")

import pytest
import torch

torch.set_num_threads(1)

try:  # fuzz tests: random examples by default (the failing one's seed printed); `--hypothesis-profile=ci`
    # pins them (derandomized, no example database) for a CI that must be reproducible run to run
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
except ImportError:
    pass


def pytest_collection_modifyitems(items):
    """A test that uses the real model (the `model_dir` fixture, directly or through another) is a
    `model` test; every test that needs the model or a Kubernetes API server is `slow`: loading the one
    or starting the other takes seconds before its first assertion. `make test-fast` skips them."""
    for item in items:
        if "model_dir" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("model"):
            item.add_marker(pytest.mark.model)
        if item.get_closest_marker("model") or item.get_closest_marker("k8s"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def nats_server():
    """A real, authenticated nats-server (JetStream in memory) on a free loopback port."""
    from pdserve.natsserver import EmbeddedNats

    server = EmbeddedNats().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def model_dir():
    """The real default model (SmolLM2-135M-Instruct), converted once into the cache."""
    from pdserve.modelstore import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def hf(model_dir):
    """`transformers`' own float32 model and tokenizer of the default model: the reference
    (`servinghelpers.hf_greedy`) that served output is compared with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model
