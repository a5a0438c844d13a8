"""The decode worker: accepts KV handoffs, continues generation, streams tokens back.

Per request: an offer arrives on NATS (fenced: layout, model fingerprint, sender identity and
generation) → the worker reserves a one-time transfer token on its data port and replies →
the KV arrives over the direct stream → the sequence joins the running batch. Every step is one
forward over the whole running batch (continuous batching: sequences join and leave between
steps), each sequence bringing its last token plus its own number k of draft tokens; one fused
verification call then accepts a prefix per sequence and the rejected KV is rolled back. When
the KV pool runs out, the most recently admitted sequence is preempted and later recomputed.
Once an offer is accepted this worker owns the request: if its KV never arrives intact, the
failure policy decides — recompute the prompt here, or fail the request with the reason.
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
from pdserve.decode.drafters import make_drafter
from pdserve.decode.speculation import SpanTracker, SpeculationController
from pdserve.engine import EngineUnavailable, OutOfBlocks, create_engine
from pdserve.kernels.spec_verify import verify, verify_greedy
from pdserve.kvtransfer.channel import KVReceiveChannel
from pdserve.kvtransfer.frames import TransferError
from pdserve.kvtransfer.protocol import (
    Cancel, HandoffOffer, HandoffReply, ProtocolError, StreamEvent, Subjects, Usage,
)
from pdserve.kvtransfer.tcp_server import KVReceiver
from pdserve.sampling import TextStream, verification_randomness
from pdserve.workerbase import WorkerBase, run_worker

log = logging.getLogger("pdserve.decode")


_ADMISSIONS = itertools.count()


@dataclass
class Sequence:
    offer: HandoffOffer
    stream: TextStream
    seq: int  # next StreamEvent sequence number
    generated: list[int] = field(default_factory=list)
    last_token_at: float = field(default_factory=time.monotonic)
    max_k: int = 0  # this request's speculation bound (0 = off)
    span: SpanTracker = field(default_factory=SpanTracker)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    admitted: int = field(default_factory=lambda: next(_ADMISSIONS))  # admission order, for preemption
    last_step: int = -1  # the decode step that last included it (-1: none yet)

    @property
    def context(self) -> list[int]:
        """Prompt + everything generated so far (what drafters look up in)."""
        return self.offer.prompt_token_ids + self.generated

    @property
    def request_id(self) -> str:
        return self.offer.request_id


def next_batch(running: "OrderedDict[str, Sequence]", max_batch: int) -> list[Sequence]:
    """The sequences of the next step: the first `max_batch` in turn order, which then go to the back.

    Round robin over the running set (admissions join at the back): with R sequences running, none
    waits more than ceil(R / max_batch) - 1 steps between two of its turns.
    """
    batch = list(running.values())[:max_batch]
    for s in batch:
        running.move_to_end(s.request_id)
    return batch


class DecodeWorker(WorkerBase):
    role = "decode"
    settings = DecodeConfig
    args: DecodeConfig

    def __init__(self, args: DecodeConfig):
        super().__init__(args)
        self.receiver = KVReceiver(self.runner.layout, host=args.data_host, port=args.data_port,
                                   advertise_host=args.advertise_host, stall_timeout=args.kv.timeout,
                                   shm_pool_bytes=args.kv.shm_pool_bytes, keep_idle_s=args.kv.keep_idle_s,
                                   max_kept=args.kv.max_kept)
        self.transfer_timeout = args.kv.timeout
        self.max_running = args.max_running
        self.kv_capacity = args.kv_capacity_bytes
        self._stepping: set[str] = set()
        self.receiving_tokens = 0  # prompt tokens of accepted handoffs not yet in the pool
        self.running: OrderedDict[str, Sequence] = OrderedDict()
        self.receiving = 0
        self._cancelled: set[str] = set()
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
        self.max_batch = args.max_batch
        self.preempted: deque[Sequence] = deque()
        self.spec_k_policy = args.spec.k_policy
        self.drafter = self._make_drafter(args)
        self.controller = SpeculationController(method=args.spec.method)
        # The fused Triton verifier on GPUs; the torch reference (same function) on the CPU.
        self.verify_impl = "triton" if self.runner.device.type == "cuda" else "reference"
        r = self.registry
        self.m_tokens = Counter("pdserve_decode_tokens_total", "tokens generated by decode", registry=r)
        self.m_running = Gauge("pdserve_decode_running_sequences", "sequences being decoded", registry=r)
        Gauge("pdserve_decode_kv_utilization", "KV capacity in use (0-1)", registry=r
              ).set_function(lambda: self.engine.utilization())
        Gauge("pdserve_decode_waiting_sequences", "sequences waiting: KV in flight, or preempted", registry=r
              ).set_function(lambda: self.receiving + len(self.preempted))
        Gauge("pdserve_transfer_backlog_handoffs", "KV handoffs being received", registry=r
              ).set_function(lambda: self.receiving)
        self.m_kv_bytes = Counter("pdserve_kv_transfer_received_bytes_total",
                                  "KV bytes received from prefill (uncompressed)", registry=r)
        self.m_kv_wire = Counter("pdserve_kv_transfer_wire_bytes_total", "bytes the received KV took on the wire",
                                 ["transport", "compression"], registry=r)
        self.m_preempted = Counter("pdserve_decode_preemptions_total", "sequences preempted for KV room",
                                   registry=r)
        self.m_recompute = Counter("pdserve_kv_recompute_total", "handoffs whose KV was lost and recomputed", registry=r)
        self.m_handoffs = Counter("pdserve_decode_handoffs_total", "handoff offers", ["outcome"], registry=r)
        self.steps = 0
        self.m_wait_steps = Histogram("pdserve_decode_wait_steps", "steps a running sequence sat out between two "
                                      "of its turns (round robin: at most ceil(running / max_batch) - 1)",
                                      registry=r, buckets=(0, 1, 2, 4, 8, 16, 32))
        self.m_itl = Histogram("pdserve_decode_step_seconds", "time per decode step of one sequence (1+ tokens)",
                               registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2))
        self.m_spec_draft = Counter("pdserve_spec_draft_tokens_total", "draft tokens proposed", ["span"], registry=r)
        self.m_spec_accepted = Counter("pdserve_spec_accepted_tokens_total", "draft tokens accepted", ["span"],
                                       registry=r)
        self.m_spec_rate = Histogram("pdserve_spec_acceptance_rate", "accepted/proposed per verified step",
                                     registry=r, buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
        self.m_spec_k = Histogram("pdserve_spec_chosen_k", "speculation length chosen per step", registry=r,
                                  buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16))

    def _make_drafter(self, args: DecodeConfig):
        if args.spec.method == "draft":  # DecodeConfig makes sure a draft model is named
            from pdserve.modelstore import resolve_model

            # refused here, at load, if its tokenizer differs from the target's; its forwards run off
            # the event loop, which must keep heartbeats and token streams flowing meanwhile
            return make_drafter("draft", path=str(resolve_model(args.spec.draft_model)),
                                target_tokenizer=self.runner.tokenizer, run_in_thread=True)
        return make_drafter(args.spec.method)

    def data_addr(self) -> str | None:
        return self.receiver.address if self.receiver.port else None

    def load_fields(self) -> dict:
        util = self.engine.utilization()
        return dict(running=len(self.running), waiting=self.receiving + len(self.preempted),
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
        self.kv_channel = KVReceiveChannel(self.receiver, self.nc, worker_id=self.worker_id,
                                           stall_timeout=self.transfer_timeout,
                                           compressions=dict.fromkeys(("none", self.args.kv.compression)))
        await self.nc.subscribe(Subjects.decode_handoff(self.scope, self.worker_id), cb=self._on_offer)
        await self.nc.subscribe(Subjects.CANCEL_ALL, cb=self._on_cancel)
        self.spawn(self._decode_loop())

    async def on_stop(self) -> None:
        for s in list(self.running.values()):
            await self._emit(s, kind="error", error=f"decode worker {self.worker_id} shutting down",
                             error_type="unavailable", status=503)
        await self.receiver.close()

    # -- handoffs --------------------------------------------------------------------------

    async def _on_offer(self, msg) -> None:
        def refuse(reason: str) -> HandoffReply:
            self.m_handoffs.labels("refused").inc()
            log.warning("handoff refused: %s", reason)
            return HandoffReply(accepted=False, worker_id=self.worker_id, error=reason)

        try:
            offer = HandoffOffer.decode(msg.data)
        except ProtocolError as e:
            await msg.respond(refuse(str(e)).encode())
            return
        if len(self.running) + self.receiving >= self.max_running:
            await msg.respond(refuse(f"at capacity ({self.max_running} sequences)").encode())
            return
        if self.preempted or not self.engine.can_admit(offer.num_tokens + self.receiving_tokens):
            await msg.respond(refuse(f"no KV capacity for {offer.num_tokens} tokens "
                                     f"(utilisation {self.engine.utilization():.0%})").encode())
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
        await msg.respond(reply.encode())
        self.m_handoffs.labels("accepted").inc()
        self.spawn(self._receive(offer, token, time.monotonic(), first))

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

        sub = await self.nc.subscribe(Subjects.stream(offer.request_id), cb=on_event)
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
        seq = None
        try:
            try:
                kv, stats = await self.kv_channel.wait(token, self.transfer_timeout)
                self.m_kv_bytes.inc(stats["bytes"])  # received, whether or not there is anything to continue
                self.m_kv_wire.labels(stats["transport"], stats["compression"]).inc(stats["wire_bytes"])
                if (seq := await self._continuation(offer, first)) is None:
                    return
                await self.compute(self.engine.import_kv, rid, kv, offer.prompt_token_ids)
                del kv
                # handoff time as decode sees it: offer accepted -> KV in place, ready to decode
                await self._emit(seq, kind="handoff", kv_bytes=stats["bytes"],
                                 kv_seconds=time.monotonic() - accepted_at)
            except TransferError as e:
                if (seq := await self._continuation(offer, first)) is None:
                    return
                if offer.failure_policy != "recompute":
                    await self._emit(seq, kind="error", error=f"KV handoff failed: {e}", error_type="kv_transfer_error",
                                     status=502)
                    return
                log.warning("KV for %s lost (%s); recomputing the prompt here", rid, e)
                self.m_recompute.inc()
                await self._emit(seq, kind="handoff", kv_bytes=0, kv_seconds=0.0)
                await self.compute(self.engine.prefill, rid, offer.prompt_token_ids)
            except Exception as e:  # e.g. the pool filled up while the KV was in flight
                log.exception("admitting %s failed", rid)
                if rid in self.engine:
                    self.engine.free(rid)
                await self._emit(seq or self._sequence(offer), kind="error", error=f"decode could not admit the request: {e}",
                                 error_type="unavailable", status=503)
                return
        finally:
            self.receiving -= 1
            self.receiving_tokens -= offer.num_tokens
        if rid in self._cancelled:
            self._cancelled.discard(rid)
            self.engine.free(rid)
            return
        self.running[rid] = seq
        self.m_running.set(len(self.running))
        self._wake.set()

    async def _continuation(self, offer: HandoffOffer, first) -> Sequence | None:
        """The sequence decode continues, or None when there is nothing to continue: a layer-streamed
        offer whose first token never came (`_first_token`), or a first token that already ended the
        request (a stop: prefill reported "done")."""
        if first is not None and not await self._first_token(offer, first):
            return None
        seq = self._sequence(offer)
        return None if seq.stream.done else seq

    def _sequence(self, offer: HandoffOffer) -> Sequence:
        stream = TextStream(self.runner.tokenizer, offer.sampling, self.runner.eos_token_ids,
                            generated=offer.generated_token_ids)
        return Sequence(offer, stream, offer.next_seq, list(offer.generated_token_ids),
                        max_k=self._request_max_k(offer))

    def _request_max_k(self, offer: HandoffOffer) -> int:
        spec = offer.spec or {}
        if not spec.get("enabled", True) or spec.get("method") == "none":
            return 0
        return min(self.spec_max_k, spec.get("max_k", self.spec_max_k))

    async def _on_cancel(self, msg) -> None:
        try:
            rid = Cancel.decode(msg.data).request_id
        except ProtocolError:
            return
        s = self.running.pop(rid, None)
        if s is not None and rid in self._stepping:
            return  # the step in flight uses its KV; the loop releases it when the step ends
        if s is None:
            s = next((p for p in self.preempted if p.request_id == rid), None)
            if s is not None:
                self.preempted.remove(s)
        if s is not None:
            self._release(s)  # its blocks are free at once
        else:
            self._cancelled.add(rid)

    def _release(self, s: Sequence) -> None:
        self.drafter.release(s.request_id)
        self.controller.release(s.request_id)
        self.engine.free(s.request_id)
        self.m_running.set(len(self.running))

    async def _emit(self, s: Sequence, **fields) -> None:
        await self.nc.publish(Subjects.stream(s.request_id),
                              StreamEvent(request_id=s.request_id, seq=s.seq, worker_id=self.worker_id,
                                          **fields).encode())
        s.seq += 1

    # -- the decode loop -------------------------------------------------------------------

    async def _plan(self, s: Sequence):
        """Choose this step's k for `s` and draft that many tokens; None for a plain step."""
        rid = s.request_id
        room = min(s.offer.sampling.max_tokens - len(s.generated) - 1,
                   self.runner.max_context - len(s.offer.prompt_token_ids) - len(s.generated) - 1)
        if not s.max_k or room <= 0:
            self.m_spec_k.observe(0)
            return None
        sampling = s.offer.sampling
        max_k = min(s.max_k, room)
        confidence = getattr(self.drafter, "confidence", None)
        if confidence is not None and self.spec_k_policy == "adaptive":
            # A model-free proposal costs microseconds: propose first, then let the controller cut it
            # to what pays, using the drafter's confidence in this very proposal.
            t0 = time.perf_counter()
            draft = await self.drafter.propose(rid, s.context, max_k, sampling)
            self.controller.observe_draft(max(1, len(draft.token_ids)), time.perf_counter() - t0)
            k = 0
            if draft.token_ids and (hint := confidence(rid)) is not None:
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

    def _forward_and_verify(self, batch: list[Sequence], drafts: list) -> list[list[int]]:
        """One forward over the whole batch, verification, rollback (compute thread).

        Sequence i feeds its last token plus its k_i draft tokens; row i accepts a prefix of the
        drafts and adds the correction or bonus token (k_i = 0: a plain sampled or greedy token,
        the same draw plain sampling makes). Greedy rows are verified right here by argmax and
        compare — exactly the verifier's greedy rule (first index on ties), without building its
        [B, K+1, V] tensors; sampled rows go through one fused verification call. Returns the
        committed tokens per sequence.
        """
        rids = [s.request_id for s in batch]
        kept = [self.engine.num_tokens(r) for r in rids]
        draft_ids = [d.token_ids if d else [] for d in drafts]
        logits = self.engine.step([(r, [s.generated[-1], *ids]) for r, s, ids in zip(rids, batch, draft_ids)])
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
        for i, r in enumerate(rids):
            # keep the fed token and the accepted drafts; drop the rest
            self.engine.rollback(r, kept[i] + len(committed[i]))
        return committed

    def _verify_sampled(self, batch: list[Sequence], drafts: list, logits: list[torch.Tensor]) -> list[list[int]]:
        """The fused verification call for sampled rows: logits[i] is [k_i + 1, V]."""
        draft_ids = [d.token_ids if d else [] for d in drafts]
        B, K, V = len(batch), max(map(len, draft_ids)), logits[0].shape[-1]
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
            ui, ni = verification_randomness(s.offer.seed, len(s.generated), k, V)
            u[i, :k], noise[i, : k + 1] = ui[0], ni[0]
        sp = [s.offer.sampling for s in batch]
        out, n_acc = verify(target, ids, num, probs, torch.tensor([p.temperature for p in sp]),
                            torch.tensor([p.top_k for p in sp], dtype=torch.int32),
                            torch.tensor([p.top_p for p in sp]), u, noise, impl=self.verify_impl)
        return [out[i, : int(n_acc[i]) + 1].tolist() for i in range(B)]

    async def _resume_preempted(self) -> None:
        """Bring preempted sequences back (recomputing their KV) once the pool has room."""
        while self.preempted and self.engine.can_admit(len(self.preempted[0].context)):
            s = self.preempted.popleft()
            await self.compute(self.engine.prefill, s.request_id, s.context[:-1])
            s.last_step = -1  # it waited for memory, not for its turn: a fresh start in the rotation
            self.running[s.request_id] = s
            log.info("resumed preempted %s (%d tokens recomputed)", s.request_id, len(s.context) - 1)

    def _preempt(self, batch: list[Sequence]) -> None:
        """Out of KV blocks: the most recently admitted sequence gives its blocks back and waits."""
        victim = max(batch, key=lambda s: s.admitted)
        self.running.pop(victim.request_id, None)
        self.drafter.release(victim.request_id)
        self.engine.free(victim.request_id)
        self.preempted.append(victim)
        self.m_preempted.inc()
        log.warning("KV pool full: preempted %s (will recompute)", victim.request_id)

    async def _decode_loop(self) -> None:
        while True:
            await self._resume_preempted()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = next_batch(self.running, self.max_batch)
            self.steps += 1
            for s in batch:
                if s.last_step >= 0:
                    self.m_wait_steps.observe(self.steps - s.last_step - 1)
                s.last_step = self.steps
            drafts = [await self._plan(s) for s in batch]
            self._stepping = {s.request_id for s in batch}
            t0 = time.perf_counter()
            try:
                committed = await self.compute(self._forward_and_verify, batch, drafts)
            except OutOfBlocks:
                self._stepping = set()
                self._preempt(batch)
                continue
            except Exception as e:
                log.exception("decode step failed for %d sequences", len(batch))
                self._stepping = set()
                for s in batch:
                    if self.running.pop(s.request_id, None) is not None:
                        await self._emit(s, kind="error", error=f"decode failed: {e}", error_type="server_error",
                                         status=500)
                    self._release(s)
                continue
            self._stepping = set()
            dt = time.perf_counter() - t0
            fed = sum(1 + (len(d.token_ids) if d else 0) for d in drafts)
            self.controller.observe_verify(len(batch), max(1, round(fed / len(batch))), dt)
            self.m_itl.observe(dt)
            for s, d, tokens in zip(batch, drafts, committed):
                if s.request_id not in self.running:  # cancelled while the step ran
                    self._release(s)
                    continue
                try:
                    await self._commit(s, d, tokens, dt)
                except Exception as e:  # one request's bug must not stop the loop for everyone
                    log.exception("committing tokens of %s failed", s.request_id)
                    if self.running.pop(s.request_id, None) is not None:
                        self._release(s)
                        await self._emit(s, kind="error", error=f"decode failed: {e}", error_type="server_error",
                                         status=500)

    async def _commit(self, s: Sequence, draft, tokens: list[int], step_seconds: float) -> None:
        rid = s.request_id
        if draft:
            kd, acc = len(draft.token_ids), len(tokens) - 1
            span = s.span.kind
            self.controller.observe_step(rid, span, kd, acc)
            self.drafter.feedback(rid, acc, tokens)
            s.draft_tokens += kd
            s.accepted_tokens += acc
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
        delta = "".join(text)
        s.span.feed(delta)
        await self._emit(s, kind="token", token_ids=committed, text=delta)
        if s.stream.done:
            self.running.pop(rid, None)
            self._release(s)
            await self._emit(s, kind="done", finish_reason=s.stream.finish_reason,
                             usage=Usage(prompt_tokens=len(s.offer.prompt_token_ids),
                                         completion_tokens=len(s.generated), spec_draft_tokens=s.draft_tokens,
                                         spec_accepted_tokens=s.accepted_tokens))


def main(argv: list[str]) -> int:
    return run_worker(DecodeWorker, argv)
