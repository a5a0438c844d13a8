"""The receiver's pool of shared-memory segments for co-located KV handoffs: mapped once, reused.

A fresh tmpfs segment per transfer costs a page fault (and a zeroed page) per 4 KiB on the sender's
copy, and freeing it again when the KV dies, which costs more than the copy itself. So the receiver
(decode) keeps a pool of segments that stay mapped and populated: for a
transfer it leases one at least as big as the KV and names it to the sender (a GRANT frame); the
sender maps that range (MAP_POPULATE: the pages exist already, only the page tables are filled; the
mapping is kept for the segment's next grant, see `SenderMaps`) and copies each layer in; the
receiver hands out tensors that are views into the segment (no copy). The segment goes back to the
pool when the last of those tensors is freed, never before: a view that outlives the transfer keeps
its bytes.

Leaks: every segment's file is flock-ed (shared) by the process that owns it for as long as it lives,
so a segment whose owner died is recognisable — nobody holds its lock — and is removed by the next
receiver that starts on the host (`sweep_orphans`) or by a sender whose transfer into it failed
(`reap_if_orphaned`). A failed transfer's segment is never reused (the sender may still be writing
into it): it is unlinked at once. Idle segments beyond `max_idle_bytes` are unlinked, oldest first.

Also here: where segments live (`SHM_DIR`), the sweep of stale ones, and `host_id`, by which two
workers learn that they share memory.
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import socket
import threading
import time
import weakref

import numpy as np
import torch

from pdserve.config import KVReceiveConfig, KVSendConfig
from pdserve.kvtransfer.frames import TransferError

log = logging.getLogger("pdserve.kvtransfer.shm")

SHM_DIR = "/dev/shm"  # Linux's POSIX shared memory, where pods mount their bounded emptyDir
SHM_PREFIX = "pdkv-"  # per-transfer segments, named by their transfer token (`shm_path`)

POOL_PREFIX = "pdkv-pool-"  # under the transfer segments' prefix "pdkv-", so one listing finds both
MIN_SEGMENT = 1 << 20
DEFAULT_MAX_IDLE_BYTES = KVReceiveConfig().shm_pool_bytes  # decode sets its own (--shm-pool-bytes)


def _size_class(nbytes: int) -> int:
    """Segment size for `nbytes`: the next power of two (>= 1 MiB), so segments are reusable across sizes.
    Only the pages a transfer touches are ever allocated, so the rounding costs address space, not memory."""
    return max(MIN_SEGMENT, 1 << max(0, nbytes - 1).bit_length())


class _Segment:
    """One pool segment: its name, size, the owner's mapping, and the fd that holds the owner's lock."""

    def __init__(self, directory: str, size: int):
        self.name = f"{POOL_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(directory, self.name)
        self.size = size
        self.warm = False  # pages already allocated by an earlier transfer
        self.discarded = False
        # created under a name the sweepers ignore, locked, then renamed: never visible unlocked
        tmp = os.path.join(directory, "." + self.name)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        self.fd = fd

    def unlink(self) -> None:
        _unlink(self.path)

    def close(self) -> None:
        """Unlink and let go (the mapping lives on in any view still alive; the kernel frees it after)."""
        self.unlink()
        try:
            self.mm.close()
        except BufferError:
            pass  # views exported: they keep the mapping, the fd and lock go anyway
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Lease:
    """A pool segment lent to one transfer. `view(offset, n)` → a uint8 tensor over those bytes.

    The tensors keep the lease's buffer alive; when the last one is freed (and the transfer was
    `succeeded()`), the segment returns to the pool. `discard()` on failure drops it instead.
    """

    def __init__(self, pool: "ShmPool", seg: _Segment, nbytes: int):
        self.pool, self.seg, self.nbytes = pool, seg, nbytes
        self.name, self.size, self.warm = seg.name, seg.size, seg.warm
        self._state = {"ok": False}  # not the lease itself: a lease dropped unreleased must not pin the array
        self._array = np.frombuffer(seg.mm, dtype=np.uint8, count=seg.size)
        weakref.finalize(self._array, pool._returned, seg, self._state)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes at {offset} lie outside the {self.nbytes}-byte lease")
        return torch.from_numpy(self._array[offset:offset + nbytes])

    def succeeded(self) -> None:
        """The sender finished writing (END): the segment may be reused once no view of it is alive."""
        self._state["ok"] = True
        self._release()

    def discard(self) -> None:
        """The transfer failed: the segment is never reused (the sender may still write into it)."""
        if not self._state["ok"] and not self.seg.discarded:
            self.pool._discard(self.seg)
        self._release()

    def _release(self) -> None:
        self._array = None  # the lease's own reference; views hold theirs


class ShmPool:
    """Segments owned by one receiver, in `directory` (the host's shared /dev/shm)."""

    def __init__(self, directory: str, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES):
        self.directory, self.max_idle_bytes = directory, max_idle_bytes
        self._lock = threading.Lock()
        self._idle: list[_Segment] = []  # least recently used first
        self._leased: set[_Segment] = set()
        self.closed = False
        self.created = 0  # segments made (a reused one is not counted again)

    def lease(self, nbytes: int) -> Lease:
        """A segment of at least `nbytes` (the smallest idle one that fits, else a new one)."""
        want = _size_class(nbytes)
        with self._lock:
            if self.closed:
                raise RuntimeError("shared-memory pool is closed")
            fits = [s for s in self._idle if s.size >= want]
            seg = min(fits, key=lambda s: s.size) if fits else None
            if seg is not None:
                self._idle.remove(seg)
                self._leased.add(seg)
        if seg is None:
            seg = _Segment(self.directory, want)
            with self._lock:
                self.created += 1
                self._leased.add(seg)
        return Lease(self, seg, nbytes)

    def has_idle(self, nbytes: int) -> bool:
        """Whether an idle segment could take `nbytes` (a lease would make no new one)."""
        want = _size_class(nbytes)
        with self._lock:
            return any(s.size >= want for s in self._idle)

    def _discard(self, seg: _Segment) -> None:
        with self._lock:
            seg.discarded = True
        seg.unlink()

    def _returned(self, seg: _Segment, state: dict) -> None:
        """The last view of a lease is gone (any thread): pool it again, or close it."""
        evict: list[_Segment] = []
        with self._lock:
            self._leased.discard(seg)
            if seg.discarded or not state["ok"] or self.closed:
                evict.append(seg)
            else:
                seg.warm = True
                self._idle.append(seg)
                while self._idle and sum(s.size for s in self._idle) > self.max_idle_bytes:
                    evict.append(self._idle.pop(0))
        for s in evict:
            s.close()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._idle)

    def close(self) -> None:
        """Unlink every segment; idle ones are unmapped now, leased ones when their last view is freed."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
            leased = list(self._leased)
        for s in idle:
            s.close()
        for s in leased:
            s.unlink()


# --- the sender's side and the sweepers ------------------------------------------------------


def check_name(name: str) -> str:
    """A segment name from a peer: a plain pool name, nothing that walks out of the directory."""
    if not name.startswith(POOL_PREFIX) or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"not a pdserve shared-memory segment name: {name!r}")
    return name


class SegmentMapping:
    """The first `nbytes` of a granted segment as the sender maps them, and their base address for `memmove`.

    Warm segments are pre-faulted (MAP_POPULATE: their pages exist, so this only fills page tables, far
    cheaper than a fault per page); cold ones are not (populating fresh tmpfs pages costs more than the
    copy's own faults). Only the transfer's bytes are mapped: populating the whole size class would
    allocate pages no transfer asked for."""

    def __init__(self, directory: str, name: str, nbytes: int, warm: bool):
        path = os.path.join(directory, check_name(name))
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_size < nbytes:
                raise ValueError(f"segment {name} is {st.st_size} B, the transfer needs {nbytes} B")
            self.ident = (st.st_dev, st.st_ino, st.st_size)
            self.size = max(nbytes, 1)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if warm else 0)
            self.mm = mmap.mmap(fd, self.size, flags=flags)
        finally:
            os.close(fd)
        self.path = path
        self._array = np.frombuffer(self.mm, dtype=np.uint8)  # pins the mapping while we hold it
        self.base = self._array.ctypes.data
        self.busy = False
        self.used = 0.0

    def write(self, offset: int, src: torch.Tensor) -> None:
        """Copy a tensor's bytes to `offset` (glibc memmove: faster than a tensor copy_ here)."""
        if src.device.type != "cpu" or not src.is_contiguous():
            src = src.detach().to("cpu").contiguous()
        n = src.numel() * src.element_size()
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{n} bytes at {offset} lie outside the {self.size}-byte segment")
        if n:
            ctypes.memmove(self.base + offset, src.data_ptr(), n)

    def same_file(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino, st.st_size) == self.ident

    def close(self) -> None:
        self.size = 0  # any later write is refused by the bounds check, never sent to a dead address
        self._array = None
        self.mm.close()


class SenderMaps:
    """The sending side's mappings of segments decode granted, kept for the next grant of the same segment.

    Decode's pool hands the same few segments out again and again. Mapping one costs a page-table fill
    (MAP_POPULATE) and unmapping it a TLB shootdown, together about as long as copying the KV in. A kept
    mapping costs nothing per transfer. A mapping pins the segment's pages even after its
    owner unlinks it, so: a mapping is checked against the file (same inode) before each use; at every
    `acquire` the mappings of files that are gone are dropped; at most `max_bytes` (prefill's
    --shm-sender-map-bytes) stay mapped, least recently used dropped first; a transfer
    that fails drops its mapping (`release(ok=False)`).
    """

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = KVSendConfig().shm_sender_map_bytes if max_bytes is None else max_bytes
        self._lock = threading.Lock()
        self._maps: dict[str, SegmentMapping] = {}  # by the segment's path
        self.mapped = 0  # new mappings made (a kept one reused is not counted)

    def acquire(self, directory: str, name: str, nbytes: int, warm: bool) -> SegmentMapping:
        """The mapping of granted segment `name` (kept or new), for one transfer's exclusive use."""
        key = os.path.join(directory, check_name(name))
        stale: list[SegmentMapping] = []
        with self._lock:
            for k, m in list(self._maps.items()):  # files gone (or replaced): let their pages go
                if not m.busy and not m.same_file():
                    stale.append(self._maps.pop(k))
            m = self._maps.get(key)
            if m is not None and m.busy:
                raise ValueError(f"segment {name} granted to two transfers at once")
            if m is not None and m.size < nbytes:  # a bigger transfer than before: map it again, bigger
                stale.append(self._maps.pop(key))
                m = None
            if m is not None:
                m.busy = True
        for old in stale:
            old.close()
        if m is None:
            m = SegmentMapping(directory, name, nbytes, warm)
            m.busy = True
            with self._lock:
                self.mapped += 1
                self._maps[key] = m
        return m

    def release(self, m: SegmentMapping, ok: bool) -> None:
        """The transfer is over: keep the mapping (ok) or drop it; then trim to `max_bytes`."""
        drop: list[SegmentMapping] = []
        with self._lock:
            m.busy = False
            m.used = time.monotonic()
            if not ok and self._maps.get(m.path) is m:
                drop.append(self._maps.pop(m.path))
            idle = sorted((v.used, k) for k, v in self._maps.items() if not v.busy)
            total = sum(v.size for v in self._maps.values())
            while idle and total > self.max_bytes:
                _, k = idle.pop(0)
                total -= self._maps[k].size
                drop.append(self._maps.pop(k))
        for d in drop:
            d.close()

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(v.size for v in self._maps.values())

    def clear(self) -> None:
        """Unmap everything not in use."""
        with self._lock:
            drop = [self._maps.pop(k) for k, v in list(self._maps.items()) if not v.busy]
        for d in drop:
            d.close()


SENDER_MAPS = SenderMaps()


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def owned_elsewhere(directory: str, name: str) -> bool:
    """Whether another live process holds pool segment `name` (its owner's lock). Changes nothing."""
    try:
        fd = os.open(os.path.join(directory, check_name(name)), os.O_RDONLY)
    except (OSError, ValueError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails on our own segments too (per open file)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return not name.startswith(f"{POOL_PREFIX}{os.getpid()}-")
    finally:
        os.close(fd)


def reap_if_orphaned(directory: str, name: str) -> bool:
    """Unlink segment `name` if no live process owns it (nobody holds its lock). → whether it was removed."""
    path = os.path.join(directory, check_name(name))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its owner is alive
    finally:
        os.close(fd)
    return _unlink(path)


def sweep_orphans(directory: str) -> int:
    """Remove pool segments whose owners died (on any process sharing this directory). → count."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(POOL_PREFIX)]
    except OSError:
        return 0
    return sum(reap_if_orphaned(directory, n) for n in names)


# --- per-transfer segments and host identity --------------------------------------------------


def shm_path(token: str) -> str:
    """The segment of a transfer is named by its one-time token, so either side can remove it."""
    safe = "".join(c for c in token if c.isalnum() or c in "-_")
    if safe != token or not token:
        raise TransferError("malformed transfer token")
    return os.path.join(SHM_DIR, SHM_PREFIX + token)


def sweep_stale_segments(max_age_s: float = 600.0) -> int:
    """Remove per-transfer segments older than `max_age_s` (both sides of a transfer died), and pool
    segments whose owner died (`sweep_orphans`). Returns the count."""
    n = sweep_orphans(SHM_DIR)
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return n
    now = time.time()
    for name in names:
        if name.startswith(SHM_PREFIX) and not name.startswith(POOL_PREFIX):
            p = os.path.join(SHM_DIR, name)
            try:
                if now - os.stat(p).st_mtime > max_age_s and _unlink(p):
                    n += 1
            except OSError:
                pass
    return n


_HOST_ID: str | None = None


def host_id() -> str:
    """Who shares memory with whom: boot id + the shm directory's identity (pods on one node that mount
    the same /dev/shm volume agree; a pod with a private /dev/shm does not)."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        except OSError:
            boot = socket.gethostname()
        try:
            st = os.stat(SHM_DIR)
            _HOST_ID = f"{boot}:{st.st_dev}:{st.st_ino}"
        except OSError:
            _HOST_ID = f"{boot}:noshm:{os.getpid()}"
    return _HOST_ID
