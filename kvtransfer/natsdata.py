"""KV over NATS: chunked messages (the fallback that always works) and the JetStream object store (offload tier).

Both use the frames of `kvtransfer.frames` — one frame per NATS message on the transfer's own subject
`Subjects.kv_data(scope, token)` (chunks stay below the server's max_payload). Every message is a request:
the receiver answers each with `{"ok": true}` or the error that stopped it, and the sender keeps at most
`window` chunks unanswered (flow control). The last answer (to END) is the ACK with the receiver's stats.

The object-store transport puts the whole frame stream as one object (the scope's bucket
`Buckets.kv_transfer(scope)`, with a TTL, memory storage), then sends one OBJECT frame naming it; the
receiver fetches it — only from its own scope's bucket, only the transfer's own object —, checks and
deletes it. The TTL
removes whatever a dead peer leaves behind.

Stalls are bounded on both sides: the sender's requests time out after `timeout` s; the receiver's
watchdog fails a transfer that has seen nothing for `stall_timeout` s.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

import torch

from pdserve.kvtransfer.protocol import Buckets, Subjects, settle
from pdserve.basetypes import LayoutMismatch
from pdserve.kvtransfer.frames import (
    END, HELLO, MAX_CHUNK, OBJECT, TransferError, TransferHeader, crc32, frame, layer_wire_pieces, split_frames,
)
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.kvtransfer.receiver import Assembly, Receiver

log = logging.getLogger("pdserve.kvtransfer.nats")

NATS_CHUNK_BYTES = 4 << 20  # below the 8 MB max_payload with room for headers
DEFAULT_OBJECT_TTL_S = 300.0


def object_name(token: str) -> str:
    """The object-store name of a transfer's frames."""
    return f"kv-{token}"


def _msg(kind: int, payload, layer: int = 0, offset: int = 0) -> bytes:
    hdr, body = frame(kind, payload, layer, offset)
    return hdr + bytes(body)


async def ensure_bucket(js, bucket: str, ttl_s: float = DEFAULT_OBJECT_TTL_S):
    """The object store bucket (memory storage, objects expire after `ttl_s`), created if missing."""
    from nats.js.api import ObjectStoreConfig, StorageType

    try:
        return await js.object_store(bucket)
    except Exception:
        return await js.create_object_store(bucket, config=ObjectStoreConfig(
            bucket=bucket, ttl=ttl_s, storage=StorageType.MEMORY))


# --- sender -------------------------------------------------------------------------------


# How long a sender keeps asking when NATS says nobody listens on the transfer's subject yet. The receiver
# subscribes (and flushes) before it replies, but in a NATS cluster interest reaches the other servers
# asynchronously, and even on one server a request that follows at once can find no responders now and
# then. A receiver that is really gone fails the transfer after this.
NO_RESPONDERS_RETRY_S = 2.0


async def _first_request(nc, subject: str, data: bytes, timeout: float):
    """`nc.request` for a transfer's first message: a "no responders" answer is asked again, every 20 ms,
    for up to NO_RESPONDERS_RETRY_S (nothing was delivered, so nothing is duplicated)."""
    import nats.errors

    deadline = asyncio.get_running_loop().time() + min(timeout, NO_RESPONDERS_RETRY_S)
    while True:
        try:
            return await nc.request(subject, data, timeout=timeout)
        except nats.errors.NoRespondersError:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            await asyncio.sleep(0.02)


async def send_kv_nats(nc, header: TransferHeader, layers: AsyncIterator[tuple[int, torch.Tensor]], *,
                       scope: str = "default", timeout: float = 30.0, window: int = 8,
                       chunk_bytes: int = NATS_CHUNK_BYTES) -> dict:
    """Send layers as chunked NATS requests on the transfer's subject in `scope`; → the receiver's ACK.

    At most `window` chunks are in flight; each must be answered within `timeout` s.
    """
    subject = Subjects.kv_data(scope, header.transfer_token)
    sem = asyncio.Semaphore(window)
    failures: list[str] = []
    inflight: set[asyncio.Task] = set()

    async def request(data: bytes, first: bool = False) -> dict:
        import nats.errors

        try:
            raw = await (_first_request(nc, subject, data, timeout) if first else
                         nc.request(subject, data, timeout=timeout))
        except nats.errors.NoRespondersError:
            raise TransferError(f"nobody receives transfer {header.transfer_token} on NATS (receiver gone)") from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            raise TransferError(f"NATS transfer stalled: no answer within {timeout:.1f} s") from None
        except Exception as e:  # connection closed / reconnecting
            raise TransferError(f"NATS transfer broke: {type(e).__name__}: {e}") from None
        reply = json.loads(raw.data)
        if not reply.get("ok"):
            raise TransferError(f"receiver refused KV: {reply.get('error')}")
        return reply

    async def chunk(data: bytes) -> None:
        try:
            await request(data)
        except TransferError as e:
            failures.append(str(e))
        finally:
            sem.release()

    await request(_msg(HELLO, header.model_dump_json().encode()), first=True)
    sent = 0
    try:
        async for index, layer in layers:
            for kind, li, off, payload in layer_wire_pieces(index, layer, header.compression, chunk_bytes):
                await sem.acquire()
                if failures:
                    raise TransferError(failures[0])
                t = asyncio.create_task(chunk(_msg(kind, payload, li, off)))
                inflight.add(t)
                t.add_done_callback(inflight.discard)
            sent += 1
        if inflight:
            await asyncio.gather(*inflight)
        if failures:
            raise TransferError(failures[0])
        return await request(_msg(END, json.dumps({"chunks": sent, "bytes": header.total_bytes}).encode()))
    finally:
        for t in inflight:
            t.cancel()


async def send_kv_objstore(nc, header: TransferHeader, kv: KVBlocks, *, scope: str = "default",
                           ttl_s: float = DEFAULT_OBJECT_TTL_S, timeout: float = 30.0) -> dict:
    """Put the transfer's frames as one object (TTL `ttl_s`) in the scope's bucket, name it to the
    receiver; → its ACK."""
    import nats.errors

    js = nc.jetstream()
    bucket = Buckets.kv_transfer(scope)
    store = await ensure_bucket(js, bucket, ttl_s)
    parts = []
    for i, layer in enumerate(kv.layers):
        for kind, li, off, payload in layer_wire_pieces(i, layer, header.compression, MAX_CHUNK):
            hdr, body = frame(kind, payload, li, off)
            parts += [hdr, body]
    parts += frame(END, json.dumps({"chunks": len(kv.layers), "bytes": header.total_bytes}).encode())
    name = object_name(header.transfer_token)
    await asyncio.wait_for(store.put(name, b"".join(parts)), timeout)
    del parts
    ref = json.dumps({"bucket": bucket, "name": name}).encode()
    try:
        raw = await _first_request(nc, Subjects.kv_data(scope, header.transfer_token),
                                   _msg(HELLO, header.model_dump_json().encode()) + _msg(OBJECT, ref), timeout)
        reply = json.loads(raw.data)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError) as e:
        reply = {"ok": False, "error": f"receiver did not fetch the object: {type(e).__name__}"}
    if not reply.get("ok"):
        try:  # the receiver deletes it after a fetch; on failure it is ours (and the TTL's)
            await store.delete(name)
        except Exception:
            pass
        raise TransferError(f"receiver refused KV: {reply.get('error')}")
    return reply


# --- receiver -----------------------------------------------------------------------------


class NatsTransferServer:
    """Receives one agreed transfer over NATS (chunked messages or an object-store reference).

    Created by the receive channel when it picks "nats" or "objstore"; subscribes to the transfer's
    subject, fills an `Assembly`, resolves the receiver's future, then unsubscribes (on success,
    failure, stall or cancel alike).
    """

    def __init__(self, nc, receiver: Receiver, token: str, stall_timeout: float, scope: str = "default"):
        self.nc, self.rx, self.token, self.stall_timeout, self.scope = nc, receiver, token, stall_timeout, scope
        self.exp = receiver.expected(token)
        self.asm: Assembly | None = None
        self.last = time.monotonic()
        self.sub = None
        self.watchdog: asyncio.Task | None = None
        self.fetching = False

    async def start(self) -> "NatsTransferServer":
        self.sub = await self.nc.subscribe(Subjects.kv_data(self.scope, self.token), cb=self._on_msg)
        self.watchdog = asyncio.create_task(self._watch())
        self.exp.cleanup.append(self._stop)
        # the server has the subscription before the sender can hear of it: the reply may travel a faster
        # way than this connection (or another NATS connection), and a chunk sent before would find nobody
        await settle(self.nc)
        return self

    def _stop(self) -> None:
        if self.watchdog and self.watchdog is not asyncio.current_task():
            self.watchdog.cancel()
        if self.sub is not None:
            sub, self.sub = self.sub, None
            asyncio.ensure_future(self._unsubscribe(sub))

    @staticmethod
    async def _unsubscribe(sub) -> None:
        try:
            await sub.unsubscribe()
        except Exception:
            pass  # connection gone: the server dropped the interest with it

    async def _watch(self) -> None:
        # Until the first frame, only the caller's `wait(token, timeout)` bounds the transfer (as for TCP,
        # where no connection means no stall clock); from then on, silence longer than the bound fails it.
        while not self.exp.future.done():
            if self.asm is None or self.fetching:  # a fetch is bounded by its own timeout
                await asyncio.sleep(0.2)
                continue
            idle = time.monotonic() - self.last
            if idle > self.stall_timeout:
                self.rx.fail(self.token, f"peer stalled: nothing for {self.stall_timeout:.1f} s (NATS transfer)")
                return
            await asyncio.sleep(min(0.2, self.stall_timeout - idle + 0.01))

    async def _on_msg(self, msg) -> None:
        self.last = time.monotonic()
        try:
            if self.exp.future.done():
                raise TransferError("transfer already ended")
            reply = await self._handle(msg.data)
        except (TransferError, LayoutMismatch) as e:
            self.rx.fail(self.token, str(e))
            reply = {"ok": False, "error": str(e)}
        except Exception as e:  # never leave the sender waiting without a reason
            log.exception("NATS KV transfer %s failed", self.token)
            self.rx.fail(self.token, f"receiver error: {e}")
            reply = {"ok": False, "error": f"receiver error: {e}"}
        if msg.reply:
            try:
                await msg.respond(json.dumps(reply).encode())
            except Exception:
                pass

    async def _handle(self, data: bytes) -> dict:
        for kind, layer, crc, offset, payload in split_frames(data, MAX_CHUNK):
            if crc32(payload) != crc:
                raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
            if kind == HELLO:
                if self.asm is not None:
                    raise TransferError("a second HELLO in one transfer")
                try:
                    header = TransferHeader.model_validate_json(bytes(payload))
                except ValueError as e:
                    raise TransferError(f"malformed transfer header: {str(e)[:500]}") from None
                if header.transfer_token != self.token:
                    raise TransferError("transfer token does not match the subject")
                _, self.asm = self.rx.begin(header, header.transport)
                if header.transport not in ("nats", "objstore"):
                    raise TransferError(f"transport {header.transport!r} on NATS")
            elif self.asm is None:
                raise TransferError(f"expected HELLO, got frame kind {kind}")
            elif kind == OBJECT:
                self.fetching = True
                try:
                    try:
                        ref = json.loads(bytes(payload))
                    except ValueError:
                        raise TransferError("malformed object reference (not JSON)") from None
                    await self._fetch(ref)
                finally:
                    self.fetching = False
                    self.last = time.monotonic()
                return self._finish()
            elif kind == END:
                return self._finish()
            else:
                self.asm.accept(kind, layer, offset, payload)
        return {"ok": True}

    def _finish(self) -> dict:
        stats = self.rx.complete(self.exp, self.asm)
        return {"ok": True, **stats}

    async def _fetch(self, ref) -> None:
        # Only this transfer's object in this scope's bucket: the frame names what to read and then delete.
        want = {"bucket": Buckets.kv_transfer(self.scope), "name": object_name(self.token)}
        if ref != want:
            raise TransferError(f"object reference {str(ref)[:200]} is not this transfer's ({want})")
        store = await self.nc.jetstream().object_store(want["bucket"])
        try:
            res = await asyncio.wait_for(store.get(want["name"]), self.stall_timeout)
        except Exception as e:
            raise TransferError(f"cannot fetch KV object {want['name']}: {type(e).__name__}: {e}") from None
        finally:
            try:
                await store.delete(want["name"])  # fetched or not, nobody else needs it
            except Exception:
                pass
        for kind, layer, crc, offset, payload in split_frames(res.data, MAX_CHUNK):
            if crc32(payload) != crc:
                raise TransferError(f"corrupt chunk (layer {layer}): crc32 mismatch")
            if kind == END:
                return
            self.asm.accept(kind, layer, offset, payload)
        raise TransferError("stream truncated: object ends before END")
