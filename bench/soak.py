"""Chaos soak: mixed load on a local deployment (2 prefill + 2 decode workers, ngram speculation) while a
seeded fault driver kills, stops and freezes workers, restarts NATS and corrupts, truncates, delays and cuts
KV transfers; every request is checked against its invariants, and leaks are read off the processes after.

    python -P bench/soak.py --minutes 10 [--seed N] [--kinds sigkill,sigterm,sigstop] [--json out.json]

Invariants (each a counted violation; the run fails on any):
- a 200 is whole and right: a greedy request's tokens equal the reference, a seeded one equals its replay
  (references: each distinct request answered once, fault-free, before the faults start); a stream ends
  with `[DONE]`, its text neither duplicated nor reordered;
- a failure is clean: an OpenAI-style JSON error (502/503/504), or one SSE `error` event that ends the
  stream; every request ends within REQUEST_BOUND_S; nothing hangs and nothing is lost;
- no failure at all where migration covers the fault: a request whose life met only worker kills, stops and
  freezes (MIGRATED_KINDS) moves to other workers and gets its whole answer; the failures are reported by the
  faults they met, and the moves with where their KV came from and the wait they added (p50, p99);
- after the faults stop, full capacity (every worker registered, a round of requests all answered right)
  is back within CAPACITY_BOUND_S;
- nothing leaks: KV bytes in use back to 0 on every decode worker, no shared-memory segment of ours left
  once the cluster stops, and each process's open fds, asyncio tasks and NATS subscriptions back within a
  slack of a fresh process's (RSS within RSS_GROWTH of it).

Faults reach the KV data path through `FaultProxy`: each decode worker advertises a proxy's port
(`--advertise-port`) instead of its data port, and prefill-0 sends over TCP only (prefill-1 keeps shared
memory, so both paths carry load).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

HOST = "127.0.0.1"
REQUEST_BOUND_S = 180.0  # every request is answered or failed within this: the front's token bounds, and slack
CAPACITY_BOUND_S = 90.0  # faults stopped → every worker back and a round of requests answered right
HEARTBEAT_BOUND_S = 3.0  # LoadReport.stale_after_s: a worker unheard this long is dead to the front
LEAK_SLACK = {"process_open_fds": 12, "pdserve_asyncio_tasks": 6, "pdserve_nats_subscriptions": 2}
# gauges that are 0 on an idle worker: KV held, sequences, transfers, queued prompts
IDLE_GAUGES = ("pdserve_decode_kv_utilization", "pdserve_decode_running_sequences", "pdserve_decode_waiting_sequences",
               "pdserve_transfer_backlog_handoffs", "pdserve_prefill_queue_depth", "pdserve_prefill_kv_utilization")
RSS_GROWTH = 1.5  # a process's resident memory at the end, at most this × a fresh one's
KV_DELAY_S = 1.5  # a delayed transfer stalls this long (below the transfer timeout: it must still succeed)
FAULT_KINDS = ("sigkill", "sigterm", "nats_restart", "sigstop", "kv_corrupt", "kv_truncate", "kv_delay", "kv_cut")
# What migration covers: a request a worker held when it died, stopped or froze moves to others
# (`FrontConfig.migration_limit`), so a failure of a request that met only these faults is a violation.
MIGRATED_KINDS = ("sigkill", "sigterm", "sigstop")
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")

PROMPTS = {
    "colours": "The three primary colours are",
    "press": "The printing press spread literacy across Europe because",
    "count": "Count from one to twenty: one, two, three,",
    "recipe": "A simple recipe for bread needs flour, water,",
    # a long one: several prefill chunks, a KV transfer of megabytes
    "long": "Summarise the following inventory.\n" + "".join(
        f"Item {i}: a crate of {i * 7 % 23 + 1} brass fittings, stored on shelf {i % 9}, checked on day {i % 28 + 1}.\n"
        for i in range(24)),
}
CONVERSATIONS = {
    "travel": ["I am planning a trip to Lisbon.", "What should I pack?", "And which neighbourhood should I stay in?"],
    "garden": ["I want to grow tomatoes on a balcony.", "How often do I water them?", "What about fertiliser?"],
}


# ------------------------------------------------------------------------------------------------ requests

@dataclass(frozen=True)
class Job:
    """One distinct request of the catalogue: its key names it; a conversation turn carries its messages."""

    key: str
    path: str
    body: dict


def catalogue(model: str) -> list[Job]:
    """The distinct completion requests (greedy and seeded) the load draws from; conversations come later,
    their turns built on the reference answers."""
    jobs = []
    for name, prompt in PROMPTS.items():
        n = 6 if name == "long" else 16
        jobs.append(Job(f"greedy:{name}", "/v1/completions",
                        {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True}))
    for name in ("colours", "press", "recipe"):
        for seed in (1, 2):
            jobs.append(Job(f"seeded:{name}:{seed}", "/v1/completions",
                            {"model": model, "prompt": PROMPTS[name], "max_tokens": 16, "temperature": 0.8,
                             "top_p": 0.95, "seed": seed, "return_token_ids": True}))
    return jobs


def chat_job(model: str, conv: str, turn: int, replies: list[str]) -> Job:
    """Turn `turn` of conversation `conv`: every earlier turn with its reference reply, then this question
    (so the turns share their prefixes, as a client's conversation does)."""
    messages = []
    for i in range(turn):
        messages += [{"role": "user", "content": CONVERSATIONS[conv][i]}, {"role": "assistant", "content": replies[i]}]
    messages.append({"role": "user", "content": CONVERSATIONS[conv][turn]})
    return Job(f"chat:{conv}:{turn}", "/v1/chat/completions",
               {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, "return_token_ids": True})


@dataclass
class Answer:
    """What one request got: `outcome` correct | failed_clean | wrong | lost, and why when not correct."""

    outcome: str
    why: str = ""
    text: str = ""
    token_ids: list[int] | None = None
    seconds: float = 0.0
    ended_at: float = field(default_factory=time.monotonic)  # when the answer was read (monotonic)


def _error_ok(err) -> bool:
    return isinstance(err, dict) and isinstance(err.get("error"), dict) and bool(err["error"].get("message")) \
        and bool(err["error"].get("type"))


def call(url: str, job: Job, stream: bool) -> Answer:
    """Send `job` (streamed or not) and classify the answer's shape; correctness against the reference is
    `check`'s. Never raises: a hang past REQUEST_BOUND_S, a reset or a malformed answer is `lost`."""
    body = {**job.body, "stream": stream}
    req = urllib.request.Request(url + job.path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_BOUND_S) as r:
            if not stream:
                out = json.loads(r.read())
                choice = out["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                if choice.get("finish_reason") not in ("stop", "length"):
                    return Answer("lost", f"200 without a finish_reason: {out}", seconds=time.monotonic() - t0)
                return Answer("correct", text=text, token_ids=choice["token_ids"], seconds=time.monotonic() - t0)
            return _read_stream(r, t0)
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read())
        except ValueError:
            err = None
        if e.code in (502, 503, 504) and _error_ok(err):
            return Answer("failed_clean", f"{e.code} {err['error'].get('code')}", seconds=time.monotonic() - t0)
        return Answer("wrong", f"HTTP {e.code}: {err}", seconds=time.monotonic() - t0)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:  # timeout, reset, truncated body
        return Answer("lost", f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)


def _read_stream(r, t0: float) -> Answer:
    text, ids, done, finished = [], [], False, False
    for raw in r:
        line = raw.decode().strip()
        if not line:
            continue
        if not line.startswith("data: "):
            return Answer("lost", f"not an SSE data line: {line[:200]}", seconds=time.monotonic() - t0)
        if done:
            return Answer("lost", "data after [DONE]", seconds=time.monotonic() - t0)
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        ev = json.loads(data)
        if "error" in ev:
            rest = [x for x in r if x.strip()]
            if not _error_ok(ev) or rest:
                return Answer("lost", f"malformed or non-final error event: {ev} then {rest[:2]}",
                              seconds=time.monotonic() - t0)
            return Answer("failed_clean", f"stream error {ev['error'].get('code')}", seconds=time.monotonic() - t0)
        if finished:
            return Answer("lost", "a token after the finish_reason", seconds=time.monotonic() - t0)
        choice = ev["choices"][0]
        text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
        ids += choice.get("token_ids") or []
        finished = choice.get("finish_reason") is not None
    if not done or not finished:
        return Answer("lost", f"stream ended without {'a finish_reason' if done else '[DONE]'} (truncated)",
                      seconds=time.monotonic() - t0)
    return Answer("correct", text="".join(text), token_ids=ids or None, seconds=time.monotonic() - t0)


def check(answer: Answer, ref: Answer) -> Answer:
    """A 200 against the reference: token ids where both carry them, else the text (a stream's text is the
    concatenation of its deltas: a duplicated or reordered token changes it)."""
    if answer.outcome != "correct":
        return answer
    if answer.seconds > REQUEST_BOUND_S:
        return Answer("lost", f"answered after {answer.seconds:.0f} s, past the bound")
    if answer.token_ids is not None and ref.token_ids is not None:
        if answer.token_ids != ref.token_ids:
            return Answer("wrong", f"tokens {answer.token_ids} != reference {ref.token_ids}")
    elif answer.text != ref.text:
        return Answer("wrong", f"text {answer.text!r} != reference {ref.text!r}")
    return answer


# ------------------------------------------------------------------------------------------ the KV proxy

class FaultProxy:
    """A TCP proxy on the KV data path (prefill → decode's data port). `arm(kind)` makes the next upstream
    bytes suffer one fault: `kv_corrupt` flips a byte, `kv_truncate` forwards part of a read and closes,
    `kv_cut` resets both connections, `kv_delay` holds the bytes KV_DELAY_S. The fault lands a random
    0–256 KiB into the armed stretch, so headers and payload both get hit."""

    def __init__(self, target_port: int, rng: random.Random):
        self.target_port, self.rng = target_port, rng
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._armed: tuple[str, int] | None = None  # (kind, bytes still to pass before it fires)
        self.fired = threading.Event()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def arm(self, kind: str) -> None:
        with self._lock:
            self.fired.clear()
            self._armed = (kind, self.rng.randrange(0, 256 << 10))

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((HOST, self.target_port), timeout=5)
                server.settimeout(None)
            except OSError:  # decode is down: prefill sees the refusal as a closed connection
                client.close()
                continue
            for src, dst, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up), daemon=True).start()

    def _take(self, n: int) -> tuple[str, int] | None:
        """The fault to apply within the next `n` upstream bytes, and at which offset (None: pass them)."""
        with self._lock:
            if self._armed is None:
                return None
            kind, left = self._armed
            if left >= n and kind != "kv_delay":
                self._armed = (kind, left - n)
                return None
            self._armed = None
            self.fired.set()
            return kind, min(left, n - 1)

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                fault = self._take(len(data)) if upstream else None
                if fault:
                    kind, at = fault
                    if kind == "kv_corrupt":
                        data = bytearray(data)
                        data[at] ^= 0x5A
                    elif kind == "kv_delay":
                        time.sleep(KV_DELAY_S)
                    elif kind == "kv_truncate":
                        dst.sendall(data[:at])
                        break
                    elif kind == "kv_cut":
                        for s in (src, dst):
                            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                        break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass


# ------------------------------------------------------------------------------------------ the soak

@dataclass
class Tally:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)
    recovery_s: dict[str, list[float]] = field(default_factory=dict)
    windows: list[tuple[str, float, float]] = field(default_factory=list)  # (fault kind, injected, recovered)
    failed: list[tuple[str, float, float, str]] = field(default_factory=list)  # (job, sent, ended, why)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, job: Job, stream: bool, answer: Answer) -> None:
        with self.lock:
            self.sent += 1
            self.outcomes[answer.outcome] += 1
            if answer.outcome in ("wrong", "lost"):
                self.violations.append(f"{job.key} stream={stream}: {answer.outcome}: {answer.why}")
            elif answer.outcome == "failed_clean":
                self.failed.append((f"{job.key} stream={stream}", answer.ended_at - answer.seconds, answer.ended_at,
                                    answer.why))

    def failures_by_fault(self) -> dict[str, int]:
        """Each cleanly failed request, by the faults whose windows (injection to recovery) its life overlapped:
        "sigkill", "kv_cut+sigkill", … ("none": no fault's). One whose faults are all MIGRATED_KINDS is a violation:
        migration should have hidden it."""
        out: Counter = Counter()
        for name, start, end, why in self.failed:
            kinds = sorted({k for k, t0, t1 in self.windows if t0 <= end and start <= t1})
            out["+".join(kinds) or "none"] += 1
            if kinds and all(k in MIGRATED_KINDS for k in kinds):
                self.violations.append(f"{name}: failed ({why}) though it met only {'+'.join(kinds)}, which "
                                       "migration covers")
        return dict(out)


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Soak:
    """The cluster, its proxies, the load and the fault driver of one run."""

    def __init__(self, model: str, seed: int, concurrency: int, gap_s: tuple[float, float], log=print,
                 kinds: tuple[str, ...] = FAULT_KINDS):
        from pdserve.local import LocalCluster
        from pdserve.natsserver import free_port

        self.rng = random.Random(seed)
        self.seed, self.concurrency, self.gap_s, self.log = seed, concurrency, gap_s, log
        unknown = set(kinds) - set(FAULT_KINDS)
        if unknown or not kinds:
            raise ValueError(f"fault kinds {sorted(unknown) or '(none)'}: choose from {', '.join(FAULT_KINDS)}")
        self.kinds = tuple(kinds)
        self.metrics_ports = {w: free_port() for w in WORKERS}
        data_ports = {w: free_port() for w in WORKERS if w.startswith("decode")}
        self.proxies = {w: FaultProxy(p, random.Random(seed + i)) for i, (w, p) in enumerate(data_ports.items())}
        args = {w: ["--metrics-port", str(self.metrics_ports[w])] for w in WORKERS}
        for w, p in data_ports.items():
            args[w] += ["--data-port", str(p), "--advertise-port", str(self.proxies[w].port)]
        args["prefill-0"] += ["--kv-transports", "tcp"]
        args["decode"] = ["--spec-method", "ngram"]
        # the token bounds inside REQUEST_BOUND_S, wide enough for a busy 2-core machine
        args["front"] = ["--dispatch-timeout", "5", "--first-token-timeout", "120", "--token-timeout", "60"]
        # float32: a greedy answer must equal its reference whatever batch it shared a step with, and at
        # bfloat16 (dtype auto, on a CPU with native bf16) a step of other rows rounds differently
        self.cluster = LocalCluster(model, 2, 2, worker_args=args, drain_timeout=5.0,
                                    env={"PDSERVE_DTYPE": os.environ.get("PDSERVE_DTYPE") or "float32"})
        self.tally = Tally()
        self.refs: dict[str, Answer] = {}
        self.jobs: list[Job] = []
        self.conversations: dict[str, list[Job]] = {}
        self.baseline: dict[str, dict[str, float]] = {}
        self._stop_load = threading.Event()
        self.pids: set[int] = set()  # every worker process of the run, restarted ones included
        self.shm_before: set[str] = set()

    # -- phases ----------------------------------------------------------------------------------------

    def start(self) -> float:
        from pdserve.kvtransfer.shm import SHM_DIR

        self.shm_before = set(os.listdir(SHM_DIR))
        t0 = time.monotonic()
        self.cluster.start()
        with urllib.request.urlopen(self.cluster.url + "/v1/models", timeout=10) as r:
            self.model = json.loads(r.read())["data"][0]["id"]
        return time.monotonic() - t0

    def references(self) -> None:
        """Each distinct request once, fault-free: the answers every later one must equal."""
        self.jobs = catalogue(self.model)
        for job in self.jobs:
            self.refs[job.key] = self._reference(job)
        for conv in CONVERSATIONS:
            replies: list[str] = []
            turns = []
            for turn in range(len(CONVERSATIONS[conv])):
                job = chat_job(self.model, conv, turn, replies)
                self.refs[job.key] = self._reference(job)
                replies.append(self.refs[job.key].text)
                turns.append(job)
            self.conversations[conv] = turns
        for w in WORKERS:
            self.baseline[w] = _metrics(self.metrics_ports[w])

    def _reference(self, job: Job) -> Answer:
        a = call(self.cluster.url, job, stream=False)
        if a.outcome != "correct":
            raise RuntimeError(f"reference request {job.key} failed on a fault-free cluster: {a.why}")
        return a

    def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while not self._stop_load.is_set():
            if rng.random() < 0.25:
                turns = self.conversations[rng.choice(sorted(self.conversations))]
            else:
                turns = [rng.choice(self.jobs)]
            for job in turns:
                stream = rng.random() < 0.5
                self.tally.record(job, stream, check(call(self.cluster.url, job, stream), self.refs[job.key]))
                if self._stop_load.is_set():
                    break

    def inject(self, kind: str) -> float:
        """Inject one fault of `kind` and wait for the deployment to have recovered from it → seconds from
        injection (a KV fault: the transfer it hit) to recovery (every worker registered and ready again)."""
        c = self.cluster
        t0 = time.monotonic()
        if kind in ("sigkill", "sigterm"):
            name = self.rng.choice(WORKERS)
            self.pids.add(c.procs[name].pid)
            rc = c.kill(name, signal.SIGKILL if kind == "sigkill" else signal.SIGTERM, timeout=c.drain_timeout + 15)
            if kind == "sigterm" and rc != 0:
                self.tally.violations.append(f"{name} exited {rc} after SIGTERM (a drain ends with 0)")
            c.restart(name)
            what = name
        elif kind == "nats_restart":
            c.nats_server.restart()
            c.wait_ready(120)
            what = "nats"
        elif kind == "sigstop":
            name = self.rng.choice(WORKERS)
            role = name.split("-")[0]
            c.send_signal(name, signal.SIGSTOP)
            try:  # past the heartbeat bound: the front has given it up
                _wait(lambda: c.health()[f"{role}_workers"] < 2, f"the front to give up frozen {name}",
                      HEARTBEAT_BOUND_S + 15)
            finally:
                c.send_signal(name, signal.SIGCONT)
            c.wait_ready(60)
            what = name
        else:
            name = self.rng.choice(sorted(self.proxies))
            proxy = self.proxies[name]
            proxy.arm(kind)
            if not proxy.fired.wait(60):
                proxy.disarm()
                self.log(f"soak: {kind} on {name}'s data path did not fire within 60 s (no TCP transfer to it)")
                return float("nan")
            t0 = time.monotonic()  # from the transfer it hit, not from the wait for one
            c.wait_ready(60)
            what = name
        took = time.monotonic() - t0
        self.tally.windows.append((kind, t0, time.monotonic()))
        self.tally.faults[kind] += 1
        self.tally.recovery_s.setdefault(kind, []).append(took)
        self.log(f"soak: {kind:<13} {what:<10} recovered in {took:5.1f} s")
        return took

    def run(self, seconds: float) -> dict:
        """Load and faults for `seconds` (every fault kind at least once, however short), then the checks
        after: capacity back, nothing leaked. → the report."""
        clients = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.concurrency)]
        for t in clients:
            t.start()
        t0 = time.monotonic()
        kinds = list(self.kinds)
        self.rng.shuffle(kinds)
        while kinds or time.monotonic() - t0 < seconds:
            # the gap between faults: a random moment, from the fault's recovery
            self._stop_load.wait(self.rng.uniform(*self.gap_s))
            self.inject(kinds.pop() if kinds else self.rng.choice(self.kinds))
        faults_end = time.monotonic()
        load_s = faults_end - t0
        capacity_s = self.capacity(faults_end)
        self._stop_load.set()
        for t in clients:
            t.join(REQUEST_BOUND_S + 10)
            if t.is_alive():
                self.tally.violations.append("a client thread is still waiting on its request past the bound")
        moved = self.moves()  # before `leaks`, which stops the deployment
        leaks = self.leaks()
        return {**self.report(load_s, capacity_s, leaks), "moved": moved}

    def moves(self) -> dict:
        """What the front's metrics say of the requests it moved off a worker that died or stopped holding them
        (each a failure the client did not see: `FrontConfig.migration_limit`): how many, by that worker's role;
        the tokens whose KV they needed, by where it came from; and the wait each added for its client (last token
        before the move to first after), p50 and p99 interpolated in the histogram's buckets as Prometheus'
        histogram_quantile does."""
        text = urllib.request.urlopen(self.cluster.url + "/metrics", timeout=5).read().decode()

        def label(line: str, name: str) -> str:
            return line.split(f'{name}="')[1].split('"')[0]
        by_role, kv, buckets = {}, {}, []
        for line in text.splitlines():
            value = float(line.split()[-1]) if line and not line.startswith("#") else 0.0
            if line.startswith("pdserve_request_moves_total{"):
                by_role[label(line, "role")] = int(value)
            elif line.startswith("pdserve_request_move_kv_tokens_total{"):
                kv[label(line, "source")] = int(value)
            elif line.startswith("pdserve_request_move_stall_seconds_bucket{"):
                buckets.append((float(label(line, "le")), value))
        return {"by_role": by_role, "kv_tokens": kv, "stalls": int(buckets[-1][1]) if buckets else 0,
                "stall_p50_s": histogram_quantile(0.5, buckets), "stall_p99_s": histogram_quantile(0.99, buckets)}

    def capacity(self, since: float) -> float:
        """Seconds from the last fault until every worker is registered and a round of one request per
        worker pair, sent together, is answered right."""
        deadline = since + CAPACITY_BOUND_S
        while time.monotonic() < deadline:
            self.cluster.wait_ready(max(1.0, deadline - time.monotonic()))
            jobs = [self.rng.choice(self.jobs) for _ in range(4)]
            answers: list[Answer] = [None] * len(jobs)  # type: ignore[list-item]

            def one(i: int) -> None:
                answers[i] = check(call(self.cluster.url, jobs[i], False), self.refs[jobs[i].key])
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if all(a.outcome == "correct" for a in answers):
                return time.monotonic() - since
            bad = [a for a in answers if a.outcome in ("wrong", "lost")]
            if bad:
                self.tally.violations.append(f"after the faults: {bad[0].outcome}: {bad[0].why}")
        self.tally.violations.append(f"full capacity not back within {CAPACITY_BOUND_S:.0f} s of the last fault")
        return float("nan")

    def leaks(self) -> dict:
        """Once idle: KV in use 0 on decode, and every worker's fds, tasks and subscriptions within slack of a
        fresh process's; after the cluster stops, no shared-memory segment of its workers left."""
        from pdserve.kvtransfer.shm import POOL_PREFIX, SHM_DIR, SHM_PREFIX

        found: dict = {}

        def settled() -> bool:
            found.clear()
            for w in WORKERS:
                now = _metrics(self.metrics_ports[w])
                base = self.baseline[w]
                for name, slack in LEAK_SLACK.items():
                    if now.get(name, 0) > base.get(name, 0) + slack:
                        found[f"{w} {name}"] = (base.get(name), now.get(name))
                if now.get("process_resident_memory_bytes", 0) > RSS_GROWTH * base["process_resident_memory_bytes"]:
                    found[f"{w} rss"] = (base["process_resident_memory_bytes"], now["process_resident_memory_bytes"])
                for busy in IDLE_GAUGES:
                    if now.get(busy, 0):
                        found[f"{w} {busy}"] = (0, now[busy])
            return not found

        try:  # kept idle connections close after their idle timeout; requests end within the bound
            _wait(settled, "every worker to settle back to its fresh state", REQUEST_BOUND_S)
        except TimeoutError:
            self.tally.violations += [f"leak: {k} fresh {v[0]} → now {v[1]}" for k, v in found.items()]
        self.pids |= {p.pid for p in self.cluster.procs.values()}
        self.stop()
        # pool segments of any incarnation of our workers, and transfer segments (named by token) new since start
        ours = [f for f in os.listdir(SHM_DIR) if f.startswith(POOL_PREFIX) and int(f.split("-")[2]) in self.pids
                or f.startswith(SHM_PREFIX) and not f.startswith(POOL_PREFIX) and f not in self.shm_before]
        if ours:
            self.tally.violations.append(f"leak: shared-memory segments left after the stop: {ours[:5]}")
        return {"unsettled": {k: list(v) for k, v in found.items()}, "shm_left": ours}

    def stop(self) -> None:
        for p in self.proxies.values():
            p.close()
        if self.cluster.children():
            self.cluster.stop()

    def report(self, load_s: float, capacity_s: float, leaks: dict) -> dict:
        t = self.tally
        rec = {k: {"n": len(v), "mean_s": sum(v) / len(v), "max_s": max(v)} for k, v in t.recovery_s.items()}
        return {"seed": self.seed, "load_seconds": round(load_s, 1), "requests_sent": t.sent,
                "correct": t.outcomes["correct"], "failed_cleanly": t.outcomes["failed_clean"],
                "wrong": t.outcomes["wrong"], "lost": t.outcomes["lost"], "faults": dict(t.faults),
                "faults_total": sum(t.faults.values()), "recovery_seconds": rec,
                "failed_by_fault": t.failures_by_fault(),
                "capacity_back_seconds": capacity_s, "capacity_bound_seconds": CAPACITY_BOUND_S,
                "request_bound_seconds": REQUEST_BOUND_S, "leaks": leaks, "violations": t.violations}


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The `q` quantile of a Prometheus histogram's cumulative (le, count) buckets, linear within a bucket; the
    highest finite bound when it falls in +Inf; nan when it is empty."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank = q * buckets[-1][1]
    lo_le, lo_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return lo_le
            return lo_le + (le - lo_le) * (rank - lo_n) / (n - lo_n) if n > lo_n else le
        lo_le, lo_n = le, n
    return lo_le


def _wait(fn, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def soak(minutes: float, seed: int = 0, model: str = "default", concurrency: int = 3,
         gap_s: tuple[float, float] = (1.0, 6.0), log=print, kinds: tuple[str, ...] = FAULT_KINDS) -> dict:
    """Start the deployment, take the references, soak for `minutes` (at least one fault of each of `kinds`),
    check, stop → the report (see `Soak.report`); `report["violations"]` empty when every invariant held."""
    s = Soak(model, seed, concurrency, gap_s, log, kinds)
    try:
        started = s.start()
        log(f"soak: cluster up in {started:.1f} s (logs in {s.cluster.log_dir}); taking references ...")
        s.references()
        log(f"soak: {len(s.refs)} references; load ({concurrency} clients) and faults for {minutes:g} min ...")
        report = s.run(minutes * 60)
        report["cluster_start_seconds"] = round(started, 1)
        report["logs"] = str(s.cluster.log_dir)
        return report
    finally:
        s.stop()


def print_report(r: dict) -> None:
    print(f"\nsoak (seed {r['seed']}): {r['load_seconds']} s of load and faults")
    print(f"  requests sent {r['requests_sent']}: correct {r['correct']}, failed cleanly {r['failed_cleanly']}, "
          f"wrong {r['wrong']}, lost {r['lost']}")
    m = r.get("moved") or {}
    print("  moved off a dead or stopped worker (the client saw nothing): " + (", ".join(
        f"{role} {n}" for role, n in sorted(m.get("by_role", {}).items())) or "none"))
    if m.get("stalls"):
        print("    their KV, tokens by source: " + ", ".join(f"{k} {v}" for k, v in sorted(m["kv_tokens"].items()))
              + f"; the wait a move added: p50 {m['stall_p50_s']:.2f} s, p99 {m['stall_p99_s']:.2f} s "
              f"({m['stalls']} moves, from the front's histogram buckets)")
    print("  failed cleanly, by the faults they met: " + (", ".join(
        f"{k} {v}" for k, v in sorted(r["failed_by_fault"].items())) or "none")
          + f" (those meeting only {', '.join(MIGRATED_KINDS)} are violations: migration covers them)")
    print(f"  faults injected {r['faults_total']}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items())))
    print("  recovery (injection → all workers ready), seconds:")
    for k, v in sorted(r["recovery_seconds"].items()):
        print(f"    {k:<13} n={v['n']:<3} mean {v['mean_s']:5.1f}  max {v['max_s']:5.1f}")
    print(f"  full capacity back {r['capacity_back_seconds']:.1f} s after the last fault "
          f"(bound {r['capacity_bound_seconds']:.0f} s)")
    print(f"  leaks: {r['leaks']}")
    print(f"  violations: {len(r['violations'])}")
    for v in r["violations"][:20]:
        print(f"    {v}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of load and faults")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault driver and the load")
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", type=int, default=3, help="client threads")
    p.add_argument("--kinds", default=",".join(FAULT_KINDS),
                   help="the fault kinds to inject, comma-separated (default: all); e.g. "
                        f"{','.join(MIGRATED_KINDS)} for the ones migration covers")
    p.add_argument("--gap", type=float, nargs=2, default=(1.0, 6.0), metavar=("MIN", "MAX"),
                   help="seconds between one fault's recovery and the next fault, drawn uniformly")
    p.add_argument("--json", help="also write the report here")
    a = p.parse_args(argv)
    r = soak(a.minutes, a.seed, a.model, a.concurrency, tuple(a.gap), kinds=tuple(k for k in a.kinds.split(",") if k))
    print_report(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 1 if r["violations"] or r["lost"] or r["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
