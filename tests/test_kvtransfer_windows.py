"""A handoff of a model with sliding-window layers carries only each window's blocks, over every transport.

The layout names each layer's attention; a sliding-window layer ships the blocks from the one holding
the first position its next query sees, so layers differ in size on the wire (and in a shared-memory
segment). Random KV with a real layout, no model: each transport and compression must deliver exactly
the blocks `KVBlocks.for_handoff` holds.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from kvhelpers import random_kv
from pdserve.basetypes import KVLayout, LayoutMismatch
from pdserve.kvtransfer.frames import TransferHeader
from pdserve.kvtransfer.tcp_send import send_kv
from pdserve.kvtransfer.tcp_server import KVReceiver

# layers: sliding 5, full, sliding 9, full (Gemma-style alternation), 4-token blocks
LAYOUT = KVLayout(model_fingerprint="f00d", num_layers=4, kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4,
                  layer_windows=(5, 0, 9, 0))


def test_sliding_layers_ship_the_blocks_their_next_query_reads():
    # 30 tokens: the next query (position 30) reads 26..30 with a window of 5, 22..30 with 9
    assert [LAYOUT.layer_blocks(i, 30) for i in range(4)] == [2, 8, 3, 8]  # blocks 6-7, all, 5-7, all
    assert [LAYOUT.layer_blocks(i, 3) for i in range(4)] == [1, 1, 1, 1]
    full = random_kv(LAYOUT, 30, seed=1)
    kv = full.for_handoff()
    assert kv.nbytes == LAYOUT.payload_bytes(30) == 21 * LAYOUT.block_bytes < full.nbytes
    assert [kv.first_block(i) for i in range(4)] == [6, 0, 5, 0]
    assert torch.equal(kv.layers[0], full.layers[0][6:]) and torch.equal(kv.layers[2], full.layers[2][5:])
    assert torch.equal(kv.layers[1], full.layers[1]) and torch.equal(kv.layers[3], full.layers[3])
    assert LAYOUT.layer_offsets(30) == [0, 2 * LAYOUT.block_bytes, 10 * LAYOUT.block_bytes, 13 * LAYOUT.block_bytes,
                                        21 * LAYOUT.block_bytes]


@pytest.mark.parametrize("transport,compression", [("tcp", "none"), ("tcp", "int8"), ("shm", "none")])
def test_windowed_handoff_arrives_intact_over_each_transport(transport, compression):
    kv = random_kv(LAYOUT, 30, seed=2).for_handoff()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens, compression=compression, transport=transport)
        hdr = TransferHeader(transfer_token=token, request_id="r1", sender_id="prefill-a", sender_generation=7,
                             layout=LAYOUT, num_tokens=kv.num_tokens, num_chunks=4, total_bytes=kv.nbytes,
                             compression=compression, transport=transport)
        ack, (got, stats) = await asyncio.gather(send_kv(rx.address, hdr, kv, chunk_bytes=200), rx.wait(token, 10))
        await rx.close()
        return ack, got, stats

    ack, got, stats = asyncio.run(go())
    assert ack["ok"] and stats["bytes"] == LAYOUT.payload_bytes(30)
    assert [t.shape[0] for t in got.layers] == [2, 8, 3, 8]
    for a, b in zip(kv.layers, got.layers):
        if compression == "none":
            assert torch.equal(a, b)
        else:
            assert (a.float() - b.float()).abs().max() <= a.float().abs().max() / 100


def test_a_receiver_of_another_attention_pattern_refuses_naming_the_layers():
    other = LAYOUT.model_copy(update={"layer_windows": (5, 0, 0, 0)})
    with pytest.raises(LayoutMismatch, match="layer 2 expected sliding window of 9, got full"):
        LAYOUT.check_matches(other)
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        KVLayout(model_fingerprint="f", num_layers=4, kv_heads=2, head_dim=8, dtype="float32", block_size=4,
                 layer_windows=(1, 2, 3))
