"""Child processes that cannot outlive the process that started them, and a sweep for any that did.

Two mechanisms, because neither covers every way a parent ends:
- `die_with_parent()` has the kernel kill a child when its parent dies (PR_SET_PDEATHSIG), however
  the parent dies: a signal before its handlers exist, SIGKILL, an OOM kill, a crash. It is set
  between fork and exec, and the child exits at once if the parent is already gone by then.
- `ChildRecord` writes each child's pid and start time into a state file; `sweep()` at the next
  start kills the children of owners that are gone. It covers what the death signal cannot: a
  child started from a thread other than the main one (the death signal follows the thread that
  forked, not the process), and children of a parent that the kernel could not signal for.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import threading
from pathlib import Path

log = logging.getLogger("pdserve.children")

_PR_SET_PDEATHSIG = 1
# The signals a supervisor turns into an orderly stop; held back while it forks and records a child.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def die_with_parent(sig: int = signal.SIGKILL):
    """A `subprocess.Popen(preexec_fn=...)` that makes the child get `sig` when this process dies.

    Only from the main thread: the kernel signals the child when the thread that forked it exits,
    and any other thread may exit long before the process (the state file's sweep covers those).
    SIGKILL by default: once the supervisor is gone nothing can be served (the HTTP front is one of
    its children), so there is nothing left to drain and nothing may keep a child alive.
    The child also starts with no signals blocked, whatever the supervisor held back while forking.
    """
    if threading.current_thread() is not threading.main_thread():
        return _unblock_signals
    parent = os.getpid()
    # resolved before the fork: the child between fork and exec must not load libraries or take locks
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def preexec() -> None:
        _unblock_signals()
        if prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the parent died before the death signal was armed
            os._exit(1)

    return preexec


def _unblock_signals() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


@contextlib.contextmanager
def signals_held():
    """Hold back the stop signals (delivered on exit) while a child is forked and recorded, so a stop
    can never interrupt between the two and leave a child the supervisor does not know about."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if it is gone.

    A pid alone may be reused by an unrelated process; the pair (pid, start time) names one process.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces and parentheses
    if fields[0] == "Z":  # a zombie has ended; only its parent's wait() is missing
        return None
    return int(fields[19])


def run_dir() -> Path:
    """Where supervisors keep their children's state files: <cache>/run."""
    from pdserve.modelstore import cache_dir

    return cache_dir() / "run"


class ChildRecord:
    """The state file of one supervisor: its own identity and each child's (name, pid, start time)."""

    def __init__(self, directory: Path | None = None):
        self.dir = directory or run_dir()
        self.path = self.dir / f"owner-{os.getpid()}.json"
        self.children: dict[str, tuple[int, int]] = {}

    def add(self, name: str, pid: int) -> None:
        started = start_time(pid)
        if started is not None:
            self.children[name] = (pid, started)
            self._write()

    def remove(self, name: str) -> None:
        if self.children.pop(name, None) is not None:
            self._write()

    def close(self) -> None:
        self.children.clear()
        self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        body = {"owner": [os.getpid(), start_time(os.getpid())],
                "children": {n: list(p) for n, p in self.children.items()}}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(self.path)  # a reader never sees half a file


def sweep(directory: Path | None = None) -> list[str]:
    """Kill (SIGKILL) the recorded children of supervisors that are gone; remove their state files.

    A child is killed only if its pid still has the recorded start time (never a reused pid).
    Returns one line per process killed, e.g. "decode-0 (pid 1234)".
    """
    directory = directory or run_dir()
    killed = []
    for path in sorted(directory.glob("owner-*.json")):
        try:
            body = json.loads(path.read_text())
            owner_pid, owner_started = body["owner"]
            children = body["children"]
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)  # unreadable: written by nothing we know
            continue
        if start_time(owner_pid) == owner_started and owner_started is not None:
            continue  # its supervisor is alive and looks after its own children
        for name, (pid, started) in children.items():
            if start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(f"{name} (pid {pid})")
                except ProcessLookupError:
                    pass
        path.unlink(missing_ok=True)
    return killed
