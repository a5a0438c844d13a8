"""The wire protocol of pdserve's control plane: every NATS subject and message schema, in one place.

NATS carries control, never bulk KV bytes: requests to prefill, handoff offers and replies,
token streams, cancellations, failure records, and worker load reports (which double as
heartbeats and as the registry). KV bytes travel a direct data path (see `kvtransfer.tcp_send`
and `kvtransfer.tcp_server`) whose frames are described in `kvtransfer.frames`.

Versioning: every subject starts with `pdserve.v2`; every message carries `v` (the protocol
version). A receiver refuses a message of a version it does not speak with an explicit error.
The version is in every subject's prefix, not only in the messages: processes of two versions
then never see each other, where two subject layouts on one server would leave a request waiting
for its timeout.

Isolation: `{s}` (the deployment scope as one subject token, see `scope_token`) is the fourth token
of every subject, so one NATS permission, `pdserve.v2.*.{s}.>`, confines a deployment to its own
traffic (`permissions` writes it out, with the per-scope inbox and object-store buckets). Each
process sets `inbox_prefix(scope)` as its reply inbox, so no other deployment may read its replies.

Subjects (`{s}` the deployment scope — see LoadReport.scope —, `{m}` the served model name,
`{w}` a worker id, `{r}` a request id, `{t}` a one-time transfer token):

| subject                                  | from → to        | message                      |
|------------------------------------------|------------------|------------------------------|
| pdserve.v2.prefill.{s}.{m} (queue)       | front → prefill  | PrefillRequest → Ack         |
| pdserve.v2.prefill.{s}.{m}.w.{w}         | front → prefill  | PrefillRequest → Ack (routed |
|                                          |                  | to the worker holding the    |
|                                          |                  | longest cached prefix)       |
| pdserve.v2.preposition.{s}.{w}           | front → prefill  | PrepositionHint (fire and    |
|                                          |                  | forget)                      |
| pdserve.v2.decode.{s}.{w}.handoff        | prefill → decode | HandoffOffer → HandoffReply  |
| pdserve.v2.stream.{s}.{r}                | workers → front  | StreamEvent (tokens/errors)  |
| pdserve.v2.cancel.{s}.{r}                | front → workers  | Cancel (a worker sends one   |
|                                          |                  | for a request whose front    |
|                                          |                  | went silent)                 |
| pdserve.v2.front.{s}.{f}                 | front → workers  | FrontBeat (1 Hz; heartbeat)  |
| pdserve.v2.load.{s}.{role}.{w}           | worker → all     | LoadReport (1 Hz; heartbeat) |
| pdserve.v2.bye.{s}.{role}.{w}            | worker → all     | LoadReport (clean shutdown)  |
| pdserve.v2.kv.{s}.data.{t}               | prefill → decode | KV frames (NATS-chunked and  |
|                                          |                  | object-store transports)     |
| pdserve.v2.kv.{s}.failed.{r}             | either side → all| TransferFailed               |
| pdserve.v2.draft.{s}.{m} (queue)         | decode → pool    | DraftRequest → DraftReply    |
| pdserve.v2.draft.{s}.{m}.report          | decode → pools   | DraftReport (fire and forget)|

Trace context: `PrefillRequest` and `HandoffOffer` may carry a W3C `traceparent` (the front's request
span, see `pdserve.tracing`), so prefill's and decode's spans join the request's one trace. The field is
optional within v2 and left out of a message that has none: with tracing off, messages are byte for byte
what they were before it existed, and a worker that predates it reads them.

Object-store buckets (`Buckets`) are per scope too: `pdserve-kv-{s}` (the objstore transport) and
`pdserve-prefix-{s}` (the prefix offload tier; per scope, so one deployment cannot probe which
prompts another has seen).

KV transports (`HandoffOffer.transports`, chosen in `HandoffReply.transport`): "shm" (same host),
"tcp" (direct stream), "nats" (chunked messages on `kv.{s}.data.{t}`, the fallback that always
works), "objstore" (the JetStream object store, the offload tier). See `kvtransfer.channel`.
"""
from __future__ import annotations

import asyncio
import string
import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator

from pdserve.basetypes import KVLayout, SamplingParams
from pdserve.tracing import valid_traceparent

PROTOCOL_VERSION = 2
PREFIX = f"pdserve.v{PROTOCOL_VERSION}"
PREFILL_QUEUE_GROUP = "prefill"
DECODE_QUEUE_GROUP = "decode"

Role = Literal["prefill", "decode", "front", "draft"]

_SUBJECT_SAFE = frozenset(string.ascii_letters + string.digits + "-_")


class ProtocolError(ValueError):
    """A control message that cannot be accepted (wrong version, malformed, fenced out)."""


def _safe_token(s: str) -> str:
    # Subject tokens may not contain '.', '*', '>' or whitespace; bucket names allow ASCII letters,
    # digits, '-' and '_' only, so everything else becomes '_'.
    return "".join(c if c in _SUBJECT_SAFE else "_" for c in s) or "_"


def scope_token(scope: str) -> str:
    """The deployment scope as it appears in subjects, inbox prefixes and bucket names.

    In Kubernetes a scope is "namespace.name": both DNS labels (no '_'), so the mapping is one to one."""
    return _safe_token(scope)


def inbox_prefix(scope: str) -> str:
    """The reply inbox prefix of a deployment's processes (nats-py's `inbox_prefix`)."""
    return f"_INBOX.{scope_token(scope)}"


class Buckets:
    """JetStream object-store buckets, one of each per deployment scope."""

    @staticmethod
    def kv_transfer(scope: str) -> str:
        return f"pdserve-kv-{scope_token(scope)}"

    @staticmethod
    def prefix(scope: str) -> str:
        return f"pdserve-prefix-{scope_token(scope)}"


class Subjects:
    """Subject names. Every one carries the deployment scope as its fourth token; model names and ids
    are sanitised into single subject tokens."""

    @staticmethod
    def prefill(scope: str, model: str) -> str:
        return f"{PREFIX}.prefill.{scope_token(scope)}.{_safe_token(model)}"

    @staticmethod
    def prefill_worker(scope: str, model: str, worker_id: str) -> str:
        """One prefill worker's own subject: the router sends here to reuse that worker's cached prefix."""
        return f"{Subjects.prefill(scope, model)}.w.{_safe_token(worker_id)}"

    @staticmethod
    def preposition(scope: str, worker_id: str) -> str:
        return f"{PREFIX}.preposition.{scope_token(scope)}.{_safe_token(worker_id)}"

    @staticmethod
    def decode_handoff(scope: str, worker_id: str) -> str:
        return f"{PREFIX}.decode.{scope_token(scope)}.{_safe_token(worker_id)}.handoff"

    @staticmethod
    def decode_handoff_any(scope: str, model: str) -> str:
        """Any decode worker of a model that takes new work (a queue group): where prefill re-routes a
        handoff whose routed decode worker is gone or refused it. A draining worker leaves it."""
        return f"{PREFIX}.handoff.{scope_token(scope)}.{_safe_token(model)}"

    @staticmethod
    def stream(scope: str, request_id: str) -> str:
        return f"{PREFIX}.stream.{scope_token(scope)}.{_safe_token(request_id)}"

    @staticmethod
    def cancel(scope: str, request_id: str) -> str:
        return f"{PREFIX}.cancel.{scope_token(scope)}.{_safe_token(request_id)}"

    @staticmethod
    def cancel_all(scope: str) -> str:
        return f"{PREFIX}.cancel.{scope_token(scope)}.*"

    @staticmethod
    def front_beat(scope: str, front_id: str) -> str:
        return f"{PREFIX}.front.{scope_token(scope)}.{_safe_token(front_id)}"

    @staticmethod
    def front_beats(scope: str) -> str:
        """Every front's heartbeat in a scope."""
        return f"{PREFIX}.front.{scope_token(scope)}.*"

    @staticmethod
    def load(scope: str, role: str, worker_id: str) -> str:
        return f"{PREFIX}.load.{scope_token(scope)}.{_safe_token(role)}.{_safe_token(worker_id)}"

    @staticmethod
    def load_role(scope: str, role: str) -> str:
        """Every load report of one role's workers in a scope."""
        return f"{PREFIX}.load.{scope_token(scope)}.{_safe_token(role)}.*"

    @staticmethod
    def load_all(scope: str) -> str:
        return f"{PREFIX}.load.{scope_token(scope)}.>"

    @staticmethod
    def bye(scope: str, role: str, worker_id: str) -> str:
        return f"{PREFIX}.bye.{scope_token(scope)}.{_safe_token(role)}.{_safe_token(worker_id)}"

    @staticmethod
    def bye_all(scope: str) -> str:
        return f"{PREFIX}.bye.{scope_token(scope)}.>"

    # Every deployment's load reports and goodbyes: the metrics adapter's view (see `scope_of`).
    LOAD_ANY = f"{PREFIX}.load.>"
    BYE_ANY = f"{PREFIX}.bye.>"

    @staticmethod
    def kv_data(scope: str, transfer_token: str) -> str:
        return f"{PREFIX}.kv.{scope_token(scope)}.data.{_safe_token(transfer_token)}"

    @staticmethod
    def kv_failed(scope: str, request_id: str) -> str:
        return f"{PREFIX}.kv.{scope_token(scope)}.failed.{_safe_token(request_id)}"

    @staticmethod
    def kv_failed_all(scope: str) -> str:
        return f"{PREFIX}.kv.{scope_token(scope)}.failed.*"

    @staticmethod
    def draft(scope: str, model: str) -> str:
        """The draft pool's request subject for a model's drafts (a queue group: one pool replica answers)."""
        return f"{PREFIX}.draft.{scope_token(scope)}.{_safe_token(model)}"

    @staticmethod
    def draft_report(scope: str, model: str) -> str:
        """Where decode workers report finished requests' tokens to every draft pool replica."""
        return f"{Subjects.draft(scope, model)}.report"

    @staticmethod
    def scope_of(subject: str) -> str | None:
        """The scope token of a pdserve subject (the fourth token), or None for another subject."""
        parts = subject.split(".")
        return parts[3] if len(parts) > 4 and f"{parts[0]}.{parts[1]}" == PREFIX else None


def permissions(scope: str) -> dict:
    """NATS permissions that confine a deployment's processes to their own scope.

    Publish and subscribe on `pdserve.v2.*.{s}.>`; replies only to requests received
    (`allow_responses`); its own inbox; and the JetStream API, object-store and flow-control subjects
    of its own two buckets (streams `OBJ_<bucket>`), nothing else of JetStream but the list of stream
    names. In the NATS server
    config's shape: `{"publish": {"allow": [...]}, "subscribe": {"allow": [...]}, "allow_responses": true}`."""
    own = f"{PREFIX}.*.{scope_token(scope)}.>"
    # STREAM.NAMES: nats-py finds an object's stream by subject before it reads one. It shows stream
    # names (other deployments' bucket names, so their scopes), never a stream's contents.
    publish, subscribe = [own, "$JS.API.STREAM.NAMES"], [own, f"{inbox_prefix(scope)}.>"]
    for bucket in (Buckets.kv_transfer(scope), Buckets.prefix(scope)):
        stream = f"OBJ_{bucket}"
        publish += [f"$JS.API.STREAM.*.{stream}", f"$JS.API.STREAM.*.*.{stream}",
                    f"$JS.API.CONSUMER.*.{stream}", f"$JS.API.CONSUMER.*.{stream}.>",
                    f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
                    f"$O.{bucket}.>", f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]
    return {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}, "allow_responses": True}


def observer_permissions() -> dict:
    """NATS permissions of the metrics adapter: every deployment's load reports and goodbyes, read only."""
    return {"publish": {"deny": [">"]}, "subscribe": {"allow": [Subjects.LOAD_ANY, Subjects.BYE_ANY]}}


class Message(BaseModel):
    """Base of every control message: versioned, strict about unknown fields, no NaN or infinity (a
    load of NaN would poison the router's and the autoscaler's arithmetic); counts and sizes are
    non-negative."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    v: int = PROTOCOL_VERSION

    # Fields added within v2, left out of the encoding while they hold their default: a process of an earlier
    # build (which refuses a field it does not know) reads the message as before unless the feature is used.
    added_in_v2: ClassVar[tuple[str, ...]] = ()

    def encode(self) -> bytes:
        unset = {f for f in self.added_in_v2 if getattr(self, f) == type(self).model_fields[f].get_default(
            call_default_factory=True)}
        return self.model_dump_json(exclude=unset or None).encode()

    @classmethod
    def decode(cls, data: bytes):
        try:
            msg = cls.model_validate_json(data)
        except Exception as e:  # pydantic.ValidationError or a JSON error
            raise ProtocolError(f"malformed {cls.__name__}: {e}") from e
        if msg.v != PROTOCOL_VERSION:
            raise ProtocolError(f"{cls.__name__} speaks protocol v{msg.v}; this worker speaks v{PROTOCOL_VERSION}")
        return msg


class LoadReport(Message):
    """A worker's identity and load, published at 1 Hz on `load.{role}.{worker_id}`.

    It is the heartbeat (a worker unseen for `stale_after_s` is dead), the registry (who serves
    which model, where its data port is) and the autoscaling signal source (the metrics adapter
    and the router read it). Units are in the field names.
    """

    worker_id: str
    role: Role
    model: str
    model_fingerprint: str = ""
    generation: NonNegativeInt = 0  # incarnation of this worker id; a handoff from an older one is refused
    time_unix_s: float = Field(default_factory=time.time)
    # Kubernetes identity: the worker's --isvc / --pool settings, POD_NAME / POD_NAMESPACE from the downward API.
    isvc: str | None = None
    pool: str | None = None
    pod: str | None = None
    namespace: str | None = None
    data_addr: str | None = None  # "host:port" of the worker's direct KV data server
    # Load. Prefill: queue of prompts not yet started. Decode: sequences running/waiting.
    queue_depth: NonNegativeInt = 0
    queue_wait_seconds: float = 0.0
    running: NonNegativeInt = 0
    waiting: NonNegativeInt = 0
    kv_utilization: float = 0.0  # 0..1 of the worker's KV capacity in use
    kv_bytes_used: NonNegativeInt = 0
    kv_bytes_capacity: NonNegativeInt = 0
    transfer_backlog_handoffs: NonNegativeInt = 0
    transfer_backlog_bytes: NonNegativeInt = 0
    ttft_seconds: float = 0.0  # recent mean, prefill side
    itl_seconds: float = 0.0  # recent mean inter-token latency, decode side
    tokens_per_second: float = 0.0
    spec_acceptance_rate: float = 0.0
    requests_per_second: float = 0.0  # recent rate of requests taken (the draft pool: draft asks)
    stale_after_s: float = 3.0
    # Prefill: prompt tokens accepted but not yet computed (the router's load signal), and the
    # prefix cache's contents — `basetypes.announced()` addresses of cached full blocks of `block_size`
    # tokens, most recently used first, at most a few thousand.
    queue_tokens: NonNegativeInt = 0
    block_size: NonNegativeInt = 0
    cached_blocks: list[str] = Field(default_factory=list)
    preposition_hits: NonNegativeInt = 0
    preposition_computed: NonNegativeInt = 0
    # The deployment this worker belongs to (an InferenceService: "namespace.name"; locally, one
    # `pdserve up`). Prefill queues and handoff subjects are per scope, so two deployments of the
    # same model on one NATS never take each other's requests.
    scope: str = "default"


# --- the request path -------------------------------------------------------------------------

class Traced(Message):
    """A request-path message that may carry the request's W3C trace context (see the module's doc)."""

    traceparent: str | None = None

    @field_validator("traceparent")
    @classmethod
    def _traceparent(cls, v: str | None) -> str | None:
        if v is not None and valid_traceparent(v) != v:
            raise ValueError(f"traceparent {v[:80]!r} is not a W3C trace context (00-<32 hex>-<16 hex>-<2 hex>)")
        return v

    added_in_v2: ClassVar[tuple[str, ...]] = ("traceparent",)


FailurePolicy = Literal["recompute", "fail"]


class PrefillRequest(Traced):
    """front → prefill (queue group): run this prompt, then hand the KV to `decode_worker_id`."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int  # resolved by the front, so every worker samples the same stream
    decode_worker_id: str
    failure_policy: FailurePolicy = "recompute"
    spec: dict | None = None  # speculation overrides for this request (method, max_k, enabled)
    # A request moved off a worker that died (`FrontConfig.migration_limit`): the tokens the client has already
    # been sent. Prefill computes the KV of the prompt and all of them but the last, samples nothing, and hands
    # them over with it (`HandoffOffer.resumed`); one choice only.
    generated_token_ids: list[int] = Field(default_factory=list)
    # The front that follows the request (its `FrontBeat`): should that front stop beating, the workers cancel
    # the request, as nobody is left to read its tokens. None: no front vouches for it (never cancelled so).
    front_id: str | None = Field(None, max_length=256)
    added_in_v2 = ("traceparent", "generated_token_ids", "front_id")

    @property
    def resumed(self) -> bool:
        """A request moved off a worker that died, with tokens already streamed."""
        return bool(self.generated_token_ids)


class FrontBeat(Message):
    """A front's heartbeat, every second on `front.{s}.{front_id}`: the workers cancel what a front that stopped
    beating for `stale_after_s` asked for (a front that crashed, or one cut off from NATS, which could not deliver
    a token either). Longer than a worker's bound: cancelling is final for the client, moving a request is not."""

    front_id: str = Field(min_length=1, max_length=256)
    stale_after_s: float = Field(10.0, gt=0)


class PrepositionHint(Message):
    """front → one prefill worker: the likely start of this conversation's next request.

    Sent after a request finishes: the conversation so far plus the answer just given. An idle
    prefill worker computes its KV into the prefix cache (under a budget, evicted first), so the
    next turn's prefill covers only the new message. Fire and forget: a busy worker drops it.
    """

    request_id: str
    model: str
    token_ids: list[int]


class Ack(Message):
    accepted: bool
    worker_id: str
    error: str | None = None
    status: int = 500  # of a refusal: 400 when the request itself is invalid


class HandoffOffer(Traced):
    """prefill → decode: a request's KV is ready; fenced by sender identity, generation and layout."""

    request_id: str
    sender_id: str
    sender_generation: NonNegativeInt
    layout: KVLayout
    num_tokens: NonNegativeInt
    kv_bytes: NonNegativeInt
    prompt_token_ids: list[int]
    generated_token_ids: list[int]  # what prefill already produced (the first token; none when n > 1)
    sampling: SamplingParams
    seed: int
    next_seq: NonNegativeInt  # sequence number of the next StreamEvent
    failure_policy: FailurePolicy = "recompute"
    spec: dict | None = None
    # KV transport negotiation (all optional: an offer without them means direct TCP, uncompressed).
    transports: list[str] = Field(default_factory=lambda: ["tcp"])  # sender's preference order
    host_id: str | None = None  # equal on both sides ⇒ they share memory (see kvtransfer.shm.host_id)
    compression: Literal["none", "int8", "fp8"] = "none"  # what the sender would like on the wire
    # Layer streaming: the offer is made before the prompt's last forward, so the KV can flow layer by
    # layer while it is computed; the first token is not known yet (generated_token_ids is empty) and
    # reaches decode as prefill's seq-0 "token" event on the request's stream (decode subscribes to it
    # before replying). A "done" or "error" event from prefill instead means: nothing to continue.
    first_token_pending: bool = False
    # Conditional disaggregation: prefill's queue is long, so the prompt comes uncomputed (no KV, no first
    # token; num_tokens is the prompt's length, kv_bytes 0) and decode prefills it between its own steps.
    # Decode takes it only while its own queue of such prompts is shorter than `queue_ahead_tokens`, the
    # prompt tokens waiting at prefill ahead of it; a refusal leaves the prompt with prefill.
    kv_deferred: bool = False
    queue_ahead_tokens: NonNegativeInt = 0
    # A moved request (`PrefillRequest.generated_token_ids`): its generated tokens reached the client through an
    # earlier attempt, so decode emits none of them (the stream starts at seq 0) and, should they already end it
    # (a stop, max_tokens), says "done" itself.
    resumed: bool = False
    front_id: str | None = Field(None, max_length=256)  # `PrefillRequest.front_id`
    # A moved request's KV, by where prefill got it: its prefix cache (where the worker that computed the prompt
    # first keeps it), of which the offload tier supplied `fetched_tokens`; the rest it computed. Decode passes them
    # on in its "handoff" event, for the front's count of what moving cost.
    cached_tokens: NonNegativeInt = 0
    fetched_tokens: NonNegativeInt = 0
    added_in_v2 = ("traceparent", "resumed", "front_id", "cached_tokens", "fetched_tokens")

    @property
    def kv_token_ids(self) -> list[int]:
        """The tokens whose KV the offer carries: the prompt and every generated token but the last, which
        decode's first step feeds."""
        return self.prompt_token_ids + self.generated_token_ids[:-1]


class HandoffReply(Message):
    accepted: bool
    worker_id: str
    transfer_token: str | None = None
    data_addr: str | None = None
    error: str | None = None
    transport: str = "tcp"  # the one the receiver picked from the offer's list
    compression: Literal["none", "int8", "fp8"] = "none"  # the one it agreed to
    rendezvous: dict = Field(default_factory=dict)  # per transport: {"subject": …} for nats/objstore, …


class TransferFailed(Message):
    """Either side → `kv.failed.{request_id}`: a KV transfer failed; the record says who, how and why.

    The decode side still applies the request's failure policy (recompute or fail); this record is for
    the other side, the front and operators (metrics, logs), so a failure never vanishes.
    """

    request_id: str
    transfer_token: str | None = None
    worker_id: str
    side: Literal["sender", "receiver"]
    transport: str
    reason: str
    bytes_done: NonNegativeInt = 0
    time_unix_s: float = Field(default_factory=time.time)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    spec_draft_tokens: int = 0  # all drafts, grammar-forced ones included
    spec_accepted_tokens: int = 0
    forced_draft_tokens: int = 0  # drafts the request's grammar forced
    forced_accepted_tokens: int = 0


LOGPROB_FLOOR = -9999.0  # what a zero-probability token reports (vLLM reports the same)


class TokenLogprob(BaseModel):
    """One generated token's raw model logprob (log-softmax of the logits before any sampling
    option), and the `top` most likely tokens at its position with theirs, most likely first."""

    logprob: float
    top_ids: list[int] = Field(default_factory=list)
    top_logprobs: list[float] = Field(default_factory=list)

    @field_validator("logprob", "top_logprobs")
    @classmethod
    def _finite(cls, v):
        """A token the model gives zero probability has logprob -inf, which JSON cannot carry (it
        would travel as null and the event would be refused): floor it at LOGPROB_FLOOR, as vLLM's
        OpenAI server does, so clients see a number."""
        if isinstance(v, list):
            return [max(x, LOGPROB_FLOOR) for x in v]
        return max(v, LOGPROB_FLOOR)


class StreamEvent(Message):
    """workers → front on `stream.{request_id}`, in `seq` order (one sequence for all of a request's choices).

    kind: "token" (text delta + ids), "handoff" (responsibility moves to decode; KV stats),
    "done" (finish_reason + usage), "error" (message, type, http status). `index`: the choice a
    token or done event belongs to (0..n-1; with n > 1 the request is done when every choice is).
    """

    request_id: str
    seq: NonNegativeInt
    kind: Literal["token", "handoff", "done", "error"]
    worker_id: str
    index: int = 0
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, when the request asked for them
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    error_type: str | None = None  # WORKER_STOPPED: the worker left it unfinished, and the front may move it
    status: int | None = None
    kv_bytes: NonNegativeInt | None = None
    kv_seconds: float | None = None
    cached_tokens: int | None = None  # first token event: prompt tokens served from the prefix cache
    prepositioned: bool | None = None  # … of which some were computed ahead by pre-positioning
    # a moved request's "handoff" event: `HandoffOffer.cached_tokens`/`fetched_tokens` (cached_tokens 0 when decode
    # recomputed all of it)
    fetched_tokens: NonNegativeInt | None = None
    added_in_v2 = ("fetched_tokens",)


# The error type of a request a worker stopped holding (SIGTERM, scale-down, a rollout: its drain timeout passed).
# Not the client's error: the front moves the request to other workers, and only past `--migration-limit` (or with
# none to take it) tells the client, as "unavailable".
WORKER_STOPPED = "worker_stopped"


class Cancel(Message):
    request_id: str
    reason: str = "client went away"


class DraftRequest(Message):
    """decode → draft pool: propose up to `k` tokens to follow `tail` (the last tokens of the request's
    prompt + output), from text of `tenant` only. A pool drops a request that waited past `timeout_ms`."""

    request_id: str
    tenant: str
    tail: list[int] = Field(max_length=1024)
    k: int = Field(ge=1, le=64)
    timeout_ms: float = Field(gt=0)


class DraftReply(Message):
    """draft pool → decode: `token_ids` (maybe empty) follow an earlier occurrence of the tail's last
    `match_len` tokens; `batch_size`: requests the pool answered in the same pass; `overloaded`: the pool
    shed this request (ask again later)."""

    request_id: str
    token_ids: list[int]
    match_len: int = 0
    batch_size: int = 1
    overloaded: bool = False


class DraftReport(Message):
    """decode → draft pools: a finished request's tokens (prompt + output) join `tenant`'s index."""

    request_id: str
    tenant: str
    token_ids: list[int]


async def settle(nc, timeout: float = 10.0) -> None:
    """Return once the server has processed everything `nc` sent or queued before the call — a subscription
    made just before, above all — so that a message another connection sends next finds it.

    `nc.flush()` alone does not promise that in nats-py (2.16): `subscribe` leaves its SUB in the client's
    pending buffer for the flusher task, and `flush` writes its PING straight to the socket, ahead of it.
    The server answers the PING first; where it reads the SUB in a later read (a loaded machine), the PONG
    can come back before the subscription exists, and a report or request sent by another connection then
    is lost or answered "no responders". So: first have the flusher write the pending buffer (and wait for
    it), then one round trip, whose PING now follows the SUB."""
    flush_pending = getattr(nc, "_flush_pending", None)
    if flush_pending is not None:
        try:
            await asyncio.wait_for(flush_pending(force_flush=True), timeout)
        except TypeError:  # another client version's signature: the round trips below still order it
            await nc.flush(timeout)
    await nc.flush(timeout)
