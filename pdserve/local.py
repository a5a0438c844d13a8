"""`pdserve up`: the whole system as local processes — embedded NATS, prefill, decode, HTTP front.

The same worker and front commands that run in Kubernetes pods run here as child processes,
wired through an authenticated nats-server on a free loopback port.

What `up` promises:
- It prints the API address only once the front answers /ready with the workers registered; a
  child that exits during start (a model it refuses, a busy port) stops everything, and `up` exits
  non-zero with that child's reason on its own output.
- Ctrl-C, SIGTERM or SIGHUP stop every child within the workers' drain bound. No child outlives
  `up` however it ends (see pdserve.children: the kernel's parent-death signal, and a sweep of a
  dead supervisor's children at the next start).
- A child that dies later is reported at once and `up` stops the rest and exits non-zero. It does
  not restart children: a crash here is a bug or a resource limit that a restart would repeat or
  hide, the user is at the terminal to see it, and restarts with back-off are what Kubernetes does
  for the same processes in pods.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from pydantic import ValidationError

from pdserve.basetypes import TOOL_CALL_FORMATS
from pdserve.children import STOP_SIGNALS, ChildRecord, die_with_parent, signals_held, sweep
from pdserve.config import DTYPES, DecodeConfig, FrontConfig, KVSendConfig, PrefillConfig, S, option, to_args
from pdserve.natsserver import EmbeddedNats, NatsCredentials, free_port

HOST = "127.0.0.1"
# -P: the working directory never goes on sys.path, where a checkout's top-level operator/ folder
# would shadow the standard library's `operator`.
CHILD_PYTHON = (sys.executable, "-P", "-m", "pdserve.cli")
# Past the workers' drain timeout, the seconds a stopping child gets to close NATS and exit before SIGKILL.
STOP_GRACE_S = 1.0
# The drain timeout `up` gives its workers: with STOP_GRACE_S, every child is gone 2 s after a stop.
UP_DRAIN_TIMEOUT_S = 1.0


class ChildExited(RuntimeError):
    """A child process ended while the cluster needed it; `reason` is the gist of its log."""

    def __init__(self, name: str, returncode: int, reason: str, log_path: Path, tail: str):
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"
        super().__init__(f"{name} {how}: {reason}")
        self.name, self.returncode, self.reason, self.log_path, self.tail = name, returncode, reason, log_path, tail


class PortBusy(RuntimeError):
    """The front's port is taken by another program."""


def check_port_free(host: str, port: int) -> None:
    """Raise PortBusy if nothing of ours could listen on host:port (bound the way the front binds it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortBusy(f"port {port} on {host} is already in use by another program; "
                               f"stop it or choose another port with --port") from None
            raise


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Refused)\b.*")


def log_reason(text: str) -> str:
    """The gist of why a process ended, from its log: the last exception line (`Type: message`) or,
    failing that, the last line (argparse's `error: ...`, a message printed before exiting)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line
    return lines[-1] if lines else "(its log is empty)"


class LocalCluster:
    """NATS + N prefill + M decode workers + one front, as child processes of this one.

    `worker_args` maps a role ("prefill", "decode", "front") or one worker's name ("decode-1") to extra flags
    of its command line; a worker's own come after its role's, so they win.

    Children get the parent-death signal when started from the main thread, and are listed in a
    state file that the next cluster's start sweeps if this process vanishes without stopping them.
    """

    def __init__(self, model: str = "default", prefill_workers: int = 1, decode_workers: int = 1,
                 port: int | None = None, nats: NatsCredentials | None = None, log_dir: str | None = None,
                 worker_args: dict[str, list[str]] | None = None, env: dict[str, str] | None = None,
                 drain_timeout: float = UP_DRAIN_TIMEOUT_S, cpu_lease: bool = True):
        self.model = model
        self.n_prefill, self.n_decode = prefill_workers, decode_workers
        self.port = port or free_port()
        self._own_nats = nats is None
        self.nats_server: EmbeddedNats | None = None
        self.creds = nats
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.worker_args = worker_args or {}
        self.extra_env = env or {}
        self.drain_timeout = drain_timeout
        self.cpu_lease = cpu_lease
        self.procs: dict[str, subprocess.Popen] = {}
        self._log_start: dict[str, int] = {}  # child -> its log's size when it was (re)started
        self.record = ChildRecord()
        self.swept: list[str] = []  # children of an earlier, vanished supervisor that start() killed
        # its own deployment scope, so clusters sharing a NATS server never serve each other's requests
        self.scope = f"local-{secrets.token_hex(4)}"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.creds.env(), "PDSERVE_SCOPE": self.scope, **self.extra_env}
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.cpu_lease:  # a borrowed thread sleeps at once when its step ends, rather than spin on decode's core
            env.setdefault("GOMP_SPINCOUNT", "1000")
        return env

    def _lease(self, i: int) -> str | None:
        """The CPU lease file of prefill-i and decode-i (`pdserve.cpulease`): workers on one machine share
        its cores, and with one request at a time the idle decode worker's thread speeds up the prompt."""
        if not self.cpu_lease or i >= min(self.n_prefill, self.n_decode):
            return None
        return str(self.log_dir / f"cpu-lease-{i}")

    def _device(self) -> str:
        """The workers' torch device type, as their flags say (`--device`, last one wins; cpu by default)."""
        device = "cpu"
        for role in ("prefill", "decode"):
            args = self.worker_args.get(role, [])
            for j, a in enumerate(args):
                if a == "--device" and j + 1 < len(args):
                    device = args[j + 1]
                elif a.startswith("--device="):
                    device = a.split("=", 1)[1]
        return device.split(":")[0]

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        """Start `pdserve <args>` as child `name`, its output in <log_dir>/<name>.log."""
        log = open(self.log_dir / f"{name}.log", "ab")
        self._log_start[name] = log.tell()
        try:
            with signals_held():
                proc = subprocess.Popen([*CHILD_PYTHON, *args], env=self._env(), stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=die_with_parent())
                self.procs[name] = proc
                self.record.add(name, proc.pid)
        finally:
            log.close()  # the child holds its own copy
        return proc

    def start(self, timeout: float = 240.0) -> "LocalCluster":
        """Start every child and wait until the front is ready with all workers registered.

        Raises PortBusy, ChildExited (a child ended during start; the others are stopped) or TimeoutError.
        """
        from pdserve.modelstore import resolve_model

        check_port_free(HOST, self.port)
        self.swept = sweep()
        try:
            model_dir = str(resolve_model(self.model))  # convert once here, not in every child
            if self._own_nats:
                self.nats_server = EmbeddedNats()
                self.nats_server.start()
                self.record.add("nats", self.nats_server.proc.pid)
                self.creds = self.nats_server.creds
            # each child's flags rendered from its own settings model, as the operator renders a pod's
            for i in range(self.n_prefill):
                # A pair sharing CPU cores hands KV off after the forward: receiving a layer-streamed handoff
                # competes with the step for those cores, and decode's accepting it first stalls the step on
                # decode's busy loop (docs/PERFORMANCE.md, "KV handoff on shared cores"). Explicit flags still win.
                shared = self._lease(i) is not None and self._device() == "cpu"
                cfg = PrefillConfig(model=model_dir, worker_id=f"prefill-{i}", drain_timeout=self.drain_timeout,
                                    cpu_lease=self._lease(i), kv=KVSendConfig(stream_layers=not shared))
                self.spawn(f"prefill-{i}", "prefill", *to_args(cfg), *self.worker_args.get("prefill", []),
                           *self.worker_args.get(f"prefill-{i}", []))
            for i in range(self.n_decode):
                cfg = DecodeConfig(model=model_dir, worker_id=f"decode-{i}", drain_timeout=self.drain_timeout,
                                   cpu_lease=self._lease(i))
                self.spawn(f"decode-{i}", "decode", *to_args(cfg), *self.worker_args.get("decode", []),
                           *self.worker_args.get(f"decode-{i}", []))
            cfg = FrontConfig(model=model_dir, port=self.port, drain_timeout=self.drain_timeout)
            self.spawn("front", "front", *to_args(cfg), *self.worker_args.get("front", []))
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
            return json.loads(r.read())

    def _ready(self, want_prefill: int, want_decode: int) -> bool:
        for name in self.procs:
            # A restarted worker's id may still be registered from its previous process for a few seconds:
            # its own "ready" line says this process has subscribed and beats.
            if name != "front" and f"{name} ready: " not in self._log_since_start(name):
                return False
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=2):
                pass  # 200: NATS connected, at least one worker of each role registered
            h = self.health()
            return h["prefill_workers"] >= want_prefill and h["decode_workers"] >= want_decode
        except (urllib.error.URLError, OSError, KeyError, ValueError):  # not listening yet, or 503
            return False

    def wait_ready(self, timeout: float, prefill: int | None = None, decode: int | None = None) -> None:
        """Wait until the front answers /ready with at least `prefill`/`decode` workers (default: all).
        Raises ChildExited as soon as any child has ended, TimeoutError past `timeout` seconds."""
        want_p = self.n_prefill if prefill is None else prefill
        want_d = self.n_decode if decode is None else decode
        deadline = time.monotonic() + timeout
        while True:
            self.check_children()
            if self._ready(want_p, want_d):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ready within {timeout:.0f} s; logs in {self.log_dir}")
            time.sleep(0.1)

    def children(self) -> dict[str, subprocess.Popen]:
        """Every child process, NATS included when this cluster started it."""
        out = dict(self.procs)
        if self.nats_server and self.nats_server.proc:
            out["nats"] = self.nats_server.proc
        return out

    def check_children(self) -> None:
        """Raise ChildExited for the first child that has ended."""
        for name, p in self.children().items():
            if p.poll() is not None:
                raise self.exited(name, p.returncode)

    def exited(self, name: str, returncode: int) -> ChildExited:
        path = self.nats_server.log_path if name == "nats" else self.log_dir / f"{name}.log"
        try:
            text = path.read_text(errors="replace")
        except OSError:
            text = ""
        reason = log_reason(text)
        if name == "front" and "address already in use" in reason:
            reason = f"port {self.port} on {HOST} is already in use ({reason})"
        return ChildExited(name, returncode, reason, path, "\n".join(text.splitlines()[-30:]))

    def wait_for_exit(self) -> tuple[str, int]:
        """Block until any child ends → (its name, its exit status). A signal whose handler raises
        interrupts the wait."""
        while True:
            for name, p in self.children().items():
                if p.poll() is not None:
                    return name, p.returncode
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # leaves it for Popen to reap
            except ChildProcessError:
                raise RuntimeError("no child processes left to watch") from None
            if info and info.si_pid not in {p.pid for p in self.children().values()}:
                os.waitpid(info.si_pid, 0)  # not ours (nothing else should start children here): reap it

    def _log_since_start(self, name: str) -> str:
        try:
            with open(self.log_dir / f"{name}.log", "rb") as f:
                f.seek(self._log_start.get(name, 0))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, name: str, n: int = 30) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def restart(self, *names: str, timeout: float = 120.0, extra_args: tuple[str, ...] = ()) -> None:
        """Start stopped workers again with the arguments each had, then `extra_args` (which win over
        the same flags before them): a new generation of the same id."""
        for name in names:
            old = self.procs[name]
            if old.poll() is None:
                self.kill(name)
            self.spawn(name, *old.args[len(CHILD_PYTHON):], *extra_args)
        self.wait_ready(timeout)

    def send_signal(self, name: str, sig: int) -> None:
        """Send `sig` to child `name` (and anything it started), without waiting."""
        try:
            os.killpg(self.procs[name].pid, sig)
        except ProcessLookupError:
            pass

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout: float = 10.0) -> int:
        """Send `sig` to child `name` and wait (at most `timeout` s) for it to end → its exit status."""
        p = self.procs[name]
        if p.poll() is None:
            self.send_signal(name, sig)
        rc = p.wait(timeout)
        self.record.remove(name)
        return rc

    def stop(self) -> list[str]:
        """Stop every child: SIGTERM (workers drain, bounded by their drain timeout), SIGKILL for any
        still there STOP_GRACE_S later, NATS last. Returns the names of the children that had to be killed."""
        killed = []
        for name, p in self.procs.items():
            if p.poll() is None:
                self.send_signal(name, signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout + STOP_GRACE_S
        for name, p in self.procs.items():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.send_signal(name, signal.SIGKILL)
                p.wait()
                killed.append(name)
        if self.nats_server:
            self.nats_server.close()
        self.record.close()
        return killed

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


class Interrupted(BaseException):
    """A stop signal arrived (raised from its handler, so that any wait ends at once)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def _note_only(signum, frame):
    pass  # already stopping: a second Ctrl-C must not cut the stop short (it is bounded anyway)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description="NATS, prefill, decode and the OpenAI front as "
                                "local processes; Ctrl-C stops them all")
    p.add_argument("--model", default="default", help="checkpoint folder, or 'default'")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--port", type=int, default=8000, help="the OpenAI API's port on 127.0.0.1")
    p.add_argument("--demo", action="store_true", help="send one chat completion once up, and print it")
    # the workers' own settings, passed to them as their flags (see `worker_args`)
    w = p.add_argument_group("worker options (passed to prefill and decode)")
    w.add_argument("--dtype", default=None, choices=DTYPES, help="model and KV element type (default: auto)")
    w.add_argument("--device", default=None, help="torch device: cpu, cuda or cuda:N (default: cpu)")
    w.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: 1)")
    w.add_argument("--spec-method", default="ngram", choices=("none", "ngram"), help="decode-side speculation")
    w.add_argument("--spec-max-k", type=int, default=None, help="most draft tokens verified per decode step")
    w.add_argument("--defer-queue-tokens", type=int, default=None,
                   help="prefill hands a prompt queued behind this many prompt tokens to decode uncomputed, "
                        "if decode's own queue of such prompts is shorter (0: never; default: 256 on GPUs, 512 on "
                        "CPUs running the native decoder, else 0)")
    w.add_argument("--local-prefill-chunk", type=int, default=None,
                   help="most tokens of such a prompt per decode step beside running sequences (0: decode takes "
                        "none; default: 256 on the native CPU decoder, else 64)")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_FORMATS,
                   help="tool-call format of chat answers (default: the one the model's chat template implies)")
    w.add_argument("--cpu-lease", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill-i borrows decode-i's threads for prompt steps while decode-i is idle "
                        "(pdserve.cpulease; default: on)")
    return p


def _settings(cls: type[S], **values) -> S:
    """`cls` from `values`; ValueError naming each bad value by its flag."""
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        def named(err) -> str:
            path = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            return f"{option(cls, path).flag}: {msg}" if path else msg
        raise ValueError("; ".join(named(err) for err in e.errors())) from None


def worker_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """`pdserve up`'s options → each child command's flags, rendered from that command's settings
    model (so a bad value is refused here, before anything starts: ValueError naming its flag)."""
    def given(**values) -> dict:  # the options given, the rest left to each command's defaults
        return {k: v for k, v in values.items() if v is not None}

    both = given(dtype=args.dtype, device=args.device, threads=args.threads)
    spec = {"method": args.spec_method, **given(max_k=args.spec_max_k)}
    prefill = given(defer_queue_tokens=args.defer_queue_tokens)
    decode = given(local_prefill_chunk=args.local_prefill_chunk)
    return {"prefill": to_args(_settings(PrefillConfig, **both, **prefill)),
            "decode": to_args(_settings(DecodeConfig, **both, **decode, spec=spec)),
            # the front sizes its routing's KV estimates by the workers' element type
            "front": to_args(_settings(FrontConfig, **given(kv_dtype=args.dtype,
                                                            tool_call_parser=getattr(args, "tool_call_parser", None))))}


def main(argv: list[str]) -> int:
    # first: from here on a stop signal stops what has been started (one ignored by whoever started us,
    # as a shell does with SIGINT for background jobs and nohup with SIGHUP, stays ignored)
    for s in STOP_SIGNALS:
        if signal.getsignal(s) != signal.SIG_IGN:
            signal.signal(s, _raise_interrupted)
    cluster = None
    try:
        parser = _parser()
        args = parser.parse_args(argv)
        try:
            children_args = worker_args(args)
        except ValueError as e:
            parser.error(str(e))
        cluster = LocalCluster(args.model, args.prefill_workers, args.decode_workers, port=args.port,
                               worker_args=children_args, cpu_lease=args.cpu_lease)
        print(f"pdserve up: starting (logs in {cluster.log_dir}) ...", flush=True)
        cluster.start()
        return _serve(cluster, args)
    except Interrupted as e:
        print(f"pdserve up: {e} during start", flush=True)
        return 128 + e.signum
    except ChildExited as e:
        print(f"pdserve up: {e}\n--- last lines of {e.log_path} ---\n{e.tail}\n---", file=sys.stderr, flush=True)
        return 1
    except (PortBusy, TimeoutError, FileNotFoundError) as e:
        print(f"pdserve up: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for s in STOP_SIGNALS:
            if signal.getsignal(s) != signal.SIG_IGN:
                signal.signal(s, _note_only)
        if cluster is not None and cluster.children():
            print("pdserve up: stopping ...", flush=True)
            killed = cluster.stop()
            if killed:
                print(f"pdserve up: {', '.join(killed)} did not stop in time and were killed", file=sys.stderr)


def _serve(cluster: LocalCluster, args: argparse.Namespace) -> int:
    """Report the running cluster, run the demo if asked, then watch the children until a stop or a death."""
    if cluster.swept:
        print(f"pdserve up: killed {', '.join(cluster.swept)}, left running by an earlier pdserve up", flush=True)
    with urllib.request.urlopen(cluster.url + "/v1/models", timeout=5) as r:
        model = json.loads(r.read())["data"][0]["id"]
    print(f"pdserve up: NATS   {cluster.creds.url} (user/password auth, credentials in the children's env)")
    for name, proc in cluster.procs.items():
        print(f"pdserve up: {name:<10} pid {proc.pid:<7} log {cluster.log_dir / (name + '.log')}")
    print(f"pdserve up: OpenAI API at {cluster.url}/v1  (model {model!r}); Ctrl-C stops everything", flush=True)
    try:
        if args.demo:
            _demo(cluster.url, model)
        name, rc = cluster.wait_for_exit()
    except Interrupted:
        return 0
    except (urllib.error.URLError, OSError) as e:  # the demo failed: say why, with whatever child died
        try:
            cluster.check_children()
        except ChildExited as died:
            e = died
        print(f"pdserve up: the demo request failed: {e}", file=sys.stderr, flush=True)
        return 1
    died = cluster.exited(name, rc)
    print(f"pdserve up: {died}; stopping everything (no restarts: see {died.log_path})", file=sys.stderr, flush=True)
    return 1
