"""The KV channel facade the workers use: negotiate a transport per handoff, send, receive, report failures.

Transports (one interface, picked per handoff from the sender's preference list in `HandoffOffer`):

| name     | when                                   | bytes travel                                  |
|----------|----------------------------------------|-----------------------------------------------|
| shm      | both workers share a host (`host_id`)  | a /dev/shm segment named by the token; control|
|          |                                        | frames over the direct socket                 |
| tcp      | default across hosts                   | the direct framed stream (`kvtransfer.tcp_*`) |
| nats     | fallback that always works             | chunked, acked messages on `kv.{s}.data.{t}`  |
| objstore | offload tier (KV that must outlive one | one object in the JetStream object store, TTL |
|          | of the workers)                        |                                               |

The receiver picks the first transport in the offer it can serve: "shm" only with an equal host id,
"nats"/"objstore" only with a NATS connection. Compression ("none"/"int8"/"fp8") is the sender's
wish, granted if the receiver allows it and the transport is not shm. A device-to-device transport
(NIXL, NCCL, CUDA IPC) slots in as another name here: nothing in the interface assumes CPU bytes,
only `send(reply, header, kv)` and `wait(token) -> KVBlocks`.

Every failure, on either side, is published as a `TransferFailed` record on `kv.{s}.failed.{request_id}`.
Both channels belong to one deployment scope (`scope`): their NATS subjects and buckets are its own.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator, Iterable

import torch

from pdserve.basetypes import COMPRESSIONS, TRANSPORTS, KVLayout
from pdserve.kvtransfer.layout import KVBlocks
from pdserve.kvtransfer.protocol import HandoffOffer, HandoffReply, Subjects, TransferFailed
from pdserve.kvtransfer.frames import TransferError, TransferHeader
from pdserve.kvtransfer.shm import host_id
from pdserve.kvtransfer.tcp_send import aiter_layers, send_kv, send_kv_stream
from pdserve.kvtransfer.tcp_server import KVReceiver

log = logging.getLogger("pdserve.kvtransfer.channel")

DEFAULT_PREFERENCE = ("shm", "tcp", "nats")


async def publish_failure(nc, scope: str, request_id: str, token: str | None, worker_id: str, side: str,
                          transport: str, reason: str) -> None:
    """Publish a `TransferFailed` record in `scope` (best effort: NATS may be the thing that failed)."""
    if nc is None:
        return
    rec = TransferFailed(request_id=request_id, transfer_token=token, worker_id=worker_id, side=side,
                         transport=transport, reason=reason[:2000])
    try:
        await nc.publish(Subjects.kv_failed(scope, request_id), rec.encode())
    except Exception as e:
        log.warning("could not publish TransferFailed for %s: %s", request_id, e)


class KVReceiveChannel:
    """Decode side: wraps the data server (`KVReceiver`) and, with a NATS connection, the NATS transports."""

    def __init__(self, receiver: KVReceiver, nc=None, *, scope: str = "default", worker_id: str = "decode",
                 transports: Iterable[str] = TRANSPORTS, compressions: Iterable[str] = COMPRESSIONS,
                 stall_timeout: float | None = None):
        self.receiver, self.nc, self.scope, self.worker_id = receiver, nc, scope, worker_id
        self.transports = tuple(transports)
        self.compressions = tuple(compressions)
        self.stall_timeout = stall_timeout or receiver.stall_timeout
        self._transport: dict[str, tuple[str, str]] = {}  # token -> (transport, request id)

    def choose(self, offer: HandoffOffer) -> tuple[str, str]:
        """→ (transport, compression) for this offer; TransferError if no transport can work."""
        for t in offer.transports:
            if t not in self.transports:
                continue
            if t == "shm" and (offer.host_id is None or offer.host_id != host_id()):
                continue
            if t in ("nats", "objstore") and self.nc is None:
                continue
            comp = offer.compression if offer.compression in self.compressions and t != "shm" else "none"
            return t, comp
        raise TransferError(f"no common KV transport: offer has {offer.transports}, this worker serves "
                            f"{list(self.transports)}{'' if self.nc else ' (no NATS connection)'}")

    async def expect(self, offer: HandoffOffer) -> HandoffReply:
        """Agree to an offer: → the accepted `HandoffReply` (token, transport, rendezvous) to send back.

        Raises LayoutMismatch (another model or shape) or TransferError (no common transport).
        """
        transport, compression = self.choose(offer)
        token = self.receiver.expect(offer.request_id, offer.sender_id, offer.sender_generation, offer.layout,
                                     offer.num_tokens, transport=transport, compression=compression)
        rendezvous: dict = {}
        if transport in ("nats", "objstore"):
            from pdserve.kvtransfer.natsdata import NatsTransferServer

            try:
                await NatsTransferServer(self.nc, self.receiver, token, self.stall_timeout, self.scope).start()
            except Exception:
                self.receiver.cancel(token, "could not subscribe for the transfer")
                raise
            rendezvous["subject"] = Subjects.kv_data(self.scope, token)
        self._transport[token] = (transport, offer.request_id)
        return HandoffReply(accepted=True, worker_id=self.worker_id, transfer_token=token,
                            data_addr=self.receiver.address, transport=transport, compression=compression,
                            rendezvous=rendezvous)

    async def wait(self, token: str, timeout: float) -> tuple[KVBlocks, dict]:
        """The received KV and stats ({bytes, wire_bytes, seconds, transport, compression}).

        TransferError on any failure or after `timeout` s; the failure is published on NATS.
        """
        transport, request_id = self._transport.pop(token, ("tcp", "?"))
        try:
            return await self.receiver.wait(token, timeout)
        except TransferError as e:
            await publish_failure(self.nc, self.scope, request_id, token, self.worker_id, "receiver", transport, str(e))
            raise

    def layers(self, token: str, timeout: float) -> AsyncIterator[tuple[int, torch.Tensor]]:
        """Layer streaming: `(layer_index, tensor)` as each completes; follow with `wait(token, …)`."""
        return self.receiver.layers(token, timeout)

    def cancel(self, token: str, reason: str) -> None:
        self._transport.pop(token, None)
        self.receiver.cancel(token, reason)


class KVSendChannel:
    """Prefill side: what to offer, and how to send once decode has replied."""

    def __init__(self, nc=None, *, scope: str = "default", sender_id: str, generation: int,
                 transports: Iterable[str] = DEFAULT_PREFERENCE,
                 compression: str = "none", timeout: float = 30.0, connect_timeout: float = 5.0):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        bad = [t for t in transports if t not in TRANSPORTS]
        if bad:
            raise ValueError(f"unknown KV transports {bad}; known: {TRANSPORTS}")
        self.nc, self.scope, self.sender_id, self.generation = nc, scope, sender_id, generation
        self.transports = [t for t in transports if t not in ("nats", "objstore") or nc is not None]
        self.compression = compression
        self.timeout, self.connect_timeout = timeout, connect_timeout

    def offer_fields(self) -> dict:
        """Fields to put in the `HandoffOffer`: transports (preference order), host_id, compression."""
        return {"transports": list(self.transports), "host_id": host_id(), "compression": self.compression}

    def header(self, reply: HandoffReply, request_id: str, kv_layout: KVLayout, num_tokens: int) -> TransferHeader:
        """The HELLO for a transfer that `reply` accepted."""
        return TransferHeader(
            transfer_token=reply.transfer_token, request_id=request_id, sender_id=self.sender_id,
            sender_generation=self.generation, layout=kv_layout, num_tokens=num_tokens,
            num_chunks=kv_layout.num_layers, total_bytes=kv_layout.payload_bytes(num_tokens),
            compression=reply.compression, transport=reply.transport,
        )

    async def send(self, reply: HandoffReply, header: TransferHeader, kv: KVBlocks) -> dict:
        """Send `kv` over the transport `reply` chose; → the receiver's ACK. TransferError on failure
        (published as a `TransferFailed` record)."""
        if reply.transport == "objstore":
            from pdserve.kvtransfer.natsdata import send_kv_objstore

            return await self._guard(header, send_kv_objstore(self.nc, self._fit(reply, header), kv,
                                                              scope=self.scope, timeout=self.timeout))
        if reply.transport in ("tcp", "shm"):  # every layer at hand: one pipeline, no per-layer hand-offs
            return await self._guard(header, send_kv(reply.data_addr, self._fit(reply, header), kv,
                                                     timeout=self.timeout, connect_timeout=self.connect_timeout))
        return await self.send_stream(reply, header, aiter_layers(kv.layers))

    async def send_stream(self, reply: HandoffReply, header: TransferHeader,
                          layers: AsyncIterator[tuple[int, torch.Tensor]]) -> dict:
        """Layer streaming: send each `(layer_index, tensor)` as it is produced (tcp, shm, nats)."""
        header = self._fit(reply, header)
        if reply.transport in ("tcp", "shm"):
            coro = send_kv_stream(reply.data_addr, header, layers, timeout=self.timeout,
                                  connect_timeout=self.connect_timeout)
        elif reply.transport == "nats":
            from pdserve.kvtransfer.natsdata import send_kv_nats

            coro = send_kv_nats(self.nc, header, layers, scope=self.scope, timeout=self.timeout)
        else:
            raise TransferError(f"transport {reply.transport!r} cannot stream layers")
        return await self._guard(header, coro)

    @staticmethod
    def _fit(reply: HandoffReply, header: TransferHeader) -> TransferHeader:
        if reply.transport not in TRANSPORTS:
            raise TransferError(f"decode chose unknown transport {reply.transport!r}")
        return header.model_copy(update={"transport": reply.transport, "compression": reply.compression})

    async def _guard(self, header: TransferHeader, coro) -> dict:
        try:
            return await coro
        except TransferError as e:
            await publish_failure(self.nc, self.scope, header.request_id, header.transfer_token, self.sender_id,
                                  "sender", header.transport, str(e))
            raise
