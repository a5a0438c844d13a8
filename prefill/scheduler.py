"""Prefill's scheduling decisions, as pure functions of the worker's queue: no I/O, no awaits, no tensors.

The prefill worker (`prefill/worker.py`) is the loop that feeds these its state and carries out what they
decide: which prompts' chunks make a step (continuous batching within a token budget, oldest first, so a
short prompt arriving behind a long one joins the very next step), when a pre-positioning hint computes
instead (only when no prompt waits, and not while a co-located decode worker steps), when such a step stops
between layers, when a step borrows decode's idle threads, which prompts stream their KV layer by layer, which
hints are taken, and which prompts are offered to decode uncomputed (conditional disaggregation, prefill's
half: `decode.scheduler.local_refusal` is decode's). `tests/test_prefill_scheduler.py` holds each to a table.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# A step borrows decode's threads (`pdserve.cpulease`) only when it has this many tokens or more (a prompt's
# compute, where a second core pays) and is the one prompt waiting: a lone request's TTFT is what a second
# core shortens. With more prompts queued, decode is about to be handed work, and each borrowed step it must
# wait out to take its threads back costs it more than the step gains (docs/PERFORMANCE.md, "CPU lease"). One
# prompt a step is also within what computes bit for bit as one thread does: a float32 GEMM of a few rows sums
# in another order with two threads, and the head has a row per completed prompt.
LEASE_MIN_TOKENS = 64


@dataclass(frozen=True)
class Waiting:
    """A prompt in the queue, as scheduling sees it."""

    remaining: int  # tokens still to compute
    offering: bool = False  # offered to decode uncomputed, no answer yet: not scheduled meanwhile
    started: bool = False  # a chunk of it was computed (or its prefix taken from the cache)


@dataclass(frozen=True)
class StepPlan:
    """A step: `chunks` (queue index, tokens), oldest first; or `hint` tokens of a pre-positioning hint (when no
    prompt waits); or neither (nothing to do)."""

    chunks: tuple[tuple[int, int], ...] = ()
    hint: int = 0

    def __bool__(self) -> bool:
        return bool(self.chunks) or self.hint > 0


def plan_step(queue: Sequence[Waiting], *, hint_remaining: int | None, chunk_size: int,
              max_batch_tokens: int) -> StepPlan:
    """This step's chunks: every waiting prompt (not being offered), oldest first, its next chunk of at most
    `chunk_size`, within `max_batch_tokens` together; when no prompt waits, the next chunk of the hint
    (`hint_remaining` tokens left of it; None: no hint)."""
    chunks, budget = [], max_batch_tokens
    for i, w in enumerate(queue):
        if w.offering:
            continue
        n = min(chunk_size, w.remaining, budget)
        if n <= 0:
            break
        chunks.append((i, n))
        budget -= n
    if chunks:
        return StepPlan(chunks=tuple(chunks))
    if hint_remaining:
        return StepPlan(hint=min(chunk_size, hint_remaining))
    return StepPlan()


def step_action(plan: StepPlan, *, decode_stepping: bool) -> Literal["step", "idle", "wait_for_decode"]:
    """What the loop does with `plan`: "step"; "idle" (nothing to do: wait for work, lending the threads); or
    "wait_for_decode": the plan is only pre-positioning, idle-time work, and a co-located decode worker steps
    (`decode_stepping`, its CPU lease held), so the machine is not idle: the hint waits and decode keeps the
    threads."""
    if not plan:
        return "idle"
    if not plan.chunks and decode_stepping:
        return "wait_for_decode"
    return "step"


def hint_yields(*, hint_step: bool, prompts_waiting: int, decode_stepping: bool) -> bool:
    """Whether a step computing only a pre-positioning hint stops at its next layer: a prompt waits (it should not
    wait out the rest of the hint's chunk), or a co-located decode worker started stepping (the machine is no
    longer idle). The engine leaves the hint's sequence as before the step; it goes on when idle again."""
    return hint_step and (prompts_waiting > 0 or decode_stepping)


def borrows_threads(*, hint_step: bool, chunks: int, prompts_queued: int, tokens: int) -> bool:
    """Whether a step borrows a co-located decode worker's idle threads: one prompt's chunk of at least
    `LEASE_MIN_TOKENS`, the only prompt queued, and not pre-positioning (idle-time work must never delay decode
    taking its threads back)."""
    return not hint_step and chunks == 1 and prompts_queued == 1 and tokens >= LEASE_MIN_TOKENS


def streams_layers(*, hint: bool, chunk: int, remaining: int, max_tokens: int, choices: int,
                   streaming: bool, resumed: bool = False) -> bool:
    """Whether a prompt's KV streams to decode layer by layer during this step: its last chunk (`chunk` is all
    that `remaining` needs), a request (not a hint) that decodes past its first token, with one choice, not
    streaming already, and not a moved request (`resumed`: its offer carries the tokens generated so far, not a
    first token to follow)."""
    return (not hint and chunk == remaining and max_tokens > 1 and choices == 1 and not streaming
            and not resumed)


def ahead_tokens(queue: Sequence[Waiting], before: int | None = None) -> int:
    """Prompt tokens waiting ahead of queue index `before` (None: the whole queue, for a prompt not in it yet),
    those being offered to decode excluded."""
    return sum(w.remaining for w in queue[:before] if not w.offering)


def defer_ahead(*, defer_tokens: int, choices: int, prompt_tokens: int, cached_tokens: int,
                ahead: int, resumed: bool = False) -> int | None:
    """Conditional disaggregation, prefill's half: `ahead` (the tokens it would wait behind here) if the prompt is
    offered to decode uncomputed, else None. Offered when the queue ahead is at least `defer_tokens` (0: never),
    the prompt has one choice and 2 or more tokens, and less than half of it is in this worker's prefix cache
    (a cached prompt is cheap here), and it is not a moved request (`resumed`: decode's uncomputed path starts
    at the first token)."""
    if not defer_tokens or choices != 1 or prompt_tokens < 2 or resumed:
        return None
    if ahead < defer_tokens or 2 * cached_tokens >= prompt_tokens:
        return None
    return ahead


def reoffer_candidate(queue: Sequence[Waiting], *, defer_tokens: int, offered_this_step: bool) -> int | None:
    """Which waiting prompt is offered to decode again between steps (once a step, one at a time): the last that
    has not started, as it would wait longest. Prompts are offered on arrival, and a burst's later arrivals find
    decode's queue full; once decode has computed what it took, those would wait here while decode steps rows
    below its capacity. None: no offer now (`defer_ahead` still decides whether it is far enough back)."""
    if not defer_tokens or offered_this_step or any(w.offering for w in queue):
        return None
    return next((i for i in range(len(queue) - 1, -1, -1) if not queue[i].started), None)


def hint_refusal(*, budget_blocks: int, same_model: bool, tokens: int, max_context: int, block_size: int,
                 ids_in_vocab: bool) -> str | None:
    """Why a pre-positioning hint is not taken (None: taken): pre-positioning off (no budget), another model's,
    empty, too long for the context or the budget, or token ids outside the vocabulary."""
    if not budget_blocks:
        return "pre-positioning is off"
    if not same_model:
        return "another model's hint"
    if not tokens:
        return "an empty hint"
    if tokens >= max_context:
        return f"longer than the context ({tokens} >= {max_context} tokens)"
    if tokens // block_size > budget_blocks:
        return f"more than the pre-positioning budget ({tokens // block_size} > {budget_blocks} blocks)"
    if not ids_in_vocab:
        return "token ids outside the vocabulary"
    return None
