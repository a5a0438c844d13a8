"""What prefill and decode workers share: identity, NATS connection, heartbeat/load reports, a compute thread.

A worker is an asyncio process: networking (NATS, the KV data port) runs on the event loop,
model forwards run on one dedicated compute thread, so heartbeats keep flowing while a long
prompt is being prefilled.

Stopping (SIGTERM or SIGINT, from the first instruction of `run`): the worker says `bye` (routers
stop sending it work), stops taking work, finishes what it holds for at most `--drain-timeout`
seconds (not at all when NATS is gone: nothing it finished could reach a client), fails what
remains with an error naming the drain timeout, closes NATS within about a second whatever the
server's state, and exits. So a worker is gone within its drain timeout plus about a second, most
of it the kernel freeing the model's memory. A signal before `run` (while the model loads) ends
the process at once: it holds nothing yet.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import nats
from prometheus_client import CollectorRegistry, Counter, start_http_server

from pdserve.config import WorkerConfig, load
from pdserve.frontwatch import SWEEP_INTERVAL_S, FrontWatch, cancel_orphans
from pdserve.introspect import register_runtime_metrics
from pdserve.kvtransfer.protocol import LoadReport, Subjects
from pdserve.natsserver import NatsCredentials, close_connection

log = logging.getLogger("pdserve.worker")

HEARTBEAT_INTERVAL_S = 1.0


def setup_logging(level: str, fmt: str = "text", role: str | None = None) -> None:
    """Logging (request ids on every line, JSON when asked: `pdserve.logs`) and, where the OpenTelemetry
    variables ask for it, tracing (`pdserve.tracing`) of a serving process of `role`."""
    from pdserve import logs, tracing

    logs.setup(level, fmt)
    if role is not None:
        tracing.configure(role)


def require_device(device: str) -> None:
    """Refuse to start on a device this machine lacks, before any model is loaded: a pool given
    GPUs must not quietly run on the CPU, and a worker that exits stays NotReady where it is seen."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available here (no GPU visible to this process, or a "
                         f"CPU-only torch build {torch.__version__}); run with --device cpu, or schedule the worker "
                         "where a GPU is")


async def heartbeat(nc: nats.NATS, subject: str, report: Callable[[], LoadReport]) -> None:
    """Publish `report()` on `subject` (`Subjects.load`) every HEARTBEAT_INTERVAL_S seconds until cancelled."""
    while True:
        try:
            await nc.publish(subject, report().encode())
        except Exception as e:  # NATS reconnecting: the next beat will go through
            log.debug("heartbeat not sent: %s", e)
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


class WorkerBase:
    role: str = "worker"
    settings: type[WorkerConfig] = WorkerConfig  # what `pdserve <role>` parses

    def __init__(self, args: WorkerConfig):
        import torch

        from pdserve.checkpoint import inspect_checkpoint, resolve_dtype
        from pdserve.modelstore import resolve_model
        from pdserve.runtime import ModelRunner

        require_device(args.device)
        torch.set_num_threads(args.threads)
        self.args = args
        self.worker_id = args.worker_id or args.pod_name or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        # A restarted worker with the same id gets a newer generation; handoffs fence on it.
        self.generation = int(time.time() * 1000)
        self.scope = args.deployment_scope
        model_dir = resolve_model(args.model)
        dtype = resolve_dtype(args.dtype, args.device, inspect_checkpoint(model_dir).dtype)
        self.runner = ModelRunner(model_dir, dtype=dtype, device=args.device, block_size=args.block_size,
                                  served_name=args.served_model_name)
        self.model_name = self.runner.name
        if str(args.device).startswith("cpu"):
            # the native kernels load (or build) now, not inside the first request, and the ready line and
            # /metrics (pdserve_engine_info) say from the start which serve
            from pdserve.kernels import cpu_attention, cpu_sampling

            cpu_attention.available()
            cpu_sampling.library()
        self.creds = NatsCredentials.from_config(args.nats, scope=self.scope)
        self.registry = CollectorRegistry()
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-compute")
        self.nc: nats.NATS | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()
        self.fronts = FrontWatch()  # which fronts still follow their requests (`pdserve.frontwatch`)
        self.m_orphans = Counter("pdserve_orphans_cancelled_total", "requests this worker cancelled because the "
                                 "front that sent them stopped beating", registry=self.registry)

    # -- helpers for subclasses ----------------------------------------------------------------

    async def compute(self, fn, *args):
        """Run `fn(*args)` on the compute thread (the one thread that touches the model), in the caller's
        context (its lines log the caller's request id)."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, contextvars.copy_context().run,
                                                                fn, *args)

    def spawn(self, coro, *, background: bool = False) -> asyncio.Task:
        """Run `coro` as a task the worker cancels when it stops. `background`: a loop that lives as long
        as the worker (a scheduler), as opposed to a task for a request, which counts as work held."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        if background:
            self._background.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._background.discard(task)
        if not task.cancelled() and task.exception():
            log.error("%s task failed", self.role, exc_info=task.exception())

    def load_report(self) -> LoadReport:
        return LoadReport(
            worker_id=self.worker_id, role=self.role, model=self.model_name,
            model_fingerprint=self.runner.layout.model_fingerprint, generation=self.generation,
            isvc=self.args.isvc, pool=self.args.pool, pod=self.args.pod_name, namespace=self.args.namespace,
            data_addr=self.data_addr(), scope=self.scope, **self.load_fields(),
        )

    def data_addr(self) -> str | None:
        return None

    def load_fields(self) -> dict:
        return {}

    def held_requests(self) -> list[tuple[str, str | None]]:
        """The requests this worker holds, (request id, the front that follows it): what `_sweep_orphans` checks."""
        return []

    # -- lifecycle -------------------------------------------------------------------------

    async def on_start(self) -> None:
        raise NotImplementedError

    async def on_stop(self) -> None:
        pass

    def busy(self) -> bool:
        """Whether the worker still holds work it accepted (subclasses add their queues): any task it
        spawned for a request that has not ended."""
        return any(not t.done() for t in self._tasks if t not in self._background)

    async def on_drain(self) -> None:
        """Stop taking new work (the registry has been told `bye`); what is held goes on."""

    async def _heartbeat(self) -> None:
        # beats until cancelled, draining included: the front follows the requests a draining worker holds
        await heartbeat(self.nc, Subjects.load(self.scope, self.role, self.worker_id), self.load_report)

    async def _sweep_orphans(self) -> None:
        """Every second: cancel the requests whose front went silent (`pdserve.frontwatch`)."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                await cancel_orphans(self.nc, self.scope, self.fronts, self.held_requests(), self.role, self.m_orphans)
            except Exception as e:  # NATS reconnecting: the next sweep will go through
                log.debug("orphan sweep: %s", e)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # first, so that a stop at any moment from here is orderly
            loop.add_signal_handler(sig, self._stop.set)
        connect = asyncio.ensure_future(self.creds.connect(name=f"pdserve-{self.role}-{self.worker_id}",
                                                           max_reconnect_attempts=-1, reconnect_time_wait=0.5))
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({connect, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not connect.done():  # told to stop before NATS answered: nothing was taken yet
            connect.cancel()
            log.info("%s %s stopped before it connected to NATS", self.role, self.worker_id)
            return
        stopped.cancel()
        self.nc = connect.result()
        await self.fronts.attach(self.nc, self.scope)
        await self.on_start()
        if self.args.metrics_port:
            register_runtime_metrics(self.registry, loop, lambda: self.nc, engine=True)
            start_http_server(self.args.metrics_port, registry=self.registry)
        hb = asyncio.create_task(self._heartbeat())
        sweep = asyncio.create_task(self._sweep_orphans())
        # What is loaded by now (the model's modules, the tokenizer, calibration) lives as long as the process:
        # frozen out of the collector's sight, a full collection in the middle of a step walks only what requests
        # allocated, not the model and the tokenizer every time (docs/PERFORMANCE.md, "Garbage collector").
        gc.collect()
        gc.freeze()
        # `pdserve up` waits for this line: this process (not an earlier one under the same id) takes work
        from pdserve.kernels.native_build import engine_info

        kernels = engine_info()
        log.info("%s %s ready: model %s (%s), NATS %s%s, kernels %s%s", self.role, self.worker_id, self.model_name,
                 self.runner.layout.model_fingerprint, self.creds.url,
                 f", data {self.data_addr()}" if self.data_addr() else "", kernels["kernels"],
                 f" {kernels['isa']}" if kernels["isa"] else "")
        await self._stop.wait()
        # with NATS gone nothing finished here could reach a client: stop at once
        await self._drain(loop.time() + (self.args.drain_timeout if self.nc.is_connected else 0.0))
        hb.cancel()
        sweep.cancel()
        await self.on_stop()
        for t in list(self._tasks):
            t.cancel()
        await close_connection(self.nc)
        self._compute.shutdown(wait=False, cancel_futures=True)
        log.info("%s %s stopped", self.role, self.worker_id)

    async def _drain(self, deadline: float) -> None:
        """Say `bye` (routers stop sending work), stop taking work, and let what is held finish until
        `deadline` (event-loop time); `on_stop` then fails whatever remains."""
        try:
            await self.nc.publish(Subjects.bye(self.scope, self.role, self.worker_id), self.load_report().encode())
            await asyncio.wait_for(self.nc.flush(), max(0.05, min(0.5, deadline - asyncio.get_running_loop().time())))
        except Exception as e:  # NATS gone: nobody is routing to us anyway
            log.info("bye not delivered: %s", e)
        await self.on_drain()
        loop = asyncio.get_running_loop()
        if self.busy():
            log.info("%s %s draining: finishing what it holds (at most %.1f s)", self.role, self.worker_id,
                     max(0.0, deadline - loop.time()))
        # Work ends on many paths (done, error, cancel, preemption, a lost transfer): a cheap check every
        # 50 ms is simpler and surer than signalling from each of them.
        while self.busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)


def run_worker(cls: type[WorkerBase], argv: list[str]) -> int:
    doc = sys.modules[cls.__module__].__doc__ or ""
    args = load(cls.settings, argv, prog=f"pdserve {cls.role}", description=doc.strip().split("\n")[0])
    setup_logging(args.log_level, args.log_format, cls.role)
    from pdserve.checkpoint import UnsupportedModel

    try:
        worker = cls(args)
    except UnsupportedModel as e:  # the checkpoint, not pdserve, is the problem: say so in one line
        log.error("%s cannot serve %s: %s", cls.role, args.model, e)
        exit_now(2)
    asyncio.run(worker.run())
    exit_now(0)


def exit_now(status: int) -> None:
    """End a serving process that has stopped in order: flush logs and output, then `os._exit`.

    Everything it held (NATS, sockets, shared memory) was released by then; the interpreter's own
    teardown would add seconds (a final garbage collection over torch's objects) to its stop bound.
    """
    from pdserve import tracing

    tracing.shutdown()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
