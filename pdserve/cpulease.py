"""A CPU lease: the cores of a decode worker that a prefill worker on the same machine borrows while decode is idle.

Disaggregation gives each phase its own cores, which is right under load: decode steps never wait
behind a prompt. With one request at a time it halves what a prompt could use: while prefill computes
it, decode has nothing to do, and its core sits idle through the whole time to first token. The lease
hands that core over for exactly those moments, and hands it back before decode's next step:

- decode **holds** the lease (an exclusive `flock` on a file both name) from its first step after being
  idle until it is idle again; taking it back waits at most for the borrowed step that is running;
- prefill **borrows** it for one step at a time, only if it is free at that moment (never waiting), and
  runs that step with its own threads plus decode's (which decode wrote into the file).

`flock` locks belong to the open file and die with the process, so a worker that crashes holding the
lease frees it; nothing else is shared. Between machines, or pods with their own CPU limits, there is
nothing to lend: the lease is only for workers sharing cores (`pdserve up` pairs prefill-i with decode-i).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path


class CpuLease:
    """One side of a lease file. Not thread-safe: each side uses it from its compute thread (decode's
    `release` may come from its event loop while no step runs)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.held = False

    # -- the owner's side (decode) ---------------------------------------------------------------

    def offer(self, threads: int) -> None:
        """Say how many threads a borrower gains (the owner's own count)."""
        os.pwrite(self._fd, f"{threads}\n".encode().ljust(16), 0)

    def hold(self) -> None:
        """Take the lease, waiting while a borrowed step runs."""
        if not self.held:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self.held = True

    def release(self) -> None:
        if self.held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.held = False

    # -- the borrower's side (prefill) -----------------------------------------------------------

    def try_borrow(self) -> int:
        """Take the lease if it is free now: the threads it lends (0: not taken; `release` after use)."""
        if self.held:
            return self.lent_threads()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        self.held = True
        threads = self.lent_threads()
        if threads <= 0:  # no owner has said what it lends (not started yet): nothing to borrow
            self.release()
        return threads

    def lent_threads(self) -> int:
        try:
            return max(0, int(os.pread(self._fd, 16, 0).decode().strip() or 0))
        except ValueError:
            return 0

    def close(self) -> None:
        self.release()
        os.close(self._fd)
