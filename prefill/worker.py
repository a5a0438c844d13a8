"""The prefill worker: takes prompts from NATS (queue group), runs them, hands their KV to a decode worker.

Per request: Ack at once → prefill on the compute thread → sample and stream the first token
straight to the front (TTFT does not wait for the KV move) → offer the KV to the decode
worker the front chose (NATS) → stream it over the direct data path. Once decode has accepted
the offer it owns the request, including its failure policy; before that, prefill reports
every failure on the request's stream.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections import deque

import nats.errors
from prometheus_client import Counter, Gauge, Histogram

from pdserve.kvtransfer.protocol import (
    PREFILL_QUEUE_GROUP, Ack, Cancel, HandoffOffer, HandoffReply, PrefillRequest, ProtocolError, StreamEvent,
    Subjects, Usage,
)
from pdserve.kvtransfer.channel import KVSendChannel
from pdserve.kvtransfer.tcp import TransferError
from pdserve.sampling import TextStream, sample_next
from pdserve.workerbase import WorkerBase, run_worker

log = logging.getLogger("pdserve.prefill")


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.offer_timeout = args.offer_timeout
        self.transfer_timeout = args.transfer_timeout
        self.queue_depth = 0
        self.transfer_backlog = 0
        self.transfer_backlog_bytes = 0
        self._recent_ttft: deque[float] = deque(maxlen=32)
        self._recent_wait: deque[float] = deque(maxlen=32)
        self._cancelled: set[str] = set()
        self._slot = asyncio.Semaphore(1)
        r = self.registry
        self.m_requests = Counter("pdserve_prefill_requests_total", "prompts prefilled", ["outcome"], registry=r)
        self.m_queue = Gauge("pdserve_prefill_queue_depth", "prompts waiting for prefill", registry=r)
        self.m_prefill = Histogram("pdserve_prefill_compute_seconds", "prefill forward time", registry=r,
                                   buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32))
        # the same signals the LoadReport carries, for clusters that scrape Prometheus (prometheus-adapter)
        Gauge("pdserve_prefill_queue_wait_seconds", "recent mean wait before prefill starts", registry=r
              ).set_function(lambda: self.load_fields()["queue_wait_seconds"])
        Gauge("pdserve_prefill_ttft_seconds", "recent mean time to first token at prefill", registry=r
              ).set_function(lambda: self.load_fields()["ttft_seconds"])
        Gauge("pdserve_transfer_backlog_handoffs", "KV handoffs waiting or in flight", registry=r
              ).set_function(lambda: self.transfer_backlog)
        Gauge("pdserve_transfer_backlog_bytes", "KV bytes waiting or in flight", registry=r
              ).set_function(lambda: self.transfer_backlog_bytes)
        self.m_kv_bytes = Counter("pdserve_kv_transfer_bytes_total", "KV bytes sent to decode", registry=r)
        self.m_kv_seconds = Histogram("pdserve_kv_transfer_seconds", "KV handoff time (offer to ACK)", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))

    def load_fields(self) -> dict:
        mean = lambda d: sum(d) / len(d) if d else 0.0  # noqa: E731
        return dict(queue_depth=self.queue_depth, queue_wait_seconds=mean(self._recent_wait),
                    ttft_seconds=mean(self._recent_ttft), transfer_backlog_handoffs=self.transfer_backlog,
                    transfer_backlog_bytes=self.transfer_backlog_bytes)

    async def on_start(self) -> None:
        # transports in preference order (shm only when decode reports the same host), negotiated per handoff
        self.kv_channel = KVSendChannel(self.nc, sender_id=self.worker_id, generation=self.generation,
                                        transports=self.args.kv_transports.split(","),
                                        compression=self.args.kv_compression, timeout=self.transfer_timeout)
        await self.nc.subscribe(Subjects.prefill(self.scope, self.model_name), queue=PREFILL_QUEUE_GROUP, cb=self._on_request)
        await self.nc.subscribe(Subjects.CANCEL_ALL, cb=self._on_cancel)

    async def _on_cancel(self, msg) -> None:
        try:
            self._cancelled.add(Cancel.decode(msg.data).request_id)
        except ProtocolError:
            pass

    async def _on_request(self, msg) -> None:
        try:
            req = PrefillRequest.decode(msg.data)
        except ProtocolError as e:
            await msg.respond(Ack(accepted=False, worker_id=self.worker_id, error=str(e)).encode())
            return
        await msg.respond(Ack(accepted=True, worker_id=self.worker_id).encode())
        self.queue_depth += 1
        self.m_queue.set(self.queue_depth)
        self.spawn(self._serve(req, time.monotonic()))

    async def _publish(self, req: PrefillRequest, **fields) -> None:
        await self.nc.publish(Subjects.stream(req.request_id),
                              StreamEvent(request_id=req.request_id, worker_id=self.worker_id, **fields).encode())

    async def _fail(self, req: PrefillRequest, seq: int, message: str, status: int = 500,
                    error_type: str = "server_error") -> None:
        self.m_requests.labels("error").inc()
        log.warning("request %s failed: %s", req.request_id, message)
        await self._publish(req, seq=seq, kind="error", error=message, error_type=error_type, status=status)

    async def _serve(self, req: PrefillRequest, queued_at: float) -> None:
        try:
            async with self._slot:
                self.queue_depth -= 1
                self.m_queue.set(self.queue_depth)
                self._recent_wait.append(time.monotonic() - queued_at)
                if req.request_id in self._cancelled:
                    self._cancelled.discard(req.request_id)
                    return
                t0 = time.monotonic()
                logits, cache = await self.compute(self.runner.prefill, req.prompt_token_ids)
                self.m_prefill.observe(time.monotonic() - t0)
            first = sample_next(logits, req.sampling, 0, req.seed)
            stream = TextStream(self.runner.tokenizer, req.sampling, self.runner.eos_token_ids)
            text = stream.push(first)
            self._recent_ttft.append(time.monotonic() - queued_at)
            await self._publish(req, seq=0, kind="token", token_ids=[first], text=text)
            if stream.done:
                self.m_requests.labels("finished").inc()
                await self._publish(req, seq=1, kind="done", finish_reason=stream.finish_reason,
                                    usage=Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=1))
                return
            kv = await self.compute(self.runner.cache_to_blocks, cache)
            del cache
            await self._handoff(req, kv, [first])
        except Exception as e:  # never leave the client waiting on a request we took
            log.exception("prefill of %s failed", req.request_id)
            await self._fail(req, 1, f"prefill failed: {e}")

    async def _handoff(self, req: PrefillRequest, kv, generated: list[int]) -> None:
        offer = HandoffOffer(
            request_id=req.request_id, sender_id=self.worker_id, sender_generation=self.generation,
            layout=kv.layout, num_tokens=kv.num_tokens, kv_bytes=kv.nbytes, prompt_token_ids=req.prompt_token_ids,
            generated_token_ids=generated, sampling=req.sampling, seed=req.seed, next_seq=1,
            failure_policy=req.failure_policy, spec=req.spec, **self.kv_channel.offer_fields(),
        )
        self.transfer_backlog += 1
        self.transfer_backlog_bytes += kv.nbytes
        t0 = time.monotonic()
        try:
            try:
                raw = await self.nc.request(Subjects.decode_handoff(self.scope, req.decode_worker_id), offer.encode(),
                                            timeout=self.offer_timeout)
                reply = HandoffReply.decode(raw.data)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                await self._fail(req, 1, f"decode worker {req.decode_worker_id} did not answer the handoff "
                                         f"within {self.offer_timeout:.1f} s", status=503, error_type="unavailable")
                return
            if not reply.accepted:
                # decode refused before owning the request: it is ours to report
                await self._fail(req, 1, f"decode worker {reply.worker_id} refused the handoff: {reply.error}",
                                 status=503, error_type="unavailable")
                return
            header = self.kv_channel.header(reply, req.request_id, kv.layout, kv.num_tokens)
            try:
                await self.kv_channel.send(reply, header, kv)
            except TransferError as e:
                # decode owns the request now and applies its failure policy (recompute or fail)
                log.warning("KV send for %s to %s failed: %s", req.request_id, reply.worker_id, e)
                return
            self.m_kv_bytes.inc(kv.nbytes)
            self.m_kv_seconds.observe(time.monotonic() - t0)
            self.m_requests.labels("handed_off").inc()
        finally:
            self.transfer_backlog -= 1
            self.transfer_backlog_bytes -= kv.nbytes


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offer-timeout", type=float, default=5.0, help="seconds to wait for decode to accept a handoff")
    p.add_argument("--transfer-timeout", type=float, default=float(os.environ.get("PDSERVE_KV_TIMEOUT_SECONDS", "30")), help="seconds without progress before a KV send fails")
    p.add_argument("--kv-transports", default=os.environ.get("PDSERVE_KV_TRANSPORT", "shm,tcp,nats"),
                   help="KV transports in preference order (shm,tcp,nats,objstore); decode picks the first it can use")
    p.add_argument("--kv-compression", default=os.environ.get("PDSERVE_KV_COMPRESSION", "none"),
                   choices=["none", "int8", "fp8"], help="KV compression on the wire (off by default)")
    p.add_argument("--data-port", type=int, default=0, help="unused by prefill today (it connects out); kept for symmetry")


def main(argv: list[str]) -> int:
    return run_worker(PrefillWorker, argv, _args)
