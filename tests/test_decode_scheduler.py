"""Decode's scheduling decisions (`pdserve.decode.scheduler`), each against a table: state in, decision out, no
worker, no model, no NATS. The pool is a block count with the engine's own rule: a sequence of n tokens fits
when ceil((n + 1) / block_size) blocks are free (`PagedRunner.can_admit`)."""
from __future__ import annotations

import math
from collections import OrderedDict

import pytest

from pdserve.decode.scheduler import (
    EarlyCancels,
    IDLE_PREFILL_CHUNK,
    Load,
    OutOfBlocksPlan,
    Pool,
    chunk_runs_alone,
    chunk_tokens,
    draft_room,
    local_refusal,
    next_batch,
    offer_refusal,
    out_of_blocks,
    resume_action,
    when_nothing_steps,
)

BS = 16


def pool(free_blocks: int, block_size: int = BS) -> Pool:
    return Pool(lambda n: math.ceil((n + 1) / block_size) <= free_blocks, block_size)


def load(**kw) -> Load:
    base = dict(running=0, prefilling=0, receiving=0, receiving_tokens=0, queued_tokens=0, preempted=0)
    return Load(**{**base, **kw})


# offer_refusal: (tokens, choices, load, max_running, free blocks) -> the refusal's start, or None
OFFERS = [
    (100, 1, load(), 8, 100, None),
    (100, 1, load(running=8), 8, 100, "at capacity"),
    (100, 1, load(running=7), 8, 100, None),  # the eighth
    (100, 2, load(running=7), 8, 100, "at capacity"),  # n = 2 takes two sequences of the eight
    (100, 2, load(running=6), 8, 100, None),
    (100, 1, load(running=3, prefilling=2, receiving=3), 8, 100, "at capacity"),  # all three count
    (100, 1, load(running=3, prefilling=2, receiving=2), 8, 100, None),
    (100, 1, load(preempted=1), 8, 100, "no KV capacity"),  # the preempted are owed the room first
    (15, 1, load(), 8, 1, None),  # 15 tokens + the next: one block
    (16, 1, load(), 8, 1, "no KV capacity"),
    (100, 1, load(receiving_tokens=100), 8, 12, "no KV capacity"),  # KV on its way counts: 201 tokens, 13 blocks
    (100, 1, load(receiving_tokens=100), 8, 13, None),
    (100, 1, load(queued_tokens=300), 8, 20, "no KV capacity"),  # so do uncomputed prompts still to compute
    (100, 1, load(queued_tokens=300), 8, 26, None),
]


@pytest.mark.parametrize("tokens,choices,state,max_running,free,refused", OFFERS)
def test_offer_refusal(tokens, choices, state, max_running, free, refused):
    why = offer_refusal(tokens=tokens, choices=choices, load=state, max_running=max_running, pool=pool(free))
    assert (why is None) if refused is None else (why is not None and why.startswith(refused)), why


def test_a_kv_refusal_names_the_utilisation():
    why = offer_refusal(tokens=100, choices=1, load=load(kv_utilization=0.93), max_running=8, pool=pool(0))
    assert why == "no KV capacity for 100 tokens (utilisation 93%)"


# local_refusal (conditional disaggregation): prompt, choices, offered, queue ahead, queued, running, max_batch, chunk
LOCAL = [
    (300, 1, 300, 1000, 0, 0, 16, 256, None),
    (300, 1, 300, 1000, 0, 0, 16, 0, "this worker takes no uncomputed prompts"),
    (300, 2, 300, 1000, 0, 0, 16, 256, "an uncomputed prompt must have n = 1"),
    (1, 1, 1, 1000, 0, 0, 16, 256, "an uncomputed prompt must have n = 1"),
    (2, 1, 2, 1000, 0, 0, 16, 256, None),
    (300, 1, 300, 1000, 0, 16, 16, 256, "its steps are full"),
    (300, 1, 300, 1000, 0, 15, 16, 256, None),
    (300, 1, 300, 1000, 700, 0, 16, 256, None),  # 700 + 300 = prefill's 1000: not longer
    (300, 1, 300, 1000, 701, 0, 16, 256, "its queue of uncomputed prompts (701 tokens)"),
    (300, 1, 300, 299, 0, 0, 16, 256, "its queue of uncomputed prompts (0 tokens)"),  # prefill gets there first
]


@pytest.mark.parametrize("prompt,choices,offered,ahead,queued,running,max_batch,chunk,refused", LOCAL)
def test_local_refusal(prompt, choices, offered, ahead, queued, running, max_batch, chunk, refused):
    why = local_refusal(prompt_tokens=prompt, choices=choices, offered_tokens=offered, queue_ahead_tokens=ahead,
                        queued_tokens=queued, running=running, max_batch=max_batch, local_chunk=chunk)
    assert (why is None) if refused is None else (why is not None and why.startswith(refused)), why


# resume_action: context, running, free blocks -> action
RESUMES = [
    (100, 0, 7, "resume"),  # 101 tokens: 7 blocks
    (100, 0, 6, "fail"),  # alone and it still does not fit: it outgrew the pool
    (100, 1, 7, None),  # fits alone, but not with a block of growth for the one running: waits
    (100, 1, 8, "resume"),
    (100, 3, 9, None),
    (100, 3, 10, "resume"),
    (15, 0, 1, "resume"),
    (16, 0, 1, "fail"),
    (0, 0, 0, "fail"),
    (1000, 5, 0, None),  # others run: it waits for them rather than fail
]


@pytest.mark.parametrize("context,running,free,action", RESUMES)
def test_resume_action(context, running, free, action):
    assert resume_action(context, running, pool(free)) == action


def test_a_resumed_sequence_leaves_growth_room_so_the_next_step_does_not_preempt_it_again():
    # whatever the pool, a resume decision leaves a block for each sequence it then steps with
    for free in range(0, 20):
        for running in range(0, 6):
            for context in (10, 40, 100):
                if resume_action(context, running, pool(free)) == "resume":
                    assert math.ceil((context + 1) / BS) + running <= free


# chunk_tokens: remaining, rows, local chunk, blocked, free blocks -> tokens
CHUNKS = [
    (1000, 0, 64, False, 1000, IDLE_PREFILL_CHUNK),  # nothing runs: prefill-sized
    (1000, 3, 64, False, 1000, 64),  # beside running rows: the small chunk
    (40, 3, 64, False, 1000, 40),  # the rest of the prompt
    (40, 0, 64, False, 1000, 40),
    (0, 0, 64, False, 1000, 0),
    (1000, 3, 64, True, 1000, 0),  # a chunk ran out of blocks: none until blocks come back
    (1000, 3, 0, False, 1000, 0),  # --local-prefill-chunk 0
    (1000, 3, 64, False, 4, 0),  # 64 + 4 rows of growth: 129 tokens, 9 blocks
    (1000, 3, 64, False, 9, 64),
    (1000, 0, 64, False, 17, 0),  # 256 + a block: 18 blocks
    (1000, 0, 64, False, 18, IDLE_PREFILL_CHUNK),
]


@pytest.mark.parametrize("remaining,rows,local,blocked,free,tokens", CHUNKS)
def test_chunk_tokens(remaining, rows, local, blocked, free, tokens):
    assert chunk_tokens(remaining=remaining, rows=rows, local_chunk=local, blocked=blocked, pool=pool(free)) == tokens


# chunk_runs_alone: rows fed, chunk tokens, native decoder's rows -> alone
ALONE = [
    (16, 16, 16, True),  # the step fits the native decoder, with the chunk it would not
    (16, 16, 32, False),  # both fit: one forward
    (17, 16, 16, False),  # the step does not fit alone either: one forward
    (4, 256, 16, True),
    (4, 8, 16, False),
    (4, 8, 0, False),  # no native decoder
    (0, 256, 0, True),  # nothing steps: the chunk is the step (both orders run it the same)
]


@pytest.mark.parametrize("fed,chunk,native,alone", ALONE)
def test_chunk_runs_alone(fed, chunk, native, alone):
    assert chunk_runs_alone(fed, chunk, native) is alone


@pytest.mark.parametrize("prefilling,running,receiving,action", [
    (1, 0, 0, "fail_prompt"),  # prompts fill the pool and nothing can bring room
    (3, 0, 0, "fail_prompt"),
    (1, 0, 1, "wait"),  # a KV on its way: it admits or fails, either way the loop looks again
    (1, 2, 0, "wait"),  # a running sequence ends and frees blocks
    (0, 0, 0, "wait"),
])
def test_when_nothing_steps(prefilling, running, receiving, action):
    assert when_nothing_steps(prefilling=prefilling, running=running, receiving=receiving) == action


@pytest.mark.parametrize("had_chunk,live,plan", [
    (True, [("a", 1), ("b", 2)], OutOfBlocksPlan(block_chunk=True)),  # the chunk did not fit: step again without
    (False, [("a", 1), ("b", 2)], OutOfBlocksPlan(preempt="b")),  # the latest admitted gives back
    (False, [("b", 9), ("a", 1), ("c", 4)], OutOfBlocksPlan(preempt="b")),
    (False, [("a", 1)], OutOfBlocksPlan(preempt="a")),
    (False, [], OutOfBlocksPlan()),  # every one of them was cancelled during the step
])
def test_out_of_blocks(had_chunk, live, plan):
    assert out_of_blocks(had_chunk=had_chunk, live=live) == plan


@pytest.mark.parametrize("max_tokens,generated,prompt,context,room", [
    (100, 0, 10, 2048, 99),
    (100, 99, 10, 2048, 0),  # the step's own token is the last
    (100, 10, 2000, 2048, 37),  # the context binds first
    (5, 1, 10, 2048, 3),
])
def test_draft_room(max_tokens, generated, prompt, context, room):
    assert draft_room(max_tokens=max_tokens, generated=generated, prompt_tokens=prompt, max_context=context) == room


def test_next_batch_takes_turns_and_moves_the_stepped_to_the_back():
    running = OrderedDict((k, k.upper()) for k in "abcde")
    assert next_batch(running, 2) == ["A", "B"] and list(running) == ["c", "d", "e", "a", "b"]
    assert next_batch(running, 8) == ["C", "D", "E", "A", "B"] and list(running) == ["c", "d", "e", "a", "b"]
    assert next_batch(OrderedDict(), 4) == []


def test_early_cancels_are_spent_once_and_forgotten_after_their_ttl_or_past_the_bound():
    now = [0.0]
    seen = EarlyCancels(ttl_s=60, most=3, clock=lambda: now[0])
    seen.add("a")
    assert "a" in seen and seen.take("a") and not seen.take("a")  # one request per cancel
    seen.add("b")
    now[0] = 59.0
    seen.add("c")
    assert "b" in seen
    now[0] = 61.0  # b's cancel is older than the ttl: forgotten; c's is not
    assert "b" not in seen and "c" in seen
    for rid in "defg":
        seen.add(rid)
    assert len(seen) == 3 and "c" not in seen and "d" not in seen  # the oldest went first
    assert all(rid in seen for rid in "efg")
    seen.add("e")  # cancelled again: its clock starts over, and it is the newest
    now[0] = 61.0 + 59.0
    seen.add("h")
    assert "e" in seen and "f" not in seen
