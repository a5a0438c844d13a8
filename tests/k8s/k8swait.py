"""Test helper: poll the API server until a condition holds (a bound on waiting, never asserted as a duration)."""
from __future__ import annotations

from kubernetes import client
from servinghelpers import wait_for as _wait_for

WAIT_S = 90


def wait_for(fn, what: str, timeout: float = WAIT_S):
    """Call `fn` until it returns something truthy; an ApiException counts as not yet."""
    return _wait_for(fn, what, timeout, retry_on=(client.ApiException,))
