"""Prefill's scheduling decisions (`pdserve.prefill.scheduler`), each against a table: state in, decision out, no
worker, no model, no NATS. These replace end-to-end tests that bet on timing (a short prompt sent 0.3 s after a
long one, a hint not computed within 1.5 s): the decision is asserted here, the mechanics end to end."""
from __future__ import annotations

import pytest

from pdserve.prefill.scheduler import (
    LEASE_MIN_TOKENS,
    StepPlan,
    Waiting,
    ahead_tokens,
    borrows_threads,
    defer_ahead,
    hint_refusal,
    hint_yields,
    plan_step,
    reoffer_candidate,
    step_action,
    streams_layers,
)

W = Waiting

# plan_step: queue, hint remaining, chunk size, token budget -> plan
PLANS = [
    ([], None, 128, 2048, StepPlan()),
    ([], 300, 128, 2048, StepPlan(hint=128)),  # nothing waits: the hint's next chunk
    ([], 50, 128, 2048, StepPlan(hint=50)),
    ([W(1400, started=True)], 300, 128, 2048, StepPlan(chunks=((0, 128),))),  # a prompt waits: no hint
    # a short prompt behind a long one joins the very next step, whole: it is not starved
    ([W(1400, started=True), W(5)], None, 128, 2048, StepPlan(chunks=((0, 128), (1, 5)))),
    ([W(1400, started=True), W(500)], None, 128, 2048, StepPlan(chunks=((0, 128), (1, 128)))),
    ([W(100)] * 20, None, 128, 1000, StepPlan(chunks=tuple((i, 100) for i in range(10)))),  # the budget binds
    ([W(300), W(300), W(300)], None, 256, 600, StepPlan(chunks=((0, 256), (1, 256), (2, 88)))),
    ([W(300, offering=True), W(40)], None, 256, 600, StepPlan(chunks=((1, 40),))),  # offered: skipped meanwhile
    ([W(300, offering=True)], 90, 256, 600, StepPlan(hint=90)),  # only an offered one: the hint may go
    ([W(300), W(20)], None, 128, 128, StepPlan(chunks=((0, 128),))),  # no budget left: the next step
]


@pytest.mark.parametrize("queue,hint,chunk,budget,plan", PLANS)
def test_plan_step(queue, hint, chunk, budget, plan):
    got = plan_step(queue, hint_remaining=hint, chunk_size=chunk, max_batch_tokens=budget)
    assert got == plan
    assert sum(n for _, n in got.chunks) <= budget


def test_a_short_prompt_finishes_before_a_long_one_that_came_first():
    """Steps until each is computed: the short one (arriving while the long one is a chunk in) is done in the first
    step it is in; the long one after 12 steps. What the timing-bet end-to-end test asserted, exactly."""
    queue = [W(1500, started=True)]
    finished, step = {}, 0
    names = ["long"]
    while queue:
        step += 1
        if step == 2:
            queue.append(W(5))
            names.append("short")
        plan = plan_step(queue, hint_remaining=None, chunk_size=128, max_batch_tokens=2048)
        for i, n in plan.chunks:
            queue[i] = W(queue[i].remaining - n, started=True)
        for i in reversed(range(len(queue))):
            if not queue[i].remaining:
                finished[names.pop(i)] = step
                del queue[i]
    assert finished == {"short": 2, "long": 12}


@pytest.mark.parametrize("plan,decode_stepping,action", [
    (StepPlan(), False, "idle"),
    (StepPlan(), True, "idle"),
    (StepPlan(chunks=((0, 10),)), False, "step"),
    (StepPlan(chunks=((0, 10),)), True, "step"),  # a prompt computes whatever decode does
    (StepPlan(hint=128), False, "step"),  # idle machine: pre-position
    (StepPlan(hint=128), True, "wait_for_decode"),  # decode steps: idle-time work waits
])
def test_step_action(plan, decode_stepping, action):
    assert step_action(plan, decode_stepping=decode_stepping) == action


@pytest.mark.parametrize("hint_step,waiting,decode_stepping,yields", [
    (True, 0, False, False),
    (True, 1, False, True),  # a prompt arrived: the hint's step stops at the next layer
    (True, 0, True, True),  # decode started stepping: the machine is no longer idle
    (False, 3, True, False),  # prompts' steps never stop midway
    (False, 0, False, False),
])
def test_hint_yields(hint_step, waiting, decode_stepping, yields):
    assert hint_yields(hint_step=hint_step, prompts_waiting=waiting, decode_stepping=decode_stepping) is yields


@pytest.mark.parametrize("hint_step,chunks,queued,tokens,borrows", [
    (False, 1, 1, LEASE_MIN_TOKENS, True),
    (False, 1, 1, 1024, True),
    (False, 1, 1, LEASE_MIN_TOKENS - 1, False),  # too little compute for a second core to pay
    (False, 2, 2, 1024, False),  # more prompts: decode is about to be handed work
    (False, 1, 2, 1024, False),  # one in the step, another queued (e.g. being offered)
    (True, 1, 0, 1024, False),  # pre-positioning never borrows
])
def test_borrows_threads(hint_step, chunks, queued, tokens, borrows):
    assert borrows_threads(hint_step=hint_step, chunks=chunks, prompts_queued=queued, tokens=tokens) is borrows


@pytest.mark.parametrize("hint,chunk,remaining,max_tokens,choices,streaming,streams", [
    (False, 100, 100, 16, 1, False, True),  # the last chunk of a request that decodes on
    (False, 100, 300, 16, 1, False, False),  # not its last chunk
    (False, 100, 100, 1, 1, False, False),  # one token: prefill answers it all, nothing to hand off
    (False, 100, 100, 16, 2, False, False),  # n > 1: decode starts every choice from the imported KV
    (False, 100, 100, 16, 1, True, False),  # streaming already
    (True, 100, 100, 0, 0, False, False),  # a hint's KV stays here
])
def test_streams_layers(hint, chunk, remaining, max_tokens, choices, streaming, streams):
    assert streams_layers(hint=hint, chunk=chunk, remaining=remaining, max_tokens=max_tokens, choices=choices,
                          streaming=streaming) is streams


@pytest.mark.parametrize("queue,before,ahead", [
    ([], None, 0),
    ([W(100), W(50)], None, 150),  # a prompt arriving waits behind all
    ([W(100), W(50)], 1, 100),
    ([W(100, offering=True), W(50)], None, 50),  # one being offered may leave: not counted
    ([W(100), W(50), W(7)], 0, 0),
])
def test_ahead_tokens(queue, before, ahead):
    assert ahead_tokens(queue, before) == ahead


@pytest.mark.parametrize("defer,choices,prompt,cached,ahead,offered", [
    (512, 1, 300, 0, 600, 600),
    (512, 1, 300, 0, 511, None),  # too little ahead: computed here sooner
    (0, 1, 300, 0, 5000, None),  # off
    (512, 2, 300, 0, 600, None),  # n > 1 is not offered uncomputed
    (512, 1, 1, 0, 600, None),
    (512, 1, 300, 150, 600, None),  # half of it cached here: cheap here
    (512, 1, 300, 144, 600, 600),
])
def test_defer_ahead(defer, choices, prompt, cached, ahead, offered):
    assert defer_ahead(defer_tokens=defer, choices=choices, prompt_tokens=prompt, cached_tokens=cached,
                       ahead=ahead) == offered


@pytest.mark.parametrize("queue,defer,offered_this_step,candidate", [
    ([W(10, started=True), W(300), W(300)], 512, False, 2),  # the last not started: it would wait longest
    ([W(10, started=True), W(300), W(300, started=True)], 512, False, 1),
    ([W(10, started=True)], 512, False, None),
    ([W(10, started=True), W(300)], 0, False, None),  # off
    ([W(10, started=True), W(300)], 512, True, None),  # once a step
    ([W(10, offering=True), W(300)], 512, False, None),  # one offer at a time
])
def test_reoffer_candidate(queue, defer, offered_this_step, candidate):
    assert reoffer_candidate(queue, defer_tokens=defer, offered_this_step=offered_this_step) == candidate


@pytest.mark.parametrize("budget,same,tokens,in_vocab,refused", [
    (64, True, 200, True, None),
    (0, True, 200, True, "pre-positioning is off"),
    (64, False, 200, True, "another model's"),
    (64, True, 0, True, "an empty hint"),
    (64, True, 2048, True, "longer than the context"),
    (4, True, 200, True, "more than the pre-positioning budget"),  # 12 blocks
    (12, True, 200, True, None),
    (64, True, 200, False, "token ids outside"),
])
def test_hint_refusal(budget, same, tokens, in_vocab, refused):
    why = hint_refusal(budget_blocks=budget, same_model=same, tokens=tokens, max_context=2048, block_size=16,
                       ids_in_vocab=in_vocab)
    assert (why is None) if refused is None else (why is not None and why.startswith(refused)), why
