"""A CPU lease: the cores of a decode worker that a prefill worker on the same machine borrows while decode is idle.

Disaggregation gives each phase its own cores, which is right under load: decode steps never wait
behind a prompt. With one request at a time it halves what a prompt could use: while prefill computes
it, decode has nothing to do, and its core sits idle through the whole time to first token. The lease
hands that core over for exactly those moments, and hands it back before decode's next step:

- decode **holds** the lease (an exclusive `flock` on a file both name) from its first step after being
  idle until it is idle again; taking it back waits at most for the borrowed step that is running (and
  never past `HOLD_WAIT_S`: a frozen borrower costs decode its cores' sharing, not its progress);
- prefill **borrows** it for one step at a time, only if it is free at that moment (never waiting), and
  runs that step with its own threads plus decode's (which decode wrote into the file).

`flock` locks belong to the open file and die with the process, so a worker that crashes holding the
lease frees it; nothing else is shared. Between machines, or pods with their own CPU limits, there is
nothing to lend: the lease is only for workers sharing cores (`pdserve up` pairs prefill-i with decode-i).

The other way round, under load, prefill is the idle one: once the prompts of a burst are in, decode runs
alone for as long as its longest output, and prefill's cores sit idle through much of a loaded run while
decode is the bound (docs/PERFORMANCE.md, "CPU lease"). So prefill **lends** its cores while it has no
prompt: it writes how many threads it has idle into the same file (`lend_idle`, an aligned 4-byte word at
`IDLE_OFFSET`, shared by `mmap`), and zero the moment work arrives, before it computes. Decode's native
layers read that word at every phase of every layer (`kernels/cpu_decoder.c`, `pdserve_native_lender`) and
add those threads while it is non-zero: prefill never waits for its core, it takes it back within one work
item of decode's (tens of microseconds) and a helper's spin (`SPIN_NS`).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from pathlib import Path

HOLD_WAIT_S = 2.0  # the longest decode waits for a borrowed step before it steps without the lease
IDLE_OFFSET = 16  # the lent-back word: prefill's idle threads (int32, native byte order); 0 while it works
_SIZE = 64


class CpuLease:
    """One side of a lease file. Not thread-safe: each side uses it from its compute thread (decode's
    `release` may come from its event loop while no step runs)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.held = False
        self.waited_out = False  # the owner gave up waiting for a borrowed step; it only tries until it is back
        if os.fstat(self._fd).st_size < _SIZE:
            os.ftruncate(self._fd, _SIZE)  # grows only: a zero word means prefill lends nothing
        self._map = mmap.mmap(self._fd, _SIZE)
        self._word_shared = False

    # -- the owner's side (decode) ---------------------------------------------------------------

    def offer(self, threads: int) -> None:
        """Say how many threads a borrower gains (the owner's own count)."""
        os.pwrite(self._fd, f"{threads}\n".encode().ljust(16), 0)

    def hold(self, wait_s: float = HOLD_WAIT_S) -> bool:
        """Take the lease, waiting while a borrowed step runs → whether it is held. A borrower still holding it
        after `wait_s` is frozen or stuck mid-step (SIGSTOP, a debugger, a swap storm): the lease only shares
        cores, so the owner steps without it rather than stall its requests behind another process, and until
        the borrower lets go, later calls only try (`waited_out`) — a step never waits for it again."""
        if self.held:
            return True
        deadline = time.monotonic() + wait_s
        pause = 0.0001
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self.waited_out or time.monotonic() >= deadline:
                    self.waited_out = True
                    return False
                # a borrowed step ends within milliseconds: look again soon, less often the longer it runs (a
                # poll is a wakeup on the cores the borrower steps on), at most a millisecond late
                time.sleep(pause)
                pause = min(2 * pause, 0.001)
                continue
            self.held, self.waited_out = True, False
            return True

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

    def owner_busy(self) -> bool:
        """Whether the owner holds the lease now (decode is stepping), without taking it."""
        if self.held:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def lent_threads(self) -> int:
        try:
            return max(0, int(os.pread(self._fd, 16, 0).decode().strip() or 0))
        except ValueError:
            return 0

    # -- the other way round: prefill lends its idle threads to decode ---------------------------

    def lend_idle(self, threads: int) -> None:
        """Prefill: `threads` of its own are idle from now on (0: it works again, and takes them back)."""
        struct.pack_into("=i", self._map, IDLE_OFFSET, max(0, int(threads)))

    def idle_threads(self) -> int:
        """What prefill lends now."""
        return struct.unpack_from("=i", self._map, IDLE_OFFSET)[0]

    def idle_word(self) -> int:
        """The address of the lent-back word in this process (for `cpu_decoder.set_lender`); valid until
        `close`."""
        import ctypes

        self._word_shared = True
        return ctypes.addressof(ctypes.c_int32.from_buffer(self._map, IDLE_OFFSET))

    def close(self) -> None:
        self.release()
        if not self._word_shared:  # else native code may still read it: the mapping lives as long as the process
            self._map.close()
        os.close(self._fd)
