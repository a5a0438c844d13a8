"""Test helper: poll the API server until a condition holds (a bound on waiting, never asserted as a duration)."""
from __future__ import annotations

import time

from kubernetes import client

WAIT_S = 90


def wait_for(fn, what: str, timeout: float = WAIT_S):
    """Call `fn` until it returns something truthy; an ApiException counts as not yet."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except client.ApiException as e:
            last = e
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")
