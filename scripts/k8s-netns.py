"""Linux plumbing for the node harness (scripts/k8s-node.py): loopback relays into a network
namespace, and the cgroup tree that holds every process of one node so that it can be ended
whole, even after its harness was killed outright."""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
CGROUP_PREFIX = "pdserve-node-"


# ---------------------------------------------------------------- the loopback relay

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
CLONE_NEWNET = 0x40000000


class NetnsRelay:
    """Loopback listeners on the host whose connections are dialled from inside a network
    namespace. One thread joins the namespace and makes sockets there on request."""

    def __init__(self, netns: str):
        self._requests: queue.Queue = queue.Queue()
        self._listeners: list[socket.socket] = []
        self._closed = threading.Event()
        started: queue.Queue = queue.Queue()
        threading.Thread(target=self._socket_maker, args=(netns, started), name="netns-sockets", daemon=True).start()
        err = started.get()
        if err:
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")

    def _socket_maker(self, netns: str, started: queue.Queue) -> None:
        fd = os.open(netns, os.O_RDONLY)
        try:
            rc = _libc.setns(fd, CLONE_NEWNET)  # this thread only
            started.put(ctypes.get_errno() if rc != 0 else 0)
            if rc != 0:
                return
        finally:
            os.close(fd)
        while (reply := self._requests.get()) is not None:
            try:
                reply.put(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            except OSError as e:
                reply.put(e)

    def node_socket(self) -> socket.socket:
        """A TCP socket in the namespace (connect it to any address there)."""
        reply: queue.Queue = queue.Queue()
        self._requests.put(reply)
        s = reply.get()
        if isinstance(s, BaseException):
            raise s
        return s

    def forward(self, host: str, port: int) -> int:
        """A loopback port on the host that relays each connection to host:port in the namespace."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listeners.append(listener)
        threading.Thread(target=self._accept, args=(listener, host, port), name=f"relay-{host}:{port}",
                         daemon=True).start()
        return listener.getsockname()[1]

    def _accept(self, listener: socket.socket, host: str, port: int) -> None:
        while not self._closed.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client, host, port), daemon=True).start()

    def _connect(self, client: socket.socket, host: str, port: int) -> None:
        try:
            upstream = self.node_socket()
            upstream.settimeout(10)
            upstream.connect((host, port))
            upstream.settimeout(None)
        except OSError:
            client.close()  # the caller sees the connection refused or reset, as without a relay
            return
        done = threading.Semaphore(0)  # the second pump to finish closes both sockets
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b, done), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, done: threading.Semaphore) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (src, dst):  # one side broke: break the other too, as a direct connection would
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if done.acquire(blocking=False):
            src.close()
            dst.close()
        else:
            done.release()

    def close(self) -> None:
        self._closed.set()
        for listener in self._listeners:
            listener.close()
        self._requests.put(None)


# ---------------------------------------------------------------- cgroups

def hierarchies() -> list[Path]:
    """The cgroup hierarchies this machine mounts (v1: cpu, memory, pids, ..., name=systemd; v2: unified)."""
    return sorted(p for p in CGROUP_FS.iterdir() if p.is_dir() and not p.is_symlink()
                  and (p / "cgroup.procs").exists())


def cgroup_tree(root: Path) -> list[Path]:
    """root and every cgroup below it, deepest first (cgroups that vanish meanwhile are skipped:
    runc removes a container's as it ends)."""
    return [Path(d) for d, _, _ in os.walk(root, topdown=False)]


def _procs(cg: Path) -> list[int]:
    try:
        return [int(p) for p in (cg / "cgroup.procs").read_text().split()]
    except OSError:  # removed meanwhile
        return []


def kill_cgroups(name: str) -> None:
    """SIGKILL every process under /<name> in every hierarchy, until none is left."""
    for _ in range(100):
        pids = {pid for h in hierarchies() for cg in cgroup_tree(h / name) for pid in _procs(cg)}
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)  # dying takes a moment; the loop re-reads what is left


def remove_cgroups(name: str) -> None:
    """Remove the (emptied) cgroup tree /<name> from every hierarchy."""
    for h in hierarchies():
        for cg in cgroup_tree(h / name):
            try:
                cg.rmdir()
            except OSError:
                pass


def sweep_stale_nodes() -> None:
    """Remove the cgroup trees (and so every process) of node harnesses that died without stop()."""
    for h in hierarchies():
        for cg in h.glob(f"{CGROUP_PREFIX}*"):
            owner = cg.name.removeprefix(CGROUP_PREFIX)
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                kill_cgroups(cg.name)
                remove_cgroups(cg.name)


def make_cgroups(name: str) -> None:
    for h in hierarchies():
        for sub in (h / name, h / name / "system"):
            sub.mkdir(exist_ok=True)
            if h.name.startswith("cpuset"):  # a new cpuset cgroup starts empty: no task may join it
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (sub / f).write_text((sub.parent / f).read_text())
