"""Which workers are alive, for which model, and how loaded: built from their LoadReports on NATS."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.basetypes import announced, prefix_hashes
from pdserve.kvtransfer.protocol import LoadReport, ProtocolError, Subjects


# A worker silent this long is forgotten, `bye` included: a report after that is a new worker's.
FORGET_AFTER_S = 60.0


class WorkerRegistry:
    """Workers of one deployment scope; reports from other scopes on the same NATS are ignored.

    A worker that said `bye` is draining: it is never picked for new work, yet stays alive for the
    requests it holds (`is_alive`) for as long as its heartbeats go on. A restart under the same id
    (a newer generation) is a new worker. `clock` (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, scope: str = "default", clock=time.monotonic):
        self.scope = scope
        self.clock = clock
        self._workers: dict[tuple[str, str], tuple[float, LoadReport]] = {}
        self._cached: dict[str, frozenset[str]] = {}  # prefill worker id -> its announced block addresses
        self._leaving: dict[tuple[str, str], int] = {}  # (role, id) -> the generation that said bye
        self.malformed = 0
        self.restarts: Counter[str] = Counter()  # role -> workers seen again under a newer generation

    async def attach(self, nc) -> None:
        await nc.subscribe(Subjects.load_all(self.scope), cb=self._on_load)
        await nc.subscribe(Subjects.bye_all(self.scope), cb=self._on_bye)

    async def _on_load(self, msg) -> None:
        try:
            r = LoadReport.decode(msg.data)
        except ProtocolError:
            self.malformed += 1
            return
        if r.scope != self.scope:
            return
        key = (r.role, r.worker_id)
        if (prev := self._workers.get(key)) is not None and prev[1].generation != r.generation:
            self.restarts[r.role] += 1
        if key in self._leaving and self._leaving[key] != r.generation:
            del self._leaving[key]  # restarted under the same id: a new worker
        self._workers[key] = (self.clock(), r)
        if r.role == "prefill" and key not in self._leaving:
            self._cached[r.worker_id] = frozenset(r.cached_blocks)

    async def _on_bye(self, msg) -> None:
        try:
            r = LoadReport.decode(msg.data)
        except ProtocolError:
            return
        if r.scope == self.scope:
            self._leaving[(r.role, r.worker_id)] = r.generation
            if r.role == "prefill":
                self._cached.pop(r.worker_id, None)

    def alive(self, role: str | None = None, model: str | None = None) -> list[LoadReport]:
        """Workers that take new work: heartbeats fresh, no `bye` said."""
        now = self.clock()
        out = []
        for key, (seen, rep) in list(self._workers.items()):
            if now - seen > rep.stale_after_s:
                if now - seen > FORGET_AFTER_S:  # long gone: keep no memory of it (workers come and go)
                    del self._workers[key]
                    self._leaving.pop(key, None)
                    if key[0] == "prefill":
                        self._cached.pop(key[1], None)
                continue
            if key in self._leaving:
                continue
            if (role is None or key[0] == role) and (model is None or rep.model == model):
                out.append(rep)
        return out

    def is_alive(self, role: str, worker_id: str) -> bool:
        """Whether the worker still beats (draining or not): it can still finish what it holds."""
        entry = self._workers.get((role, worker_id))
        return entry is not None and self.clock() - entry[0] <= entry[1].stale_after_s

    def last_heard(self, role: str, worker_id: str) -> str:
        """How the worker was last heard of, for an error that says it went silent: "its last heartbeat
        was 3.4 s ago, after it said bye" — what tells a crash apart from a drain that ended too soon."""
        entry = self._workers.get((role, worker_id))
        if entry is None:
            return "no heartbeat from it was ever seen"
        leaving = self._leaving.get((role, worker_id)) == entry[1].generation
        return (f"its last heartbeat was {self.clock() - entry[0]:.1f} s ago"
                f"{', after it said bye (draining)' if leaving else ''}")

    def pick_decode(self, model: str, inflight: Mapping[str, int] | None = None,
                    inflight_bytes: Mapping[str, int] | None = None) -> LoadReport | None:
        """The decode worker with the most free KV capacity, then the fewest sequences.

        `inflight` / `inflight_bytes`: requests (and their KV bytes, estimated) the caller already
        sent each worker, which the 1 Hz load reports may not show yet; a worker's load counts as
        the larger of what it reported and what the caller knows it sent.
        """
        candidates = self.alive("decode", model)
        if not candidates:
            return None
        sent, sent_bytes = inflight or {}, inflight_bytes or {}

        def key(r: LoadReport):
            free = r.kv_bytes_capacity - max(r.kv_bytes_used, sent_bytes.get(r.worker_id, 0))
            return (-free, max(sent.get(r.worker_id, 0), r.running + r.waiting), r.kv_utilization, r.worker_id)

        return min(candidates, key=key)

    def cached_prefix(self, report: LoadReport, prompt_ids: list[int], _chains: dict | None = None) -> int:
        """How many leading tokens of `prompt_ids` the prefill worker's prefix cache holds (whole blocks)."""
        cached = self._cached.get(report.worker_id)
        if not cached or not report.block_size:
            return 0
        chains = _chains if _chains is not None else {}
        if report.block_size not in chains:
            chains[report.block_size] = [announced(h) for h in prefix_hashes(prompt_ids, report.block_size)]
        n = 0
        for h in chains[report.block_size]:
            if h not in cached:
                break
            n += 1
        return n * report.block_size

    def pick_prefill(self, model: str, prompt_ids: list[int],
                     inflight_tokens: Mapping[str, int] | None = None) -> tuple[LoadReport | None, int]:
        """The prefill worker that would compute the prompt soonest: (worker, tokens it has cached).

        Its cost is the prompt tokens it would compute (those past its longest cached prefix) plus
        the tokens already queued there — reported, or sent by the caller since (`inflight_tokens`),
        whichever is larger. So a worker holding a long shared prefix wins unless it is that much
        busier than the others.
        """
        candidates = self.alive("prefill", model)
        if not candidates:
            return None, 0
        sent = inflight_tokens or {}
        chains: dict = {}
        best, best_key, best_hit = None, None, 0
        for r in candidates:
            hit = self.cached_prefix(r, prompt_ids, chains)
            k = (len(prompt_ids) - hit + max(r.queue_tokens, sent.get(r.worker_id, 0)), r.queue_depth, r.worker_id)
            if best_key is None or k < best_key:
                best, best_key, best_hit = r, k, hit
        return best, best_hit

    def models(self) -> set[str]:
        return {r.model for r in self.alive()}

    def snapshot(self) -> list[tuple[LoadReport, float, bool]]:
        """Every worker still beating, draining ones included: (its last report, seconds since, draining)."""
        now = self.clock()
        return [(rep, now - seen, key in self._leaving) for key, (seen, rep) in sorted(self._workers.items())
                if now - seen <= rep.stale_after_s]


ROLES = ("prefill", "decode", "draft")


class RegistryCollector:
    """The registry on a Prometheus endpoint, read at scrape time: `pdserve_workers{role}` (workers taking
    work: the pools' sizes, so the P:D ratio and what the autoscalers did) and
    `pdserve_worker_restarts_total{role}` (a worker back under a newer generation: a crash loop shows here)."""

    def __init__(self, registry: WorkerRegistry, model: str):
        self.registry, self.model = registry, model

    def collect(self):
        workers = GaugeMetricFamily("pdserve_workers", "workers of the model taking new work, by role", labels=["role"])
        restarts = CounterMetricFamily("pdserve_worker_restarts", "workers seen again under a newer generation "
                                       "(restarted), by role", labels=["role"])
        alive = Counter(r.role for r in self.registry.alive(model=self.model))
        for role in ROLES:
            workers.add_metric([role], alive[role])
            restarts.add_metric([role], self.registry.restarts[role])
        yield workers
        yield restarts
