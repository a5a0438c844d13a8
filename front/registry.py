"""Which workers are alive, for which model, and how loaded: built from their LoadReports on NATS."""
from __future__ import annotations

import time
from collections.abc import Mapping

from pdserve.kvtransfer.protocol import LoadReport, ProtocolError, Subjects


class WorkerRegistry:
    """Workers of one deployment scope; reports from other scopes on the same NATS are ignored."""

    def __init__(self, scope: str = "default"):
        self.scope = scope
        self._workers: dict[tuple[str, str], tuple[float, LoadReport]] = {}
        self.malformed = 0

    async def attach(self, nc) -> None:
        await nc.subscribe(Subjects.LOAD_ALL, cb=self._on_load)
        await nc.subscribe(Subjects.BYE_ALL, cb=self._on_bye)

    async def _on_load(self, msg) -> None:
        try:
            r = LoadReport.decode(msg.data)
        except ProtocolError:
            self.malformed += 1
            return
        if r.scope != self.scope:
            return
        self._workers[(r.role, r.worker_id)] = (time.monotonic(), r)

    async def _on_bye(self, msg) -> None:
        try:
            r = LoadReport.decode(msg.data)
        except ProtocolError:
            return
        if r.scope == self.scope:
            self._workers.pop((r.role, r.worker_id), None)

    def alive(self, role: str | None = None, model: str | None = None) -> list[LoadReport]:
        now = time.monotonic()
        out = []
        for (r_role, _), (seen, rep) in list(self._workers.items()):
            if now - seen > rep.stale_after_s:
                continue
            if (role is None or r_role == role) and (model is None or rep.model == model):
                out.append(rep)
        return out

    def is_alive(self, role: str, worker_id: str) -> bool:
        entry = self._workers.get((role, worker_id))
        return entry is not None and time.monotonic() - entry[0] <= entry[1].stale_after_s

    def pick_decode(self, model: str, inflight: Mapping[str, int] | None = None) -> LoadReport | None:
        """The decode worker with the most free room: fewest sequences, then lowest KV utilisation.

        `inflight`: requests the caller already sent each worker, which the 1 Hz load reports may
        not show yet; a worker counts as the larger of the two.
        """
        candidates = self.alive("decode", model)
        if not candidates:
            return None
        sent = inflight or {}
        return min(candidates, key=lambda r: (max(sent.get(r.worker_id, 0), r.running + r.waiting),
                                              r.kv_utilization, r.worker_id))

    def models(self) -> set[str]:
        return {r.model for r in self.alive()}
