"""KV wire compression: Triton pack/unpack (interpreter) against the torch references, error bounds, ratios."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_quant import FORMATS, pack, pack_reference, pack_triton, payload_bytes, unpack, unpack_reference, unpack_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_pool(seed: int, num_blocks=6, heads=2, block_size=4, head_dim=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # per-head magnitudes differ by orders: a scale per (block, K/V, head) is what keeps them all precise
    mag = torch.logspace(-2, 2, num_blocks * 2 * heads).view(num_blocks, 2, heads, 1, 1)
    kv = torch.randn(num_blocks, 2, heads, block_size, head_dim, generator=g) * mag
    return kv.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_triton_matches_reference(fmt, dtype):
    kv = make_pool(1, dtype=dtype)
    ids = torch.tensor([4, 0, 5, 2], dtype=torch.int64)
    payload_ref, scales_ref = pack_reference(kv, ids, fmt)
    payload_tri, scales_tri = pack_triton(kv, ids, fmt)
    assert payload_tri.dtype == torch.uint8 and payload_tri.dim() == 1 and payload_tri.is_contiguous()
    assert payload_tri.numel() == 4 * 2 * 2 * 4 * 16
    assert scales_tri.shape == (4, 2, 2) and scales_tri.dtype == torch.float32
    assert torch.equal(scales_tri, scales_ref)
    assert torch.equal(payload_tri, payload_ref), f"{int((payload_tri != payload_ref).sum())} bytes differ"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unpack_triton_matches_reference(fmt, dtype):
    kv = make_pool(2, dtype=dtype)
    ids = torch.tensor([1, 3, 5], dtype=torch.int64)
    payload, scales = pack_reference(kv, ids, fmt)
    out_ids = torch.tensor([7, 0, 2], dtype=torch.int64)  # scattered to other slots of a bigger pool
    out_ref = torch.full((9, 2, 2, 4, 16), 9.0, dtype=dtype)
    out_tri = out_ref.clone()
    unpack_reference(payload, scales, out_ref, out_ids, fmt)
    unpack_triton(payload, scales, out_tri, out_ids, fmt)
    assert torch.equal(out_tri, out_ref)
    untouched = [i for i in range(9) if i not in out_ids.tolist()]
    assert bool((out_tri[untouched] == 9.0).all())


def test_int8_round_trip_error_bound():
    kv = make_pool(3, num_blocks=5, heads=3, block_size=8, head_dim=32)
    ids = torch.arange(5)
    payload, scales = pack(kv, ids, "int8")
    out = torch.empty_like(kv)
    unpack(payload, scales, out, ids, "int8")
    absmax = kv.abs().amax(dim=(-2, -1))  # [n, 2, H]
    err = (out - kv).abs().amax(dim=(-2, -1))
    # half a step of absmax/127, plus float rounding of the scale arithmetic
    assert bool((err <= absmax / 127 * (0.5 + 1e-4)).all()), (err / (absmax / 127)).max()
    assert torch.equal(scales, absmax / 127)


@pytest.mark.skipif("fp8" not in FORMATS, reason="torch without float8_e4m3fn")
def test_fp8_round_trip_relative_error():
    kv = make_pool(4)
    ids = torch.arange(6)
    payload, scales = pack(kv, ids, "fp8")
    out = torch.empty_like(kv)
    unpack(payload, scales, out, ids, "fp8")
    absmax = kv.abs().amax(dim=(-2, -1), keepdim=True)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 * scale near zero
    bound = torch.maximum(kv.abs() * 2 ** -4, absmax / 448 * 2 ** -9)
    assert bool(((out - kv).abs() <= bound * 1.0001).all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_zero_blocks_have_zero_scale_and_no_nan(fmt, impl):
    kv = make_pool(5, num_blocks=3)
    kv[1] = 0.0
    kv[2, 1, 0] = 0.0  # one zero head in an otherwise live block
    ids = torch.tensor([1, 2, 0])
    payload, scales = pack(kv, ids, fmt, impl=impl)
    assert bool((scales[0] == 0).all()) and float(scales[1, 1, 0]) == 0.0
    assert bool((payload.view(-1, 4 * 16)[:4] == 0).all())
    out = torch.full_like(kv, 5.0)
    unpack(payload, scales, out, ids, fmt, impl=impl)
    assert not bool(out.isnan().any())
    assert bool((out[1] == 0).all()) and bool((out[2, 1, 0] == 0).all())


def test_non_contiguous_pool_view():
    # a pool viewed per layer out of a bigger tensor keeps its strides; the kernel honours them
    big = make_pool(6, num_blocks=4, head_dim=32)
    kv = big[..., ::2]
    ids = torch.tensor([3, 1])
    assert torch.equal(pack_triton(kv, ids, "int8")[0], pack_reference(kv, ids, "int8")[0])
    out_ref, out_tri = torch.zeros_like(big), torch.zeros_like(big)
    payload, scales = pack_reference(kv, ids, "int8")
    unpack_reference(payload, scales, out_ref[..., ::2], ids, "int8")
    unpack_triton(payload, scales, out_tri[..., ::2], ids, "int8")
    assert torch.equal(out_ref, out_tri)


def test_rounding_is_half_away_from_zero_and_clamped():
    kv = torch.zeros(1, 2, 1, 1, 8)
    # absmax 127 -> scale 1: values land exactly on .5 boundaries
    kv[0, 0, 0, 0] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5, 2.4999, -126.5, 0.0])
    for impl in ("reference", "triton"):
        payload, _ = pack(kv, torch.tensor([0]), "int8", impl=impl)
        assert payload.view(torch.int8)[:8].tolist() == [127, 1, -1, 2, -3, 2, -127, 0]


@pytest.mark.parametrize("dtype,ratio", [(torch.bfloat16, 1.9), (torch.float32, 3.8)], ids=["bf16", "fp32"])
def test_byte_ratio(dtype, ratio):
    # a real layout: SmolLM2-135M has 3 KV heads of head_dim 64; blocks of 16 tokens
    kv = make_pool(7, num_blocks=2, heads=3, block_size=16, head_dim=64, dtype=dtype)
    ids = torch.arange(2)
    payload, scales = pack(kv, ids, "int8", impl="reference")
    raw = kv[ids].numel() * kv.element_size()
    wire = payload.numel() * payload.element_size() + scales.numel() * scales.element_size()
    assert wire == payload_bytes(2, 3, 16, 64)
    assert raw / wire >= ratio, raw / wire


def test_bad_inputs_are_clear_errors():
    kv = make_pool(8)
    with pytest.raises(ValueError, match="format"):
        pack(kv, torch.tensor([0]), "int4")
    with pytest.raises(ValueError, match="out of range"):
        pack(kv, torch.tensor([6]), "int8")
    payload, scales = pack(kv, torch.tensor([0, 1]), "int8")
    with pytest.raises(ValueError, match="payload"):
        unpack(payload[:-1], scales, torch.empty_like(kv), torch.tensor([0, 1]), "int8")


def test_empty_block_list():
    kv = make_pool(9)
    payload, scales = pack(kv, torch.zeros(0, dtype=torch.int64), "int8")
    assert payload.numel() == 0 and scales.shape == (0, 2, 2)
    unpack(payload, scales, kv, torch.zeros(0, dtype=torch.int64), "int8")
