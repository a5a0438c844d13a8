"""`pdserve up`: the whole system as local processes — embedded NATS, prefill, decode, HTTP front.

The same worker and front commands that run in Kubernetes pods run here as child processes,
wired through an authenticated nats-server on a free loopback port. Ctrl-C stops everything.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.natsserver import EmbeddedNats, NatsCredentials, free_port


class LocalCluster:
    """NATS + N prefill + M decode workers + one front, as child processes of this one."""

    def __init__(self, model: str = "default", prefill_workers: int = 1, decode_workers: int = 1,
                 port: int | None = None, nats: NatsCredentials | None = None, log_dir: str | None = None,
                 worker_args: dict[str, list[str]] | None = None, env: dict[str, str] | None = None):
        self.model = model
        self.n_prefill, self.n_decode = prefill_workers, decode_workers
        self.port = port or free_port()
        self._own_nats = nats is None
        self.nats_server: EmbeddedNats | None = None
        self.creds = nats
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.worker_args = worker_args or {}
        self.extra_env = env or {}
        self.procs: dict[str, subprocess.Popen] = {}
        # its own deployment scope, so clusters sharing a NATS server never serve each other's requests
        self.scope = f"local-{secrets.token_hex(4)}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.creds.env(), "PDSERVE_SCOPE": self.scope, **self.extra_env}
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], env=self._env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start(self, timeout: float = 240.0) -> "LocalCluster":
        from pdserve.modelstore import resolve_model

        model_dir = str(resolve_model(self.model))  # convert once here, not in every child
        if self._own_nats:
            self.nats_server = EmbeddedNats().start()
            self.creds = self.nats_server.creds
        for i in range(self.n_prefill):
            self.spawn(f"prefill-{i}", "prefill", "--model", model_dir, "--worker-id", f"prefill-{i}",
                       *self.worker_args.get("prefill", []))
        for i in range(self.n_decode):
            self.spawn(f"decode-{i}", "decode", "--model", model_dir, "--worker-id", f"decode-{i}",
                       *self.worker_args.get("decode", []))
        self.spawn("front", "front", "--model", model_dir, "--port", str(self.port), *self.worker_args.get("front", []))
        self.wait_ready(timeout)
        return self

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout: float, prefill: int | None = None, decode: int | None = None) -> None:
        want_p = self.n_prefill if prefill is None else prefill
        want_d = self.n_decode if decode is None else decode
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; log: {self.log_dir / (name + '.log')}\n"
                                       + self.tail(name))
            try:
                h = self.health()
                if h["prefill_workers"] >= want_p and h["decode_workers"] >= want_d:
                    return
            except (urllib.error.URLError, OSError, KeyError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"cluster not ready within {timeout:.0f} s; logs in {self.log_dir}")

    def tail(self, name: str, n: int = 30) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Start a stopped worker again with the arguments it had (a new generation of the same id)."""
        old = self.procs[name]
        if old.poll() is None:
            self.kill(name)
        self.spawn(name, *old.args[3:])
        self.wait_ready(timeout)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        if p.poll() is None:
            os.killpg(p.pid, sig)
            p.wait(10)

    def stop(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self.nats_server:
            self.nats_server.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _demo(url: str, model: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    print(f"\ndemo: POST {url}/v1/chat/completions  \"What is the capital of France?\"")
    print(f"demo: -> {out['choices'][0]['message']['content']!r}  ({time.monotonic() - t0:.2f} s, usage {out['usage']})\n")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve up")
    p.add_argument("--model", default="default", help="checkpoint folder, or 'default'")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--demo", action="store_true", help="send one chat completion once up, and print it")
    p.add_argument("--spec-method", default="ngram", choices=["none", "ngram"], help="decode-side speculation")
    args = p.parse_args(argv)
    cluster = LocalCluster(args.model, args.prefill_workers, args.decode_workers, port=args.port,
                           worker_args={"decode": ["--spec-method", args.spec_method]})
    print(f"pdserve up: starting (logs in {cluster.log_dir}) ...", flush=True)
    try:
        cluster.start()
        model = json.loads(urllib.request.urlopen(cluster.url + "/v1/models").read())["data"][0]["id"]
        print(f"pdserve up: NATS   {cluster.creds.url} (user/password auth, credentials in the children's env)")
        for name, proc in cluster.procs.items():
            print(f"pdserve up: {name:<10} pid {proc.pid:<7} log {cluster.log_dir / (name + '.log')}")
        print(f"pdserve up: OpenAI API at {cluster.url}/v1  (model {model!r}); Ctrl-C stops everything", flush=True)
        if args.demo:
            _demo(cluster.url, model)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        print("pdserve up: stopping ...", flush=True)
        cluster.stop()
    return 0
