"""The offload tier on a real NATS JetStream object store: prefix KV stored by one worker, fetched by
another, longest-prefix lookup by hash chain, layout and checksum fencing, TTL expiry."""
from __future__ import annotations

import asyncio
import time

import nats
import pytest
import torch

from pdserve.basetypes import KVLayout, LayoutMismatch
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.kvtransfer.offload import KVPrefixStore, PrefixCorrupt, block_hashes

LAYOUT = KVLayout(model_fingerprint="f00d", num_layers=3, kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4)


def make_kv(tokens: list[int], layout: KVLayout = LAYOUT) -> KVBlocks:
    # KV that depends on the tokens (like a real model's): same prefix → same blocks
    g = torch.Generator().manual_seed(sum(tokens))
    layers = []
    for li in range(layout.num_layers):
        k = torch.stack([torch.full((layout.head_dim,), float(t + li)) for t in tokens], 0)[None].repeat(
            layout.kv_heads, 1, 1) + torch.randn(layout.kv_heads, len(tokens), layout.head_dim, generator=g) * 0
        layers.append(KVBlocks.layer_from_dense(k.to(layout.torch_dtype), (-k).to(layout.torch_dtype),
                                                layout.block_size))
    return KVBlocks(layout, len(tokens), layers)


def test_hash_chain_names_prefixes_not_blocks():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    c = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert c[1] != a[1]  # same block 1 tokens after a different block 0: another name


def test_put_then_any_worker_gets_the_longest_prefix(nats_server):
    bucket = f"pdserve-kv-prefix-test-{time.monotonic_ns()}"
    tokens = list(range(100, 114))  # 14 tokens: 3 full blocks of 4

    async def go():
        nc1 = await nats.connect(**nats_server.creds.connect_kwargs())
        nc2 = await nats.connect(**nats_server.creds.connect_kwargs())  # "another worker"
        writer = KVPrefixStore(nc1, LAYOUT, bucket=bucket)
        reader = KVPrefixStore(nc2, LAYOUT, bucket=bucket)
        kv = make_kv(tokens)
        stored = await writer.put_prefix(tokens, kv)
        again = await writer.put_prefix(tokens, kv)
        full = await reader.get_longest_prefix(tokens + [1, 2, 3])
        diverged = await reader.get_longest_prefix(tokens[:9] + [0, 0, 0, 0])  # block 2 differs
        short = await reader.get_longest_prefix(tokens[:5])
        none = await reader.get_longest_prefix([7, 7, 7, 7, 7])
        removed = await writer.delete_prefix(tokens)
        gone = await reader.get_longest_prefix(tokens)
        await nc1.jetstream().delete_object_store(bucket)
        await nc1.close()
        await nc2.close()
        return kv, stored, again, full, diverged, short, none, removed, gone

    kv, stored, again, full, diverged, short, none, removed, gone = asyncio.run(go())
    assert stored == 3 and again == 0
    got, n = full
    assert n == 12 and got.num_tokens == 12
    assert all(torch.equal(g, k[:3]) for g, k in zip(got.layers, kv.layers))
    assert diverged[1] == 8 and all(torch.equal(g, k[:2]) for g, k in zip(diverged[0].layers, kv.layers))
    assert short[1] == 4 and none is None
    assert removed == 3 and gone is None


def test_another_models_prefix_is_refused_and_corruption_detected(nats_server):
    bucket = f"pdserve-kv-prefix-test-{time.monotonic_ns()}"
    tokens = list(range(8))
    other = LAYOUT.model_copy(update={"model_fingerprint": "beef"})

    async def go():
        nc = await nats.connect(**nats_server.creds.connect_kwargs())
        await KVPrefixStore(nc, other, bucket=bucket).put_prefix(tokens, make_kv(tokens, other))
        ours = KVPrefixStore(nc, LAYOUT, bucket=bucket)
        with pytest.raises(LayoutMismatch, match="stored prefix block 0 refused.*model_fingerprint: expected 'f00d', got 'beef'"):
            await ours.get_longest_prefix(tokens)
        # corrupt block 0 of our own entry: one payload byte flipped
        await ours.delete_prefix(tokens)
        await ours.put_prefix(tokens, make_kv(tokens))
        store = await nc.jetstream().object_store(bucket)
        name = f"prefix-{block_hashes(tokens, 4)[0]}"
        data = bytearray((await store.get(name)).data)
        data[-1] ^= 0x40
        await store.put(name, bytes(data))
        with pytest.raises(PrefixCorrupt, match="prefix block 0 .*layer 2: checksum mismatch"):
            await ours.get_longest_prefix(tokens)
        await nc.jetstream().delete_object_store(bucket)
        await nc.close()

    asyncio.run(go())


def test_prefix_objects_expire(nats_server):
    bucket = f"pdserve-kv-prefix-test-{time.monotonic_ns()}"
    tokens = list(range(8))

    async def go():
        nc = await nats.connect(**nats_server.creds.connect_kwargs())
        store = KVPrefixStore(nc, LAYOUT, bucket=bucket, ttl_s=1.0)
        await store.put_prefix(tokens, make_kv(tokens))
        found = await store.get_longest_prefix(tokens)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and await store.get_longest_prefix(tokens) is not None:
            await asyncio.sleep(0.25)
        after = await store.get_longest_prefix(tokens)
        await nc.jetstream().delete_object_store(bucket)
        await nc.close()
        return found, after

    found, after = asyncio.run(go())
    assert found is not None and found[1] == 8
    assert after is None
