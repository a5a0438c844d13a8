"""`pdserve up`, the README's first command, as a user runs it, against real processes.

It prints the API address only when a request would be served; whatever ends it (SIGTERM, SIGINT,
SIGKILL, at any moment) leaves no process it started and no port held; a child that fails, at start
or later, ends it with a non-zero status and that child's reason. Each run marks its processes with
an environment variable (children inherit it), so the test finds every process a run started, even
one that `up` itself lost track of.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.children import ChildRecord, start_time, sweep
from pdserve.config import DecodeConfig, FrontConfig, PrefillConfig, load
from pdserve.local import ChildExited, LocalCluster, PortBusy, _parser, log_reason, worker_args
from pdserve.natsserver import free_port
from servinghelpers import post, wait_for

MODEL = "SmolLM2-135M-Instruct"
TAG = "PDSERVE_TEST_RUN"
STOP_BOUND_S = 5.0  # the bound: everything gone this long after the signal
LOAD_BOUND_S = 240.0  # start-up on a busy 2-core machine: model load in three processes at once


def _alive(pid: int) -> bool:
    return start_time(pid) is not None  # None: gone, or a zombie awaiting its parent's wait()


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries this run's tag."""
    needle = f"{TAG}={tag}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and _alive(int(d)):
                    out.append(int(d))
        except OSError:
            continue
    return out


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Up:
    """A `pdserve up` child process whose output is read line by line as it comes."""

    def __init__(self, *args: str, tag: str):
        self.tag = tag
        # Started as a terminal's foreground job is, with SIGINT at its default: a test run that was
        # itself started in the background (CI under `cmd &`, nohup) inherits SIGINT ignored, and
        # `up` rightly leaves an ignored Ctrl-C ignored, as a shell's background job does.
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "pdserve.cli", "up", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, TAG: tag},
                                     preexec_fn=_sigint_default)
        self.lines: queue.Queue = queue.Queue()
        self.seen_lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.seen_lines.append(line)
            self.lines.put(line)
        self.lines.put(None)

    @property
    def output(self) -> str:
        return "".join(self.seen_lines)

    def wait_line(self, pattern: str, timeout: float) -> re.Match:
        """The first line (from here on) matching `pattern`; fails if `up` ends or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s:\n{self.output}")
            if line is None:
                raise AssertionError(f"pdserve up ended ({self.proc.wait()}) before {pattern!r}:\n{self.output}")
            if m := re.search(pattern, line):
                return m

    def finish(self, timeout: float) -> int:
        """Wait for `up` to exit and its output to be read in full → its exit status."""
        rc = self.proc.wait(timeout)
        while self.lines.get(timeout=timeout) is not None:
            pass
        return rc


@pytest.fixture
def tag():
    """A fresh run tag; anything still carrying it afterwards is killed (a failing test leaves nothing)."""
    t = uuid.uuid4().hex
    yield t
    for pid in tagged(t):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_all_gone(tag: str, since: float, ports: list[int], output: str, seen: set[int] = frozenset()) -> None:
    """Within STOP_BOUND_S of `since`, no process of the run is left and its ports are free.

    A process is followed by pid once seen (`seen`, and each scan's): while it exits, the kernel frees
    its memory before its sockets, and its environment (the tag) is unreadable from then on.
    """
    pids = set(seen)

    def gone() -> bool:
        pids.update(tagged(tag))
        return not [p for p in pids if _alive(p)] and all(port_free(p) for p in ports)

    remaining = STOP_BOUND_S - (time.monotonic() - since)
    try:
        wait_for(gone, "every process of the run to end and its ports to be free", max(remaining, 0.1),
                 interval=0.05)
    except AssertionError as e:
        ss = subprocess.run(["ss", "-tanp"], capture_output=True, text=True).stdout
        held = "\n".join(line for line in ss.splitlines() if any(f":{p} " in line for p in ports))
        raise AssertionError(f"{e}\nalive: {[p for p in pids if _alive(p)]}\nsockets:\n{held}\n{output}") from None


def test_busy_port_ends_up_at_once_naming_the_port(tag):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        up = Up("--port", str(port), tag=tag)
        rc = up.finish(60)
    assert rc != 0
    assert f"port {port} on 127.0.0.1 is already in use" in up.output, up.output
    assert "OpenAI API at" not in up.output
    assert not tagged(tag)


@pytest.mark.model
@pytest.mark.slow
def test_front_that_cannot_bind_is_reported_with_its_port(model_dir, monkeypatch):
    """The port taken between `up`'s own check and the front's bind: the front's error, named."""
    monkeypatch.setattr("pdserve.local.check_port_free", lambda host, port: None)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        cluster = LocalCluster(str(model_dir), prefill_workers=0, decode_workers=0, port=other.getsockname()[1])
        with pytest.raises(ChildExited) as e:
            cluster.start(timeout=LOAD_BOUND_S)
    assert e.value.name == "front" and f"port {cluster.port} on 127.0.0.1 is already in use" in str(e.value)
    assert all(p.poll() is not None for p in cluster.children().values())


def test_log_reason_finds_the_exception_or_the_last_words():
    trace = "Traceback (most recent call last):\n  File \"x\", line 1\nOSError: [Errno 98] address already in use\n"
    assert log_reason(trace) == "OSError: [Errno 98] address already in use"
    assert log_reason("usage: pdserve decode ...\npdserve decode: error: argument --dtype: invalid choice\n\n") \
        == "pdserve decode: error: argument --dtype: invalid choice"
    assert log_reason("") == "(its log is empty)"


def test_up_hands_the_workers_options_to_each_child_as_its_own_settings():
    flags = worker_args(_parser().parse_args(["--dtype", "bfloat16", "--threads", "2", "--spec-max-k", "4"]))
    prefill = load(PrefillConfig, flags["prefill"], environ={})
    decode = load(DecodeConfig, flags["decode"], environ={})
    assert (prefill.dtype, prefill.threads) == (decode.dtype, decode.threads) == ("bfloat16", 2)
    assert (decode.spec.method, decode.spec.max_k) == ("ngram", 4)
    assert load(FrontConfig, flags["front"], environ={}).kv_dtype == "bfloat16"  # its routing's KV estimate
    assert load(FrontConfig, worker_args(_parser().parse_args([]))["front"], environ={}).kv_dtype == "auto"
    flags = worker_args(_parser().parse_args(["--tool-call-parser", "mistral"]))
    assert load(FrontConfig, flags["front"], environ={}).tool_call_parser == "mistral"  # the front parses calls
    assert load(FrontConfig, worker_args(_parser().parse_args([]))["front"], environ={}).tool_call_parser is None
    with pytest.raises(ValueError, match="--threads: .*greater than or equal to 1"):
        worker_args(_parser().parse_args(["--threads", "0"]))
    with pytest.raises(ValueError, match="--spec-max-k"):
        worker_args(_parser().parse_args(["--spec-max-k", "999"]))
    flags = worker_args(_parser().parse_args(["--defer-queue-tokens", "0", "--local-prefill-chunk", "32"]))
    assert load(PrefillConfig, flags["prefill"], environ={}).defer_queue_tokens == 0
    assert load(DecodeConfig, flags["decode"], environ={}).local_prefill_chunk == 32
    assert load(PrefillConfig, worker_args(_parser().parse_args([]))["prefill"], environ={}).defer_queue_tokens is None
    with pytest.raises(ValueError, match="--local-prefill-chunk: .*greater than or equal to 0"):
        worker_args(_parser().parse_args(["--local-prefill-chunk", "-1"]))


def test_sweep_kills_only_the_children_of_a_vanished_supervisor(tmp_path):
    """The state file's sweep: a dead owner's live child is killed; a live owner's child, and a process
    that merely reuses a recorded pid (another start time), are left alone."""
    orphan = subprocess.Popen(["sleep", "300"])
    kept = subprocess.Popen(["sleep", "300"])
    try:
        dead_owner = subprocess.Popen(["true"])
        dead_owner.wait()
        (tmp_path / f"owner-{dead_owner.pid}.json").write_text(json.dumps({
            "owner": [dead_owner.pid, 12345],
            "children": {"decode-0": [orphan.pid, start_time(orphan.pid)],
                         "front": [kept.pid, start_time(kept.pid) + 1]},  # same pid, another process
        }))
        live = ChildRecord(tmp_path)  # this test process as a live owner
        live.add("prefill-0", kept.pid)
        killed = sweep(tmp_path)
        assert killed == [f"decode-0 (pid {orphan.pid})"]
        assert orphan.wait(10) == -signal.SIGKILL
        assert kept.poll() is None
        assert [p.name for p in tmp_path.iterdir()] == [live.path.name]
        live.close()
        assert not list(tmp_path.iterdir())
    finally:
        for p in (orphan, kept):
            p.kill()
            p.wait()


def _first_request(url: str) -> None:
    status, out = post(url + "/v1/completions", {"model": MODEL, "prompt": "The capital of France is",
                                                 "max_tokens": 4, "temperature": 0}, timeout=120)
    assert status == 200, out
    assert out["choices"][0]["text"]


@pytest.mark.model
@pytest.mark.slow
def test_pdserve_up_demo_answers_and_ctrl_c_stops_everything(model_dir, tag):
    port = free_port()
    up = Up("--demo", "--port", str(port), tag=tag)
    url = up.wait_line(r"OpenAI API at (http://127\.0\.0\.1:\d+)/v1", LOAD_BOUND_S).group(1)
    _first_request(url)  # sent the moment the address is printed
    up.wait_line(r"^demo: ->", 120)
    out = up.output
    assert "Paris" in out, out
    assert url == f"http://127.0.0.1:{port}"
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    nats_port = int(re.search(r"NATS +nats://127\.0\.0\.1:(\d+)", out).group(1))
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    assert "password" not in out.lower().replace("user/password auth", "")  # no secret printed
    seen = set(tagged(tag))
    t0 = time.monotonic()
    up.proc.send_signal(signal.SIGINT)
    assert up.finish(60) == 0, up.output
    assert "stopping" in up.output
    assert_all_gone(tag, t0, [port, nats_port], up.output, seen)


def _loading(up: Up) -> None:
    """Every child started (NATS, prefill, decode, front: four processes besides `up`), the workers
    still loading the model: the window the issue's "3 s" meant, observed rather than timed."""
    wait_for(lambda: len(tagged(up.tag)) >= 5, "up to start its four children", LOAD_BOUND_S, interval=0.05)
    assert "OpenAI API at" not in up.output, "the workers loaded before the test could act: not the loading window"


MOMENTS = {
    # 0.5 s after exec: importing, sweeping, or starting children (before or after the handlers exist)
    "at-0.5s": lambda up: time.sleep(0.5),
    "while-loading": _loading,
    "after-ready": None,  # handled in the test: the first request must succeed first
}


@pytest.mark.model
@pytest.mark.slow
# Ctrl-C once serving is test_pdserve_up_demo_answers_and_ctrl_c_stops_everything's case.
@pytest.mark.parametrize("sig,moment", [
    pytest.param(sig, moment, id=f"{moment}-{sig.name}")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL) for moment in MOMENTS
    if (sig, moment) != (signal.SIGINT, "after-ready")])
def test_a_stop_signal_at_any_moment_leaves_no_process_and_no_port(model_dir, tag, sig, moment):
    port = free_port()
    up = Up("--port", str(port), tag=tag)
    ports = [port]
    if moment == "after-ready":
        url = up.wait_line(r"OpenAI API at (http://\S+)/v1", LOAD_BOUND_S).group(1)
        _first_request(url)
        ports.append(int(re.search(r"NATS +nats://127\.0\.0\.1:(\d+)", up.output).group(1)))
    else:
        MOMENTS[moment](up)
    seen = set(tagged(tag))
    t0 = time.monotonic()
    up.proc.send_signal(sig)
    rc = up.finish(STOP_BOUND_S)
    assert_all_gone(tag, t0, ports, up.output, seen)
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL
    elif moment == "after-ready":
        assert rc == 0, up.output


@pytest.mark.model
@pytest.mark.slow
def test_a_model_the_workers_refuse_ends_up_nonzero_with_the_reason(model_dir, tmp_path, tag):
    """A checkpoint whose weights file is not safetensors: the front starts (it needs only the config and
    tokenizer), the workers refuse it; `up` must say so and end, never print an address."""
    bad = tmp_path / "broken-checkpoint"
    bad.mkdir()
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".jinja") and not f.name.startswith("pdserve-"):
            shutil.copy(f, bad / f.name)
    (bad / "model.safetensors").write_bytes(b"\xff" * 4096)
    up = Up("--model", str(bad), "--port", str(free_port()), tag=tag)
    rc = up.finish(LOAD_BOUND_S + 5)
    assert rc != 0
    assert re.search(r"(prefill|decode)-0 exited with status 1: .*Error while deserializing header", up.output), \
        up.output
    assert "OpenAI API at" not in up.output
    assert_all_gone(tag, time.monotonic(), [], up.output)


@pytest.mark.model
@pytest.mark.slow
def test_a_child_that_dies_later_ends_up_at_once_with_its_name(model_dir, tag):
    port = free_port()
    up = Up("--port", str(port), tag=tag)
    up.wait_line(r"OpenAI API at", LOAD_BOUND_S)
    decode_pid = int(re.search(r"decode-0 +pid (\d+)", up.output).group(1))
    seen = set(tagged(tag))
    t0 = time.monotonic()
    os.kill(decode_pid, signal.SIGKILL)
    rc = up.finish(STOP_BOUND_S)
    assert rc == 1
    assert "decode-0 was killed by signal 9" in up.output, up.output
    assert_all_gone(tag, t0, [port], up.output, seen)


@pytest.mark.model
@pytest.mark.slow
def test_models_is_not_listed_before_the_front_is_ready(nats_server, model_dir):
    """A client that lists the models and then asks must be served: /v1/models answers 503 until the
    front is ready (workers registered), never 200 before /ready does."""
    import urllib.error
    import urllib.request

    cluster = LocalCluster(str(model_dir), nats=nats_server.creds)

    def status(path: str) -> int | None:
        try:
            with urllib.request.urlopen(cluster.url + path, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None  # not listening yet

    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(cluster.start, LOAD_BOUND_S)
        try:
            answers = []
            while not answers or answers[-1][0] != 200:
                assert not started.done() or started.exception() is None, started.exception()
                models = status("/v1/models")
                if models is not None:
                    answers.append((models, status("/ready")))
                time.sleep(0.05)  # a polling interval: each answer is checked, none is waited for
            assert (503, 503) in answers, f"never saw the front before it was ready: {answers}"
            assert answers[-1] == (200, 200), answers
        finally:
            started.result()
            cluster.stop()
