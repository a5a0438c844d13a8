"""Cheap self-inspection on a process's /metrics: what a leak grows.

prometheus_client's process collector gives `process_open_fds` and `process_resident_memory_bytes`; this adds
`pdserve_asyncio_tasks` (tasks alive in the serving event loop) and `pdserve_nats_subscriptions` (subscriptions
the process holds), and on the workers `pdserve_engine_info` (1, labelled with what computes: `kernels`
"prebuilt", "compiled" or "torch", `isa` the instruction set they were built for, `decoder` what the native
projections run on, "" where torch does). A soak (bench/soak.py) reads them after its faults stop: each must come back near a fresh
process's value. Collected at scrape time, from the metrics server's thread: nothing is counted on a hot path.
"""
from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily


class RuntimeCollector:
    """Gauges of `loop`'s live tasks and the subscriptions of the NATS client `nats_client()` returns (None:
    not connected yet)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, nats_client: Callable[[], object | None]):
        self.loop, self.nats_client = loop, nats_client

    def collect(self):
        tasks = GaugeMetricFamily("pdserve_asyncio_tasks", "asyncio tasks alive in the serving event loop")
        try:
            # all_tasks copies the loop's task set, retrying if the loop's thread changes it meanwhile
            tasks.add_metric([], len(asyncio.all_tasks(self.loop)))
        except RuntimeError:  # the loop is gone (the process is stopping)
            pass
        yield tasks
        subs = GaugeMetricFamily("pdserve_nats_subscriptions", "NATS subscriptions this process holds")
        nc = self.nats_client()
        # nats-py keeps its subscriptions in `_subs` (sid -> Subscription) and offers no public count
        subs.add_metric([], len(getattr(nc, "_subs", {})) if nc is not None else 0)
        yield subs


class EngineCollector:
    """`pdserve_engine_info`: which native kernels serve, read at scrape time (they load at first use)."""

    def collect(self):
        from pdserve.kernels import native_build  # torch-free

        info = native_build.engine_info()
        decoder = sys.modules.get("pdserve.kernels.cpu_decoder")  # imported by the engine where it runs
        # only a library the engine already loaded: building one here, off the engine's thread, would race it
        built = decoder is not None and getattr(decoder, "_lib", None) is not None
        g = GaugeMetricFamily("pdserve_engine_info", "what computes this worker's steps (value always 1)",
                              labels=["kernels", "isa", "decoder"])
        g.add_metric([info["kernels"], info["isa"], decoder.isa() if built else ""], 1)
        yield g


def register_runtime_metrics(registry: CollectorRegistry, loop: asyncio.AbstractEventLoop,
                             nats_client: Callable[[], object | None], *, engine: bool = False) -> None:
    """Add the process collector and `RuntimeCollector` to `registry` (and `EngineCollector`, for a worker)."""
    ProcessCollector(registry=registry)
    registry.register(RuntimeCollector(loop, nats_client))
    if engine:
        registry.register(EngineCollector())
