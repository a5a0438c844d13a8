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


LENDER = """
import sys
from pdserve.cpulease import CpuLease
lease = CpuLease(sys.argv[1])
for line in sys.stdin:
    lease.lend_idle(int(line))
    print("lent", lease.idle_threads(), flush=True)
"""


def test_prefill_lends_its_idle_threads_to_decode_native_layers_and_takes_them_back(tmp_path):
    """The other direction: prefill (another process) writes how many of its threads are idle into the shared
    word, and decode's native layers read it at every phase (`cpu_decoder.threads_in_use`), with no lock and
    no wait on either side. A word nobody wrote lends nothing."""
    from pdserve.kernels import cpu_decoder

    path = tmp_path / "lease"
    decode = CpuLease(path)
    decode.offer(1)
    assert decode.idle_threads() == 0
    prefill = subprocess.Popen([sys.executable, "-c", LENDER, str(path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)

    def lend(n: int) -> None:
        prefill.stdin.write(f"{n}\n")
        prefill.stdin.flush()
        assert prefill.stdout.readline().split() == ["lent", str(n)]

    native = cpu_decoder.library() is not None
    if native:
        before = cpu_decoder.set_threads(1)
        cpu_decoder.set_lender(decode.idle_word())
    try:
        lend(2)
        assert decode.idle_threads() == 2
        if native:
            assert cpu_decoder.threads_in_use() == 3
        lend(0)  # work arrived at prefill
        assert decode.idle_threads() == 0
        if native:
            assert cpu_decoder.threads_in_use() == 1
    finally:
        if native:
            cpu_decoder.set_lender(None)
            cpu_decoder.set_threads(before)
        prefill.stdin.close()
        assert prefill.wait(30) == 0
    decode.close()
    assert CpuLease(path).idle_threads() == 0  # prefill's last word stands for whoever opens it next


def test_a_borrower_frozen_mid_step_costs_decode_its_lease_not_its_progress(tmp_path):
    """A prefill worker stopped (SIGSTOP) or stuck while it holds the lease: decode waits for it `wait_s` once,
    then steps without the lease, and later steps only try (no wait each step) until the borrower lets go."""
    path = tmp_path / "lease"
    decode = CpuLease(path)
    decode.offer(2)
    prefill = borrower(path, end="")  # holds until told: frozen mid-step
    assert decode.hold(wait_s=0.2) is False and decode.waited_out and not decode.held
    done = threading.Event()
    trier = threading.Thread(target=lambda: (decode.hold(wait_s=3600), done.set()))
    trier.start()
    assert done.wait(30), "a later step waited for the frozen borrower again"
    trier.join()
    assert not decode.held
    prefill.stdin.write("\n")  # it thaws and ends its step
    prefill.stdin.flush()
    assert prefill.wait(30) == 0
    assert decode.hold(wait_s=30) is True and not decode.waited_out
    assert CpuLease(path).try_borrow() == 0  # decode holds it again
    decode.close()
