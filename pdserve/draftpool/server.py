"""`pdserve draftpool`: the draft pool process — fleet-wide suffix drafts for every decode worker, over NATS.

It subscribes, in a queue group, to the deployment's draft subject (`Subjects.draft(scope, model)`)
and answers `DraftRequest`s from the `SuffixIndex` that decode workers' `DraftReport`s fill
(`Subjects.draft_report`, which every replica hears). Requests that arrive while a pass runs are
answered together in the next pass (one lookup loop, one batch: `pdserve_draftpool_batch_size`);
past `max_queue` waiting, a request is answered at once with `overloaded` so its worker drafts
locally, and one that already waited past its own deadline is dropped (its worker stopped waiting).

Like the workers, it beats a `LoadReport` (role `draft`) each second: its queue and its recent rate
of draft asks, which the metrics adapter serves to the pool's HPA (`pdserve_draftpool_*`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdserve.config import DraftPoolConfig, load
from pdserve.draftpool.index import SuffixIndex
from pdserve.kvtransfer.protocol import (
    DraftReply, DraftReport, DraftRequest, LoadReport, ProtocolError, Subjects, settle,
)
from pdserve.natsserver import NatsCredentials, close_connection
from pdserve.workerbase import heartbeat, setup_logging

log = logging.getLogger("pdserve.draftpool")

ROLE = "draft"
RATE_WINDOW_S = 10.0  # the asks-per-second an HPA sees: averaged over this long, so one burst moves it little


def served_name(cfg: DraftPoolConfig) -> str:
    """The model name decode workers use in the draft subject: the served name, else the checkpoint folder's."""
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.model == "default":
        from pdserve.modelstore import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return Path(cfg.model).name


class DraftPool:
    """The pool's request handling on an open NATS connection; `start` subscribes, `close` unsubscribes."""

    def __init__(self, cfg: DraftPoolConfig, registry: CollectorRegistry | None = None):
        self.cfg = cfg
        self.index = SuffixIndex(min_n=cfg.min_n, max_n=cfg.max_n, max_tokens=cfg.max_tokens,
                                 share_tenants=cfg.share_tenants)
        self.subject = Subjects.draft(cfg.deployment_scope, served_name(cfg))
        self.worker_id = cfg.worker_id or cfg.pod_name or f"draftpool-{socket.gethostname()}-{os.getpid()}"
        self.asked = 0  # draft requests received, answered or not
        self._rate_samples: collections.deque[tuple[float, int]] = collections.deque()  # (monotonic s, asked)
        self._pending: list[tuple[float, object, DraftRequest]] = []
        self.arrived = asyncio.Event()  # set when a request is queued
        self.indexed = asyncio.Event()  # set when a report joined the index
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []
        self._nc = None
        r = registry or CollectorRegistry()
        self.registry = r
        self.m_requests = Counter("pdserve_draftpool_requests_total", "draft requests", ["outcome"], registry=r)
        self.m_batch = Histogram("pdserve_draftpool_batch_size", "draft requests answered in one pass",
                                 registry=r, buckets=(1, 2, 4, 8, 16, 32, 64))
        self.m_reports = Counter("pdserve_draftpool_reports_total", "finished requests indexed", registry=r)
        self.m_draft_tokens = Counter("pdserve_draftpool_draft_tokens_total", "draft tokens proposed", registry=r)
        Gauge("pdserve_draftpool_index_tokens", "tokens held by the suffix index", registry=r
              ).set_function(lambda: self.index.num_tokens)
        Gauge("pdserve_draftpool_queue_depth", "draft requests waiting for the next pass", registry=r
              ).set_function(lambda: self.waiting)

    async def start(self, nc, *, serve: bool = True) -> None:
        """Subscribe on `nc`; with `serve`, answer in passes as requests arrive and beat LoadReports (without,
        call `serve_once`)."""
        self._nc = nc
        self._subs = [await nc.subscribe(self.subject, queue="draftpool", cb=self._on_request),
                      await nc.subscribe(Subjects.draft_report(self.cfg.deployment_scope, served_name(self.cfg)),
                                         cb=self._on_report)]
        # Asks and reports come over other connections: they find this pool only once the server holds
        # its subscriptions (an ask before that is "no responders", and its asker backs off; a report is lost).
        await settle(nc)
        if serve:
            load = Subjects.load(self.cfg.deployment_scope, ROLE, self.worker_id)
            self._tasks = [asyncio.create_task(self._serve()),
                           asyncio.create_task(heartbeat(nc, load, self.load_report))]
        log.info("draft pool answering on %s", self.subject)

    async def close(self) -> None:
        """Stop answering; say `bye`, so the metrics adapter forgets this replica at once rather than once
        its reports go stale."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            try:
                await self._nc.publish(Subjects.bye(self.cfg.deployment_scope, ROLE, self.worker_id),
                                       self.load_report().encode())
            except Exception as e:  # NATS gone: nobody is reading
                log.info("bye not delivered: %s", e)
        for sub in self._subs:
            await sub.unsubscribe()

    async def _on_report(self, msg) -> None:
        try:
            rep = DraftReport.decode(msg.data)
        except ProtocolError as e:
            log.warning("draft report refused: %s", e)
            return
        self.index.add(rep.tenant, rep.request_id, rep.token_ids)
        self.m_reports.inc()
        self.indexed.set()

    async def _on_request(self, msg) -> None:
        self.asked += 1
        try:
            req = DraftRequest.decode(msg.data)
        except ProtocolError as e:
            self.m_requests.labels("refused").inc()
            log.warning("draft request refused: %s", e)
            return
        if len(self._pending) >= self.cfg.max_queue:
            self.m_requests.labels("overloaded").inc()
            await msg.respond(DraftReply(request_id=req.request_id, token_ids=[], overloaded=True).encode())
            return
        self._pending.append((time.monotonic(), msg, req))
        self.arrived.set()

    @property
    def waiting(self) -> int:
        """Requests queued for the next pass."""
        return len(self._pending)

    def asks_per_second(self, now: float | None = None) -> float:
        """Draft requests received per second over about the last RATE_WINDOW_S seconds (0 on the first call)."""
        now = time.monotonic() if now is None else now
        samples = self._rate_samples
        samples.append((now, self.asked))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        t0, n0 = samples[0]
        return (self.asked - n0) / (now - t0) if now > t0 else 0.0

    def load_report(self) -> LoadReport:
        """This replica's heartbeat: who it is (pod, pool) and its load (queue, asks per second)."""
        cfg = self.cfg
        return LoadReport(worker_id=self.worker_id, role=ROLE, model=served_name(cfg), isvc=cfg.isvc, pool=cfg.pool,
                          pod=cfg.pod_name, namespace=cfg.namespace, scope=cfg.deployment_scope,
                          queue_depth=self.waiting, requests_per_second=self.asks_per_second())

    async def serve_once(self) -> int:
        """Answer every request waiting now, as one batch (one lookup pass); → how many were answered."""
        batch, self._pending = self._pending, []
        now = time.monotonic()
        live = [(msg, req) for t, msg, req in batch if (now - t) * 1e3 < req.timeout_ms]
        self.m_requests.labels("expired").inc(len(batch) - len(live))
        if not live:
            return 0
        self.m_batch.observe(len(live))
        replies = []
        for msg, req in live:  # lookups are microseconds each
            ids, n = self.index.lookup(req.tenant, req.tail, req.k)
            self.m_draft_tokens.inc(len(ids))
            replies.append((msg, DraftReply(request_id=req.request_id, token_ids=ids, match_len=n,
                                            batch_size=len(live))))
        for msg, reply in replies:
            try:
                await msg.respond(reply.encode())
                self.m_requests.labels("answered").inc()
            except Exception as e:  # the asker's connection is gone: nothing to answer
                log.debug("draft reply not sent: %s", e)
        return len(live)

    async def _serve(self) -> None:
        while True:
            await self.arrived.wait()
            self.arrived.clear()
            await self.serve_once()


async def serve(cfg: DraftPoolConfig) -> None:
    creds = NatsCredentials.from_config(cfg.nats, scope=cfg.deployment_scope)
    nc = await creds.connect(name="pdserve-draftpool", max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    pool = DraftPool(cfg)
    await pool.start(nc)
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, registry=pool.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await pool.close()
    await close_connection(nc)


def main(argv: list[str]) -> int:
    cfg = load(DraftPoolConfig, argv, prog="pdserve draftpool", description=__doc__.strip().split("\n")[0])
    setup_logging(cfg.log_level, cfg.log_format)
    asyncio.run(serve(cfg))
    return 0
