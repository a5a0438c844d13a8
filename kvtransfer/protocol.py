"""The wire protocol of pdserve's control plane: every NATS subject and message schema, in one place.

NATS carries control, never bulk KV bytes: requests to prefill, handoff offers and replies,
token streams, cancellations, failure records, and worker load reports (which double as
heartbeats and as the registry). KV bytes travel a direct data path (see `kvtransfer.tcp_send`
and `kvtransfer.tcp_server`) whose frames are described in `kvtransfer.frames`.

Versioning: every subject starts with `pdserve.v1`; every message carries `v` (the protocol
version). A receiver refuses a message of a version it does not speak with an explicit error.

Subjects (`{s}` is the deployment scope — see LoadReport.scope —, `{m}` the served model name,
`{w}` a worker id, `{r}` a request id):

| subject                                  | from → to        | message                      |
|------------------------------------------|------------------|------------------------------|
| pdserve.v1.prefill.{s}.{m} (queue)       | front → prefill  | PrefillRequest → Ack         |
| pdserve.v1.prefill.{s}.{m}.w.{w}         | front → prefill  | PrefillRequest → Ack (routed |
|                                          |                  | to the worker holding the    |
|                                          |                  | longest cached prefix)       |
| pdserve.v1.preposition.{s}.{w}           | front → prefill  | PrepositionHint (fire and    |
|                                          |                  | forget)                      |
| pdserve.v1.decode.{s}.{w}.handoff        | prefill → decode | HandoffOffer → HandoffReply  |
| pdserve.v1.stream.{r}                    | workers → front  | StreamEvent (tokens/errors)  |
| pdserve.v1.cancel.{r}                    | front → workers  | Cancel                       |
| pdserve.v1.load.{role}.{w}               | worker → all     | LoadReport (1 Hz; heartbeat) |
| pdserve.v1.bye.{role}.{w}                | worker → all     | LoadReport (clean shutdown)  |
| pdserve.v1.kv.{t}.data                   | prefill → decode | KV frames (NATS-chunked and  |
|                                          |                  | object-store transports)     |
| pdserve.v1.kv.failed.{r}                 | either side → all| TransferFailed               |

`{t}` is a one-time transfer token. KV transports (`HandoffOffer.transports`, chosen in
`HandoffReply.transport`): "shm" (same host), "tcp" (direct stream), "nats" (chunked messages on
`kv.{t}.data`, the fallback that always works), "objstore" (the JetStream object store, the offload
tier). See `kvtransfer.channel`.
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.basetypes import KVLayout, SamplingParams

PROTOCOL_VERSION = 1
PREFIX = f"pdserve.v{PROTOCOL_VERSION}"
PREFILL_QUEUE_GROUP = "prefill"

Role = Literal["prefill", "decode", "front", "draft"]


class ProtocolError(ValueError):
    """A control message that cannot be accepted (wrong version, malformed, fenced out)."""


def _safe_token(s: str) -> str:
    # Subject tokens may not contain '.', '*', '>' or whitespace.
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)


class Subjects:
    """Subject names. Model names and ids are sanitised into single subject tokens."""

    @staticmethod
    def prefill(scope: str, model: str) -> str:
        return f"{PREFIX}.prefill.{_safe_token(scope)}.{_safe_token(model)}"

    @staticmethod
    def prefill_worker(scope: str, model: str, worker_id: str) -> str:
        """One prefill worker's own subject: the router sends here to reuse that worker's cached prefix."""
        return f"{Subjects.prefill(scope, model)}.w.{_safe_token(worker_id)}"

    @staticmethod
    def preposition(scope: str, worker_id: str) -> str:
        return f"{PREFIX}.preposition.{_safe_token(scope)}.{_safe_token(worker_id)}"

    @staticmethod
    def decode_handoff(scope: str, worker_id: str) -> str:
        return f"{PREFIX}.decode.{_safe_token(scope)}.{_safe_token(worker_id)}.handoff"

    @staticmethod
    def stream(request_id: str) -> str:
        return f"{PREFIX}.stream.{_safe_token(request_id)}"

    @staticmethod
    def cancel(request_id: str) -> str:
        return f"{PREFIX}.cancel.{_safe_token(request_id)}"

    CANCEL_ALL = f"{PREFIX}.cancel.*"

    @staticmethod
    def load(role: str, worker_id: str) -> str:
        return f"{PREFIX}.load.{role}.{_safe_token(worker_id)}"

    LOAD_ALL = f"{PREFIX}.load.>"

    @staticmethod
    def bye(role: str, worker_id: str) -> str:
        return f"{PREFIX}.bye.{role}.{_safe_token(worker_id)}"

    BYE_ALL = f"{PREFIX}.bye.>"

    @staticmethod
    def kv_data(transfer_token: str) -> str:
        return f"{PREFIX}.kv.{_safe_token(transfer_token)}.data"

    @staticmethod
    def kv_failed(request_id: str) -> str:
        return f"{PREFIX}.kv.failed.{_safe_token(request_id)}"

    KV_FAILED_ALL = f"{PREFIX}.kv.failed.*"


class Message(BaseModel):
    """Base of every control message: versioned, strict about unknown fields."""

    model_config = ConfigDict(extra="forbid")
    v: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

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
    generation: int = 0  # incarnation of this worker id; a handoff from an older one is refused
    time_unix_s: float = Field(default_factory=time.time)
    # Kubernetes identity: the worker's --isvc / --pool settings, POD_NAME / POD_NAMESPACE from the downward API.
    isvc: str | None = None
    pool: str | None = None
    pod: str | None = None
    namespace: str | None = None
    data_addr: str | None = None  # "host:port" of the worker's direct KV data server
    # Load. Prefill: queue of prompts not yet started. Decode: sequences running/waiting.
    queue_depth: int = 0
    queue_wait_seconds: float = 0.0
    running: int = 0
    waiting: int = 0
    kv_utilization: float = 0.0  # 0..1 of the worker's KV capacity in use
    kv_bytes_used: int = 0
    kv_bytes_capacity: int = 0
    transfer_backlog_handoffs: int = 0
    transfer_backlog_bytes: int = 0
    ttft_seconds: float = 0.0  # recent mean, prefill side
    itl_seconds: float = 0.0  # recent mean inter-token latency, decode side
    tokens_per_second: float = 0.0
    spec_acceptance_rate: float = 0.0
    stale_after_s: float = 3.0
    # Prefill: prompt tokens accepted but not yet computed (the router's load signal), and the
    # prefix cache's contents — `basetypes.announced()` addresses of cached full blocks of `block_size`
    # tokens, most recently used first, at most a few thousand.
    queue_tokens: int = 0
    block_size: int = 0
    cached_blocks: list[str] = Field(default_factory=list)
    preposition_hits: int = 0
    preposition_computed: int = 0
    # The deployment this worker belongs to (an InferenceService: "namespace.name"; locally, one
    # `pdserve up`). Prefill queues and handoff subjects are per scope, so two deployments of the
    # same model on one NATS never take each other's requests.
    scope: str = "default"


# --- the request path -------------------------------------------------------------------------

FailurePolicy = Literal["recompute", "fail"]


class PrefillRequest(Message):
    """front → prefill (queue group): run this prompt, then hand the KV to `decode_worker_id`."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int  # resolved by the front, so every worker samples the same stream
    decode_worker_id: str
    failure_policy: FailurePolicy = "recompute"
    spec: dict | None = None  # speculation overrides for this request (method, max_k, enabled)


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


class HandoffOffer(Message):
    """prefill → decode: a request's KV is ready; fenced by sender identity, generation and layout."""

    request_id: str
    sender_id: str
    sender_generation: int
    layout: KVLayout
    num_tokens: int
    kv_bytes: int
    prompt_token_ids: list[int]
    generated_token_ids: list[int]  # what prefill already produced (the first token)
    sampling: SamplingParams
    seed: int
    next_seq: int  # sequence number of the next StreamEvent
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
    bytes_done: int = 0
    time_unix_s: float = Field(default_factory=time.time)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class StreamEvent(Message):
    """workers → front on `stream.{request_id}`, in `seq` order.

    kind: "token" (text delta + ids), "handoff" (responsibility moves to decode; KV stats),
    "done" (finish_reason + usage), "error" (message, type, http status).
    """

    request_id: str
    seq: int
    kind: Literal["token", "handoff", "done", "error"]
    worker_id: str
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    error_type: str | None = None
    status: int | None = None
    kv_bytes: int | None = None
    kv_seconds: float | None = None
    cached_tokens: int | None = None  # first token event: prompt tokens served from the prefix cache
    prepositioned: bool | None = None  # … of which some were computed ahead by pre-positioning


class Cancel(Message):
    request_id: str
    reason: str = "client went away"
