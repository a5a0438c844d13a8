"""The prefill worker: takes prompts from NATS, runs them in batched chunks, hands their KV to decode.

(Longer than our ~600-line norm: the scheduler, pre-positioning, layer streaming and the handoff
all act on the same jobs, engine and compute thread between two steps; split apart, each piece
would take the worker's whole state as an argument.)

Requests arrive on the deployment's queue group (any worker) or on this worker's own subject
(the front routed them here because this worker's prefix cache holds the longest part of the
prompt). Each is acknowledged at once and joins the scheduler's queue.

The scheduler runs one forward per step over a token budget (`--max-batch-tokens`): every
waiting prompt, oldest first, brings its next chunk of at most `--chunk-size` tokens, so a long
prompt is computed in pieces and a short one that arrives behind it joins the very next step
instead of waiting for the long one to finish. A prompt's first step reuses the longest cached
prefix of whole blocks (a shared system prompt is computed once). When its last chunk is done:
sample and stream the first token straight to the front (TTFT does not wait for the KV move),
copy its KV out of the pool (its blocks stay cached), offer it to the decode worker the front
chose, and send it over the direct data path. Once decode has accepted the offer it owns the
request, including its failure policy; before that, prefill reports every failure on the
request's stream.

Pre-positioning: after a turn, the front sends the worker a hint — the conversation plus the
answer just given. When no prompt is waiting, the worker computes that KV into its prefix cache,
so the next turn's prefill covers only the new message. Hints are bounded (a queue, a block
budget), interrupted by any real prompt (between two steps, and within a step between two layers),
evicted before anything real, and dropped first when the pool runs short. Hits are counted (`pdserve_preposition_*`).

The worker announces its load and its cached block addresses in its LoadReport (1 Hz), which is
what the front's router reads.

Layer streaming (`--kv-stream-layers`): when a prompt's last chunk is about to run, the offer
goes to decode first (from the first layer's pre-hook, once the step's blocks are secured), and
each layer's KV is sent as soon as that layer's forward is done, so the wire overlaps the compute
and decode holds the KV moments after the first token. The first token then reaches decode as
this worker's seq-0 event on the request's stream.

Conditional disaggregation (`--defer-queue-tokens`): a prompt that arrives behind a long queue here
(at least that many prompt tokens ahead of it) and whose prefix this worker does not hold is offered to
its decode worker uncomputed. Decode takes it while its own queue of such prompts is shorter, and computes
it in chunks inside its decode steps (on a GPU they ride along with steps bound by reading the weights; on
the CPU it is off by default, see `defer_tokens`); it answers for the request from then on. A refusal leaves the prompt here, where it keeps its place in the queue. Under light load nothing
is offered, and each phase keeps its own worker.

Offload tier (`--prefix-offload`, off by default): after a prompt, its full blocks are also put
in the JetStream object store (memory storage, TTL), and before a prompt starts, a longer prefix
found there than in the local cache is fetched into the pool — so any worker, including a new
or restarted one, skips what any other already computed.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import nats.errors
from prometheus_client import Counter, Gauge, Histogram

from pdserve.basetypes import announced, prefix_hashes
from pdserve.config import PrefillConfig
from pdserve.cpulease import CpuLease
from pdserve.engine import OutOfBlocks, create_engine
from pdserve.kvtransfer.channel import KVSendChannel
from pdserve.kvtransfer.frames import TransferError
from pdserve.kvtransfer.protocol import (
    PREFILL_QUEUE_GROUP, Ack, Cancel, HandoffOffer, HandoffReply, PrefillRequest, PrepositionHint, ProtocolError,
    WORKER_STOPPED, Buckets, StreamEvent, Subjects, Usage,
)
from pdserve.kvtransfer.shm import SENDER_MAPS
from pdserve.grammar import GrammarDeadEnd, GrammarError, GrammarVocab
from pdserve.processors import make_processor, token_logprobs
from pdserve.sampling import TextStream, sample_next
from pdserve.prefill import scheduler
from pdserve.workerbase import WorkerBase, run_worker
from pdserve import logs, tracing

log = logging.getLogger("pdserve.prefill")

_JOB_IDS = itertools.count()
# How often a pre-positioning hint that waits for a busy co-located decode worker looks again.
HINT_RECHECK_S = 0.05
DEFER_QUEUE_TOKENS_GPU = 256  # --defer-queue-tokens on a GPU: a prompt behind one prefill chunk's worth goes to decode
DEFER_QUEUE_TOKENS_NATIVE = 512  # … on a CPU whose steps run the native decoder: behind one full prefill step
HANDOFF_REROUTES = 3  # offers to the model's queue group after the routed decode worker did not take one


class HintYielded(Exception):
    """A pre-positioning step stopped between two layers because a prompt arrived (`_yield_hint`)."""


@dataclass(eq=False)
class LayerStream:
    reply: HandoffReply
    queue: asyncio.Queue  # (layer index, blocks) as layers finish; an exception aborts the transfer
    sender: asyncio.Task  # -> the receiver's ACK stats
    opened_at: float


@dataclass(eq=False)
class Job:
    """One prompt in the scheduler: a request, or a pre-positioning hint (req is None)."""

    seq_id: str
    token_ids: list[int]
    queued_at: float
    req: PrefillRequest | None = None
    started: bool = False
    done: int = 0  # prompt tokens whose KV is in the pool
    cached: int = 0  # … of which came from the prefix cache
    fetched: int = 0  # tokens fetched from the offload tier into the prefix cache for it
    prepositioned: bool = False  # the cached part includes pre-positioned blocks
    started_at: float = 0.0  # when its first chunk was scheduled
    stream: LayerStream | None = None  # its KV is being streamed layer by layer to decode
    offering: bool = False  # offered to decode uncomputed, no answer yet: not scheduled meanwhile
    trace: tracing.RequestSpans | None = None  # its spans here, when traced

    @property
    def hint(self) -> bool:
        return self.req is None

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.done


class PrefillWorker(WorkerBase):
    role = "prefill"
    settings = PrefillConfig
    args: PrefillConfig

    def __init__(self, args: PrefillConfig):
        super().__init__(args)
        self.offer_timeout = args.offer_timeout
        self.transfer_timeout = args.kv.timeout
        SENDER_MAPS.max_bytes = args.kv.shm_sender_map_bytes  # the process's one map of decode's segments
        self.chunk_size = max(1, args.chunk_size)
        self.max_batch_tokens = max(self.chunk_size, args.max_batch_tokens)
        # no small-step layouts (prefill runs prompts); the native decoder where it serves the model, as decode's
        # does, so a prompt's KV and first token are the bits decode would compute for it
        self.engine = create_engine(self.runner, kv_capacity_bytes=args.kv_capacity_bytes, small_step_weights=False)
        self.jobs: deque[Job] = deque()  # requests, oldest first
        self._hint_step = False  # the running step computes pre-positioning hints only (it may yield)
        self.hints: OrderedDict[str, Job] = OrderedDict()  # pre-positioning, newest last
        self.hint_job: Job | None = None  # the hint being computed (at most one at a time)
        self.preposition_budget = args.preposition_budget_blocks
        self._pp_hashes: dict[bytes, None] = {}  # block addresses computed by pre-positioning, not yet used
        self.preposition_hits = 0
        self.preposition_computed = 0
        self.queue_depth = 0
        self.transfer_backlog = 0
        self.transfer_backlog_bytes = 0
        self._recent_ttft: deque[float] = deque(maxlen=32)
        self._recent_wait: deque[float] = deque(maxlen=32)
        self._cancelled: set[str] = set()
        # accepted, not queued yet (its grammar compiling, its prefix being fetched from the offload tier): a cancel
        # meanwhile must still find it
        self._arriving: dict[str, str | None] = {}  # request id -> its front
        self._wake = asyncio.Event()
        self.prefix_store = None  # the offload tier, when --prefix-offload
        self.stream_layers = args.kv.stream_layers and self.engine.layer_hooks
        self._stream_candidates: list[Job] = []  # jobs whose last chunk the running step computes
        self._streams: list[Job] = []  # … of which decode accepted a streamed offer
        self.loop: asyncio.AbstractEventLoop | None = None
        self._offload_busy = False
        self._announced: list[str] = []  # cached block addresses, refreshed on the compute thread after each step
        self.lease = CpuLease(args.cpu_lease) if args.cpu_lease else None
        # A GPU's decode step is bound by reading the weights, which a chunk's compute rides along with. So is a
        # CPU's where its steps run the native decoder (engine/native.py: up to 1024 rows, a prompt chunk at the
        # projections' full rate, in the same forward as decode's rows): on 2 Zen 4 cores, SmolLM2 bf16, guidellm
        # 256-token prompts, 2 rounds, output tok/s 60.2 / 119.4 / 136.1 at concurrency 1 / 4 / 16 against 58.3 /
        # 106.4 / 119.0 with none deferred. Through transformers' forward (float32, no AVX512-BF16) a chunk beside
        # decode's rows costs what the two cost apart, and the TTFT saved under load was paid in output rate
        # (-11 % at concurrency 4): none deferred there.
        if args.defer_queue_tokens is not None:
            self.defer_tokens = args.defer_queue_tokens
        elif self.runner.device.type == "cuda":
            self.defer_tokens = DEFER_QUEUE_TOKENS_GPU
        else:
            self.defer_tokens = DEFER_QUEUE_TOKENS_NATIVE if self.engine.native_rows() > 0 else 0
        self._steps = 0  # prefill steps computed
        self._reoffered_at = -1  # the step count at the last `_reoffer`: at most one per step
        r = self.registry
        self.m_lease = Counter("pdserve_prefill_cpu_lease_steps_total", "prompt steps run with an idle decode "
                               "worker's threads borrowed", registry=r)
        self.m_requests = Counter("pdserve_prefill_requests_total", "prompts prefilled", ["outcome"], registry=r)
        self.m_queue = Gauge("pdserve_prefill_queue_depth", "prompts waiting for prefill", registry=r)
        self.m_prefill = Histogram("pdserve_prefill_compute_seconds", "prefill time of one prompt (all its chunks)",
                                   registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32))
        self.m_step = Histogram("pdserve_prefill_step_tokens", "tokens computed per prefill step", registry=r,
                                buckets=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
        self.m_cached = Counter("pdserve_prefix_cache_tokens_total", "prompt tokens by source", ["source"],
                                registry=r)
        self.m_offload = Counter("pdserve_prefix_offload_blocks_total", "prefix blocks moved to/from the object store",
                                 ["direction"], registry=r)
        self.m_pp = Counter("pdserve_preposition_total", "pre-positioning hints by outcome", ["outcome"], registry=r)
        Gauge("pdserve_prefill_kv_utilization", "prefill KV pool in use by prompts being computed (0-1)",
              registry=r).set_function(lambda: self.engine.utilization())
        # the same signals the LoadReport carries, for clusters that scrape Prometheus (prometheus-adapter)
        Gauge("pdserve_prefill_queue_wait_seconds", "recent mean wait before prefill starts", registry=r
              ).set_function(lambda: self.load_fields()["queue_wait_seconds"])
        Gauge("pdserve_prefill_ttft_seconds", "recent mean time to first token at prefill", registry=r
              ).set_function(lambda: self.load_fields()["ttft_seconds"])
        Gauge("pdserve_transfer_backlog_handoffs", "KV handoffs waiting or in flight", registry=r
              ).set_function(lambda: self.transfer_backlog)
        Gauge("pdserve_transfer_backlog_bytes", "KV bytes waiting or in flight", registry=r
              ).set_function(lambda: self.transfer_backlog_bytes)
        self.m_kv_bytes = Counter("pdserve_kv_transfer_sent_bytes_total", "KV bytes sent to decode (uncompressed)",
                                  registry=r)
        self.m_streamed = Counter("pdserve_kv_layer_streamed_total", "handoffs whose KV left layer by layer "
                                  "during the prompt's last forward", registry=r)
        self.m_rerouted = Counter("pdserve_handoffs_rerouted_total", "handoffs another decode worker took after "
                                  "the routed one was gone or refused (draining, full)", registry=r)
        self.m_kv_seconds = Histogram("pdserve_kv_transfer_seconds", "KV handoff time (offer to ACK)", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.m_kv_failed = Counter("pdserve_kv_transfer_failures_total", "KV transfers that failed, by side",
                                   ["side"], registry=r)
        self.m_kv_failed.labels("sender")  # a zero from the start: a rate over it is 0, not absent

    def load_fields(self) -> dict:
        mean = lambda d: sum(d) / len(d) if d else 0.0  # noqa: E731
        return dict(queue_depth=self.queue_depth, queue_wait_seconds=mean(self._recent_wait),
                    ttft_seconds=mean(self._recent_ttft), transfer_backlog_handoffs=self.transfer_backlog,
                    transfer_backlog_bytes=self.transfer_backlog_bytes,
                    queue_tokens=sum(j.remaining for j in self.jobs), kv_utilization=self.engine.utilization(),
                    block_size=self.runner.layout.block_size, cached_blocks=self._announced,
                    preposition_hits=self.preposition_hits, preposition_computed=self.preposition_computed)

    async def on_start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # layer callbacks both forwards call (transformers' and the native CPU decoder's)
        if self.engine.layer_hooks:  # a pre-positioning step gives way at any layer
            self.engine.add_layer_hooks(before=lambda i: self._yield_hint())
        if self.stream_layers:
            self.engine.add_layer_hooks(before=lambda i: i == 0 and self._open_streams(), after=self._layer_done)
        # transports in preference order (shm only when decode reports the same host), negotiated per handoff
        self.kv_channel = KVSendChannel(self.nc, scope=self.scope, sender_id=self.worker_id, generation=self.generation,
                                        transports=self.args.kv.transport_list,
                                        compression=self.args.kv.compression, timeout=self.transfer_timeout)
        # the subscriptions that bring new work, which a draining worker gives up
        self._intake = [
            await self.nc.subscribe(Subjects.prefill(self.scope, self.model_name), queue=PREFILL_QUEUE_GROUP,
                                    cb=self._on_request),
            await self.nc.subscribe(Subjects.prefill_worker(self.scope, self.model_name, self.worker_id),
                                    cb=self._on_request),
            await self.nc.subscribe(Subjects.preposition(self.scope, self.worker_id), cb=self._on_hint),
        ]
        await self.nc.subscribe(Subjects.cancel_all(self.scope), cb=self._on_cancel)
        if self.args.prefix_offload:
            from pdserve.kvtransfer.offload import KVPrefixStore

            self.prefix_store = KVPrefixStore(self.nc, self.runner.layout, bucket=Buckets.prefix(self.scope),
                                            ttl_s=self.args.prefix_offload_ttl)
        self.spawn(self._scheduler(), background=True)

    async def on_drain(self) -> None:
        """Leave the queue group and the own subjects (a request sent there now goes to another worker),
        and drop pre-positioning, which is only ever a guess about future work."""
        for sub in self._intake:
            try:
                await sub.unsubscribe()
            except Exception as e:  # NATS gone: no new work can arrive anyway
                log.debug("unsubscribe on drain: %s", e)
        self.hints.clear()

    def busy(self) -> bool:
        """Prompts queued or being computed, and first tokens or handoffs still on their way."""
        return bool(self.jobs) or self.transfer_backlog > 0 or super().busy()

    async def on_stop(self) -> None:
        """Past the drain timeout: fail every prompt still queued, naming why."""
        for job in list(self.jobs):
            await self._finish_job(job, error=f"prefill worker {self.worker_id} stopped before computing the "
                                              f"prompt (drain timeout {self.args.drain_timeout:g} s)", status=503,
                                   error_type=WORKER_STOPPED)

    async def _on_cancel(self, msg) -> None:
        try:
            rid = Cancel.decode(msg.data).request_id
        except ProtocolError:
            return
        if rid in self._arriving or any(j.req.request_id == rid for j in self.jobs):
            self._cancelled.add(rid)  # the scheduler drops it between steps

    def _check_ids(self, what: str, ids: list[int]) -> None:
        vocab = self.runner.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ProtocolError(f"{what} token ids must lie in 0..{vocab - 1}")

    def held_requests(self) -> list[tuple[str, str | None]]:
        queued = [(j.req.request_id, j.req.front_id) for j in self.jobs if j.req is not None]
        return queued + list(self._arriving.items())

    async def _on_request(self, msg) -> None:
        try:
            req = PrefillRequest.decode(msg.data)
            ids = req.prompt_token_ids
            # checked here, so that one bad prompt never fails a batch it would have joined
            if not ids or len(ids) >= self.runner.max_context:
                raise ProtocolError(f"prompt of {len(ids)} tokens: must be 1..{self.runner.max_context - 1}")
            self._check_ids("prompt", ids)
            if req.resumed:  # a moved request: its KV covers what was generated too
                gen = req.generated_token_ids
                if req.sampling.n != 1:
                    raise ProtocolError(f"a request with generated tokens has one choice, not n={req.sampling.n}")
                self._check_ids("generated", gen)
                if len(ids) + len(gen) >= self.runner.max_context:
                    raise ProtocolError(f"prompt and generated tokens ({len(ids)} + {len(gen)}) must be fewer "
                                        f"than {self.runner.max_context}")
        except ProtocolError as e:
            await msg.respond(Ack(accepted=False, worker_id=self.worker_id, error=str(e), status=400).encode())
            return
        await msg.respond(Ack(accepted=True, worker_id=self.worker_id).encode())
        self.fronts.vouch(req.front_id)
        self._arriving[req.request_id] = req.front_id
        if req.sampling.guided is not None and req.sampling.n == 1:
            await self._compile_grammar(req)
        job = Job(f"req-{next(_JOB_IDS)}-{req.request_id}", req.prompt_token_ids + req.generated_token_ids[:-1],
                  time.monotonic(), req)
        job.trace = tracing.start_request("prefill.request", req.traceparent, **{
            "pdserve.request_id": req.request_id, "pdserve.worker": self.worker_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids)})
        self.queue_depth += 1
        self.m_queue.set(self.queue_depth)
        if self.prefix_store is not None:
            self.spawn(self._fetch_then_queue(job))
        else:
            self._queue(job)

    async def _compile_grammar(self, req: PrefillRequest) -> None:
        """Compile the request's grammar off the compute thread (a new JSON schema takes as long as many model
        steps), so the first token's mask (`_choose_first`) finds it cached instead of stalling every prompt's step."""
        try:
            await asyncio.to_thread(GrammarVocab.compiled, self.runner.tokenizer, self.runner.vocab_size,
                                    self.runner.eos_token_ids, req.sampling.guided)
        except GrammarError as e:  # the front checked it; the first token's sampling reports it again
            log.warning("request %s: its grammar does not compile: %s", req.request_id, e)

    def _queue(self, job: Job) -> None:
        if job.req is not None:
            self._arriving.pop(job.req.request_id, None)
        ahead = self._defer_ahead(job)
        self.jobs.append(job)
        if ahead is not None:
            job.offering = True
            self.spawn(self._defer(job, ahead))
        self._wake.set()

    def _waiting(self) -> list[scheduler.Waiting]:
        return [scheduler.Waiting(j.remaining, j.offering, j.started) for j in self.jobs]

    def _defer_ahead(self, job: Job) -> int | None:
        """The prompt tokens waiting here ahead of `job` (arriving, or in the queue) if it is to be offered to
        decode uncomputed (`scheduler.defer_ahead`), else None."""
        if not self.defer_tokens:
            return None
        at = next((i for i, j in enumerate(self.jobs) if j is job), None)
        return scheduler.defer_ahead(defer_tokens=self.defer_tokens, choices=job.req.sampling.n,
                                     prompt_tokens=len(job.token_ids), cached_tokens=self._local_prefix(job.token_ids),
                                     ahead=scheduler.ahead_tokens(self._waiting(), at),
                                     resumed=job.req.resumed)

    def _reoffer(self) -> None:
        """Offer decode the last prompt still waiting here, once per step (scheduler, between steps).

        Prompts are offered on arrival, and decode takes them while its own queue of such prompts is no longer
        than this one's; a burst's later arrivals find decode's queue full and stay here. Once decode has
        computed what it took, those would wait behind this worker's steps while decode steps a few rows below
        its capacity. So between steps the prompt that would wait longest is offered again
        (`scheduler.reoffer_candidate`), if it is still far enough back (docs/PERFORMANCE.md, "Conditional
        disaggregation")."""
        i = scheduler.reoffer_candidate(self._waiting(), defer_tokens=self.defer_tokens,
                                        offered_this_step=self._reoffered_at == self._steps)
        job = self.jobs[i] if i is not None else None
        ahead = self._defer_ahead(job) if job is not None else None
        if ahead is not None:
            self._reoffered_at = self._steps
            job.offering = True
            self.spawn(self._defer(job, ahead))

    async def _defer(self, job: Job, ahead: int) -> None:
        """Offer `job`'s prompt uncomputed to the decode worker the front chose. Taken: decode answers for
        the request from now on. Refused or nobody there: the prompt stays here, in its place."""
        req = job.req
        logs.bind(req.request_id)  # this task serves this request only
        offer = self._offer(req, self.runner.layout, len(job.token_ids), 0, [], kv_deferred=True,
                            queue_ahead_tokens=ahead)
        target = f"decode worker {req.decode_worker_id}"
        t_offer = tracing.now_ns() if job.trace is not None else 0
        try:
            raw = await self.nc.request(Subjects.decode_handoff(self.scope, req.decode_worker_id), offer.encode(),
                                        timeout=self.offer_timeout)
            reply = HandoffReply.decode(raw.data)
        except nats.errors.TimeoutError:
            # it may still take the prompt late, and two workers must never both answer one request
            job.offering = False
            await self._finish_job(job, error=f"{target} did not answer the offer of the uncomputed prompt "
                                              f"within {self.offer_timeout:.1f} s", status=503)
            return
        except Exception as e:  # nobody listening, NATS trouble, a garbled reply: compute it here
            log.debug("uncomputed offer of %s to %s not placed: %s", req.request_id, target, e)
            reply = None
        job.offering = False
        if job.trace is not None:  # a refusal is routine here (the prompt stays): an event, not a failed span
            if reply is not None and reply.accepted:
                self._trace_offer(job.trace, t_offer, req, reply,
                                  **{"pdserve.kv_deferred": True, "pdserve.queue_ahead_tokens": ahead})
            else:
                job.trace.event("deferral_refused", **{"pdserve.reason": reply.error if reply else "not placed"})
        if reply is not None and reply.accepted:
            self.m_requests.labels("deferred").inc()
            await self._finish_job(job)
            if job.trace is not None:
                job.trace.end(**{"pdserve.kv_deferred": True})
            return
        if reply is not None:
            log.debug("%s kept the prompt of %s: %s", target, req.request_id, reply.error)
        self._wake.set()

    def _local_prefix(self, ids: list[int]) -> int:
        n = 0
        for h in prefix_hashes(ids, self.runner.layout.block_size):
            if not self.engine.holds(h):
                break
            n += 1
        return n * self.runner.layout.block_size

    async def _fetch_then_queue(self, job: Job) -> None:
        """Offload tier: bring a longer stored prefix into the pool's cache before the prompt starts.
        Any failure (absent, corrupt, another layout, NATS trouble) only means computing it here."""
        logs.bind(job.req.request_id)  # this task serves this request only
        try:
            got = await self.prefix_store.get_longest_prefix(job.token_ids[:-1])
            if got is not None and got[1] > self._local_prefix(job.token_ids):
                kv, n = got
                await self.compute(self._adopt, f"fetch-{job.seq_id}", kv, job.token_ids[:n])
                job.fetched = n
                self.m_offload.labels("fetched").inc(n // self.runner.layout.block_size)
        except Exception as e:
            log.warning("prefix fetch for %s failed (computing instead): %s", job.req.request_id, e)
        self._queue(job)

    def _adopt(self, seq_id: str, kv, token_ids: list[int]) -> None:
        """Put fetched KV into the prefix cache (compute thread): import, register, release."""
        self.engine.import_kv(seq_id, kv, token_ids)
        self.engine.free(seq_id)

    async def _offload(self, job: Job, kv) -> None:
        """Store a computed prompt's full blocks in the offload tier; skipped while a store is in flight."""
        if self._offload_busy:
            return
        self._offload_busy = True
        try:
            n = await self.prefix_store.put_prefix(job.token_ids, kv)
            self.m_offload.labels("stored").inc(n)
        except Exception as e:
            log.warning("prefix store for %s failed: %s", job.req.request_id, e)
        finally:
            self._offload_busy = False

    async def _on_hint(self, msg) -> None:
        try:
            hint = PrepositionHint.decode(msg.data)
        except ProtocolError as e:
            log.debug("bad pre-positioning hint: %s", e)
            return
        ids = hint.token_ids
        if why := scheduler.hint_refusal(
                budget_blocks=self.preposition_budget, same_model=hint.model == self.model_name, tokens=len(ids),
                max_context=self.runner.max_context, block_size=self.runner.layout.block_size,
                ids_in_vocab=not ids or (min(ids) >= 0 and max(ids) < self.runner.config.vocab_size)):
            log.debug("pre-positioning hint refused: %s", why)
            self.m_pp.labels("refused").inc()
            return
        self.hints[hint.request_id] = Job(f"pp-{next(_JOB_IDS)}-{hint.request_id}", list(hint.token_ids),
                                          time.monotonic())
        self.m_pp.labels("received").inc()
        while len(self.hints) > self.args.preposition_queue:  # keep the newest: the likeliest next turns
            self.hints.popitem(last=False)
            self.m_pp.labels("dropped").inc()
        self._wake.set()

    async def _publish(self, req: PrefillRequest, **fields) -> None:
        await self.nc.publish(Subjects.stream(self.scope, req.request_id),
                              StreamEvent(request_id=req.request_id, worker_id=self.worker_id, **fields).encode())

    async def _fail(self, req: PrefillRequest, seq: int, message: str, status: int = 500,
                    error_type: str = "server_error") -> None:
        self.m_requests.labels("error").inc()
        with logs.request(req.request_id):
            log.warning("request %s failed: %s", req.request_id, message)
        await self._publish(req, seq=seq, kind="error", error=message, error_type=error_type, status=status)

    # -- the scheduler ---------------------------------------------------------------------

    def _plan(self) -> tuple[scheduler.StepPlan, list[tuple[Job, int]]]:
        """This step's plan (`scheduler.plan_step`) and its chunks' jobs; a hint's chunk is the newest hint's,
        taken from the hints when it starts."""
        hint = self.hint_job or (next(reversed(self.hints.values())) if self.hints else None)
        plan = scheduler.plan_step(self._waiting(), hint_remaining=hint.remaining if hint is not None else None,
                                   chunk_size=self.chunk_size, max_batch_tokens=self.max_batch_tokens)
        if plan.hint:
            if self.hint_job is None:
                _, self.hint_job = self.hints.popitem(last=True)
            return plan, [(self.hint_job, plan.hint)]
        return plan, [(self.jobs[i], n) for i, n in plan.chunks]

    def _pp_in_use(self) -> int:
        for h in [h for h in self._pp_hashes if not self.engine.holds(h)]:
            del self._pp_hashes[h]  # evicted
        return len(self._pp_hashes)

    def _step(self, plan: list[tuple[Job, int]]) -> list[tuple[Job, object, object]]:
        """One forward over the plan's chunks (compute thread). Returns (job, first token, KV) of the
        requests whose prompt is now complete (`_choose_first`); their sequences are released (blocks
        stay cached)."""
        batch = []
        for job, n in plan:
            if not job.started:
                try:
                    job.cached = job.done = self.engine.start(job.seq_id, job.token_ids)
                except OutOfBlocks:
                    if not batch:
                        raise
                    break  # the prompts already in this step go ahead; this one waits for room
                job.started = True
                if job.cached and self._pp_hashes:
                    used = [h for h in prefix_hashes(job.token_ids[: job.cached], self.runner.layout.block_size)
                            if h in self._pp_hashes]
                    if used and not job.hint:
                        job.prepositioned = True
                        for h in used:  # real reuse from now on: no longer speculative
                            del self._pp_hashes[h]
            n = min(n, job.remaining)
            batch.append((job, n))
        if self.stream_layers:
            self._stream_candidates = [j for j, n in batch if scheduler.streams_layers(
                hint=j.hint, chunk=n, remaining=j.remaining, max_tokens=j.req.sampling.max_tokens if j.req else 0,
                choices=j.req.sampling.n if j.req else 0, streaming=j.stream is not None,
                resumed=bool(j.req and j.req.resumed))]
        try:
            logits = self._forward(batch)
        finally:
            self._stream_candidates, self._streams = [], []
        finished = []
        for (job, n), out in zip(batch, logits):
            job.done += n
            if job.remaining:
                continue
            if job.hint:
                bs = self.runner.layout.block_size
                for h in prefix_hashes(job.token_ids, bs)[job.cached // bs :]:
                    self._pp_hashes[h] = None
                self.engine.free(job.seq_id, evict_first_from=job.cached // bs)
                finished.append((job, None, None))
                continue
            # the KV leaves as a copy for an ordinary handoff or the offload tier; a streamed one has left already
            need_kv = job.stream is None or self.prefix_store is not None
            kv = self.engine.export_kv(job.seq_id) if need_kv else None
            self.engine.free(job.seq_id)
            finished.append((job, self._choose_first(job.req, out[-1]), kv))
        self._announced = [announced(h) for h in self.engine.cached_hashes(self.args.announce_blocks)]
        return finished

    def _lent_step(self, plan: list[tuple[Job, int]]) -> list[tuple[Job, object, object]]:
        """`_step`, with decode's threads added while its lease is free (compute thread). Pre-positioning
        never borrows: it is idle-time work of this worker's own, and must not delay decode taking its
        threads back."""
        lent = 0
        if scheduler.borrows_threads(hint_step=self._hint_step, chunks=len(plan), prompts_queued=len(self.jobs),
                                     tokens=plan[0][1]):
            lent = self.lease.try_borrow()
        if not lent:
            return self._step(plan)
        import torch

        torch.set_num_threads(self.args.threads + lent)
        try:
            return self._step(plan)
        finally:
            torch.set_num_threads(self.args.threads)
            self.lease.release()
            self.m_lease.inc()

    def _choose_first(self, req: PrefillRequest, logits) -> tuple[int, list[dict] | None] | GrammarDeadEnd | None:
        """The first generated token of a request and its logprobs (compute thread), from the raw
        logits `[vocab]` of its prompt's last position; None with n > 1: decode then starts every
        choice from the shared prompt KV, one batched step for all; GrammarDeadEnd when its grammar allows no
        first token."""
        params = req.sampling
        if params.n > 1 or req.resumed:  # a moved request's next token is decode's to sample
            return None
        proc = make_processor(params, req.prompt_token_ids, [], logits.shape[-1], self.runner.tokenizer,
                              self.runner.eos_token_ids)
        if proc is not None and proc.grammar is not None and proc.grammar.dead_end():
            return GrammarDeadEnd(0)  # this request's answer (a 400), not the step's failure
        token = sample_next(proc.process(logits[None])[0] if proc else logits, params, 0, req.seed)
        lps = token_logprobs(logits[None], [token], params.logprobs) if params.logprobs is not None else None
        return token, lps

    def _forward(self, batch: list[tuple[Job, int]]):
        return self.engine.step([(j.seq_id, j.token_ids[j.done : j.done + n]) for j, n in batch], last_only=True)

    def _yield_hint(self) -> None:
        """Every layer's pre-hook (compute thread): a step computing only a pre-positioning hint stops as soon
        as a prompt waits, rather than keep it waiting for the rest of the chunk (a whole chunk was the gap
        between a lone request's TTFT and its prefill: docs/PERFORMANCE.md, "Pre-positioning"). The engine leaves the hint's
        sequence as it was before the step; the hint goes on when the worker is idle again. The same when a
        co-located decode worker starts stepping (pdserve.cpulease): the machine is no longer idle."""
        stepping = self._hint_step and self.lease is not None and self.lease.owner_busy()  # (asked of hints only)
        if scheduler.hint_yields(hint_step=self._hint_step, prompts_waiting=len(self.jobs), decode_stepping=stepping):
            raise HintYielded

    # -- layer streaming (compute thread: hooks on the engine's layers) -----------------------

    def _open_streams(self) -> None:
        """First layer's pre-hook: the step's blocks are secured; offer the completing prompts' KV now."""
        for job in self._stream_candidates:
            fut = asyncio.run_coroutine_threadsafe(self._open_stream(job), self.loop)
            try:
                job.stream = fut.result(timeout=self.offer_timeout + 1)
            except Exception as e:  # the ordinary handoff after the step will try again and report
                log.info("streamed offer for %s not made: %s", job.req.request_id, e)
            if job.stream is not None:
                self._streams.append(job)
        self._stream_candidates = []

    def _layer_done(self, i: int) -> None:
        """A layer's forward hook: send each streamed prompt's KV of that layer."""
        for job in self._streams:
            blocks = self.engine.export_layer(job.seq_id, i)
            self.loop.call_soon_threadsafe(job.stream.queue.put_nowait, (i, blocks))

    async def _open_stream(self, job: Job) -> "LayerStream | None":
        req, layout, n = job.req, self.runner.layout, len(job.token_ids)
        offer = self._offer(req, layout, n, layout.payload_bytes(n), [], first_token_pending=True)
        t_offer = tracing.now_ns() if job.trace is not None else 0
        raw = await self.nc.request(Subjects.decode_handoff(self.scope, req.decode_worker_id), offer.encode(),
                                    timeout=self.offer_timeout)
        reply = HandoffReply.decode(raw.data)
        if job.trace is not None:
            self._trace_offer(job.trace, t_offer, req, reply, **{"pdserve.kv.layer_streamed": True})
            job.trace.marks["stream_opened"] = tracing.now_ns()
        if not reply.accepted:
            return None
        header = self.kv_channel.header(reply, req.request_id, layout, n)
        queue: asyncio.Queue = asyncio.Queue()

        async def layers():
            for _ in range(layout.num_layers):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item

        self.transfer_backlog += 1
        self.transfer_backlog_bytes += offer.kv_bytes
        sender = asyncio.ensure_future(self.kv_channel.send_stream(reply, header, layers()))
        return LayerStream(reply, queue, sender, time.monotonic())

    async def _finish_stream(self, job: Job) -> None:
        st, nbytes = job.stream, self.runner.layout.payload_bytes(len(job.token_ids))
        error = None
        try:
            await st.sender
            self.m_streamed.inc()
            self.m_kv_bytes.inc(nbytes)
            self.m_kv_seconds.observe(time.monotonic() - st.opened_at)
            self.m_requests.labels("handed_off").inc()
        except TransferError as e:  # decode owns the request and applies its failure policy
            log.warning("streamed KV for %s to %s failed: %s", job.req.request_id, st.reply.worker_id, e)
            self.m_kv_failed.labels("sender").inc()
            error = str(e)
        finally:
            self.transfer_backlog -= 1
            self.transfer_backlog_bytes -= nbytes
            if job.trace is not None and "stream_opened" in job.trace.marks:
                job.trace.child("handoff.transfer", job.trace.marks["stream_opened"], error=error,
                                **self._transfer_attrs(st.reply, nbytes, **{"pdserve.kv.layer_streamed": True}))

    def _abort_stream(self, job: Job, reason: str) -> None:
        if job.stream is not None:
            job.stream.queue.put_nowait(TransferError(f"prefill of {job.req.request_id} failed: {reason}"))
            self.spawn(self._finish_stream(job))
            job.stream = None

    def _drop(self, job: Job) -> None:
        """Forget a job and release its sequence (compute thread)."""
        if job.started:
            self.engine.free(job.seq_id, evict_first_from=0 if job.hint else None)
        job.started, job.done, job.cached, job.prepositioned = False, 0, 0, False

    async def _scheduler(self) -> None:
        while True:
            await self._drop_cancelled()
            if self.hint_job is None and self.hints and self._pp_in_use() >= self.preposition_budget:
                self.hints.clear()  # the budget is full of pre-positioned KV nobody used yet
                self.m_pp.labels("over_budget").inc()
            self._reoffer()
            step, plan = self._plan()
            action = scheduler.step_action(step, decode_stepping=bool(step.hint) and self.lease is not None
                                           and self.lease.owner_busy())
            if action == "wait_for_decode":
                # the hint waits and decode keeps these threads (a burst's last answers, each followed by a
                # hint, were computed beside the others' decode tail)
                self.lease.lend_idle(self.args.threads)
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), HINT_RECHECK_S)
                except asyncio.TimeoutError:
                    pass
                continue
            if action == "idle":
                if self.lease is not None:
                    self.lease.lend_idle(self.args.threads)  # decode's native layers use them until work arrives
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.lease is not None:
                self.lease.lend_idle(0)  # taken back before computing: decode drops them at its next phase
            t0 = time.monotonic()
            for job, _ in plan:
                if not job.started_at:
                    job.started_at = t0
                    if not job.hint:
                        self._recent_wait.append(t0 - job.queued_at)
            self._hint_step = all(job.hint for job, _ in plan)
            traced = tracing.enabled() and any(job.trace is not None for job, _ in plan)
            if traced:
                t0_ns, offsets = tracing.now_ns(), [job.done for job, _ in plan]
            try:
                finished = await self.compute(self._step if self.lease is None else self._lent_step, plan)
            except HintYielded:
                self.m_pp.labels("yielded").inc()
                continue
            except OutOfBlocks as e:  # raised before any layer ran: no stream was opened
                await self._out_of_blocks(plan, e)
                continue
            except Exception as e:
                log.exception("prefill step failed for %d prompts", len(plan))
                for job, _ in plan:
                    if not job.hint:
                        self._abort_stream(job, str(e))
                    await self.compute(self._drop, job)
                    await self._finish_job(job, error=f"prefill failed: {e}")
                continue
            self._steps += 1
            self.m_step.observe(sum(n for _, n in plan))
            if traced:
                self._trace_step(plan, offsets, t0_ns)
            for job, logits, kv in finished:
                if job.hint:
                    self.hint_job = None
                    self.preposition_computed += 1
                    self.m_pp.labels("computed").inc()
                    continue
                await self._finish_job(job)
                self.m_prefill.observe(time.monotonic() - job.started_at)
                self.spawn(self._first_token(job, logits, kv))  # logits: the `_choose_first` choice
            # let NATS callbacks (new prompts, cancels) run between steps
            await asyncio.sleep(0)

    def _trace_step(self, plan: list[tuple[Job, int]], offsets: list[int], t0_ns: int) -> None:
        """Spans of a step just computed: each traced prompt's chunk, and its wait before its first."""
        t1_ns, total = tracing.now_ns(), sum(n for _, n in plan)
        for (job, _), before in zip(plan, offsets):
            if job.trace is None or not job.started:  # not traced, or left out of the step (no room)
                continue
            if not before:  # its first chunk: the cached prefix counts as done from here
                job.trace.child("prefill.queue", job.trace.marks["start"], t0_ns,
                                **{"pdserve.cached_tokens": job.cached, "pdserve.prefix_cache_hit": job.cached > 0})
                before = job.cached
            job.trace.child("prefill.chunk", t0_ns, t1_ns, **{
                "pdserve.chunk.offset": before, "pdserve.chunk.tokens": job.done - before,
                "pdserve.step.tokens": total, "pdserve.step.prompts": len(plan)})
            job.trace.marks["computed"] = t1_ns

    async def _finish_job(self, job: Job, error: str | None = None, status: int = 500,
                          error_type: str | None = None) -> None:
        """Take a request out of the queue; with `error`, report it on the request's stream."""
        if job.hint:
            self.hint_job = None
            return
        self.jobs.remove(job)
        self.queue_depth -= 1
        self.m_queue.set(self.queue_depth)
        if error is not None and job.trace is not None:
            job.trace.end(error=error)
        if error is not None:
            await self._fail(job.req, 0, error, status=status, error_type=error_type or (
                "server_error" if status == 500 else "unavailable"))

    async def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for job in [j for j in self.jobs if j.req.request_id in self._cancelled and not j.offering]:
            self._cancelled.discard(job.req.request_id)
            log.info("%s cancelled: dropped with %d of its %d prompt tokens computed", job.req.request_id, job.done,
                     len(job.token_ids))
            await self.compute(self._drop, job)
            await self._finish_job(job)
            self.m_requests.labels("cancelled").inc()
            if job.trace is not None:
                job.trace.end(error="cancelled")
        # kept for a prompt still offered to decode (dropped here if decode refuses it), and for one not queued yet
        self._cancelled &= {j.req.request_id for j in self.jobs if j.offering} | self._arriving.keys()

    async def _out_of_blocks(self, plan: list[tuple[Job, int]], err: OutOfBlocks) -> None:
        """The pool cannot hold this step: give up speculative KV first, then preempt the youngest
        started prompt (it recomputes later), and only a prompt too large for the pool alone fails."""
        if self.hint_job is not None:
            await self.compute(self._drop, self.hint_job)
            self.hint_job = None
            self.hints.clear()
            self.m_pp.labels("preempted").inc()
            return
        started = [j for j in self.jobs if j.started]
        if len(started) > 1 or (started and started[0] is not self.jobs[0]):
            victim = started[-1]
            log.warning("prefill KV pool full: %s restarts later", victim.req.request_id)
            await self.compute(self._drop, victim)
            self.jobs.remove(victim)
            self.jobs.append(victim)
            return
        job = plan[0][0]
        await self.compute(self._drop, job)
        await self._finish_job(job, error=f"the prompt ({len(job.token_ids)} tokens) does not fit the prefill KV pool: "
                                          f"{err}", status=503)

    # -- after the prompt ------------------------------------------------------------------

    async def _first_token(self, job: Job, choice: tuple[int, list[dict] | None] | None, kv) -> None:
        """Stream the first token (`choice`, from `_choose_first`) and hand the KV to decode; with
        n > 1 (`choice` None) only the handoff: decode starts the choices."""
        req, spans = job.req, job.trace
        logs.bind(req.request_id, spans.trace_id if spans else None)  # this task serves this request only
        published = 0  # events on the request's stream so far
        error = None
        try:
            self._recent_ttft.append(time.monotonic() - job.queued_at)
            self.m_cached.labels("cache").inc(job.cached)
            self.m_cached.labels("computed").inc(len(job.token_ids) - job.cached)
            if job.prepositioned:
                self.preposition_hits += 1
                self.m_pp.labels("hit").inc()
            if choice is None:
                fetched = min(job.fetched, job.cached)
                if req.resumed:
                    log.info("%s resumed: the KV of %d tokens, %d from the prefix cache (%d fetched from the offload "
                             "tier), %d computed", req.request_id, len(job.token_ids), job.cached, fetched,
                             len(job.token_ids) - job.cached)
                await self._handoff(req, kv, list(req.generated_token_ids), spans,
                                    **({"cached_tokens": job.cached, "fetched_tokens": fetched} if req.resumed else {}))
                if self.prefix_store is not None:
                    await self._offload(job, kv)
                return
            if isinstance(choice, GrammarDeadEnd):
                await self._fail(req, 0, str(choice), status=400, error_type="invalid_request_error")
                if job.stream is not None:  # decode saw the error on the stream; let the transfer end
                    await self._finish_stream(job)
                return
            first, logprobs = choice
            stream = TextStream(self.runner.tokenizer, req.sampling, self.runner.eos_token_ids)
            text = stream.push(first)
            await self._publish(req, seq=0, kind="token", token_ids=[first], text=text, cached_tokens=job.cached,
                                prepositioned=job.prepositioned, logprobs=logprobs)
            published = 1
            if spans is not None:
                spans.child("prefill.first_token", spans.marks.get("computed", spans.marks["start"]),
                            **{"pdserve.token_id": first, "pdserve.cached_tokens": job.cached})
            if stream.done:
                self.m_requests.labels("finished").inc()
                await self._publish(req, seq=1, kind="done", finish_reason=stream.finish_reason,
                                    usage=Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=1))
                if self.prefix_store is not None:
                    await self._offload(job, kv)
                if job.stream is not None:  # decode saw "done" on the stream; let the transfer end
                    await self._finish_stream(job)
                return
            if job.stream is not None:
                await self._finish_stream(job)
                if self.prefix_store is not None:
                    await self._offload(job, kv)
                return
            await self._handoff(req, kv, [first], spans)
            if self.prefix_store is not None:
                await self._offload(job, kv)
        except Exception as e:  # never leave the client waiting on a request we took
            log.exception("prefill of %s failed", req.request_id)
            error = f"prefill failed: {e}"
            await self._fail(req, published, error)
        finally:
            if spans is not None:
                spans.end(error=error)

    def _offer(self, req: PrefillRequest, layout, num_tokens: int, kv_bytes: int, generated: list[int],
               first_token_pending: bool = False, **extra) -> HandoffOffer:
        """The handoff offer of a request's KV, fenced by this worker's identity and generation."""
        return HandoffOffer(
            request_id=req.request_id, sender_id=self.worker_id, sender_generation=self.generation, layout=layout,
            num_tokens=num_tokens, kv_bytes=kv_bytes, prompt_token_ids=req.prompt_token_ids,
            generated_token_ids=generated, first_token_pending=first_token_pending, sampling=req.sampling,
            seed=req.seed, next_seq=0 if req.resumed else len(generated) or int(first_token_pending),
            resumed=req.resumed, front_id=req.front_id, failure_policy=req.failure_policy,
            spec=req.spec, traceparent=req.traceparent, **extra,
            **self.kv_channel.offer_fields(),
        )

    async def _place(self, req: PrefillRequest, offer: HandoffOffer) -> "HandoffReply | str":
        """Offer the KV to the decode worker the front routed the request to; if that worker is gone (no
        responder) or refused (draining, full), to any decode worker of the model, a few times. The
        accepting reply, or why nobody took it.

        A worker that refused or was never there does not own the request, so another may take it. A
        worker that did not answer in time may still take it late: then the request fails here, as
        two owners of one request would each continue it."""
        subject, target = Subjects.decode_handoff(self.scope, req.decode_worker_id), f"decode worker {req.decode_worker_id}"
        why: list[str] = []
        for attempt in range(1 + HANDOFF_REROUTES):
            try:
                raw = await self.nc.request(subject, offer.encode(), timeout=self.offer_timeout)
                reply = HandoffReply.decode(raw.data)
            except nats.errors.TimeoutError:
                return "; ".join([*why, f"{target} did not answer the handoff within {self.offer_timeout:.1f} s"])
            except nats.errors.NoRespondersError:
                why.append("no other decode worker is listening" if attempt else f"{target} is not listening")
                if attempt:
                    break
            else:
                if reply.accepted:
                    if attempt:
                        self.m_rerouted.inc()
                        log.info("handoff of %s re-routed to %s (%s)", req.request_id, reply.worker_id, why[0])
                    return reply
                why.append(f"decode worker {reply.worker_id} refused the handoff: {reply.error}")
                if attempt:
                    await asyncio.sleep(0.05 * attempt)  # a full worker frees room as its sequences end
            subject, target = Subjects.decode_handoff_any(self.scope, self.model_name), "a decode worker of the model"
        return "; ".join(why)

    async def _handoff(self, req: PrefillRequest, kv, generated: list[int],
                       spans: tracing.RequestSpans | None = None, **offer_fields) -> None:
        kv = kv.for_handoff()  # a sliding-window layer's window only (the offload tier keeps every block)
        offer = self._offer(req, kv.layout, kv.num_tokens, kv.nbytes, generated, **offer_fields)
        self.transfer_backlog += 1
        self.transfer_backlog_bytes += kv.nbytes
        t0 = time.monotonic()
        try:
            t_offer = tracing.now_ns() if spans is not None else 0
            reply = await self._place(req, offer)
            if spans is not None:
                self._trace_offer(spans, t_offer, req, reply)
            if isinstance(reply, str):  # no decode worker took the request: it is ours to report
                await self._fail(req, len(generated), reply, status=503, error_type="unavailable")
                return
            header = self.kv_channel.header(reply, req.request_id, kv.layout, kv.num_tokens)
            t_send = tracing.now_ns() if spans is not None else 0
            try:
                await self.kv_channel.send(reply, header, kv)
            except TransferError as e:
                # decode owns the request now and applies its failure policy (recompute or fail)
                log.warning("KV send for %s to %s failed: %s", req.request_id, reply.worker_id, e)
                self.m_kv_failed.labels("sender").inc()
                if spans is not None:
                    spans.child("handoff.transfer", t_send, error=str(e), **self._transfer_attrs(reply, kv.nbytes))
                return
            if spans is not None:
                spans.child("handoff.transfer", t_send, **self._transfer_attrs(reply, kv.nbytes))
            self.m_kv_bytes.inc(kv.nbytes)
            self.m_kv_seconds.observe(time.monotonic() - t0)
            self.m_requests.labels("handed_off").inc()
        finally:
            self.transfer_backlog -= 1
            self.transfer_backlog_bytes -= kv.nbytes


    @staticmethod
    def _trace_offer(spans: tracing.RequestSpans, start_ns: int, req: PrefillRequest, reply: "HandoffReply | str",
                     **attrs) -> None:
        """The `handoff.offer` span: the offer until decode's answer (`reply`, or why nobody took it)."""
        accepted = not isinstance(reply, str) and reply.accepted
        spans.child("handoff.offer", start_ns, error=None if accepted else (reply if isinstance(reply, str)
                                                                             else reply.error), **{
            "pdserve.decode_worker": reply.worker_id if not isinstance(reply, str) else req.decode_worker_id,
            "pdserve.rerouted": accepted and reply.worker_id != req.decode_worker_id, "pdserve.accepted": accepted,
            **attrs})

    @staticmethod
    def _transfer_attrs(reply: HandoffReply, nbytes: int, **more) -> dict:
        return {"pdserve.kv.bytes": nbytes, "pdserve.kv.transport": reply.transport,
                "pdserve.kv.compression": reply.compression, "pdserve.decode_worker": reply.worker_id, **more}


def main(argv: list[str]) -> int:
    return run_worker(PrefillWorker, argv)
