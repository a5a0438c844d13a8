"""Which fronts still follow their requests: a worker cancels what a front that went silent asked for.

A front that dies (a crash, an OOM kill, its pod deleted) takes its clients' connections with it: nobody will
read the tokens of the requests it dispatched, yet without this the workers would decode them to their last
token, holding KV and batch rows a live client could use. Every front beats (`FrontBeat`, 1 Hz); each request
names its front (`PrefillRequest.front_id`, carried on to decode in `HandoffOffer.front_id`). A worker holding a
request whose front has not beaten for its bound publishes the request's `Cancel` (every worker drops it, as if
the front had sent it), so a restarted front leaves no orphan behind for longer than the bound plus a sweep.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from pdserve.kvtransfer.protocol import Cancel, FrontBeat, ProtocolError, Subjects

log = logging.getLogger("pdserve.frontwatch")

SWEEP_INTERVAL_S = 1.0
FORGET_AFTER_S = 600.0  # a front silent this long is forgotten (fronts come and go)


class FrontWatch:
    """The fronts of one scope, by their heartbeats. `clock` (seconds, monotonic) is injectable for tests.

    A request is evidence too: a front first heard of through a request it sent (`vouch`) counts as having beaten
    then, so a worker that started after the front's last beat does not take its requests for orphans at once.
    """

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._seen: dict[str, tuple[float, float]] = {}  # front id -> (last heard, its bound in seconds)
        self.malformed = 0

    async def attach(self, nc, scope: str) -> None:
        await nc.subscribe(Subjects.front_beats(scope), cb=self._on_beat)

    async def _on_beat(self, msg) -> None:
        try:
            beat = FrontBeat.decode(msg.data)
        except ProtocolError:
            self.malformed += 1
            return
        self._seen[beat.front_id] = (self.clock(), beat.stale_after_s)

    def vouch(self, front_id: str | None) -> None:
        """A request from `front_id` arrived: it was alive a moment ago."""
        if front_id is not None and front_id not in self._seen:
            self._seen[front_id] = (self.clock(), FrontBeat.model_fields["stale_after_s"].default)

    def silent_for(self, front_id: str | None) -> float | None:
        """Seconds since `front_id` was last heard, when that is past its bound (it is gone); else None."""
        if front_id is None or (entry := self._seen.get(front_id)) is None:
            return None
        silent = self.clock() - entry[0]
        return silent if silent > entry[1] else None

    def orphans(self, held: Iterable[tuple[str, str | None]]) -> list[tuple[str, str, float]]:
        """Of the requests held, (request id, front id), those whose front is gone: (request id, front, silent s)."""
        now = self.clock()
        for fid, (seen, _) in list(self._seen.items()):
            if now - seen > FORGET_AFTER_S:
                del self._seen[fid]
        out, done = [], set()
        for rid, fid in held:
            if rid not in done and (silent := self.silent_for(fid)) is not None:
                done.add(rid)
                out.append((rid, fid, silent))
        return out


async def cancel_orphans(nc, scope: str, watch: FrontWatch, held: Iterable[tuple[str, str | None]],
                         role: str, counter=None) -> int:
    """Publish the `Cancel` of every held request whose front is gone (every worker drops it, this one included);
    → how many. `counter`: a Prometheus counter to count them on."""
    n = 0
    for rid, fid, silent in watch.orphans(held):
        reason = f"its front {fid} went silent ({silent:.1f} s without a heartbeat)"
        log.warning("%s cancelled by %s: %s", rid, role, reason)
        await nc.publish(Subjects.cancel(scope, rid), Cancel(request_id=rid, reason=reason).encode())
        n += 1
    if n and counter is not None:
        counter.inc(n)
    return n
