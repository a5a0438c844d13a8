"""Decode's scheduling decisions, as pure functions of the worker's state: no I/O, no awaits, no tensors.

The decode worker (`decode/worker.py`) is the loop that feeds these its state and carries out what they
decide: which handoff offers it takes, which preempted sequence comes back or fails, which sequences step
(round robin), how much of an uncomputed prompt joins a step and whether it rides in the step's forward or
runs just before it, what runs out of KV blocks gives back, and whether a loop with nothing to step waits or
fails a prompt that can never be placed. `tests/test_decode_scheduler.py` holds each to a table.

The KV pool enters as `Pool`: whether a sequence of n tokens (plus its next) fits now, and a block's size —
the two questions every decision here asks of it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

# An uncomputed prompt's chunk when no sequence is running: nobody's step waits on it, so it is prefill's
# chunk size, which computes a prompt at full speed.
IDLE_PREFILL_CHUNK = 256


@dataclass(frozen=True)
class Pool:
    """What scheduling asks of the KV pool: `can_admit(n)`, whether a sequence of n tokens and its next fits in
    the free blocks now (`Engine.can_admit`); `block_size`, the tokens of one block (a running sequence's growth
    before it needs another)."""

    can_admit: Callable[[int], bool]
    block_size: int


# -- offers ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What the worker holds when an offer arrives."""

    running: int  # sequences stepping
    prefilling: int  # uncomputed prompts being computed here
    receiving: int  # accepted handoffs whose KV is on its way
    receiving_tokens: int  # their prompt tokens
    queued_tokens: int  # uncomputed prompts' tokens still to compute (accepted ones included), the offer's excluded
    preempted: int  # sequences waiting for KV room to be recomputed
    kv_utilization: float = 0.0  # share of the pool in use, for the refusal's words


def offer_refusal(*, tokens: int, choices: int, load: Load, max_running: int, pool: Pool) -> str | None:
    """Why an offer of `tokens` prompt tokens and `choices` sequences (its `n`) is refused for capacity, or None.
    A worker with preempted sequences takes nothing new: they are owed the room first."""
    if load.running + load.prefilling + load.receiving + choices - 1 >= max_running:
        return f"at capacity ({max_running} sequences)"
    if load.preempted or not pool.can_admit(tokens + load.receiving_tokens + load.queued_tokens):
        return f"no KV capacity for {tokens} tokens (utilisation {load.kv_utilization:.0%})"
    return None


def local_refusal(*, prompt_tokens: int, choices: int, offered_tokens: int, queue_ahead_tokens: int,
                  queued_tokens: int, running: int, max_batch: int, local_chunk: int) -> str | None:
    """Conditional disaggregation, decode's half: why an uncomputed prompt (`kv_deferred`) is not computed here
    (it then stays in prefill's queue), or None to take it. Taken only where it is computed sooner than in
    prefill's queue: this worker's own queue of uncomputed prompts, with it, is shorter than the
    `queue_ahead_tokens` prefill would make it wait behind, and its steps have a free row."""
    if not local_chunk:
        return "this worker takes no uncomputed prompts (--local-prefill-chunk 0)"
    if choices != 1 or prompt_tokens < 2:
        return "an uncomputed prompt must have n = 1 and 2 or more tokens"
    if running >= max_batch:
        return f"its steps are full ({running} sequences running)"
    if queued_tokens + offered_tokens > queue_ahead_tokens:
        return (f"its queue of uncomputed prompts ({queued_tokens} tokens) is no shorter than prefill's "
                f"({queue_ahead_tokens} tokens)")
    return None


# -- the step loop -------------------------------------------------------------------------------


def resume_action(context_tokens: int, running: int, pool: Pool) -> Literal["resume", "fail"] | None:
    """What becomes of the oldest preempted sequence (`context_tokens` long) now: "resume" (recompute its KV) once
    it fits with a block of growth for each of the `running` sequences it would step with — fitting its context
    alone is not enough: the next step then runs out again and preempts it at once, a loop in which no sequence
    advances —; "fail" when nothing runs and it still does not fit (its answer outgrew the whole pool); else
    None (it waits for room)."""
    if not running and not pool.can_admit(context_tokens):
        return "fail"
    if pool.can_admit(context_tokens + pool.block_size * running):
        return "resume"
    return None


S = TypeVar("S")


def next_batch(running: "OrderedDict[str, S]", max_batch: int) -> list[S]:
    """The sequences of the next step: the first `max_batch` in turn order, which then go to the back.

    Round robin over the running set (admissions join at the back): with R sequences running, none
    waits more than ceil(R / max_batch) - 1 steps between two of its turns.
    """
    batch = list(running.values())[:max_batch]
    for key in list(running)[:max_batch]:
        running.move_to_end(key)
    return batch


def chunk_tokens(*, remaining: int, rows: int, local_chunk: int, blocked: bool, pool: Pool) -> int:
    """How many tokens of the oldest uncomputed prompt (`remaining` still to compute, its last excluded: its
    first decode step feeds that) join this step beside `rows` stepping sequences; 0 for none.

    Small beside running sequences (`local_chunk`: their next token waits for it), prefill-sized when nothing
    runs; none after a chunk ran out of blocks until a sequence gives some back (`blocked`), and none that would
    not leave a block of growth for each row and the prompt."""
    if blocked or remaining <= 0:
        return 0
    n = min(local_chunk if rows else IDLE_PREFILL_CHUNK, remaining)
    return n if n and pool.can_admit(n + pool.block_size * (rows + 1)) else 0


def chunk_runs_alone(fed_rows: int, chunk_tokens: int, native_rows: int) -> bool:
    """Whether a prompt chunk runs in a forward of its own just before the step rather than in it: when the step
    alone (`fed_rows` rows) stays within the native CPU decoder's rows and with the chunk would not. On a CPU a
    mixed forward costs what the two cost apart, and the step keeps its fast path."""
    return fed_rows <= native_rows < fed_rows + chunk_tokens


def when_nothing_steps(*, prefilling: int, running: int, receiving: int) -> Literal["fail_prompt", "wait"]:
    """No sequence steps and no chunk fits. "fail_prompt": nothing runs, nothing arrives, and uncomputed prompts
    fill the pool, so the oldest is failed (its blocks free the rest); else "wait" for what brings room (a KV
    arriving, a sequence ending, a cancel)."""
    return "fail_prompt" if prefilling and not running and not receiving else "wait"


@dataclass(frozen=True)
class OutOfBlocksPlan:
    """What a step that ran out of KV blocks gives back: the chunk waits (`block_chunk`), or `preempt` (a key)
    gives its blocks back and waits to be recomputed."""

    block_chunk: bool = False
    preempt: str | None = None


def out_of_blocks(*, had_chunk: bool, live: Sequence[tuple[str, int]]) -> OutOfBlocksPlan:
    """A step ran out of KV blocks (nothing of it committed). With a prompt chunk in it, the chunk is what did not
    fit: the step goes again without one. Else the most recently admitted of the `live` (key, admission order)
    sequences is preempted — the oldest keep their progress; none when every one of them was cancelled."""
    if had_chunk:
        return OutOfBlocksPlan(block_chunk=True)
    if not live:
        return OutOfBlocksPlan()
    return OutOfBlocksPlan(preempt=max(live, key=lambda kv: kv[1])[0])


def draft_room(*, max_tokens: int, generated: int, prompt_tokens: int, max_context: int) -> int:
    """How many tokens a sequence may still draft this step: what its `max_tokens` and the model's context leave
    after the token the step commits anyway."""
    return min(max_tokens - generated - 1, max_context - prompt_tokens - generated - 1)


class EarlyCancels:
    """Cancels of requests this worker does not hold (yet): every decode worker hears every cancel, and the one
    whose offer is still on its way — a prefill worker frozen past its bound and thawed, a handoff in flight —
    must refuse it each time it comes (`in`: prefill offers a refused handoff again, to any decode worker), and
    one cancelled while its KV was on its way is dropped once it lands (`take`). Most never come (the request was
    another worker's), so the set is bounded: an id is forgotten `ttl_s` after its cancel, and past `most` ids the
    oldest go first. `clock` is injectable (seconds, monotonic)."""

    def __init__(self, ttl_s: float = 600.0, most: int = 65536, clock: Callable[[], float] | None = None):
        import time

        self.ttl_s, self.most = ttl_s, most
        self.clock = clock or time.monotonic
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, rid: str) -> None:
        self._ids[rid] = self.clock()
        self._ids.move_to_end(rid)
        self._expire()

    def take(self, rid: str) -> bool:
        """Whether `rid` was cancelled (and still remembered); a cancel is spent by the one request it names."""
        self._expire()
        return self._ids.pop(rid, None) is not None

    def __contains__(self, rid: str) -> bool:
        self._expire()
        return rid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._ids and (len(self._ids) > self.most or next(iter(self._ids.values())) < cutoff):
            self._ids.popitem(last=False)
