"""What prefill and decode workers share: identity, NATS connection, heartbeat/load reports, a compute thread.

A worker is an asyncio process: networking (NATS, the KV data port) runs on the event loop,
model forwards run on one dedicated compute thread, so heartbeats keep flowing while a long
prompt is being prefilled.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import signal
import socket
import time

import nats
from prometheus_client import CollectorRegistry, start_http_server

from pdserve.kvtransfer.protocol import LoadReport, Subjects
from pdserve.natsserver import NatsCredentials

log = logging.getLogger("pdserve.worker")

HEARTBEAT_INTERVAL_S = 1.0


def deployment_scope() -> str:
    """Which deployment this process belongs to: $PDSERVE_SCOPE, else the InferenceService
    ("namespace.name", from the pod's env), else "default". Requests never cross scopes."""
    if os.environ.get("PDSERVE_SCOPE"):
        return os.environ["PDSERVE_SCOPE"]
    if os.environ.get("PDSERVE_ISVC"):
        return f"{os.environ.get('POD_NAMESPACE', 'default')}.{os.environ['PDSERVE_ISVC']}"
    return "default"


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="checkpoint folder, or 'default' (SmolLM2-135M-Instruct)")
    env = os.environ.get
    # Defaults from the environment the operator sets on pods (PDSERVE_*), flags win.
    p.add_argument("--served-model-name", default=env("PDSERVE_MODEL_NAME"),
                   help="name clients use (default: $PDSERVE_MODEL_NAME, else the folder's name)")
    p.add_argument("--nats-url", default=None, help="default: $PDSERVE_NATS_URL; credentials from $PDSERVE_NATS_USER/_PASSWORD")
    p.add_argument("--worker-id", default=None, help="default: $POD_NAME or host-pid")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=env("PDSERVE_KV_DTYPE", "float32"), choices=["float32", "bfloat16", "float16"],
                   help="model and KV dtype (default: $PDSERVE_KV_DTYPE or float32)")
    p.add_argument("--block-size", type=int, default=int(env("PDSERVE_KV_BLOCK_SIZE", "16")),
                   help="KV tokens per block (default: $PDSERVE_KV_BLOCK_SIZE or 16)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0 = off)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the compute thread")
    p.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for noisy in ("nats", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class WorkerBase:
    role: str = "worker"

    def __init__(self, args: argparse.Namespace):
        import torch

        from pdserve.modelstore import resolve_model
        from pdserve.runtime import ModelRunner

        torch.set_num_threads(args.threads)
        self.args = args
        self.worker_id = args.worker_id or os.environ.get("POD_NAME") or f"{self.role}-{socket.gethostname()}-{os.getpid()}"
        # A restarted worker with the same id gets a newer generation; handoffs fence on it.
        self.generation = int(time.time() * 1000)
        self.scope = deployment_scope()
        from pdserve.engine.checkpoint import inspect_checkpoint, resolve_dtype

        model_dir = resolve_model(args.model)
        dtype = resolve_dtype(args.dtype, args.device, inspect_checkpoint(model_dir).dtype)
        self.runner = ModelRunner(model_dir, dtype=dtype, device=args.device,
                                  block_size=args.block_size, served_name=args.served_model_name)
        self.model_name = self.runner.name
        self.creds = NatsCredentials.from_env(args.nats_url)
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
            isvc=os.environ.get("PDSERVE_ISVC"), pool=os.environ.get("PDSERVE_POOL"),
            pod=os.environ.get("POD_NAME"), namespace=os.environ.get("POD_NAMESPACE"),
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
                await self.nc.publish(Subjects.load(self.role, self.worker_id), self.load_report().encode())
            except Exception as e:  # NATS reconnecting: the next beat will go through
                log.debug("heartbeat not sent: %s", e)
            try:
                await asyncio.wait_for(self._stop.wait(), HEARTBEAT_INTERVAL_S)
            except asyncio.TimeoutError:
                pass

    async def run(self) -> None:
        self.nc = await nats.connect(
            **self.creds.connect_kwargs(), name=f"pdserve-{self.role}-{self.worker_id}",
            max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        )
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
        await self.nc.publish(Subjects.bye(self.role, self.worker_id), self.load_report().encode())
        hb.cancel()
        await self.on_stop()
        for t in list(self._tasks):
            t.cancel()
        await self.nc.drain()
        self._compute.shutdown(wait=False, cancel_futures=True)
        log.info("%s %s stopped", self.role, self.worker_id)


def run_worker(cls, argv: list[str], extra_args=None) -> int:
    p = argparse.ArgumentParser(prog=f"pdserve {cls.role}")
    add_common_args(p)
    if extra_args:
        extra_args(p)
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    from pdserve.engine.checkpoint import UnsupportedModel

    try:
        worker = cls(args)
    except UnsupportedModel as e:  # the checkpoint, not pdserve, is the problem: say so in one line
        log.error("%s cannot serve %s: %s", cls.role, args.model, e)
        return 2
    asyncio.run(worker.run())
    return 0
