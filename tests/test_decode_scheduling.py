"""Decode's turn order: round robin over the running set bounds every sequence's wait.

`next_batch` only reads `key` (the running set's key of a sequence), so the running set here holds plain stand-ins rather than
full `Sequence`s (which need a handoff offer and a tokenizer); the worker's loop calls the same function.
"""
from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass

import pytest

from pdserve.decode.scheduler import next_batch


@dataclass
class Seq:
    request_id: str

    @property
    def key(self) -> str:
        return self.request_id


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_no_running_sequence_waits_more_than_its_round_robin_bound(max_batch):
    # The bound holds for the running set's size at a sequence's last turn: the ones ahead of it then
    # are all that can be served before it again (arrivals join behind it, departures only help).
    rng = random.Random(max_batch)
    running: OrderedDict[str, Seq] = OrderedDict()
    last: dict[str, tuple[int, int]] = {}  # request id -> (step of its last turn, its bound from then)
    worst = 0
    n = 0
    for step in range(2000):
        for _ in range(rng.choice([0, 0, 1, 2])):  # an arrival waits for those ahead of it (as if last served just before)
            n += 1
            running[f"r{n}"] = Seq(f"r{n}")
            last[f"r{n}"] = (step - 1, math.ceil(len(running) / max_batch) - 1)
        for rid in [r for r in running if rng.random() < 0.03]:  # some finish or are cancelled
            del running[rid]
            last.pop(rid, None)
        if not running:
            continue
        bound = math.ceil(len(running) / max_batch) - 1
        batch = next_batch(running, max_batch)
        assert len(batch) == min(max_batch, len(running))
        assert len({s.request_id for s in batch}) == len(batch)
        for s in batch:
            if s.request_id in last:
                at, was_bound = last[s.request_id]
                waited = step - at - 1
                assert waited <= was_bound, (s.request_id, waited, was_bound)
                worst = max(worst, waited)
            last[s.request_id] = (step, bound)
        for rid in running:  # nobody left out of this step has already passed its bound either
            if rid in last:
                at, was_bound = last[rid]
                assert step - at <= was_bound
    if max_batch > 1:
        assert worst > 0  # sequences did wait, so the bound was exercised


def test_a_full_batch_rotates_to_the_back():
    running = OrderedDict((r, Seq(r)) for r in "abcde")
    assert [s.request_id for s in next_batch(running, 2)] == ["a", "b"]
    assert [s.request_id for s in next_batch(running, 2)] == ["c", "d"]
    assert [s.request_id for s in next_batch(running, 2)] == ["e", "a"]
