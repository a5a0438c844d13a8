"""BlockPool: allocation, refcounts, copy-on-write forks, truncation, OutOfBlocks, prefix cache by hash chain, LRU."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.blocks import BlockPool, OutOfBlocks
from pdserve.basetypes import KVLayout, LayoutMismatch
from pdserve.kvtransfer.layout import KVBlocks

BS = 4


def make_pool(num_blocks: int = 8, layers: int = 2) -> BlockPool:
    layout = KVLayout(model_fingerprint="test", num_layers=layers, kv_heads=2, head_dim=3, dtype="float32", block_size=BS)
    return BlockPool(layout, num_blocks)


def assert_empty(pool: BlockPool) -> None:
    assert pool.num_free == pool.num_blocks
    assert all(r == 0 for r in pool.refcount)
    assert pool.utilization() == 0.0


def write(pool: BlockPool, slots: torch.Tensor, value: float) -> None:
    """Write `value` as K and V of every layer at `slots` (what the model's write_kv does)."""
    b, o = slots // BS, slots % BS
    pool.kv[:, b, :, :, o] = value


def read(pool: BlockPool, seq_id) -> torch.Tensor:
    """Layer-0 keys of head 0, dim 0 of every token of a sequence `[num_tokens]`."""
    return pool.kv[0, :, 0, 0, :, 0].reshape(-1)[pool.slots(seq_id, 0, pool.num_tokens(seq_id))]


def test_allocate_and_free_return_pool_to_empty():
    pool = make_pool()
    pool.allocate("a", 5)  # 2 blocks
    pool.allocate("b", 4)  # 1 block
    assert pool.num_free == 5
    assert len(pool.block_table("a")) == 2 and len(pool.block_table("b")) == 1
    assert set(pool.block_table("a")).isdisjoint(pool.block_table("b"))
    assert pool.utilization() == pytest.approx(3 / 8)
    slots = pool.append_slots("a", 4)  # 5 -> 9 tokens: 3 blocks
    assert len(pool.block_table("a")) == 3
    table = pool.block_table("a")
    assert slots.tolist() == [table[1] * BS + 1, table[1] * BS + 2, table[1] * BS + 3, table[2] * BS]
    assert pool.num_tokens("a") == 9
    pool.free("a")
    pool.free("b")
    assert_empty(pool)
    with pytest.raises(KeyError, match="unknown sequence"):
        pool.free("a")


def test_fork_shares_blocks_and_copy_on_write_keeps_parent_intact():
    pool = make_pool()
    pool.allocate("p", 0)
    write(pool, pool.append_slots("p", 6), 1.0)  # block 0 full, block 1 half
    pool.fork("p", "c")
    assert pool.block_table("c") == pool.block_table("p")
    assert all(pool.refcount[b] == 2 for b in pool.block_table("p"))
    parent_before = read(pool, "p").clone()

    write(pool, pool.append_slots("c", 1), 7.0)  # writes into the shared half block: must copy it first
    assert pool.block_table("c")[0] == pool.block_table("p")[0]  # the full block stays shared
    assert pool.block_table("c")[1] != pool.block_table("p")[1]
    assert torch.equal(read(pool, "p"), parent_before)
    assert read(pool, "c").tolist() == [1.0] * 6 + [7.0]

    write(pool, pool.append_slots("p", 1), 9.0)  # now the parent owns its half block alone: no copy
    assert read(pool, "p").tolist() == [1.0] * 6 + [9.0]
    assert read(pool, "c").tolist() == [1.0] * 6 + [7.0]
    pool.free("p")
    assert read(pool, "c").tolist() == [1.0] * 6 + [7.0]
    pool.free("c")
    assert_empty(pool)


def test_truncate_frees_whole_blocks_past_the_end():
    pool = make_pool()
    pool.allocate("a", 10)  # 3 blocks
    pool.truncate("a", 5)  # 2 blocks
    assert len(pool.block_table("a")) == 2 and pool.num_tokens("a") == 5
    assert pool.num_free == 6
    pool.truncate("a", 4)
    assert len(pool.block_table("a")) == 1
    with pytest.raises(ValueError):
        pool.truncate("a", 5)
    pool.append_slots("a", 1)
    assert len(pool.block_table("a")) == 2
    pool.free("a")
    assert_empty(pool)


def test_out_of_blocks_is_clean_and_leaks_nothing():
    pool = make_pool(num_blocks=4)
    pool.allocate("a", 8)  # 2 blocks
    with pytest.raises(OutOfBlocks) as e:
        pool.allocate("b", 9)  # 3 blocks, 2 left
    assert e.value.needed == 3 and e.value.available == 2
    assert "b" not in pool and pool.num_free == 2
    with pytest.raises(OutOfBlocks):
        pool.append_slots("a", 9)  # 17 tokens: 5 blocks
    assert pool.num_tokens("a") == 8 and len(pool.block_table("a")) == 2 and pool.num_free == 2
    pool.append_slots("a", 8)  # exactly fits
    assert pool.num_free == 0
    # copy-on-write needs a block too: a fork whose shared last block is partial cannot grow
    pool.truncate("a", 14)
    pool.fork("a", "c")
    assert pool.blocks_needed("c", 1) == 1 and pool.blocks_needed("c", 2) == 1 and pool.blocks_needed("c", 3) == 2
    with pytest.raises(OutOfBlocks):
        pool.append_slots("c", 1)
    assert pool.block_table("c") == pool.block_table("a") and pool.num_tokens("c") == 14
    pool.free("a")
    pool.free("c")
    assert_empty(pool)


def test_prefix_match_by_hash_chain_whole_blocks_only():
    pool = make_pool(num_blocks=16)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 2 full blocks + 2 tokens
    pool.allocate("a", len(prompt))
    pool.register_prefix("a", prompt)
    a_table = pool.block_table("a")

    blocks, n = pool.match_prefix(prompt)
    assert blocks == a_table[:2] and n == 8  # the partial last block is never shared by hash
    blocks, n = pool.match_prefix(prompt[:8] + [99, 98, 97, 96])
    assert blocks == a_table[:2] and n == 8
    blocks, n = pool.match_prefix(prompt[:4] + [0, 10, 11, 12])  # block 1 alike, but its parent differs
    assert blocks == a_table[:1] and n == 4
    assert pool.match_prefix([1, 2, 3, 4, 5]) == ([], 0)
    assert pool.match_prefix(prompt[:3]) == ([], 0)

    # a second sequence reuses the prefix: shared blocks, refcount 2, only new blocks taken
    free_before = pool.num_free
    pool.allocate("b", 11, prefix_blocks=blocks)
    assert pool.block_table("b")[0] == a_table[0] and pool.refcount[a_table[0]] == 2
    assert pool.num_free == free_before - 2
    pool.free("a")
    pool.free("b")
    assert pool.utilization() == 0.0
    # freed but cached: still matchable, and counted as free
    assert pool.num_cached == 2 and pool.num_free == 16
    assert pool.match_prefix(prompt)[1] == 8


def test_lru_eviction_of_unreferenced_cached_blocks():
    pool = make_pool(num_blocks=4)
    p1, p2 = [1, 2, 3, 4], [5, 6, 7, 8]
    for sid, p in (("x", p1), ("y", p2)):
        pool.allocate(sid, 4)
        pool.register_prefix(sid, p)
        pool.free(sid)  # x freed first: least recently used
    assert pool.num_cached == 2
    pool.match_prefix(p1)  # a hit refreshes x: now y is the least recently used
    pool.allocate("z", 12)  # 3 blocks: 2 free + 1 evicted (y's)
    assert pool.match_prefix(p2) == ([], 0)
    assert pool.match_prefix(p1)[1] == 4
    with pytest.raises(OutOfBlocks):
        pool.allocate("w", 8)  # needs 2, only x's cached block is left
    pool.free("z")
    pool.allocate("w", 16)  # takes everything: x's cached block is evicted too
    assert pool.match_prefix(p1) == ([], 0) and pool.num_cached == 0
    pool.free("w")
    assert_empty(pool)


def test_reviving_a_cached_prefix_counts_against_free_blocks():
    pool = make_pool(num_blocks=2)
    pool.allocate("x", 4)
    pool.register_prefix("x", [1, 2, 3, 4])
    pool.free("x")
    blocks, n = pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert n == 4
    with pytest.raises(OutOfBlocks):  # 1 reused + 2 new > 2 blocks
        pool.allocate("y", 9, prefix_blocks=blocks)
    assert pool.refcount == [0, 0] and pool.num_cached == 1
    pool.allocate("y", 8, prefix_blocks=blocks)
    assert pool.num_free == 0 and pool.block_table("y")[0] == blocks[0]
    pool.free("y")
    assert_empty(pool)


def test_rewriting_a_truncated_cached_block_drops_its_hash():
    pool = make_pool()
    pool.allocate("a", 0)
    write(pool, pool.append_slots("a", 8), 1.0)
    pool.register_prefix("a", [1, 2, 3, 4, 5, 6, 7, 8])
    pool.truncate("a", 6)  # block 1 becomes partial, still only a's
    write(pool, pool.append_slots("a", 1), 2.0)  # its content changes: it must stop answering for its hash
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])[1] == 4
    pool.free("a")
    assert pool.num_free == pool.num_blocks


def test_export_import_roundtrip_and_layout_fence():
    pool = make_pool()
    pool.allocate("a", 0)
    slots = pool.append_slots("a", 6)
    for layer in range(2):
        b, o = slots // BS, slots % BS
        pool.kv[layer, b, :, :, o] = torch.arange(6, dtype=torch.float32).view(6, 1, 1, 1) + 10 * layer
    kv = pool.export_blocks("a")
    assert kv.num_tokens == 6 and len(kv.layers) == 2 and kv.layers[0].shape == (2, 2, 2, BS, 3)
    assert torch.all(kv.layers[0][-1, :, :, 2:] == 0)  # zero padding past the end
    keys, values = KVBlocks.layer_to_dense(kv.layers[1], 6)
    assert torch.equal(keys[0, :, 0], torch.arange(6.0) + 10)

    other = make_pool()
    other.allocate("filler", 3)
    other.import_blocks("b", kv)
    assert torch.equal(other.export_blocks("b").layers[1], kv.layers[1])
    bad = KVBlocks(kv.layout.model_copy(update={"model_fingerprint": "other"}), kv.num_tokens, kv.layers)
    with pytest.raises(LayoutMismatch):
        other.import_blocks("c", bad)
    assert "c" not in other


def is_run(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def test_pool_is_stored_head_major_so_consecutive_blocks_are_one_strided_run():
    pool = make_pool(num_blocks=6)
    # [L, blocks, 2, heads, bs, D] is a view of [L, 2, heads, blocks, bs, D] storage
    assert pool.kv.permute(0, 2, 3, 1, 4, 5).is_contiguous()
    by_head = pool.kv[0].permute(1, 2, 0, 3, 4)  # [2, heads, blocks, bs, D]
    assert by_head[:, :, 1:4].reshape(2, 2, 3 * BS, 3).data_ptr() == by_head[:, :, 1].data_ptr()  # a view, no copy


def test_growing_sequences_keep_their_blocks_consecutive():
    pool = make_pool(num_blocks=64)
    for name in "abc":
        pool.allocate(name, 5)
    for _ in range(30):  # three sequences growing in turns, one token at a time
        for name in "abc":
            pool.append_slots(name, 1)
    tables = [pool.block_table(n) for n in "abc"]
    assert all(is_run(t) for t in tables), tables
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables)
    # a speculative rollback and regrowth comes back to the same blocks
    before = pool.block_table("a")
    pool.truncate("a", 9)
    pool.append_slots("a", 26)
    assert pool.block_table("a") == before


def test_allocation_falls_back_to_scattered_blocks_when_no_run_is_long_enough():
    pool = make_pool(num_blocks=8)
    for i in range(8):
        pool.allocate(i, BS)
    even = [i for i in range(8) if pool.block_table(i)[0] % 2 == 0]
    for i in even:  # free the sequences on even blocks: no two free blocks are adjacent
        pool.free(i)
    pool.allocate("x", 4 * BS)
    assert sorted(pool.block_table("x")) == [0, 2, 4, 6]
    assert pool.num_free == 0
    with pytest.raises(OutOfBlocks):
        pool.append_slots("x", 1)
    for i in [i for i in range(8) if i not in even] + ["x"]:
        pool.free(i)
    assert_empty(pool)
