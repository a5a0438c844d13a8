"""The decode worker: accepts KV handoffs, continues generation, streams tokens back.

Per request: an offer arrives on NATS (fenced: layout, model fingerprint, sender identity and
generation) → the worker reserves a one-time transfer token on its data port and replies →
the KV arrives over the direct stream → the sequence joins the running batch. Every step is one
forward over the whole running batch (continuous batching: sequences join and leave between
steps), each sequence bringing its last token plus its own number k of draft tokens; one fused
verification call then accepts a prefix per sequence and the rejected KV is rolled back. When
the KV pool runs out, the most recently admitted sequence is preempted and later recomputed.
Once an offer is accepted this worker owns the request: if its KV never arrives intact, the
failure policy decides — recompute the prompt here, or fail the request with the reason. Offers come
on the worker's own subject (the front routed the request here) and, through a queue group, on the
model's (prefill re-routes there when the routed worker is gone or refused); a draining worker
leaves the queue group and refuses every new offer, so the request goes to a worker that stays.

Conditional disaggregation: when prefill's queue is long, it offers a prompt uncomputed (`kv_deferred`).
The worker takes it while its own queue of such prompts is shorter than prefill's, and computes it in
chunks of `--local-prefill-chunk` tokens mixed into its decode steps (one forward for both: the running
sequences' step reads the weights anyway), except where the step's rows run on the native CPU decoder
and the chunk would push it past that: then the chunk is its own forward beside the step. With nothing
running, a chunk runs alone and is larger. The
prompt's last token is left to the first decode step, which samples the first token as prefill would
have: the same draw from (seed, position 0).

A request with n > 1 choices arrives once, without a first token: its prompt's KV is imported
once, cut back by its last token, and forked (copy-on-write blocks) into n sequences, whose first
step feeds that last token again — the choices share the prompt's KV instead of recomputing it.
Options whose distributions depend on the tokens before (penalties, min_tokens, JSON) are applied
per sequence and, in a speculative step, per verified position with the drafts before it
counted (`pdserve.processors`), so drafts are verified against what plain decoding samples from.

(Longer than our ~600-line norm: admission, choice forking, the speculative step and streaming all
act on the one running batch between two steps; split apart, each piece would need the others' state.)
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from prometheus_client import Counter, Gauge, Histogram

from pdserve.basetypes import LayoutMismatch
from pdserve.config import DecodeConfig
from pdserve.cpulease import HOLD_WAIT_S, CpuLease
from pdserve.decode import scheduler
from pdserve.decode.drafters import Draft, make_drafter
from pdserve.decode.speculation import LatencyModel, SpanTracker, SpeculationController
from pdserve.engine import EngineUnavailable, OutOfBlocks, create_engine
from pdserve.kernels.spec_verify import verify, verify_greedy
from pdserve.kvtransfer.channel import KVReceiveChannel
from pdserve.kvtransfer.frames import TransferError
from pdserve.grammar import GrammarDeadEnd, GrammarVocab
from pdserve.kvtransfer.protocol import (
    DECODE_QUEUE_GROUP, WORKER_STOPPED, Cancel, HandoffOffer, HandoffReply, ProtocolError, StreamEvent, Subjects,
    Usage,
)
from pdserve.kvtransfer.tcp_server import KVReceiver
from pdserve.processors import SequenceProcessor, make_processor, token_logprobs
from pdserve.sampling import TextStream, choice_seed, sample_rows, verification_randomness
from pdserve.workerbase import WorkerBase, run_worker
from pdserve import logs, tracing

log = logging.getLogger("pdserve.decode")
OFFER_DRAIN_S = 2.0  # at most this long to answer the offers NATS had already sent when leaving a subject
LOCAL_CHUNK_NATIVE = 256  # --local-prefill-chunk's default on the native CPU decoder
LOCAL_CHUNK_DEFAULT = 64  # … elsewhere
# Grammar-forced drafts: at most this many a step, taken by the speculation policy as accepted with this
# probability (the grammar allows nothing else; the model may still split the forced text into other tokens)
FORCED_MAX_K = 8
FORCED_ALPHA = 0.95


_ADMISSIONS = itertools.count()


@dataclass
class EventSeq:
    """The next StreamEvent sequence number of a request: one counter for all its choices."""

    next: int

    def take(self) -> int:
        self.next += 1
        return self.next - 1


@dataclass
class Sequence:
    """One choice of a request being decoded (n = 1: the request itself)."""

    offer: HandoffOffer
    stream: TextStream
    events: EventSeq
    generated: list[int] = field(default_factory=list)
    index: int = 0  # the choice
    seed: int = 0  # this choice's sampling seed (`sampling.choice_seed`)
    processor: SequenceProcessor | None = None  # history-dependent logits processing, when the request needs any
    last_token_at: float = field(default_factory=time.monotonic)
    max_k: int = 0  # this request's speculation bound (0 = off)
    span: SpanTracker = field(default_factory=SpanTracker)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    forced_drafts: bool = False  # the grammar's forced tokens are proposed as drafts
    forced_draft_tokens: int = 0
    forced_accepted_tokens: int = 0
    admitted: int = field(default_factory=lambda: next(_ADMISSIONS))  # admission order, for preemption
    last_step: int = -1  # the decode step that last included it (-1: none yet)
    prefilled: int = 0  # an uncomputed prompt (`kv_deferred`): its tokens computed here so far
    # tracing (`pdserve.tracing`), None when the request is not traced: its request's spans, its steps' group,
    # and when (ns) it began waiting for its next step or was preempted (0: not now)
    trace: tracing.RequestSpans | None = None
    step_spans: tracing.StepGroup | None = None
    queued_ns: int = 0
    preempted_ns: int = 0

    @property
    def context(self) -> list[int]:
        """Prompt + everything generated so far (what drafters look up in)."""
        return self.offer.prompt_token_ids + self.generated

    @property
    def request_id(self) -> str:
        return self.offer.request_id

    @property
    def key(self) -> str:
        """The sequence's id in the engine, the running set, the drafter and the controller."""
        return self.request_id if self.offer.sampling.n == 1 else f"{self.request_id}#{self.index}"

    @property
    def last_token(self) -> int:
        """What the next step feeds first: the last generated token (the prompt's last before any)."""
        return self.generated[-1] if self.generated else self.offer.prompt_token_ids[-1]


class DecodeWorker(WorkerBase):
    role = "decode"
    settings = DecodeConfig
    args: DecodeConfig

    def __init__(self, args: DecodeConfig):
        super().__init__(args)
        self.receiver = KVReceiver(self.runner.layout, host=args.data_host, port=args.data_port,
                                   advertise_host=args.advertise_host, advertise_port=args.advertise_port, stall_timeout=args.kv.timeout,
                                   shm_pool_bytes=args.kv.shm_pool_bytes, keep_idle_s=args.kv.keep_idle_s,
                                   max_kept=args.kv.max_kept)
        self.transfer_timeout = args.kv.timeout
        self.max_running = args.max_running
        self.kv_capacity = args.kv_capacity_bytes
        self._stepping: set[str] = set()
        # requests from their offer's arrival (reserved before any await) until their sequences run: offer
        # being answered, or accepted with the KV on its way
        self._receiving_offers: dict[str, HandoffOffer] = {}
        self._resuming: Sequence | None = None  # a preempted sequence whose KV is being recomputed
        self.receiving_tokens = 0  # prompt tokens of accepted handoffs not yet in the pool
        # uncomputed prompts (`kv_deferred`), oldest first: computed chunk by chunk in the decode steps
        self.prefilling: OrderedDict[str, Sequence] = OrderedDict()
        self._chunk_blocked = False  # a chunk ran out of KV blocks: none until a sequence gives some back
        self.draining = False
        self._own_offers = None  # offers routed here, left at the stop
        self._any_offers = None  # the model's queue group, left on drain
        self.running: OrderedDict[str, Sequence] = OrderedDict()
        self.receiving = 0
        self._cancelled = scheduler.EarlyCancels()  # cancels of requests not (yet) held here
        self._traces: dict[str, tracing.RequestSpans] = {}  # request id -> its spans here (only while tracing)
        self._wake = asyncio.Event()
        self._recent_itl: deque[float] = deque(maxlen=64)
        self.spec_method = args.spec.method
        self.spec_max_k = args.spec.max_k if args.spec.method != "none" else 0
        try:
            # no prefix cache: decode never looks prompts up, and cached blocks would fragment the free space
            self.engine = create_engine(self.runner, kind=args.engine, kv_capacity_bytes=args.kv_capacity_bytes,
                                        prefix_cache=False, small_step_weights=args.cpu_weight_layouts)
        except EngineUnavailable as e:
            raise SystemExit(str(e)) from None
        self.pool = scheduler.Pool(self.engine.can_admit, self.engine.layout.block_size)  # what scheduling asks of it
        # An uncomputed prompt's chunk beside running sequences: where steps run the native CPU decoder a chunk
        # rides in the same forward at the projections' full rate, and a larger one amortises the step's read of
        # the weights over more prompt tokens (docs/PERFORMANCE.md, "Conditional disaggregation"); elsewhere a
        # small one keeps the running sequences' ITL down.
        self.local_chunk = (args.local_prefill_chunk if args.local_prefill_chunk is not None
                            else LOCAL_CHUNK_NATIVE if self.engine.native_rows() > 0 else LOCAL_CHUNK_DEFAULT)
        self.max_batch = args.max_batch
        self.preempted: deque[Sequence] = deque()
        # held from the first step after idle until idle again; a co-located prefill borrows it meanwhile
        self.lease = CpuLease(args.cpu_lease) if args.cpu_lease else None
        if self.lease is not None:
            self.lease.offer(args.threads)
        self.spec_k_policy = args.spec.k_policy
        self.drafter = self._make_drafter(args)
        self.step_profile = None
        # measured once per model, device and dtype, then cached: the step costs choose k; the fastest weight
        # layout per row count is what plain decode gains too (docs/PERFORMANCE.md, "CPU weight layouts")
        if args.spec.calibrate and (self.spec_max_k or len(self.engine.step_layouts()) > 1):
            from pdserve.engine.calibrate import calibrated

            self.step_profile = calibrated(self.engine, max_k=self.spec_max_k)
            self.engine.release_unplanned_layouts()
        if self.lease is not None and self.engine.native_rows() > 0:
            from pdserve.kernels import cpu_decoder

            # prefill's threads while it has no prompt (pdserve.cpulease): a burst's decode tail runs on both cores
            cpu_decoder.set_lender(self.lease.idle_word())
        self.controller = SpeculationController(method=args.spec.method, latency=LatencyModel(
            step_costs=self.step_profile.cost if self.step_profile else None))
        # The fused Triton verifier on GPUs; the torch reference (same function) on the CPU.
        self.verify_impl = "triton" if self.runner.device.type == "cuda" else "reference"
        r = self.registry
        self.m_tokens = Counter("pdserve_decode_tokens_total", "tokens generated by decode", registry=r)
        self.m_running = Gauge("pdserve_decode_running_sequences", "sequences being decoded", registry=r)
        Gauge("pdserve_decode_kv_utilization", "KV capacity in use (0-1)", registry=r
              ).set_function(lambda: self.engine.utilization())
        Gauge("pdserve_decode_waiting_sequences", "sequences waiting: KV in flight, prompt being computed here, "
              "or preempted", registry=r).set_function(lambda: self.receiving + len(self.prefilling) + len(self.preempted))
        Gauge("pdserve_decode_local_prefill_queue_tokens", "tokens of uncomputed prompts still to compute here",
              registry=r).set_function(lambda: self._local_queued())
        Gauge("pdserve_transfer_backlog_handoffs", "KV handoffs being received", registry=r
              ).set_function(lambda: self.receiving)
        self.m_kv_bytes = Counter("pdserve_kv_transfer_received_bytes_total",
                                  "KV bytes received from prefill (uncompressed)", registry=r)
        self.m_kv_wire = Counter("pdserve_kv_transfer_wire_bytes_total", "bytes the received KV took on the wire",
                                 ["transport", "compression"], registry=r)
        self.m_preempted = Counter("pdserve_decode_preemptions_total", "sequences preempted for KV room",
                                   registry=r)
        self.m_recompute = Counter("pdserve_kv_recompute_total", "handoffs whose KV was lost and recomputed", registry=r)
        self.m_kv_failed = Counter("pdserve_kv_transfer_failures_total", "KV transfers that failed, by side",
                                   ["side"], registry=r)
        self.m_kv_failed.labels("receiver")  # a zero from the start: a rate over it is 0, not absent
        self.m_handoffs = Counter("pdserve_decode_handoffs_total", "handoff offers", ["outcome"], registry=r)
        self.m_local = Counter("pdserve_decode_local_prefills_total", "prompts prefill handed over uncomputed "
                               "(its queue was long) and computed here, by outcome", ["outcome"], registry=r)
        self.m_local_tokens = Counter("pdserve_decode_local_prefill_tokens_total", "prompt tokens computed here "
                                      "(conditional disaggregation)", registry=r)
        self.m_forks = Counter("pdserve_decode_choice_forks_total", "choices (n > 1) started from a request's "
                               "shared prompt KV", registry=r)
        self.steps = 0
        self.m_wait_steps = Histogram("pdserve_decode_wait_steps", "steps a running sequence sat out between two "
                                      "of its turns (round robin: at most ceil(running / max_batch) - 1)",
                                      registry=r, buckets=(0, 1, 2, 4, 8, 16, 32))
        self.m_itl = Histogram("pdserve_decode_step_seconds", "time per decode step of one sequence (1+ tokens)",
                               registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2))
        self.m_lease_wait = Histogram("pdserve_decode_cpu_lease_wait_seconds", "waits to take the CPU lease back "
                                      "from prefill's borrowed step, after being idle", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5))
        self.m_spec_draft = Counter("pdserve_spec_draft_tokens_total", "draft tokens proposed", ["span"], registry=r)
        self.m_forced_draft = Counter("pdserve_spec_forced_draft_tokens_total",
                                      "draft tokens a request's grammar forced", registry=r)
        self.m_forced_accepted = Counter("pdserve_spec_forced_accepted_tokens_total",
                                         "grammar-forced draft tokens accepted", registry=r)
        self.m_spec_accepted = Counter("pdserve_spec_accepted_tokens_total", "draft tokens accepted", ["span"],
                                       registry=r)
        self.m_spec_rate = Histogram("pdserve_spec_acceptance_rate", "accepted/proposed per verified step",
                                     registry=r, buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
        if self.drafter.stats is not None:
            r.register(self.drafter.stats)  # the draft pool's asks, round trips and acceptance by drafter
        self.m_spec_k = Histogram("pdserve_spec_chosen_k", "speculation length chosen per step", registry=r,
                                  buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16))

    def _make_drafter(self, args: DecodeConfig):
        if args.spec.method == "draft":  # DecodeConfig makes sure a draft model is named
            from pdserve.modelstore import resolve_model

            # refused here, at load, if its tokenizer differs from the target's; its forwards run off
            # the event loop, which must keep heartbeats and token streams flowing meanwhile
            return make_drafter("draft", path=str(resolve_model(args.spec.draft_model)),
                                target_tokenizer=self.runner.tokenizer, run_in_thread=True)
        if args.spec.draft_pool:  # DecodeConfig makes sure the method is ngram
            from pdserve.decode.pool_drafter import PoolDrafter

            # the pool may take at most a quarter of a plain step: a slow pool costs little, a dead one nothing
            return PoolDrafter(make_drafter("ngram"), tenant_of=self._tenant, timeout_s=args.spec.draft_pool_timeout,
                               budget_s=lambda: 0.25 * self.controller.latency.verify_seconds(1, 0))
        return make_drafter(args.spec.method)

    def _tenant(self, key: str) -> str:
        """Whose text may draft for the sequence `key` (draft pool): its scope and the tenant its request names."""
        s = self.running.get(key)
        tenant = ((s.offer.spec or {}).get("tenant") if s else None) or "default"
        return f"{self.scope}/{tenant}"

    def data_addr(self) -> str | None:
        return self.receiver.address if self.receiver.port else None

    def load_fields(self) -> dict:
        util = self.engine.utilization()
        return dict(running=len(self.running), waiting=self.receiving + len(self.prefilling) + len(self.preempted),
                    kv_utilization=util, kv_bytes_used=int(util * self.kv_capacity),
                    kv_bytes_capacity=self.kv_capacity, transfer_backlog_handoffs=self.receiving,
                    itl_seconds=sum(self._recent_itl) / len(self._recent_itl) if self._recent_itl else 0.0,
                    spec_acceptance_rate=self._acceptance_rate())

    def _acceptance_rate(self) -> float:
        st = self.controller.stats
        drafted = sum(st.draft_tokens.values())
        return sum(st.accepted_tokens.values()) / drafted if drafted else 0.0

    async def on_start(self) -> None:
        await self.receiver.start()
        self.kv_channel = KVReceiveChannel(self.receiver, self.nc, scope=self.scope, worker_id=self.worker_id,
                                           stall_timeout=self.transfer_timeout,
                                           compressions=dict.fromkeys(("none", self.args.kv.compression)))
        self._own_offers = await self.nc.subscribe(Subjects.decode_handoff(self.scope, self.worker_id),
                                                   cb=self._on_offer)
        self._any_offers = await self.nc.subscribe(Subjects.decode_handoff_any(self.scope, self.model_name),
                                                   queue=DECODE_QUEUE_GROUP, cb=self._on_offer)
        await self.nc.subscribe(Subjects.cancel_all(self.scope), cb=self._on_cancel)
        self.drafter.attach(self.nc, self.scope, self.model_name)
        self.spawn(self._decode_loop(), background=True)

    def busy(self) -> bool:
        """Sequences decoding, preempted, being resumed or prefilled here, or a request whose offer is being answered or
        whose KV is on its way. Each of those is a client waiting on this worker: the drain must not end
        under it, or the worker exits holding it and the client learns only that it went silent."""
        return (bool(self.running) or bool(self.preempted) or bool(self.prefilling) or self._resuming is not None
                or self.receiving > 0 or bool(self._receiving_offers) or super().busy())

    def held_requests(self) -> list[tuple[str, str | None]]:
        return [(s.request_id, s.offer.front_id) for s in (*self.running.values(), *self.prefilling.values(),
                                                           *self.preempted, *filter(None, [self._resuming]))] \
            + [(rid, o.front_id) for rid, o in self._receiving_offers.items()]

    async def on_drain(self) -> None:
        """Refuse new offers from now on (prefill re-routes them: a request routed here before the `bye`
        still reaches a worker that stays) and leave the model's queue group; finish what is held."""
        self.draining = True
        await self._leave(self._any_offers)

    async def _leave(self, sub) -> None:
        """End an offer subscription without losing an offer: the server stops sending (a later offer
        finds no responder, which prefill re-routes at once), and what it already sent is answered."""
        if sub is None or not self.nc.is_connected:  # NATS gone: nothing more arrives, nothing can be answered
            return
        try:
            await asyncio.wait_for(sub.drain(), OFFER_DRAIN_S)
        except Exception as e:  # NATS lost meanwhile, or too slow
            log.debug("offer subscription drain: %s", e)

    async def on_stop(self) -> None:
        """Past the drain timeout: fail every request still held, naming why: sequences decoding, preempted,
        being resumed or prefilled, and requests whose KV had not arrived (their receive is cancelled next)."""
        await self._leave(self._own_offers)
        error = dict(kind="error", error=f"decode worker {self.worker_id} stopped before finishing the request "
                     f"(drain timeout {self.args.drain_timeout:g} s)", error_type=WORKER_STOPPED, status=503)
        held = [*self.running.values(), *self.prefilling.values(), *self.preempted,
                *([self._resuming] if self._resuming else [])]
        for s in held:
            await self._emit(s, **error)
        for rid, offer in list(self._receiving_offers.items()):
            if not any(s.request_id == rid for s in held):  # nothing of it published by this worker yet
                await self._publish(rid, offer.next_seq, **error)
        await self.receiver.close()
        if self.lease is not None:
            self.lease.close()

    # -- handoffs --------------------------------------------------------------------------

    async def _on_offer(self, msg) -> None:
        def refuse(reason: str, level: int = logging.WARNING) -> HandoffReply:
            self.m_handoffs.labels("refused").inc()
            log.log(level, "handoff refused: %s", reason)
            return HandoffReply(accepted=False, worker_id=self.worker_id, error=reason)

        try:
            offer = HandoffOffer.decode(msg.data)
        except ProtocolError as e:
            await msg.respond(refuse(str(e)).encode())
            return
        with logs.request(offer.request_id):
            await self._answer_offer(msg, offer, refuse)

    async def _answer_offer(self, msg, offer: HandoffOffer, refuse) -> None:
        t_offer = tracing.now_ns() if tracing.enabled() else 0
        if self.draining:
            await msg.respond(refuse(f"decode worker {self.worker_id} is draining").encode())
            return
        if offer.request_id in self._cancelled:
            # cancelled before it was offered: a prefill worker frozen past its bound thawed with a request the
            # front has since moved elsewhere (or whose client went away); its KV is not wanted. Remembered, not
            # spent: prefill offers a refused handoff again, to any decode worker (this one too, through the queue
            # group), and each must refuse it
            await msg.respond(refuse(f"request {offer.request_id} was cancelled before its handoff",
                                     logging.INFO).encode())
            return
        if self._holds(offer.request_id):
            # A second offer of a request this worker owns: prefill re-offered it (its first offer's reply was
            # lost, e.g. across a NATS restart). One owner per request: the first stays, this one is refused.
            await msg.respond(refuse(f"decode worker {self.worker_id} already holds request "
                                     f"{offer.request_id}").encode())
            return
        self.fronts.vouch(offer.front_id)
        self._receiving_offers[offer.request_id] = offer  # reserved now: a duplicate during the awaits below is refused
        accepted = False
        try:
            queued = self._local_queued(but=offer.request_id)
            load = scheduler.Load(running=len(self.running), prefilling=len(self.prefilling), receiving=self.receiving,
                                  receiving_tokens=self.receiving_tokens, queued_tokens=queued,
                                  preempted=len(self.preempted), kv_utilization=self.engine.utilization())
            if why := scheduler.offer_refusal(tokens=offer.num_tokens, choices=offer.sampling.n, load=load,
                                              max_running=self.max_running, pool=self.pool):
                await msg.respond(refuse(why).encode())
                return
            if offer.kv_deferred:
                try:  # a prompt of another model's shape: a deployment mistake, worth its warning
                    self.runner.layout.check_matches(offer.layout)
                except LayoutMismatch as e:
                    await msg.respond(refuse(str(e)).encode())
                    return
                if why := scheduler.local_refusal(
                        prompt_tokens=len(offer.prompt_token_ids), choices=offer.sampling.n,
                        offered_tokens=offer.num_tokens, queue_ahead_tokens=offer.queue_ahead_tokens,
                        queued_tokens=queued, running=len(self.running), max_batch=self.max_batch,
                        local_chunk=self.local_chunk):
                    # routine: prefill offers its queue's prompts (again once per step) and keeps what decode
                    # would not compute sooner; the refusals are counted, not worth a warning each
                    await msg.respond(refuse(why, logging.DEBUG).encode())
                    return
                accepted = True
                self._start_trace(offer, t_offer)
                await msg.respond(HandoffReply(accepted=True, worker_id=self.worker_id).encode())
                self.m_handoffs.labels("accepted").inc()
                self.spawn(self._take_prompt(offer))
                return
            try:
                reply = await self.kv_channel.expect(offer)  # picks the transport and compression
            except (LayoutMismatch, TransferError) as e:
                await msg.respond(refuse(str(e)).encode())
                return
            token = reply.transfer_token
            first = None
            if offer.first_token_pending:  # subscribed before replying, so prefill's seq-0 event cannot be missed
                first = await self._watch_first_token(offer)
            self.receiving += 1
            self.receiving_tokens += offer.num_tokens
            accepted = True
            self._start_trace(offer, t_offer)
            await msg.respond(reply.encode())
            self.m_handoffs.labels("accepted").inc()
            self.spawn(self._receive(offer, token, time.monotonic(), first))
        finally:
            if not accepted:
                self._receiving_offers.pop(offer.request_id, None)

    def _start_trace(self, offer: HandoffOffer, start_ns: int) -> None:
        """The request's `decode.request` span from its offer's arrival, when traced."""
        spans = tracing.start_request("decode.request", offer.traceparent, start_ns=start_ns, **{
            "pdserve.request_id": offer.request_id, "pdserve.worker": self.worker_id,
            "pdserve.sender": offer.sender_id, "pdserve.kv_deferred": offer.kv_deferred,
            "gen_ai.usage.input_tokens": len(offer.prompt_token_ids)})
        if spans is not None:
            spans.open_choices = offer.sampling.n
            self._traces[offer.request_id] = spans

    def _end_trace(self, request_id: str, error: str | None = None) -> None:
        spans = self._traces.pop(request_id, None)
        if spans is not None:
            spans.end(error=error, **{f"pdserve.{k}": v for k, v in spans.marks.items() if k != "start"})

    def _sequence_ends(self, s: Sequence, fields: dict) -> None:
        """A traced sequence's last event (done or error) is going out: its steps' last span, and the
        request's span once every choice has ended."""
        s.step_spans.flush()
        m = s.trace.marks
        for k, v in (("tokens", len(s.generated)), ("spec.drafted", s.draft_tokens), ("spec.accepted", s.accepted_tokens)):
            m[k] = m.get(k, 0) + v
        s.trace.open_choices -= 1
        if fields["kind"] == "error" or s.trace.open_choices <= 0:
            self._end_trace(s.request_id, fields.get("error"))
        s.trace = None

    def _local_queued(self, but: str | None = None) -> int:
        """Tokens of the uncomputed prompts this worker holds still to compute, accepted ones not yet
        queued included (all but request `but`'s)."""
        todo = sum(len(s.offer.prompt_token_ids) - s.prefilled for s in self.prefilling.values())
        return todo + sum(o.num_tokens for rid, o in self._receiving_offers.items() if o.kv_deferred and rid != but)

    async def _take_prompt(self, offer: HandoffOffer) -> None:
        """An uncomputed prompt just accepted: say on its stream that this worker now answers for it, and
        queue it for the decode loop, which computes it in chunks between (and within) its steps."""
        rid = offer.request_id
        logs.bind(rid)  # this task serves this request only
        try:
            seqs = await self._continuation(offer, None)  # one, with nothing generated yet
            await self._emit(seqs[0], kind="handoff", kv_bytes=0, kv_seconds=0.0)
            if self._cancelled.take(rid):
                self.m_local.labels("cancelled").inc()
                return
            self.prefilling[seqs[0].key] = seqs[0]
            self._wake.set()
        except Exception as e:
            log.exception("taking the uncomputed prompt of %s failed", rid)
            await self._publish(rid, offer.next_seq, kind="error", error=f"decode could not take the prompt: {e}",
                                error_type="unavailable", status=503)
        finally:
            self._receiving_offers.pop(rid, None)

    async def _watch_first_token(self, offer: HandoffOffer):
        """Layer-streamed offer: (future of the first token's ids — None if prefill ended the request
        itself —, the subscription) from prefill's events on the request's stream."""
        fut = asyncio.get_running_loop().create_future()

        async def on_event(msg) -> None:
            try:
                ev = StreamEvent.decode(msg.data)
            except ProtocolError:
                return
            if ev.worker_id != offer.sender_id or fut.done():
                return
            if ev.kind == "token" and ev.seq == 0:
                fut.set_result(list(ev.token_ids))
            elif ev.kind in ("done", "error"):
                fut.set_result(None)

        sub = await self.nc.subscribe(Subjects.stream(self.scope, offer.request_id), cb=on_event)
        return fut, sub

    async def _first_token(self, offer: HandoffOffer, first) -> bool:
        """Layer-streamed offer: wait (bounded) for prefill's first token and put it in the offer.
        False if there is nothing to continue: prefill finished or failed the request itself, or went
        silent (it is still the responsible worker then: the front reports it)."""
        fut, sub = first
        try:
            ids = await asyncio.wait_for(fut, self.transfer_timeout)
        except asyncio.TimeoutError:
            log.warning("first token of %s never came from %s", offer.request_id, offer.sender_id)
            ids = None
        finally:
            await sub.unsubscribe()
        if not ids:
            return False
        offer.generated_token_ids = ids
        return True

    async def _receive(self, offer: HandoffOffer, token: str, accepted_at: float, first=None) -> None:
        rid = offer.request_id
        logs.bind(rid)  # this task serves this request only
        spans = self._traces.get(rid)
        seqs: list[Sequence] = []
        try:
            try:
                t_wait = tracing.now_ns() if spans is not None else 0
                kv, stats = await self.kv_channel.wait(token, self.transfer_timeout)
                if spans is not None:
                    spans.child("handoff.import", t_wait, **{
                        "pdserve.kv.bytes": stats["bytes"], "pdserve.kv.wire_bytes": stats["wire_bytes"],
                        "pdserve.kv.transport": stats["transport"], "pdserve.kv.compression": stats["compression"]})
                self.m_kv_bytes.inc(stats["bytes"])  # received, whether or not there is anything to continue
                self.m_kv_wire.labels(stats["transport"], stats["compression"]).inc(stats["wire_bytes"])
                if not (seqs := await self._continuation(offer, first)):
                    self._end_trace(rid)  # prefill ended the request itself
                    return
                t_admit = tracing.now_ns() if spans is not None else 0
                await self.compute(self._admit, offer, seqs, kv)
                if spans is not None:
                    spans.child("decode.admission", t_admit, **{"pdserve.choices": len(seqs),
                                                                "pdserve.prompt_tokens": len(offer.prompt_token_ids)})
                del kv
                # handoff time as decode sees it: offer accepted -> KV in place, ready to decode
                await self._emit(seqs[0], kind="handoff", kv_bytes=stats["bytes"],
                                 kv_seconds=time.monotonic() - accepted_at, **self._moved_kv(offer))
            except TransferError as e:
                self.m_kv_failed.labels("receiver").inc()
                if spans is not None:
                    spans.child("handoff.import", t_wait, error=str(e))
                if not (seqs := await self._continuation(offer, first)):
                    self._end_trace(rid)
                    return
                if offer.failure_policy != "recompute":
                    await self._emit(seqs[0], kind="error", error=f"KV handoff failed: {e}",
                                     error_type="kv_transfer_error", status=502)
                    return
                log.warning("KV for %s lost (%s); recomputing the prompt here", rid, e)
                self.m_recompute.inc()
                await self._emit(seqs[0], kind="handoff", kv_bytes=0, kv_seconds=0.0,
                                 **self._moved_kv(offer, recomputed=True))
                t_admit = tracing.now_ns() if spans is not None else 0
                await self.compute(self._admit, offer, seqs, None)
                if spans is not None:
                    spans.child("decode.admission", t_admit, **{"pdserve.recomputed": True,
                                                                "pdserve.prompt_tokens": len(offer.prompt_token_ids)})
            except Exception as e:  # e.g. the pool filled up while the KV was in flight
                log.exception("admitting %s failed", rid)
                for key in {rid, *(s.key for s in seqs)}:
                    if key in self.engine:
                        self.engine.free(key)
                await self._publish(rid, seqs[0].events.take() if seqs else offer.next_seq, kind="error",
                                    error=f"decode could not admit the request: {e}", error_type="unavailable",
                                    status=503)
                return
        finally:
            self.receiving -= 1
            self.receiving_tokens -= offer.num_tokens
            self._receiving_offers.pop(rid, None)
            self._wake.set()  # admitted, or failed: either changes what the loop can do
        if self._cancelled.take(rid):
            for s in seqs:
                self.engine.free(s.key)
            self._end_trace(rid, "cancelled")
            return
        for s in seqs:
            if s.trace is not None:
                s.queued_ns = tracing.now_ns()
            self.running[s.key] = s
        self.m_running.set(len(self.running))
        self._wake.set()

    @staticmethod
    def _moved_kv(offer: HandoffOffer, recomputed: bool = False) -> dict:
        """A moved request's "handoff" event says where its KV came from (`HandoffOffer.cached_tokens`)."""
        if not offer.resumed:
            return {}
        return {"cached_tokens": 0, "fetched_tokens": 0} if recomputed else \
            {"cached_tokens": offer.cached_tokens, "fetched_tokens": offer.fetched_tokens}

    def _holds(self, request_id: str) -> bool:
        """Whether this worker already owns `request_id`: its KV on the way, or a sequence of it running,
        preempted or in the engine."""
        return (request_id in self._receiving_offers or request_id in self.engine
                or any(s.request_id == request_id
                       for s in (*self.running.values(), *self.prefilling.values(), *self.preempted)))

    async def _continuation(self, offer: HandoffOffer, first) -> list[Sequence]:
        """The sequences decode continues (one per choice), or none when there is nothing to continue:
        a layer-streamed offer whose first token never came (`_first_token`), or a first token that
        already ended the request (a stop: prefill reported "done")."""
        if first is not None and not await self._first_token(offer, first):
            return []
        if offer.sampling.guided is not None:  # compiled once per grammar, off the event loop
            await asyncio.to_thread(GrammarVocab.compiled, self.runner.tokenizer, self.runner.vocab_size,
                                    self.runner.eos_token_ids, offer.sampling.guided)
        seqs = self._sequences(offer)
        if all(s.stream.done for s in seqs):
            if offer.resumed:  # the tokens the client has already end it: nobody else will say so
                for s in seqs:
                    await self._emit_done(s)
            return []
        return seqs

    def _sequences(self, offer: HandoffOffer) -> list[Sequence]:
        events, params, tok = EventSeq(offer.next_seq), offer.sampling, self.runner.tokenizer
        out = []
        for i in range(params.n):
            generated = list(offer.generated_token_ids)  # the first token with n = 1; none with n > 1
            stream = TextStream(tok, params, self.runner.eos_token_ids, generated=generated)
            proc = make_processor(params, offer.prompt_token_ids, generated, self.runner.vocab_size, tok,
                                  self.runner.eos_token_ids)
            out.append(Sequence(offer, stream, events, generated, index=i, seed=choice_seed(offer.seed, i),
                                processor=proc, max_k=self._request_max_k(offer),
                                forced_drafts=self._request_forced(offer)))
            if (spans := self._traces.get(offer.request_id)) is not None:
                out[-1].trace, out[-1].step_spans = spans, tracing.StepGroup(spans)
        return out

    def _admit(self, offer: HandoffOffer, seqs: list[Sequence], kv) -> None:
        """Put a request's prompt KV in the engine (compute thread): the received `kv`, or recomputed when
        None. With n > 1 each choice forks it, less the prompt's last token, which its first step feeds."""
        rid = offer.request_id
        if kv is None:
            self.engine.prefill(rid, offer.kv_token_ids)
        else:
            self.engine.import_kv(rid, kv, offer.kv_token_ids)
        if offer.sampling.n == 1:
            return
        try:
            self.engine.rollback(rid, len(offer.prompt_token_ids) - 1)
            for s in seqs:
                self.engine.fork(rid, s.key)  # copy-on-write blocks where the engine has them, else a copy
                self.m_forks.inc()
        except BaseException:
            for s in seqs:
                if s.key in self.engine:
                    self.engine.free(s.key)
            raise
        finally:
            self.engine.free(rid)

    def _request_max_k(self, offer: HandoffOffer) -> int:
        spec = offer.spec or {}
        if not spec.get("enabled", True) or spec.get("method") == "none":
            return 0
        return min(self.spec_max_k, spec.get("max_k", self.spec_max_k))

    @staticmethod
    def _request_forced(offer: HandoffOffer) -> bool:
        spec = offer.spec or {}
        return offer.sampling.guided is not None and spec.get("enabled", True) and spec.get("forced", True)

    async def _on_cancel(self, msg) -> None:
        try:
            rid = Cancel.decode(msg.data).request_id
        except ProtocolError:
            return
        found = False
        for s in [s for s in self.running.values() if s.request_id == rid]:
            found = True
            del self.running[s.key]
            if s.key not in self._stepping:  # else the step in flight uses its KV; the loop releases it after
                self._release(s)  # its blocks are free at once
        for s in [p for p in self.preempted if p.request_id == rid]:
            found = True
            self.preempted.remove(s)
            self._release(s)
        for s in [p for p in self.prefilling.values() if p.request_id == rid]:
            found = True
            del self.prefilling[s.key]
            self.m_local.labels("cancelled").inc()
            if s.key not in self._stepping:  # else its chunk is in the step in flight; the loop releases it after
                self._release(s)
        if not found:
            self._cancelled.add(rid)
        elif self._traces:
            self._end_trace(rid, "cancelled")

    def _release(self, s: Sequence) -> None:
        self._chunk_blocked = False  # blocks given back: an uncomputed prompt's chunk may fit again
        self._wake.set()  # … and a loop waiting for room looks again
        self.drafter.release(s.key)
        self.controller.release(s.key)
        if s.key in self.engine:  # a preempted sequence gave its blocks back already
            self.engine.free(s.key)
        self.m_running.set(len(self.running))

    async def _publish(self, request_id: str, seq: int, **fields) -> None:
        if self._traces and fields["kind"] == "error":
            self._end_trace(request_id, fields.get("error"))
        await self.nc.publish(Subjects.stream(self.scope, request_id),
                              StreamEvent(request_id=request_id, seq=seq, worker_id=self.worker_id, **fields).encode())

    async def _emit(self, s: Sequence, **fields) -> None:
        if s.trace is not None and fields["kind"] in ("done", "error"):
            self._sequence_ends(s, fields)
        await self._publish(s.request_id, s.events.take(), index=s.index, **fields)

    async def _emit_done(self, s: Sequence) -> None:
        await self._emit(s, kind="done", finish_reason=s.stream.finish_reason,
                         usage=Usage(prompt_tokens=len(s.offer.prompt_token_ids), completion_tokens=len(s.generated),
                                     spec_draft_tokens=s.draft_tokens, spec_accepted_tokens=s.accepted_tokens,
                                     forced_draft_tokens=s.forced_draft_tokens,
                                     forced_accepted_tokens=s.forced_accepted_tokens))

    # -- the decode loop -------------------------------------------------------------------

    async def _plan(self, s: Sequence):
        """Choose this step's k for `s` and draft that many tokens; None for a plain step."""
        rid = s.key
        room = scheduler.draft_room(max_tokens=s.offer.sampling.max_tokens, generated=len(s.generated),
                                    prompt_tokens=len(s.offer.prompt_token_ids), max_context=self.runner.max_context)
        if s.forced_drafts and room > 0:
            forced = s.processor.grammar.forced(min(FORCED_MAX_K, room))
            if forced:  # free to propose, and near-certain: verified like any draft, so exactness holds
                k = self.controller.choose_k(rid, s.span.kind, len(self.running), len(forced), alpha_hint=FORCED_ALPHA)
                if k:
                    self.m_spec_k.observe(k)
                    return Draft(forced[:k], forced=True)
        if not s.max_k or room <= 0:
            self.m_spec_k.observe(0)
            return None
        sampling = s.offer.sampling
        max_k = min(s.max_k, room)
        if self.drafter.model_free and self.spec_k_policy == "adaptive":
            # A model-free proposal costs microseconds: propose first, then let the controller cut it
            # to what pays, using the drafter's confidence in this very proposal.
            t0 = time.perf_counter()
            draft = await self.drafter.propose(rid, s.context, max_k, sampling)
            self.controller.observe_draft(max(1, len(draft.token_ids)), time.perf_counter() - t0)
            k = 0
            if draft.token_ids and (hint := self.drafter.confidence(rid)) is not None:
                k = self.controller.choose_k(rid, s.span.kind, len(self.running), len(draft.token_ids),
                                             alpha_hint=hint)
            self.drafter.trim(rid, k)
            draft.token_ids = draft.token_ids[:k]
            self.m_spec_k.observe(k)
            return draft if k else None
        if self.spec_k_policy == "fixed":
            k = max_k
        else:
            k = self.controller.choose_k(rid, s.span.kind, len(self.running), max_k)
        self.m_spec_k.observe(k)
        if not k:
            return None
        t0 = time.perf_counter()
        draft = await self.drafter.propose(rid, s.context, k, sampling)
        self.controller.observe_draft(k, time.perf_counter() - t0)
        return draft if draft.token_ids else None

    def _forward_and_verify(self, batch: list[Sequence], drafts: list,
                            chunk: tuple[Sequence, list[int]] | None = None) -> list[tuple[list[int], list[dict] | None]]:
        """One forward over the whole batch, verification, rollback (compute thread).

        `chunk`: an uncomputed prompt's next tokens, computed in the same forward, or in one of its own just
        before where that keeps the step on the native CPU decoder (its sequence is opened in the engine on its
        first chunk); its logits are not needed. Either way, a step that fails leaves the chunk uncomputed.

        Sequence i feeds its last token plus its k_i draft tokens; row i accepts a prefix of the
        drafts and adds the correction or bonus token (k_i = 0: a plain sampled or greedy token,
        the same draw plain sampling makes). A sequence with history-dependent options has its
        rows processed first, row j as if drafts[:j] were generated. Greedy rows are verified
        right here by argmax and compare — exactly the verifier's greedy rule (first index on
        ties), without building its [B, K+1, V] tensors; sampled rows go through one fused
        verification call. Returns per sequence the committed tokens and, when asked for, their
        raw logprobs (`processors.token_logprobs`).
        """
        keys = [s.key for s in batch]
        kept = [self.engine.num_tokens(k) for k in keys]
        draft_ids = [d.token_ids if d else [] for d in drafts]
        rows = [(k, [s.last_token, *ids]) for k, s, ids in zip(keys, batch, draft_ids)]
        alone = None
        if chunk is not None:
            local, tokens = chunk
            if local.key not in self.engine:
                self.engine.start(local.key, local.offer.prompt_token_ids[:-1], reuse_prefix=False)
            if scheduler.chunk_runs_alone(sum(len(t) for _, t in rows), len(tokens), self.engine.native_rows()):
                alone = (local.key, tokens)
            else:
                rows.append((local.key, tokens))
        if alone is None:
            raw = self.engine.step(rows, last_only=[False] * len(batch) + [True] * (chunk is not None))[: len(batch)]
        else:
            before = self.engine.num_tokens(alone[0])
            self.engine.step([alone], last_only=True)
            try:
                raw = self.engine.step(rows)
            except BaseException:  # the step failed as a whole, chunk included: it is fed again next time
                self.engine.rollback(alone[0], before)
                raise
        logits = [s.processor.process(x, ids) if s.processor else x for s, x, ids in zip(batch, raw, draft_ids)]
        committed: list[list[int]] = [[] for _ in batch]
        sampled = []
        for i, s in enumerate(batch):
            if not s.offer.sampling.greedy:
                sampled.append(i)
                continue
            committed[i] = verify_greedy(logits[i], draft_ids[i])
        if sampled:
            for i, tokens in zip(sampled, self._verify_sampled([batch[i] for i in sampled],
                                                               [drafts[i] for i in sampled],
                                                               [logits[i] for i in sampled])):
                committed[i] = tokens
        for i, k in enumerate(keys):
            # keep the fed token and the accepted drafts; drop the rest
            self.engine.rollback(k, kept[i] + len(committed[i]))
        return [(tokens, token_logprobs(x, tokens, s.offer.sampling.logprobs)
                 if s.offer.sampling.logprobs is not None else None)
                for s, x, tokens in zip(batch, raw, committed)]

    def _verify_sampled(self, batch: list[Sequence], drafts: list, logits: list[torch.Tensor]) -> list[list[int]]:
        """The fused verification call for sampled rows: logits[i] is [k_i + 1, V]."""
        draft_ids = [d.token_ids if d else [] for d in drafts]
        B, K, V = len(batch), max(map(len, draft_ids)), logits[0].shape[-1]
        sp = [s.offer.sampling for s in batch]
        if K == 0 and self.verify_impl == "reference":
            # Nothing drafted (on the CPU): verification's k = 0 case is the race argmax(p / E) over each row's noise for
            # its position, which is plain sampling's draw, batched (`sample_rows`: natively in one pass for rows
            # without a cut, where torch took a large share of the step: docs/PERFORMANCE.md, "Sampling")
            return [[t] for t in sample_rows(torch.cat(logits), sp, [len(s.generated) for s in batch],
                                             [s.seed for s in batch])]
        min_p = torch.tensor([p.min_p for p in sp]) if any(p.min_p for p in sp) else None
        target = logits[0].new_zeros(B, K + 1, V)
        ids = torch.zeros(B, K, dtype=torch.long)
        num = torch.tensor([len(d) for d in draft_ids], dtype=torch.int32)
        with_probs = any(d is not None and d.probs is not None for d in drafts)
        probs = torch.zeros(B, K, V) if with_probs else None
        u, noise = torch.zeros(B, K), torch.ones(B, K + 1, V)
        for i, (s, d) in enumerate(zip(batch, drafts)):
            k = len(draft_ids[i])
            target[i, : k + 1] = logits[i]
            if k:
                ids[i, :k] = torch.tensor(draft_ids[i])
                if probs is not None and d.probs is not None:
                    probs[i, :k] = d.probs
            ui, ni = verification_randomness(s.seed, len(s.generated), k, V)
            u[i, :k], noise[i, : k + 1] = ui[0], ni[0]
        out, n_acc = verify(target, ids, num, probs, torch.tensor([p.temperature for p in sp]),
                            torch.tensor([p.top_k for p in sp], dtype=torch.int32),
                            torch.tensor([p.top_p for p in sp]), u, noise, min_p=min_p, impl=self.verify_impl)
        return [out[i, : int(n_acc[i]) + 1].tolist() for i in range(B)]

    async def _resume_preempted(self) -> None:
        """Bring preempted sequences back (recomputing their KV) once the pool has room; fail one that cannot
        fit even alone (its answer outgrew the whole pool)."""
        while self.preempted and (action := scheduler.resume_action(len(self.preempted[0].context), len(self.running),
                                                                     self.pool)):
            s = self.preempted.popleft()
            if action == "fail":
                log.warning("%s needs more KV than the pool holds (%d tokens); failing it", s.key, len(s.context))
                await self._emit(s, kind="error", status=503, error_type="unavailable",
                                 error=f"decode worker {self.worker_id}: the sequence outgrew its KV pool "
                                       f"({len(s.context)} tokens); retry with a smaller max_tokens")
                self._release(s)
                continue
            self._resuming = s
            try:
                await self.compute(self.engine.prefill, s.key, s.context[:-1])
            finally:
                self._resuming = None
            if s.request_id in self._cancelled:  # cancelled while its KV was recomputed (it was in neither set)
                if not any(p.request_id == s.request_id for p in self.preempted):
                    self._cancelled.take(s.request_id)
                self._release(s)
                continue
            s.last_step = -1  # it waited for memory, not for its turn: a fresh start in the rotation
            self.running[s.key] = s
            if s.trace is not None:
                s.queued_ns = tracing.now_ns()
                s.trace.child("decode.preempted", s.preempted_ns, s.queued_ns,
                              **{"pdserve.recomputed_tokens": len(s.context) - 1})
            with logs.request(s.request_id):
                log.info("resumed preempted %s (%d tokens recomputed)", s.key, len(s.context) - 1)

    def _preempt(self, victim: Sequence) -> None:
        """Out of KV blocks (`scheduler.out_of_blocks` chose it): `victim` gives its blocks back and waits."""
        self.running.pop(victim.key, None)
        self.drafter.release(victim.key)
        self.engine.free(victim.key)
        self.preempted.append(victim)
        self.m_preempted.inc()
        if victim.trace is not None:
            victim.preempted_ns, victim.queued_ns = tracing.now_ns(), 0
            victim.step_spans.flush()
        with logs.request(victim.request_id):
            log.warning("KV pool full: preempted %s (will recompute)", victim.key)

    def _next_chunk(self, rows: int) -> tuple[Sequence, list[int]] | None:
        """The oldest uncomputed prompt's next chunk beside `rows` stepping sequences (`scheduler.chunk_tokens`),
        if one joins the step."""
        if not self.prefilling:
            return None
        s = next(iter(self.prefilling.values()))
        todo = s.offer.prompt_token_ids[s.prefilled : -1]
        n = scheduler.chunk_tokens(remaining=len(todo), rows=rows, local_chunk=self.local_chunk,
                                   blocked=self._chunk_blocked, pool=self.pool)
        return (s, todo[:n]) if n else None

    def _chunk_done(self, s: Sequence, n: int) -> None:
        """`n` more tokens of uncomputed prompt `s` are in the pool; once all are, it joins the running set."""
        if s.key not in self.prefilling:  # cancelled while the step ran
            self._release(s)
            return
        s.prefilled += n
        self.m_local_tokens.inc(n)
        if s.prefilled == len(s.offer.prompt_token_ids) - 1:
            del self.prefilling[s.key]
            self.m_local.labels("computed").inc()
            if s.trace is not None:
                s.queued_ns = tracing.now_ns()
            self.running[s.key] = s
            self.m_running.set(len(self.running))

    async def _fail_unplaceable_prompt(self) -> None:
        """Nothing runs, nothing arrives, and the oldest uncomputed prompt's next chunk still does not fit: the
        pool is full of prompts being computed here. The oldest is failed, which frees its blocks."""
        s = self.prefilling.pop(next(iter(self.prefilling)))
        self.m_local.labels("failed").inc()
        await self._emit(s, kind="error", status=503, error_type="unavailable",
                         error=f"decode worker {self.worker_id}: no KV room to compute the prompt "
                               f"({len(s.offer.prompt_token_ids)} tokens)")
        self._release(s)

    async def _decode_loop(self) -> None:
        while True:
            await self._resume_preempted()
            if not self.running and not self.prefilling:
                if self.lease is not None:
                    self.lease.release()  # idle: prefill may borrow these threads until the next step
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.lease is not None and not self.lease.held:
                t_wait = time.perf_counter()
                was_out = self.lease.waited_out
                if not await self.compute(self.lease.hold) and not was_out:  # at most one borrowed step away
                    log.warning("prefill has held this worker's CPU lease for %.0f s (frozen or stuck mid-step): "
                                "stepping without it until it lets go", HOLD_WAIT_S)
                self.m_lease_wait.observe(time.perf_counter() - t_wait)
            batch = scheduler.next_batch(self.running, self.max_batch) if self.running else []
            self.steps += 1
            for s in batch:
                if s.last_step >= 0:
                    self.m_wait_steps.observe(self.steps - s.last_step - 1)
                s.last_step = self.steps
            # Stepping from here on: drafting can await (a draft model's thread, the pool over NATS), and
            # a cancel arriving then must leave the sequence's KV to this loop rather than free it under us.
            self._stepping = {s.key for s in batch}
            if self.drafter.concurrent:  # remote drafts: ask for the whole batch at once
                drafts = await asyncio.gather(*(self._plan(s) for s in batch))
            else:
                drafts = [await self._plan(s) for s in batch]
            if cancelled := [i for i, s in enumerate(batch) if s.key not in self.running]:
                for i in cancelled:
                    self._release(batch[i])
                batch = [s for i, s in enumerate(batch) if i not in cancelled]
                drafts = [d for i, d in enumerate(drafts) if i not in cancelled]
                self._stepping = {s.key for s in batch}
            chunk = self._next_chunk(len(batch))
            if chunk is not None:
                self._stepping.add(chunk[0].key)
            elif not batch:
                if scheduler.when_nothing_steps(prefilling=len(self.prefilling), running=len(self.running),
                                                receiving=self.receiving) == "fail_prompt":
                    await self._fail_unplaceable_prompt()
                else:  # a chunk waits for room: a KV arriving, a sequence ending or a cancel sets the event
                    self._wake.clear()
                    await self._wake.wait()
                continue
            t0 = time.perf_counter()
            if traced := bool(self._traces):  # a step of a traced request: its wait ends here
                t0_ns = tracing.now_ns()
                for s in batch:
                    if s.queued_ns:
                        s.trace.child("decode.queue", s.queued_ns, t0_ns, **{"pdserve.batch": len(batch)})
                        s.queued_ns = 0
            try:
                committed = await self.compute(self._forward_and_verify, batch, drafts, chunk)
            except OutOfBlocks:
                self._stepping = set()
                for s in batch:
                    if s.key not in self.running:  # cancelled while the step ran: its KV goes now
                        self._release(s)
                if chunk is not None and chunk[0].key not in self.prefilling:  # cancelled while the step ran
                    self._release(chunk[0])
                live = [s for s in batch if s.key in self.running]
                plan = scheduler.out_of_blocks(had_chunk=chunk is not None, live=[(s.key, s.admitted) for s in live])
                if plan.block_chunk:  # the chunk did not fit: the step goes again without one
                    self._chunk_blocked = True
                elif plan.preempt is not None:
                    self._preempt(self.running[plan.preempt])
                continue
            except Exception as e:
                log.exception("decode step failed for %d sequences%s", len(batch), " and a prompt chunk" if chunk else "")
                self._stepping = set()
                for s in batch:
                    if self.running.pop(s.key, None) is not None:
                        await self._emit(s, kind="error", error=f"decode failed: {e}", error_type="server_error",
                                         status=500)
                    self._release(s)
                if chunk is not None:
                    if self.prefilling.pop(chunk[0].key, None) is not None:
                        self.m_local.labels("failed").inc()
                        await self._emit(chunk[0], kind="error", error=f"decode failed computing the prompt: {e}",
                                         error_type="server_error", status=500)
                    self._release(chunk[0])
                continue
            self._stepping = set()
            dt = time.perf_counter() - t0
            if traced:
                t1_ns = tracing.now_ns()
                if chunk is not None and chunk[0].trace is not None:
                    chunk[0].trace.child("decode.prefill_chunk", t0_ns, t1_ns, **{
                        "pdserve.chunk.offset": chunk[0].prefilled, "pdserve.chunk.tokens": len(chunk[1]),
                        "pdserve.batch": len(batch)})
            if chunk is not None:
                self._chunk_done(chunk[0], len(chunk[1]))
            if not batch:
                continue
            if chunk is None:  # the latency model learns what verification costs, without prompt chunks
                fed = sum(1 + (len(d.token_ids) if d else 0) for d in drafts)
                self.controller.observe_verify(len(batch), max(1, round(fed / len(batch))), dt)
            self.m_itl.observe(dt)
            for s, d, (tokens, logprobs) in zip(batch, drafts, committed):
                if s.key not in self.running:  # cancelled while the step ran
                    self._release(s)
                    continue
                if traced and s.trace is not None:
                    kd = len(d.token_ids) if d else 0
                    s.step_spans.add(self.steps, t0_ns, t1_ns, len(tokens), kd, len(tokens) - 1 if kd else 0,
                                     len(batch))
                try:
                    await self._commit(s, d, tokens, dt, logprobs)
                except GrammarDeadEnd as e:  # the request's grammar, not a fault here: its 400, the loop goes on
                    if self.running.pop(s.key, None) is not None:
                        self._release(s)
                        await self._emit(s, kind="error", error=str(e), error_type="invalid_request_error", status=400)
                except Exception as e:  # one request's bug must not stop the loop for everyone
                    with logs.request(s.request_id):
                        log.exception("committing tokens of %s failed", s.key)
                    if self.running.pop(s.key, None) is not None:
                        self._release(s)
                        await self._emit(s, kind="error", error=f"decode failed: {e}", error_type="server_error",
                                         status=500)

    async def _commit(self, s: Sequence, draft, tokens: list[int], step_seconds: float,
                      logprobs: list[dict] | None = None) -> None:
        rid = s.key
        if draft:
            kd, acc = len(draft.token_ids), len(tokens) - 1
            s.draft_tokens += kd
            s.accepted_tokens += acc
            if draft.forced:  # the grammar's, not the drafter's: neither it nor the controller learns from them
                s.forced_draft_tokens += kd
                s.forced_accepted_tokens += acc
                self.m_forced_draft.inc(kd)
                self.m_forced_accepted.inc(acc)
            else:
                span = s.span.kind
                self.controller.observe_step(rid, span, kd, acc)
                self.drafter.feedback(rid, acc, tokens)
                self.m_spec_draft.labels(span.value).inc(kd)
                self.m_spec_accepted.labels(span.value).inc(acc)
                self.m_spec_rate.observe(acc / kd)
        self._recent_itl.append(step_seconds / len(tokens))
        committed, text = [], []
        for token in tokens:
            s.generated.append(token)
            committed.append(token)
            text.append(s.stream.push(token))
            if s.stream.done:
                break
        self.m_tokens.inc(len(committed))
        if s.processor is not None:
            s.processor.advance(committed)
        delta = "".join(text)
        s.span.feed(delta)
        await self._emit(s, kind="token", token_ids=committed, text=delta,
                         logprobs=logprobs[: len(committed)] if logprobs is not None else None)
        if s.stream.done:  # the last event goes out while `s` still counts as held (`busy`): a drain waits for it
            await self._emit_done(s)
            if self.running.pop(rid, None) is not None:  # else a cancel during the emit released it
                self._release(s)


def main(argv: list[str]) -> int:
    return run_worker(DecodeWorker, argv)
