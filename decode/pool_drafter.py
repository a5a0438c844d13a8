"""A decode worker's side of the draft pool: prompt lookup here, fleet-wide suffix drafts from the pool.

`PoolDrafter` speaks the decode loop's drafter interface (`pdserve.decode.drafters.Drafter`, with the
model-free extras `confidence` and `trim`). Each proposal is first looked up locally (the request's
own text); when that match is short, the pool is asked — with a deadline, the smaller of
`timeout_s` and `budget_s()` (the worker passes a share of a plain step) — and its draft is used
when it follows a longer match. Whatever the pool does costs a step at most that deadline:

* no answer in time, no pool listening, a closed connection, or "overloaded": the local draft is
  used and the pool is not asked again for a back-off that doubles per failure (`max_backoff_s`);
* a pool that answers but whose drafts keep losing to the local ones is asked only every
  `probe_every`-th time until one wins again.

A request's tokens (prompt + output) are reported to every pool replica when it ends (`release`),
tagged with its tenant (`tenant_of`), so later requests of that tenant, on any worker, draft from it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pdserve.decode.drafters import Draft, DrafterBase, NgramDrafter
from pdserve.kvtransfer.protocol import DraftReply, DraftReport, DraftRequest, ProtocolError, Subjects

log = logging.getLogger("pdserve.decode.pool")

SOURCES = ("local", "pool")


@dataclass(eq=False)  # registered with Prometheus as a collector: hashed by identity
class PoolStats:
    """Plain counters (the worker exports them): asks of the pool by outcome, draft and accepted tokens
    by source (acceptance by drafter), round-trip seconds of answered asks, and pool batch sizes seen."""

    asks: Counter = field(default_factory=Counter)  # answered, timeout, unavailable, overloaded, skipped
    draft_tokens: Counter = field(default_factory=Counter)
    accepted_tokens: Counter = field(default_factory=Counter)
    rtt_seconds_total: float = 0.0
    rtt_count: int = 0
    batch_sizes: Counter = field(default_factory=Counter)

    def acceptance(self, source: str) -> float:
        d = self.draft_tokens[source]
        return self.accepted_tokens[source] / d if d else 0.0

    def collect(self):
        """Prometheus collector protocol: the counters as `pdserve_spec_pool_*` and `pdserve_spec_drafter_*`."""
        from prometheus_client.core import CounterMetricFamily, SummaryMetricFamily

        asks = CounterMetricFamily("pdserve_spec_pool_asks", "asks of the draft pool by outcome", labels=["outcome"])
        for outcome in ("answered", "timeout", "unavailable", "overloaded", "error", "skipped"):
            asks.add_metric([outcome], self.asks[outcome])
        yield asks
        for name, counts, doc in (("draft_tokens", self.draft_tokens, "draft tokens verified, by drafter"),
                                  ("accepted_tokens", self.accepted_tokens, "draft tokens accepted, by drafter")):
            fam = CounterMetricFamily(f"pdserve_spec_drafter_{name}", doc, labels=["drafter"])
            for source in SOURCES:
                fam.add_metric([source], counts[source])
            yield fam
        yield SummaryMetricFamily("pdserve_spec_pool_rtt_seconds", "round trip of answered draft pool asks",
                                  count_value=self.rtt_count, sum_value=self.rtt_seconds_total)


class PoolDrafter(DrafterBase):
    """Local prompt lookup plus the draft pool's fleet index; see the module doc."""

    name = "pool"
    model_free = True  # local lookup first, the pool's answer within a fraction of a step
    concurrent = True  # the decode loop may plan a batch's requests at once, so their asks share a pool pass

    def __init__(self, local: NgramDrafter, *, tenant_of: Callable[[str], str], timeout_s: float = 0.02,
                 budget_s: Callable[[], float] | None = None, probe_every: int = 8, lose_streak: int = 32,
                 min_backoff_s: float = 0.1, max_backoff_s: float = 5.0):
        self.local = local
        # learns the acceptance of pool drafts by match length, as `local` does its own
        self.fleet = NgramDrafter(min_n=local.min_n, max_n=local.max_n, min_reach=local.min_reach)
        self.tenant_of = tenant_of
        self.timeout_s = timeout_s
        self.budget_s = budget_s
        self.probe_every = probe_every
        self.lose_streak = lose_streak
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.stats = PoolStats()
        self.nc = None
        self.subject = self.report_subject = ""
        self._source: dict[str, str] = {}
        self._proposed: dict[str, int] = {}
        self._context: dict[str, tuple[str, Sequence[int]]] = {}
        self._failures = 0
        self._down_until = 0.0
        self._losses = 0
        self._skips = 0
        self._tasks: set[asyncio.Task] = set()

    def attach(self, nc, scope: str, model: str) -> None:
        """Start asking the pool of `scope` for `model`'s drafts over the connection `nc`."""
        self.nc = nc
        self.subject = Subjects.draft(scope, model)
        self.report_subject = Subjects.draft_report(scope, model)

    # -- proposing --------------------------------------------------------------------------

    def deadline_s(self) -> float:
        """Seconds one ask may take: `timeout_s`, or less where the budget (a share of a plain step) is less."""
        return min(self.timeout_s, self.budget_s()) if self.budget_s else self.timeout_s

    def _should_ask(self, k: int, local_match: int) -> bool:
        if self.nc is None or k <= 0 or local_match >= self.local.max_n:
            return False  # nothing to ask, or the local match is as long as the pool looks up
        if time.monotonic() < self._down_until:
            self.stats.asks["skipped"] += 1
            return False
        if self._losses >= self.lose_streak:
            self._skips += 1
            if self._skips % self.probe_every:
                self.stats.asks["skipped"] += 1
                return False
        return True

    def _failed(self, outcome: str) -> None:
        self.stats.asks[outcome] += 1
        self._failures += 1
        backoff = min(self.min_backoff_s * 2 ** (self._failures - 1), self.max_backoff_s)
        self._down_until = time.monotonic() + backoff
        if self._failures == 1:
            log.warning("draft pool %s: %s; drafting locally for %.1f s", self.subject, outcome, backoff)

    async def _ask(self, request_id: str, tenant: str, token_ids: Sequence[int], k: int) -> DraftReply | None:
        import nats.errors

        timeout = self.deadline_s()
        req = DraftRequest(request_id=request_id, tenant=tenant, tail=[int(t) for t in token_ids[-self.local.max_n:]],
                           k=k, timeout_ms=timeout * 1e3)
        t0 = time.perf_counter()
        try:
            msg = await self.nc.request(self.subject, req.encode(), timeout=timeout)
        except nats.errors.TimeoutError:
            self._failed("timeout")
            return None
        except (nats.errors.NoRespondersError, nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                nats.errors.ConnectionDrainingError, nats.errors.OutboundBufferLimitError, OSError) as e:
            self._failed("unavailable" if isinstance(e, nats.errors.NoRespondersError) else "error")
            return None
        self.stats.rtt_seconds_total += time.perf_counter() - t0
        self.stats.rtt_count += 1
        try:
            reply = DraftReply.decode(msg.data)
        except ProtocolError as e:
            log.warning("draft pool %s: bad reply: %s", self.subject, e)
            self._failed("error")
            return None
        if reply.overloaded:
            self._failed("overloaded")
            return None
        if self._failures:
            log.info("draft pool %s answers again", self.subject)
        self._failures = 0
        self.stats.asks["answered"] += 1
        self.stats.batch_sizes[reply.batch_size] += 1
        return reply

    async def propose(self, request_id: str, token_ids: Sequence[int], k: int, sampling=None) -> Draft:
        """The local prompt-lookup draft, or the pool's when it follows a longer match (at most `k` tokens)."""
        tenant = self.tenant_of(request_id)
        self._context[request_id] = (tenant, token_ids)
        self._source[request_id] = "local"
        draft = self.local.propose_now(request_id, token_ids, k)
        local_match = self.local.last_match_n.get(request_id, 0)
        if not self._should_ask(k, local_match):
            return draft
        reply = await self._ask(request_id, tenant, token_ids, k)
        if reply is None:
            return draft
        if not reply.token_ids or reply.match_len <= local_match:
            self._losses += 1
            return draft
        pooled = self.fleet.adopt(request_id, reply.token_ids[:k], reply.match_len)
        if not pooled.token_ids:  # its match length's acceptance says: not worth verifying
            self._losses += 1
            return draft
        self._losses = self._skips = 0
        self.local.trim(request_id, 0)  # the local proposal is not the one verified
        self._source[request_id] = "pool"
        return pooled

    def _drafter(self, request_id: str) -> NgramDrafter:
        return self.fleet if self._source.get(request_id) == "pool" else self.local

    def confidence(self, request_id: str) -> float | None:
        """Per-token acceptance expected of the request's last proposal (by its source and match length)."""
        return self._drafter(request_id).confidence(request_id)

    def trim(self, request_id: str, keep: int) -> None:
        self._drafter(request_id).trim(request_id, keep)
        self._proposed[request_id] = keep

    def feedback(self, request_id: str, num_accepted: int, new_token_ids: Sequence[int]) -> None:
        source = self._source.get(request_id, "local")
        proposed = self._proposed.pop(request_id, None)
        if proposed is not None:
            self.stats.draft_tokens[source] += proposed
            self.stats.accepted_tokens[source] += min(int(num_accepted), proposed)
        self._drafter(request_id).feedback(request_id, num_accepted, new_token_ids)

    # -- reporting --------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """The request ended: forget it, and report its tokens to the pool (fire and forget)."""
        self.local.release(request_id)
        self.fleet.release(request_id)
        self._source.pop(request_id, None)
        self._proposed.pop(request_id, None)
        ctx = self._context.pop(request_id, None)
        if ctx is None or self.nc is None:
            return
        tenant, tokens = ctx
        data = DraftReport(request_id=request_id, tenant=tenant, token_ids=[int(t) for t in tokens]).encode()
        task = asyncio.get_running_loop().create_task(self._report(data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, data: bytes) -> None:
        try:
            await self.nc.publish(self.report_subject, data)
        except Exception as e:  # NATS away: the pool misses one document, nothing else depends on it
            log.debug("draft report not sent: %s", e)
