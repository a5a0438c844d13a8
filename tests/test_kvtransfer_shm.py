"""The receiver's shared-memory segment pool: reuse, views that outlive a transfer, failures, orphans."""
from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvhelpers import random_kv
from pdserve.basetypes import KVLayout
from pdserve.kvtransfer.frames import TransferError, TransferHeader
from pdserve.kvtransfer.shm import (
    POOL_PREFIX, SENDER_MAPS, SHM_DIR, SenderMaps, ShmPool, owned_elsewhere, sweep_orphans, sweep_stale_segments,
)
from pdserve.kvtransfer.tcp_send import send_kv
from pdserve.kvtransfer.tcp_server import KVReceiver

LAYOUT = KVLayout(model_fingerprint="f00d", num_layers=4, kv_heads=2, head_dim=16, dtype="bfloat16", block_size=8)


def header(token: str, kv, **over) -> TransferHeader:
    fields = dict(transfer_token=token, request_id="r1", sender_id="prefill-a", sender_generation=7,
                  layout=kv.layout, num_tokens=kv.num_tokens, num_chunks=len(kv.layers), total_bytes=kv.nbytes,
                  transport="shm")
    fields.update(over)
    return TransferHeader(**fields)


def pool_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(POOL_PREFIX) and not owned_elsewhere(SHM_DIR, n)}


async def transfer(rx: KVReceiver, kv):
    token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens, transport="shm")
    _, (got, stats) = await asyncio.gather(send_kv(rx.address, header(token, kv), kv), rx.wait(token, 10))
    return got


def test_segments_are_reused_once_the_kv_is_freed_and_never_while_it_lives():
    a, b, c = (random_kv(LAYOUT, 37, seed=s) for s in (1, 2, 3))
    before = pool_files()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        got_a = await transfer(rx, a)
        got_b = await transfer(rx, b)  # a's views are alive: b must not land in a's segment
        assert rx.shm_pool.created == 2
        assert all(torch.equal(x, y) for x, y in zip(a.layers, got_a.layers)), "b overwrote a's live KV"
        assert all(torch.equal(x, y) for x, y in zip(b.layers, got_b.layers))
        del got_a, got_b
        gc.collect()
        assert rx.shm_pool.idle_bytes > 0
        got_c = await transfer(rx, c)  # reuses a freed segment: no new one
        assert rx.shm_pool.created == 2
        assert all(torch.equal(x, y) for x, y in zip(c.layers, got_c.layers))
        assert len(pool_files() - before) == 2
        await rx.close()
        assert pool_files() == before, "close unlinks every segment, leased ones too"
        return got_c

    got_c = asyncio.run(go())
    # the last KV stays readable after the receiver closed: the mapping outlives the name
    assert all(torch.equal(x, y) for x, y in zip(c.layers, got_c.layers))


def test_failed_transfer_segment_is_dropped_not_reused():
    kv = random_kv(LAYOUT, 37, seed=4)
    before = pool_files()

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        token = rx.expect("r1", "prefill-a", 7, LAYOUT, kv.num_tokens, transport="shm")
        # the header lies about the token count: refused after the grant, mid-transfer
        bad = header(token, kv, num_tokens=kv.num_tokens)
        bad_kv = random_kv(LAYOUT, 37, seed=5)
        bad_kv.layers.pop()
        with pytest.raises(TransferError):
            await asyncio.gather(send_kv(rx.address, bad, bad_kv), rx.wait(token, 10))
        gc.collect()
        assert rx.shm_pool.idle_bytes == 0 and pool_files() == before
        got = await transfer(rx, kv)
        assert rx.shm_pool.created == 2 and all(torch.equal(x, y) for x, y in zip(kv.layers, got.layers))
        await rx.close()

    asyncio.run(go())
    assert pool_files() == before


def test_sender_keeps_its_mapping_for_the_next_grant_and_drops_it_when_the_segment_goes():
    """The sender maps a granted segment once and writes the next transfers that decode grants it into the
    same mapping; once decode unlinks the segment (here: receiver closed), the next transfer anywhere lets
    the old mapping (and with it the segment's pages) go."""
    kvs = [random_kv(LAYOUT, 37, seed=s) for s in (6, 7, 8)]

    async def go():
        rx = await KVReceiver(LAYOUT).start()
        mapped = SENDER_MAPS.mapped
        for kv in kvs:
            got = await transfer(rx, kv)
            assert all(torch.equal(x, y) for x, y in zip(kv.layers, got.layers))
            del got
            gc.collect()
        assert rx.shm_pool.created == 1 and SENDER_MAPS.mapped == mapped + 1, "one segment, mapped once"
        seg_bytes = SENDER_MAPS.mapped_bytes
        assert seg_bytes >= kvs[0].nbytes
        await rx.close()  # unlinks the segment: the sender's mapping would pin its pages
        rx2 = await KVReceiver(LAYOUT).start()
        got = await transfer(rx2, kvs[0])
        assert all(torch.equal(x, y) for x, y in zip(kvs[0].layers, got.layers))
        assert SENDER_MAPS.mapped == mapped + 2
        assert SENDER_MAPS.mapped_bytes <= seg_bytes, "the gone segment's mapping must have been dropped"
        del got
        await rx2.close()

    asyncio.run(go())


def test_sender_mappings_are_bounded_least_recently_used_first():
    pool = ShmPool(SHM_DIR)
    leases = [pool.lease(1 << 20) for _ in range(3)]
    maps = SenderMaps(max_bytes=2 << 20)
    held = []
    for lease in leases:
        m = maps.acquire(SHM_DIR, lease.name, 1 << 20, warm=False)
        m.write(0, torch.full((1 << 18,), 7, dtype=torch.int32))
        held.append(m)
    with pytest.raises(ValueError, match="granted to two transfers at once"):
        maps.acquire(SHM_DIR, leases[0].name, 1 << 20, warm=False)
    for m in held:
        maps.release(m, ok=True)
    assert maps.mapped_bytes == 2 << 20, "the least recently used mapping goes beyond the bound"
    again = maps.acquire(SHM_DIR, leases[2].name, 1 << 20, warm=True)
    assert again is held[2] and maps.mapped == 3
    maps.release(again, ok=False)  # a failed transfer: its mapping is not kept
    assert maps.mapped_bytes == 1 << 20
    assert torch.equal(leases[2].view(0, 1 << 20).view(torch.int32), torch.full((1 << 18,), 7, dtype=torch.int32))
    with pytest.raises(ValueError, match="outside"):
        held[1].write((1 << 20) - 4, torch.zeros(2, dtype=torch.int32))
    maps.clear()
    for lease in leases:
        lease.succeeded()
    pool.close()


def test_idle_segments_beyond_the_bound_are_released():
    pool = ShmPool(SHM_DIR, max_idle_bytes=1 << 20)
    leases = [pool.lease(1 << 20) for _ in range(3)]
    for lease in leases:
        lease.succeeded()
    assert pool.idle_bytes == 1 << 20 and pool.created == 3
    assert len({n for n in os.listdir(SHM_DIR) if n.startswith(f"{POOL_PREFIX}{os.getpid()}-")}) == 1
    pool.close()
    assert not {n for n in os.listdir(SHM_DIR) if n.startswith(f"{POOL_PREFIX}{os.getpid()}-")}


_ORPHAN = textwrap.dedent("""
    import os
    from pdserve.kvtransfer.shm import ShmPool
    pool = ShmPool(os.environ.get("PDSERVE_SHM_DIR", "/dev/shm"))
    lease = pool.lease(1 << 20)
    lease.succeeded()
    print(lease.name, flush=True)
    os._exit(0)  # dies without closing its pool, as a killed decode worker would
""")


def test_orphaned_segments_of_a_dead_owner_are_swept_live_ones_kept():
    live = ShmPool(SHM_DIR)
    mine = live.lease(1 << 20)
    mine.succeeded()
    name = subprocess.run([sys.executable, "-c", _ORPHAN], capture_output=True, check=True,
                          cwd=os.getcwd()).stdout.decode().strip()
    assert os.path.exists(os.path.join(SHM_DIR, name))
    assert sweep_orphans(SHM_DIR) >= 1 and not os.path.exists(os.path.join(SHM_DIR, name))
    sweep_stale_segments(max_age_s=0)  # the age sweep of per-transfer segments leaves pool segments alone
    assert os.path.exists(os.path.join(SHM_DIR, mine.name)), "a live owner's segment must survive sweeps"
    live.close()
