"""Typed settings of every pdserve process: one pydantic model per command, read from flags and environment.

Each setting is declared once, as a field: its type, default, bounds and description. From the
field come its flag (`--field-name`, with its group's prefix: `--kv-compression`) and its
environment variable (`PDSERVE_` + the flag in capitals: `PDSERVE_KV_COMPRESSION`), both derived
in `options` and nowhere else. The same models

- parse a process's settings (`load`: flags win over the environment, the environment over defaults),
- print `pdserve prefill|decode|front --help` (every option with its variable and default),
- and render a pod's arguments in the operator (`to_args`),

so what the operator writes is what the worker reads. Secrets (NATS password, API key) and what
Kubernetes' downward API hands a pod (`POD_NAME`, `POD_NAMESPACE`, `POD_IP`) are read from the
environment only: a secret on a command line is visible to anyone who can list processes.

This module imports nothing heavier than pydantic: the operator (an image without torch) renders
pods from it.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from pdserve.basetypes import DEFAULT_BLOCK_SIZE, TRANSPORTS, Compression, ToolCallFormat

ENV_PREFIX = "PDSERVE_"
# Model and KV element types a worker runs with; auto: bfloat16 on GPUs that have it, float32 on the CPU.
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES = get_args(Dtype)


@dataclass(frozen=True)
class Opt:
    """How a field meets the outside, where it departs from the derived names.

    flag: the flag without dashes ("transfer-timeout"), or None for a field set only by the
    environment (secrets, the downward API). env: the variable's full name, or None for none."""

    flag: str | None = ""
    env: str | None = ""


ENV_ONLY = Opt(flag=None)


class Settings(BaseModel):
    """A group of settings. `prefix` starts the flags of its fields ("kv" -> --kv-compression)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    prefix: ClassVar[str] = ""
    title: ClassVar[str] = ""


def nats_url(v: str) -> str:
    """`v` if it is a NATS server URL, else ValueError saying how to write one."""
    if not re.match(r"^(nats|tls|ws|wss)://[^\s/,]+$", v):
        raise ValueError(f"{v!r} is not a NATS URL; write it as nats://HOST:PORT")
    return v


# ------------------------------------------------------------------------------------------ groups

class NatsConfig(Settings):
    prefix: ClassVar[str] = "nats"
    title: ClassVar[str] = "NATS (control plane)"

    url: str = Field("nats://127.0.0.1:4222", description="NATS server URL")
    user: Annotated[str | None, ENV_ONLY] = Field(None, description="NATS user")
    password: Annotated[SecretStr | None, ENV_ONLY] = Field(None, description="NATS password")
    tls_ca: str | None = Field(None, description="CA certificate (PEM file) that signs the NATS server's certificate; "
                                                 "set, the connection is TLS and the server is verified against it")
    tls_cert: str | None = Field(None, description="client certificate (PEM file), for a NATS server that verifies "
                                                   "its clients")
    tls_key: str | None = Field(None, description="the client certificate's private key (PEM file)")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return nats_url(v)

    @model_validator(mode="after")
    def _tls(self) -> "NatsConfig":
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together: give both or neither")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("--nats-tls-cert needs --nats-tls-ca (the CA that signs the NATS server's certificate)")
        return self


class KVTransferConfig(Settings):
    prefix: ClassVar[str] = "kv"
    title: ClassVar[str] = "KV transfer"

    timeout: Annotated[float, Opt(flag="transfer-timeout")] = Field(
        30.0, gt=0, description="seconds a KV transfer may go without progress before it fails")


class KVSendConfig(KVTransferConfig):
    transports: str = Field("shm,tcp,nats", description="KV transports in preference order (shm, tcp, nats, "
                                                        "objstore); decode picks the first it can use")
    compression: Compression = Field("none", description="KV compression on the wire")
    stream_layers: bool = Field(True, description="send each layer's KV to decode as soon as the prompt's last "
                                                  "forward computed it")
    shm_sender_map_bytes: Annotated[int, Opt(flag="shm-sender-map-bytes")] = Field(
        2 << 30, ge=0, description="bytes of decode's shared-memory segments kept mapped between transfers")

    @field_validator("transports")
    @classmethod
    def _transports(cls, v: str) -> str:
        names = [t.strip() for t in v.split(",") if t.strip()]
        unknown = [t for t in names if t not in TRANSPORTS]
        if not names or unknown:
            raise ValueError(f"unknown transport(s) {unknown or [v]}; choose from {', '.join(TRANSPORTS)}")
        return ",".join(names)

    @property
    def transport_list(self) -> list[str]:
        return self.transports.split(",")


class KVReceiveConfig(KVTransferConfig):
    compression: Compression = Field("none", description="KV compression this worker takes on the wire besides "
                                                          "none; prefill offering another is answered with none")
    keep_idle_s: float = Field(30.0, ge=0, description="seconds a kept (idle) connection from prefill stays open")
    max_kept: int = Field(16, ge=0, description="most idle connections kept open (each holds a thread)")
    shm_pool_bytes: Annotated[int, Opt(flag="shm-pool-bytes")] = Field(
        2 << 30, ge=0, description="bytes of idle shared-memory segments kept warm for the next transfers")


class SpeculationConfig(Settings):
    prefix: ClassVar[str] = "spec"
    title: ClassVar[str] = "Speculative decoding"

    method: Literal["none", "ngram", "draft"] = Field("none", description="how draft tokens are proposed")
    max_k: int = Field(8, ge=1, le=64, description="most draft tokens verified per step")
    k_policy: Literal["adaptive", "fixed"] = Field(
        "adaptive", description="adaptive: the latency model and acceptance choose k each step (0 when it would not "
                                "pay); fixed: always the max (for tests and measurements)")
    draft_model: Annotated[str | None, Opt(flag="draft-model")] = Field(
        None, description="checkpoint folder of the draft model (method draft); it must share the target's tokenizer")
    draft_pool: Annotated[bool, Opt(flag="draft-pool")] = Field(
        False, description="also ask the deployment's draft pool (pdserve draftpool) for drafts from every "
                           "request's text (method ngram); local drafts when it is slow, overloaded or gone")
    draft_pool_timeout: Annotated[float, Opt(flag="draft-pool-timeout")] = Field(
        0.02, gt=0, description="most seconds a step waits for the pool's draft (less where a quarter of "
                                      "a plain step is less)")
    calibrate: bool = Field(
        True, description="measure the engine step's cost per row count and its fastest weight layout on this "
                          "machine at start (cached per model, device and dtype): every decode step takes that "
                          "layout, and speculation chooses k from those costs")


# ------------------------------------------------------------------------------------------ processes

class ProcessConfig(Settings):
    """What every serving process has: the model it serves, NATS, and where it belongs."""

    title: ClassVar[str] = "General"

    model: str = Field("default", description="checkpoint folder, or 'default' (SmolLM2-135M-Instruct)")
    served_model_name: str | None = Field(None, description="name clients use (default: the folder's name)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    log_format: Literal["text", "json"] = Field("text", description="log lines as text, or one JSON object a line "
                                                                    "(time, level, logger, message, request_id, "
                                                                    "trace_id)")
    scope: str | None = Field(None, description="deployment scope: processes serve requests of their own scope "
                                                "only (default: NAMESPACE.ISVC in Kubernetes, else 'default')")
    isvc: str | None = Field(None, description="the InferenceService this process belongs to")
    pool: str | None = Field(None, description="its pool in that InferenceService (prefill, decode, front, draftpool)")
    namespace: Annotated[str | None, Opt(env="POD_NAMESPACE")] = Field(None, description="its Kubernetes namespace")
    drain_timeout: float = Field(25.0, ge=0, description="seconds a stopping process (SIGTERM) keeps serving what it "
                                                         "holds before failing the rest; keep it below the pod's "
                                                         "terminationGracePeriodSeconds")
    nats: NatsConfig = Field(default_factory=NatsConfig)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @property
    def deployment_scope(self) -> str:
        """Requests never cross scopes: `scope`, else "namespace.isvc", else "default"."""
        if self.scope:
            return self.scope
        if self.isvc:
            return f"{self.namespace or 'default'}.{self.isvc}"
        return "default"


class ReportingConfig(ProcessConfig):
    """A process that publishes LoadReports (its heartbeat and autoscaling signal): its id and pod."""

    worker_id: str | None = Field(None, description="this worker's id (default: $POD_NAME, else role-host-pid)")
    pod_name: Annotated[str | None, Opt(flag=None, env="POD_NAME")] = Field(None, description="the pod's name")


class WorkerConfig(ReportingConfig):
    """What prefill and decode workers share."""

    device: str = Field("cpu", description="torch device: cpu, cuda or cuda:N; a worker refuses to start on cuda "
                                           "where CUDA is absent")
    dtype: Dtype = Field("auto", description="model and KV element type; auto: bfloat16 on GPUs that have it, "
                                             "float32 on the CPU")
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, le=1024, description="KV tokens per block")
    threads: int = Field(1, ge=1, le=1024, description="torch threads of the compute thread")
    cpu_lease: str | None = Field(None, description="a lock file shared with one worker of the other role on the "
                                                    "same cores (pdserve.cpulease): decode lends its threads to "
                                                    "prefill's prompt steps while it is idle")
    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus /metrics on this port (0: off)")
    data_port: int = Field(0, ge=0, le=65535, description="KV data port (0: any free port)")
    kv_capacity_bytes: int = Field(512 << 20, gt=0, description="KV pool size in bytes")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.match(r"^(cpu|cuda(:\d+)?)$", v):
            raise ValueError(f"{v!r} is not a device; use cpu, cuda or cuda:N")
        return v


class PrefillConfig(WorkerConfig):
    offer_timeout: float = Field(5.0, gt=0, description="seconds to wait for decode to accept a handoff")
    chunk_size: int = Field(256, ge=1, description="most tokens of one prompt per step (chunked prefill)")
    max_batch_tokens: int = Field(512, ge=1, description="most tokens per prefill step, all prompts together")
    announce_blocks: int = Field(2048, ge=0, description="most cached block addresses announced to routers per "
                                                         "load report")
    preposition_budget_blocks: int = Field(256, ge=0, description="most KV blocks pre-positioned and not yet used "
                                                                  "(0 turns pre-positioning off)")
    preposition_queue: int = Field(16, ge=0, description="most pre-positioning hints kept waiting")
    prefix_offload: bool = Field(False, description="share prefix KV blocks with every worker through the JetStream "
                                                    "object store (offload tier)")
    prefix_offload_ttl: float = Field(3600.0, gt=0, description="seconds a stored prefix block lives")
    defer_queue_tokens: int | None = Field(
        None, ge=0, description="conditional disaggregation: offer a new prompt to its decode worker uncomputed "
                                "(decode computes it inside its own steps) when at least this many prompt tokens "
                                "wait here ahead of it and decode's own queue of such prompts is shorter; 0: never; "
                                "default: 256 on a GPU, 512 on a CPU whose steps run the native decoder "
                                "(a decode step and a prompt chunk are one native forward there), 0 on other CPUs "
                                "(there the two cost what they cost apart)")
    kv: KVSendConfig = Field(default_factory=KVSendConfig)


class DecodeConfig(WorkerConfig):
    data_host: str = Field("127.0.0.1", description="bind address of the KV data port")
    advertise_host: Annotated[str | None, Opt(env="POD_IP")] = Field(
        None, description="address prefill dials for KV (default: the data host)")
    advertise_port: int | None = Field(None, ge=1, le=65535, description="port prefill dials for KV (default: the "
                                                                         "data port), where something forwarding to "
                                                                         "it listens (a fault-injecting proxy, a NAT)")
    max_running: int = Field(64, ge=1, description="sequences admitted at once")
    max_batch: int = Field(32, ge=1, description="sequences stepped together in one forward")
    engine: Literal["auto", "paged", "dense"] = Field(
        "auto", description="paged: block pool + batched steps (Llama-family); dense: per-sequence caches; auto: "
                            "paged where it applies")
    cpu_weight_layouts: bool = Field(
        True, description="on the CPU, keep up to two more copies of the weights that make small steps "
                          "(one row, speculative verification, small batches) cheaper (with --spec-calibrate, only those "
                          "measured faster here); off saves that memory (up to 2x the model's projection weights)")
    local_prefill_chunk: int | None = Field(
        None, ge=0, description="prompts prefill hands over uncomputed (its queue is long): most of their tokens "
                                "computed in one decode step beside the running sequences (0: refuse such prompts; "
                                "default: 256 where steps run the native CPU decoder, else 64)")
    spec: SpeculationConfig = Field(default_factory=SpeculationConfig)
    kv: KVReceiveConfig = Field(default_factory=KVReceiveConfig)

    @model_validator(mode="after")
    def _draft(self) -> "DecodeConfig":
        if self.spec.method == "draft" and not self.spec.draft_model:
            raise ValueError("--spec-method draft needs --draft-model PATH (a model sharing the target's tokenizer)")
        if self.spec.draft_pool and self.spec.method != "ngram":
            raise ValueError("--draft-pool drafts beside prompt lookup: it needs --spec-method ngram")
        return self


class DraftPoolConfig(ReportingConfig):
    """`pdserve draftpool`: a fleet-wide suffix index answering decode workers' draft requests."""

    min_n: int = Field(2, ge=1, le=16, description="shortest context suffix a draft may follow")
    max_n: int = Field(8, ge=1, le=32, description="longest context suffix looked up")
    max_tokens: int = Field(1 << 18, ge=1, description="most tokens of reported requests held (least recently "
                                                       "used evicted first); memory grows ~100 bytes per token "
                                                       "per suffix length")
    share_tenants: bool = Field(False, description="let one tenant's text draft for another's requests")
    max_queue: int = Field(256, ge=1, description="most draft requests waiting; past it a request is answered "
                                                  "'overloaded' at once and its worker drafts locally")
    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus /metrics on this port (0: off)")

    @model_validator(mode="after")
    def _ngram(self) -> "DraftPoolConfig":
        if self.min_n > self.max_n:
            raise ValueError(f"--min-n {self.min_n} exceeds --max-n {self.max_n}")
        return self


class FrontConfig(ProcessConfig):
    host: str = Field("127.0.0.1", description="address the HTTP front listens on")
    port: int = Field(8000, ge=1, le=65535, description="its port")
    dispatch_timeout: float = Field(5.0, gt=0, description="seconds for a prefill worker to accept a request")
    first_token_timeout: float = Field(300.0, gt=0, description="seconds of silence allowed before the first token")
    token_timeout: float = Field(60.0, gt=0, description="seconds of silence allowed between tokens")
    max_model_len: int | None = Field(None, ge=2, description="longest prompt + output served, in tokens (as "
                                      "vLLM's --max-model-len): at most the model's context, which is the default")
    migration_limit: int = Field(2, ge=0, description="times a request whose worker dies holding it is moved to "
                                 "others, with the tokens already streamed (invisible to the client); 0: it fails "
                                 "with worker_lost")
    kv_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="when a request's KV is lost in transit: recompute it on decode, or fail")
    preposition: bool = Field(True, description="after each request, hint its prefill worker to pre-compute the "
                                                "next turn's KV when idle")
    kv_dtype: Dtype = Field("auto", description="the decode workers' KV element type, for the router's estimate "
                                                "of KV bytes per token")
    api_key: Annotated[SecretStr | None, ENV_ONLY] = Field(None, description="require this bearer token on /v1")
    tool_call_parser: ToolCallFormat | None = Field(
        None, description="tool-call format to parse out of chat answers (as vLLM's --tool-call-parser); default: "
                          "the one the model's chat template implies")


class OperatorSettings(Settings):
    """`pdserve operator`: what the operator knows beyond the InferenceServices (set by the chart)."""

    title: ClassVar[str] = "Operator"

    image: str = Field("ghcr.io/pdserve/pdserve:0.1.0", min_length=1,
                       description="worker image of InferenceServices that name none")
    nats_url: str = Field("nats://pdserve-nats:4222", description="NATS URL handed to workers whose "
                                                                   "InferenceService names none")
    nats_secret: str | None = Field(None, description="Secret with the NATS user and password (keys user, "
                                                      "password), copied into each InferenceService's namespace")
    nats_secret_namespace: str | None = Field(None, description="its namespace (default: the operator's own)")
    nats_users_secret: str | None = Field(None, description="Secret (in the NATS Secret's namespace) whose users.conf "
                                                            "the chart's NATS server reads: each InferenceService "
                                                            "then gets a NATS user of its own, confined to its "
                                                            "scope; unset, all share the NATS Secret's credentials")
    nats_tls_ca: str | None = Field(None, description="CA certificate (PEM file) of the NATS server, handed to the "
                                                      "workers (TLS to NATS)")
    metrics_scraper_namespace: str | None = Field(None, description="namespace of the Prometheus that scrapes the "
                                                                    "workers' /metrics: the only one, beside the "
                                                                    "InferenceService's own pods, that the workers' "
                                                                    "NetworkPolicy admits to it")
    own_namespace: Annotated[str | None, Opt(flag=None, env="POD_NAMESPACE")] = Field(
        None, description="the operator's namespace")
    webhook_cert: str | None = Field(None, description="TLS certificate of the validating admission webhook; "
                                                       "without one (and a key) no webhook is served")
    webhook_key: str | None = Field(None, description="its private key")
    webhook_addr: str = Field("0.0.0.0", description="address the webhook listens on")
    webhook_port: int = Field(9443, ge=1, le=65535, description="its port")
    manage_crd: bool = Field(True, description="apply the InferenceService CRD of this version at start (Helm never "
                                               "upgrades a chart's crds/)")

    @field_validator("nats_url")
    @classmethod
    def _url(cls, v: str) -> str:
        return nats_url(v)


COMMANDS: dict[str, type[ProcessConfig]] = {"prefill": PrefillConfig, "decode": DecodeConfig, "front": FrontConfig,
                                             "draftpool": DraftPoolConfig}
"""The serving commands (`pdserve <name>`, and the operator's pools of the same names) by their settings."""


# ------------------------------------------------------------------------------------------ options

@dataclass(frozen=True)
class Option:
    """One setting as the outside sees it: `path` into the model ("kv.compression"), its flag
    ("--kv-compression", or None) and its environment variable ("PDSERVE_KV_COMPRESSION", or None)."""

    path: str
    flag: str | None
    env: str | None
    field: FieldInfo
    group: str

    @property
    def is_bool(self) -> bool:
        return self.field.annotation is bool

    @property
    def names(self) -> str:
        """How a message names it: "--kv-compression ($PDSERVE_KV_COMPRESSION)"."""
        return " ".join(x for x in (self.flag, f"(${self.env})" if self.env else None) if x) or self.path


def _opt(field: FieldInfo) -> Opt:
    return next((m for m in field.metadata if isinstance(m, Opt)), Opt())


def _is_group(field: FieldInfo) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, Settings)


@functools.cache
def options(cls: type[Settings]) -> tuple[Option, ...]:
    """Every setting of `cls`, nested groups included, in declaration order."""
    out: list[Option] = []

    def walk(model: type[Settings], path: str, title: str) -> None:
        for name, field in model.model_fields.items():
            if _is_group(field):
                sub = field.annotation
                walk(sub, f"{path}{name}.", sub.title or title)
                continue
            opt = _opt(field)
            derived = "-".join(x for x in (model.prefix, name.replace("_", "-")) if x)
            flag = opt.flag if opt.flag != "" else derived
            env = opt.env if opt.env != "" else ENV_PREFIX + (flag or derived).upper().replace("-", "_")
            out.append(Option(f"{path}{name}", f"--{flag}" if flag else None, env, field, title))

    walk(cls, "", cls.title)
    flags = [o.flag for o in out if o.flag]
    if len(flags) != len(set(flags)):
        raise TypeError(f"{cls.__name__}: two settings share a flag")
    return tuple(out)


def option(cls: type[Settings], path: str) -> Option:
    """The option at `path` ("nats.password") of `cls`."""
    for o in options(cls):
        if o.path == path:
            return o
    raise KeyError(f"{cls.__name__} has no setting {path!r}")


def _default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return ""
    d = field.default
    if d is None:
        return "unset"
    if isinstance(d, bool):
        return "on" if d else "off"
    return str(d)


def parser(cls: type[Settings], prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser for `cls` whose help names each option's variable and default.

    Defaults are suppressed: the namespace holds only the flags given, so `load` can put them
    over the environment."""
    env_only = [f"${o.env} ({o.field.description})" for o in options(cls) if o.env and not o.flag]
    epilog = "Read from the environment only: " + ", ".join(env_only) + "." if env_only else None
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                argument_default=argparse.SUPPRESS)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for o in options(cls):
        if not o.flag:
            continue
        if o.group not in groups:
            groups[o.group] = p.add_argument_group(o.group)
        g = groups[o.group]
        extra = [f"${o.env}" if o.env else None]
        default = _default_text(o.field)
        if default:
            extra.append(f"default: {default}")
        help_text = f"{o.field.description or ''} ({'; '.join(x for x in extra if x)})".replace("%", "%%")
        if o.is_bool:
            g.add_argument(o.flag, dest=o.path, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            choices = getattr(o.field.annotation, "__args__", None) if _is_literal(o.field) else None
            g.add_argument(o.flag, dest=o.path, help=help_text,
                           metavar="{" + ",".join(choices) + "}" if choices else o.path.rsplit(".", 1)[-1].upper())
    return p


def _is_literal(field: FieldInfo) -> bool:
    return getattr(field.annotation, "__origin__", None) is Literal


def _nest(flat: Mapping[str, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _describe(cls: type[Settings], err: ValidationError, sources: Mapping[str, str]) -> str:
    by_path = {o.path: o for o in options(cls)}
    lines = []
    for e in err.errors():
        path = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        o = by_path.get(path)
        if o is None:  # a rule across settings: its message names them
            lines.append(msg)
            continue
        source = sources.get(path)
        where = f"{source}={e['input']!r}" if source else o.names
        other = [x for x in (o.flag, f"${o.env}" if o.env else None) if x and x != source]
        lines.append(f"{where}{' (' + ', '.join(other) + ')' if source and other else ''}: {msg}")
    return "invalid settings:\n  " + "\n  ".join(lines)


S = TypeVar("S", bound=Settings)


def _from_sources(cls: type[S], flags: Mapping[str, Any], environ: Mapping[str, str]) -> S:
    """`cls` from parsed `flags` (by path) over `environ` over defaults; an empty variable counts as
    unset. Raises ValueError naming each bad value's flag or variable."""
    flat: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for o in options(cls):
        if o.env and environ.get(o.env):
            flat[o.path], sources[o.path] = environ[o.env], f"${o.env}"
        if o.path in flags:
            flat[o.path], sources[o.path] = flags[o.path], o.flag
    try:
        return cls.model_validate(_nest(flat))
    except ValidationError as e:
        raise ValueError(_describe(cls, e, sources)) from None


def from_environ(cls: type[S], environ: Mapping[str, str] | None = None) -> S:
    """`cls` from the environment (default os.environ) and defaults alone; ValueError on bad values."""
    return _from_sources(cls, {}, os.environ if environ is None else environ)


def load(cls: type[S], argv: list[str] | None = None, environ: Mapping[str, str] | None = None,
         prog: str | None = None, description: str | None = None) -> S:
    """`cls` from flags (`argv`), then the environment (`environ`, default os.environ), then defaults.

    An empty variable counts as unset. Bad values exit (status 2) with a message naming the
    flag, the variable and the value given, as argparse does for its own errors."""
    p = parser(cls, prog, description)
    try:
        return _from_sources(cls, vars(p.parse_args(argv or [])), os.environ if environ is None else environ)
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
        raise  # not reached: parser.exit exits


def to_args(cfg: Settings) -> list[str]:
    """The flags that give a process `cfg`: every setting set explicitly (not left at its default),
    in declaration order. Settings without a flag (secrets, the downward API) are never rendered."""
    out: list[str] = []

    def walk(model: Settings, prefix: str) -> None:
        for name in type(model).model_fields:
            if name not in model.model_fields_set:
                continue
            value = getattr(model, name)
            if isinstance(value, Settings):
                walk(value, f"{prefix}{name}.")
                continue
            o = option(type(cfg), f"{prefix}{name}")
            if not o.flag or value is None:
                continue
            if isinstance(value, bool):
                out.append(o.flag if value else "--no-" + o.flag[2:])
            elif isinstance(value, float) and value.is_integer():
                out.extend((o.flag, str(int(value))))
            else:
                out.extend((o.flag, str(value)))

    walk(cfg, "")
    return out
