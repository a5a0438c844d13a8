"""The CPU lease (`pdserve.cpulease`) across real processes: decode holds it while it steps, prefill borrows
it only when it is free and never waits, decode taking it back waits for the borrowed step alone, and a
holder that dies frees it."""
from __future__ import annotations

import subprocess
import sys
import threading

from pdserve.cpulease import CpuLease

HOLDER = """
import sys
from pdserve.cpulease import CpuLease
lease = CpuLease(sys.argv[1])
assert lease.try_borrow() == 2, "the owner's threads"
print("borrowed", flush=True)
sys.stdin.readline()  # hold until told
{end}
"""


def borrower(path, end: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER.format(end=end), str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "borrowed"
    return p


def test_nothing_is_lent_before_the_owner_says_what(tmp_path):
    lease = CpuLease(tmp_path / "lease")
    assert lease.try_borrow() == 0 and not lease.held  # and it did not keep the lock
    owner = CpuLease(tmp_path / "lease")
    owner.offer(3)
    owner.hold()  # would wait forever had the borrower kept it
    owner.release()
    assert lease.try_borrow() == 3


def test_prefill_borrows_only_a_free_lease_and_decode_waits_only_for_the_borrowed_step(tmp_path):
    path = tmp_path / "lease"
    decode = CpuLease(path)
    decode.offer(2)
    decode.hold()
    assert CpuLease(path).try_borrow() == 0  # decode is stepping: prefill does not wait, it runs alone
    decode.release()

    prefill = borrower(path, end="")  # borrows the idle decode's threads, holds them for one "step"
    taken = threading.Event()
    waiter = threading.Thread(target=lambda: (decode.hold(), taken.set()))
    waiter.start()
    assert not taken.wait(0.3), "decode took the lease while prefill's borrowed step ran"
    prefill.stdin.write("\n")  # the step ends: prefill releases
    prefill.stdin.flush()
    assert taken.wait(30)
    waiter.join()
    assert prefill.wait(30) == 0
    assert CpuLease(path).try_borrow() == 0  # decode holds it again
    decode.close()


def test_a_borrower_that_dies_holding_the_lease_frees_it(tmp_path):
    path = tmp_path / "lease"
    decode = CpuLease(path)
    decode.offer(2)
    prefill = borrower(path, end="")
    prefill.kill()
    assert prefill.wait(30) != 0
    decode.hold()  # the kernel released the dead process's lock
    assert decode.held
    decode.close()
