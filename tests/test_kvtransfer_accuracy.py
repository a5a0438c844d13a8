"""KV compression on the wire against the real default model (SmolLM2-135M): int8 keeps greedy decoding.

The KV of each prompt goes through exactly the path a compressed transfer takes (sender's wire
pieces → receiver's Assembly), then the model continues from it; its greedy choices are compared
with those from the exact KV at every position of a varied text set.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.kvtransfer.compression import VARIED_TEXTS, compression_accuracy, wire_ratios, wire_round_trip


@pytest.fixture(scope="module")
def runner(model_dir):
    from pdserve.runtime import ModelRunner

    return ModelRunner(model_dir)


def test_int8_kv_keeps_greedy_tokens_on_99_percent_of_positions(runner):
    texts = [runner.encode(t) for t in VARIED_TEXTS]
    res = compression_accuracy(runner, texts, "int8")
    print(res)  # the numbers behind the assertion, for the log
    assert res["positions"] >= 300
    assert res["agreement"] >= 0.99, res
    assert abs(res["ppl_change"]) < 0.01, res
    assert res["wire_ratio"] >= 4.0  # float32 KV: one byte per value + a scale per 64 values, then deflate


def test_int8_cuts_wire_bytes_2x_vs_bf16_and_4x_vs_fp32_on_real_kv(runner):
    """The issue's byte targets, measured on the model's own KV (random KV would not deflate the same)."""
    ratios = wire_ratios(runner, [runner.encode(t) for t in VARIED_TEXTS], "int8")
    print(ratios)
    assert ratios["bfloat16"] >= 2.0, ratios
    assert ratios["float32"] >= 4.0, ratios


def test_uncompressed_round_trip_is_exact(runner):
    _, cache = runner.prefill(runner.encode(VARIED_TEXTS[0]))
    kv = runner.cache_to_blocks(cache)
    same, nbytes = wire_round_trip(kv, "none")
    assert nbytes == kv.nbytes and all(torch.equal(a, b) for a, b in zip(kv.layers, same.layers))
    lossy, _ = wire_round_trip(kv, "int8")
    assert not all(torch.equal(a, b) for a, b in zip(kv.layers, lossy.layers))  # int8 really was applied
