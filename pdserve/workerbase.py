"""What prefill and decode workers share: identity, NATS connection, heartbeat/load reports, a compute thread.

A worker is an asyncio process: networking (NATS, the KV data port) runs on the event loop,
model forwards run on one dedicated compute thread, so heartbeats keep flowing while a long
prompt is being prefilled.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import socket
import sys
import time

import nats
from prometheus_client import CollectorRegistry, start_http_server

from pdserve.kvtransfer.protocol import LoadReport, Subjects
from pdserve.config import WorkerConfig, load
from pdserve.natsserver import NatsCredentials

log = logging.getLogger("pdserve.worker")

HEARTBEAT_INTERVAL_S = 1.0


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for noisy in ("nats", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def require_device(device: str) -> None:
    """Refuse to start on a device this machine lacks, before any model is loaded: a pool given
    GPUs must not quietly run on the CPU, and a worker that exits stays NotReady where it is seen."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available here (no GPU visible to this process, or a "
                         f"CPU-only torch build {torch.__version__}); run with --device cpu, or schedule the worker "
                         "where a GPU is")


def resolve_dtype(name: str, device: str):
    """The torch dtype for a `--dtype` value; `auto`: bfloat16 on a GPU that has it (else float16),
    float32 on the CPU, where bfloat16 matmuls are slower on most processors."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class WorkerBase:
    role: str = "worker"
    settings: type[WorkerConfig] = WorkerConfig  # what `pdserve <role>` parses

    def __init__(self, args: WorkerConfig):
        import torch

        from pdserve.modelstore import resolve_model
        from pdserve.runtime import ModelRunner

        require_device(args.device)
        torch.set_num_threads(args.threads)
        self.args = args
        self.worker_id = args.worker_id or args.pod_name or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        # A restarted worker with the same id gets a newer generation; handoffs fence on it.
        self.generation = int(time.time() * 1000)
        self.scope = args.deployment_scope
        self.runner = ModelRunner(resolve_model(args.model), dtype=resolve_dtype(args.dtype, args.device),
                                  device=args.device, block_size=args.block_size, served_name=args.served_model_name)
        self.model_name = self.runner.name
        self.creds = NatsCredentials.from_config(args.nats, scope=self.scope)
        self.registry = CollectorRegistry()
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-compute")
        self.nc: nats.NATS | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    # -- helpers for subclasses ----------------------------------------------------------------

    async def compute(self, fn, *args):
        """Run `fn(*args)` on the compute thread (the one thread that touches the model)."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
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

    # -- lifecycle -------------------------------------------------------------------------

    async def on_start(self) -> None:
        raise NotImplementedError

    async def on_stop(self) -> None:
        pass

    async def _heartbeat(self) -> None:
        while not self._stop.is_set():
            try:
                await self.nc.publish(Subjects.load(self.scope, self.role, self.worker_id), self.load_report().encode())
            except Exception as e:  # NATS reconnecting: the next beat will go through
                log.debug("heartbeat not sent: %s", e)
            try:
                await asyncio.wait_for(self._stop.wait(), HEARTBEAT_INTERVAL_S)
            except asyncio.TimeoutError:
                pass

    async def run(self) -> None:
        self.nc = await self.creds.connect(name=f"pdserve-{self.role}-{self.worker_id}",
                                           max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        await self.on_start()
        if self.args.metrics_port:
            start_http_server(self.args.metrics_port, registry=self.registry)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        hb = asyncio.create_task(self._heartbeat())
        log.info("%s %s ready: model %s (%s), NATS %s%s", self.role, self.worker_id, self.model_name,
                 self.runner.layout.model_fingerprint, self.creds.url,
                 f", data {self.data_addr()}" if self.data_addr() else "")
        await self._stop.wait()
        await self.nc.publish(Subjects.bye(self.scope, self.role, self.worker_id), self.load_report().encode())
        hb.cancel()
        await self.on_stop()
        for t in list(self._tasks):
            t.cancel()
        await self.nc.drain()
        self._compute.shutdown(wait=False, cancel_futures=True)
        log.info("%s %s stopped", self.role, self.worker_id)


def run_worker(cls: type[WorkerBase], argv: list[str]) -> int:
    doc = sys.modules[cls.__module__].__doc__ or ""
    args = load(cls.settings, argv, prog=f"pdserve {cls.role}", description=doc.strip().split("\n")[0])
    setup_logging(args.log_level)
    asyncio.run(cls(args).run())
    return 0
