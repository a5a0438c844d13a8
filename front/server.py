"""The OpenAI-compatible HTTP front: validate, tokenise, route to prefill/decode over NATS, stream back.

Routing (both from the workers' load reports on NATS): the prefill worker whose prefix cache
holds the longest part of the prompt, balanced against the tokens already queued there, gets
the request on its own subject (the deployment's queue group takes it if that worker does not
answer); the decode worker with the most free KV capacity gets the handoff. After a request,
the front sends the prefill worker that served it a pre-positioning hint: the conversation plus
the answer, whose KV an idle worker computes ahead so the next turn starts from it. The front follows each request through its stream of events, always
knowing which worker is responsible for it (prefill until the handoff, decode after), and
fails the request — with an OpenAI-style error, or an error event on an SSE stream — when that
worker dies or goes silent past a bound. It never answers 200 with a truncated result.

(Just over our ~600-line norm: the two OpenAI endpoints share the request life cycle here —
routing, following the responsible worker, streaming and n choices — and splitting it would put
one request's state in two modules.)
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
import uuid
from collections import Counter as PyCounter

import nats
import nats.errors
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from transformers import AutoTokenizer

from pdserve.basetypes import SamplingParams
from pdserve.config import FrontConfig, load
from pdserve.front.guided import GuidedError, guided_spec
from pdserve.front.openai_schema import ChatCompletionRequest, CompletionRequest, asked_logprobs, ignored_fields
from pdserve.front.openapi import IGNORED_FIELDS_HEADER, openapi_document
from pdserve.front.toolcalls import ToolCallStream, extract, family_for_template, render_calls, tools_prompt
from pdserve.introspect import register_runtime_metrics
from pdserve.front.responses import TokenTexts, chat_logprobs, completion_logprobs
from pdserve.kvtransfer.protocol import (
    WORKER_STOPPED, Ack, Cancel, FrontBeat, PrefillRequest, PrepositionHint, ProtocolError, StreamEvent, Subjects,
    TokenLogprob,
)
from pdserve.natsserver import NatsCredentials, close_connection
from pdserve import logs, tracing

log = logging.getLogger("pdserve.front")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FRONT_BEAT_INTERVAL_S = 1.0  # a `FrontBeat` every second (its bound: `FrontBeat.stale_after_s`)
MAX_IGNORED_NAMED = 32  # unknown fields named in the response header and the log, at most
# what /workers shows of each worker's LoadReport: its load, not its addresses or cache contents
WORKER_FIELDS = {"worker_id", "role", "model", "pool", "pod", "queue_depth", "queue_wait_seconds", "running", "waiting",
                 "kv_utilization", "transfer_backlog_handoffs", "ttft_seconds", "itl_seconds", "tokens_per_second",
                 "spec_acceptance_rate", "requests_per_second"}


class RequestFailed(Exception):
    def __init__(self, status: int, message: str, type_: str = "server_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


class WorkerLost(Exception):
    """The worker responsible for one attempt of a request stopped beating (killed, frozen, its node gone).
    `Generation._move` decides whether the request goes on elsewhere; `failure` is the client's error if not."""

    def __init__(self, failure: RequestFailed, role: str, worker_id: str):
        super().__init__(failure.message)
        self.failure, self.role, self.worker_id = failure, role, worker_id


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers: dict | None = None):
    return web.json_response(error_body(message, type_, param, code), status=status, headers=headers)


def _header_safe(name: str) -> str:
    """A client-chosen field name as it may appear in a header and a log line: printable, short."""
    clean = "".join(c if c.isalnum() or c in "_.-[]" else "?" for c in name[:64])
    return clean + ("..." if len(name) > 64 else "")


class Front:
    def __init__(self, args: FrontConfig):
        from pdserve.front.registry import WorkerRegistry
        from pdserve.modelstore import resolve_model

        self.args = args
        model_dir = resolve_model(args.model)
        self.model_name = args.served_model_name or model_dir.name
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        self.max_context = int(cfg.get("max_position_embeddings", 2048))
        if args.max_model_len is not None:
            if args.max_model_len > self.max_context:
                raise SystemExit(f"--max-model-len {args.max_model_len} exceeds {self.model_name}'s context of "
                                 f"{self.max_context} tokens")
            self.max_context = args.max_model_len
        self.vocab_size = max(int(cfg.get("vocab_size", 0)), len(self.tokenizer))
        self.tool_family = args.tool_call_parser or family_for_template(self.tokenizer.chat_template)
        self.template_shows_tools, self.template_shows_calls = self._template_tool_support()
        self.api_key = args.api_key.get_secret_value() if args.api_key else None
        self.scope = args.deployment_scope
        self.creds = NatsCredentials.from_config(args.nats, scope=self.scope)
        self.registry = WorkerRegistry(self.scope)
        # this process's identity on its requests (`PrefillRequest.front_id`): the workers cancel them should its
        # heartbeats stop (`pdserve.frontwatch`); new for every start, so a restarted front's orphans are not its own
        self.front_id = f"front-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.nc: nats.NATS | None = None
        self._beat: asyncio.Task | None = None
        self.inflight: PyCounter[str] = PyCounter()  # decode worker id -> requests this front sent it
        self.inflight_bytes: PyCounter[str] = PyCounter()  # decode worker id -> their KV bytes (estimated)
        self.prefill_inflight: PyCounter[str] = PyCounter()  # prefill worker id -> tokens sent, not yet computed
        self.kv_bytes_per_token = self._kv_bytes_per_token(cfg, args.kv_dtype)
        self._hint_tasks: set[asyncio.Task] = set()
        self.created = int(time.time())
        self.was_ready = False  # the front has been ready once (see `models`)
        r = self.metrics = CollectorRegistry()
        self.m_requests = Counter("pdserve_requests_total", "HTTP requests", ["endpoint", "status"], registry=r)
        self.m_ttft = Histogram("pdserve_time_to_first_token_seconds", "time to first token", registry=r,
                                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
        self.m_itl = Histogram("pdserve_inter_token_latency_seconds", "time between streamed tokens", registry=r,
                               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2))
        self.m_e2e = Histogram("pdserve_request_duration_seconds", "request latency", registry=r,
                               buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.m_queue = Gauge("pdserve_queue_depth", "requests in flight at this front", registry=r)
        self.m_kv_bytes = Counter("pdserve_kv_transfer_moved_bytes_total",
                                  "KV bytes moved prefill -> decode, as the handoffs report them", registry=r)
        self.m_kv_seconds = Histogram("pdserve_kv_transfer_seconds", "KV transfer time", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.m_prompt_tokens = Counter("pdserve_prompt_tokens_total", "prompt tokens", registry=r)
        self.m_completion_tokens = Counter("pdserve_completion_tokens_total", "generated tokens", registry=r)
        self.m_moves = Counter("pdserve_request_moves_total", "requests dispatched again after the worker holding "
                               "them died, by that worker's role", ["role"], registry=r)
        self.m_move_kv = Counter("pdserve_request_move_kv_tokens_total", "tokens whose KV a moved request needed on "
                                 "its new workers, by where it came from: a prefill worker's prefix cache (where the "
                                 "worker that computed the prompt keeps it), the offload tier, or computed again",
                                 ["source"], registry=r)
        self.m_move_stall = Histogram("pdserve_request_move_stall_seconds", "what a move cost the client: from its "
                                      "last token before the worker was lost (its start, when none) to the first after",
                                      registry=r, buckets=(0.25, 0.5, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 60))
        self.m_hints = Counter("pdserve_preposition_hints_sent_total", "pre-positioning hints sent to prefill",
                               registry=r)
        from pdserve.front.registry import RegistryCollector

        r.register(RegistryCollector(self.registry, self.model_name))

    @staticmethod
    def _kv_bytes_per_token(cfg: dict, kv_dtype: str) -> int:
        """KV bytes one token takes on a decode worker (for routing estimates; `auto` counts as float32,
        what decode resolves it to on the CPU)."""
        heads = int(cfg.get("num_attention_heads", 1))
        head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 64)) // heads)
        itemsize = 2 if kv_dtype in ("bfloat16", "float16") else 4
        return int(cfg.get("num_hidden_layers", 1)) * 2 * int(cfg.get("num_key_value_heads", heads)) * head_dim * itemsize

    def _template_tool_support(self) -> tuple[bool, bool]:
        """Whether the chat template renders `tools`, and an assistant's earlier `tool_calls` (SmolLM2-Instruct's
        renders neither: the front then writes them in the family's format itself)."""
        probe = "pdserve_probe_fn"
        user = [{"role": "user", "content": "hi"}]
        tool = [{"type": "function", "function": {"name": probe, "parameters": {"type": "object"}}}]
        call = [*user, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": probe, "arguments": {}}}]}]
        try:
            shows_tools = probe in self.tokenizer.apply_chat_template(user, tools=tool, tokenize=False)
            shows_calls = probe in self.tokenizer.apply_chat_template(call, tokenize=False)
        except Exception:  # a template that refuses these shapes: the front writes them
            return False, False
        return shows_tools, shows_calls

    def chat_messages(self, req: ChatCompletionRequest) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools to render with the chat template: where the template does not show
        tools or earlier calls, the tools go in a system prompt and the calls into the assistant's text,
        in the deployment's tool-call format."""
        messages = [m.for_template() for m in req.messages]
        tools = req.template_tools()
        if not self.template_shows_calls:
            for m in messages:
                if m.get("tool_calls"):
                    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.pop("tool_calls")]
                    m["content"] = (m["content"] + "\n" if m["content"] else "") + render_calls(self.tool_family,
                                                                                               calls)
        if tools and not self.template_shows_tools:
            prompt = tools_prompt(self.tool_family, tools)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
            else:
                messages.insert(0, {"role": "system", "content": prompt})
            tools = None
        return messages, tools

    def chat_prompt_ids(self, messages: list[dict], generation_prompt: bool = True,
                        tools: list[dict] | None = None) -> list[int]:
        """The model's chat template over `messages` (system prompts, tool calls and results included) and
        `tools` (the function specs, for templates that show them), tokenized."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  **({"tools": tools} if tools else {}))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def next_user_turn_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Tokens every next request of this conversation starts with: the messages so far and the
        header of the user's next message, as the chat template renders them (the header only
        where the template renders the conversation so far as a prefix of the longer one)."""
        marker = "\x00pdserve-next\x00"
        extra = {"tools": tools} if tools else {}
        so_far = self.tokenizer.apply_chat_template(messages, tokenize=False, **extra)
        longer = self.tokenizer.apply_chat_template([*messages, {"role": "user", "content": marker}], tokenize=False,
                                                    **extra)
        text = longer[: longer.index(marker)] if marker in longer and longer.startswith(so_far) else so_far
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- app -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_mw], client_max_size=16 << 20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/workers", self.workers)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app) -> None:
        register_runtime_metrics(self.metrics, asyncio.get_running_loop(), lambda: self.nc)
        self.nc = await self.creds.connect(name="pdserve-front", max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        await self.registry.attach(self.nc)
        self._beat = asyncio.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        subject, beat = Subjects.front_beat(self.scope, self.front_id), FrontBeat(front_id=self.front_id).encode()
        while True:
            try:
                await self.nc.publish(subject, beat)
            except Exception as e:  # NATS reconnecting: the next beat will go through
                log.debug("front heartbeat not sent: %s", e)
            await asyncio.sleep(FRONT_BEAT_INTERVAL_S)

    async def _cleanup(self, app) -> None:
        if self._beat is not None:
            self._beat.cancel()
        if self.nc:
            await close_connection(self.nc)

    @web.middleware
    async def _errors_mw(self, request: web.Request, handler):
        if request.path.startswith("/v1/") and self.api_key:
            got = request.headers.get("Authorization", "")
            if not secrets.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
                return error_response(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status >= 400 and request.path.startswith("/v1/"):
                return error_response(e.status, e.reason, "invalid_request_error")
            raise

    # -- simple endpoints -------------------------------------------------------------------

    async def health(self, request):
        body = {"status": "ok", "nats": bool(self.nc and self.nc.is_connected),
                "prefill_workers": len(self.registry.alive("prefill", self.model_name)),
                "decode_workers": len(self.registry.alive("decode", self.model_name))}
        return web.json_response(body, status=200 if body["nats"] else 503)

    def is_ready(self) -> bool:
        """NATS connected and at least one prefill and one decode worker registered for the model."""
        ok = bool(self.nc and self.nc.is_connected) and bool(self.registry.alive("prefill", self.model_name)) \
            and bool(self.registry.alive("decode", self.model_name))
        self.was_ready = self.was_ready or ok
        return ok

    async def ready(self, request):
        ok = self.is_ready()
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    def spawn_hint(self, gen: "Generation", worker_id: str) -> None:
        task = asyncio.create_task(self._send_hint(gen, worker_id))
        self._hint_tasks.add(task)
        task.add_done_callback(self._hint_tasks.discard)

    async def _send_hint(self, gen: "Generation", worker_id: str) -> None:
        try:
            ids = gen.next_turn_ids()
            if len(ids) >= self.max_context:
                return
            hint = PrepositionHint(request_id=gen.rid, model=self.model_name, token_ids=ids)
            await self.nc.publish(Subjects.preposition(self.scope, worker_id), hint.encode())
            self.m_hints.inc()
        except Exception as e:  # a hint is an optimisation: never let it disturb serving
            log.debug("pre-positioning hint for %s not sent: %s", gen.rid, e)

    async def metrics_handler(self, request):
        self.m_queue.set(sum(self.inflight.values()))
        return web.Response(body=generate_latest(self.metrics), content_type="text/plain", charset="utf-8")

    async def workers(self, request):
        """The workers this front routes to, from their load reports (what `pdserve top` shows per worker)."""
        rows = [{**rep.model_dump(include=WORKER_FIELDS), "age_seconds": round(age, 3), "draining": draining}
                for rep, age, draining in self.registry.snapshot()]
        return web.json_response({"model": self.model_name, "workers": rows})

    async def openapi(self, request):
        return web.json_response(openapi_document(self.model_name, auth=bool(self.api_key)))

    async def models(self, request):
        # Not before the front is first ready (a client that lists models then asks must be served);
        # from then on the model stays advertised, even while its pools are scaled to zero.
        if not self.was_ready and not self.is_ready():
            return error_response(503, f"model {self.model_name!r} is not ready: waiting for its prefill and "
                                       f"decode workers to register", "unavailable", code="not_ready")
        data = [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdserve"}]
        return web.json_response({"object": "list", "data": data})

    # -- generation ---------------------------------------------------------------------------

    async def _parse(self, request: web.Request, schema):
        try:
            raw = await request.read()
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestFailed(400, f"request body is not valid JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            raise RequestFailed(400, "request body must be a JSON object", "invalid_request_error")
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            msg = first["msg"].removeprefix("Value error, ")
            raise RequestFailed(400, f"{where}: {msg}" if where else msg, "invalid_request_error", code=where)
        if req.model != self.model_name:
            raise RequestFailed(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                                "invalid_request_error", code="model_not_found")
        return req

    def _ignored(self, req, rid: str) -> dict[str, str]:
        """Log the request's unknown fields (names only, once) and name them in a response header."""
        names = ignored_fields(req)
        if not names:
            return {}
        shown = [_header_safe(n) for n in names[:MAX_IGNORED_NAMED]] + (["..."] if len(names) > MAX_IGNORED_NAMED else [])
        log.warning("request %s: ignored unknown fields: %s", rid, ", ".join(shown))
        return {IGNORED_FIELDS_HEADER: ", ".join(shown)}

    def _sampling(self, req, prompt_len: int, default_max: int | None) -> SamplingParams:
        room = self.max_context - prompt_len
        if room < 1:
            raise RequestFailed(400, f"prompt is {prompt_len} tokens; the model's context is {self.max_context}",
                                "invalid_request_error", code="context_length_exceeded")
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or default_max or room
        if max_tokens > room:
            raise RequestFailed(400, f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceeds the model's "
                                     f"context of {self.max_context}", "invalid_request_error",
                                code="context_length_exceeded")
        bad = [t for t in req.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestFailed(400, f"stop_token_ids: {bad[:5]} outside the vocabulary (0..{self.vocab_size - 1})",
                                "invalid_request_error", code="stop_token_ids")
        try:
            guided = guided_spec(req, self.tool_family)
        except GuidedError as e:
            raise RequestFailed(400, str(e), "invalid_request_error", code=e.field)
        # -1 and 0 are off, and so is a k past the vocabulary (it keeps every token; as a number it would
        # not fit the workers' int32 sampling tensors)
        top_k = req.top_k if 0 < req.top_k < self.vocab_size else 0
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
                min_p=req.min_p, seed=req.seed, stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, n=req.n,
                logprobs=asked_logprobs(req), skip_special_tokens=req.skip_special_tokens, guided=guided)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            msg = first["msg"].removeprefix("Value error, ")
            raise RequestFailed(400, f"{where}: {msg}" if where else msg, "invalid_request_error", code=where)

    async def completions(self, request):
        return await self._handle(request, chat=False)

    async def chat_completions(self, request):
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        # W3C: a traceparent that does not parse is ignored, and the request starts a trace of its own
        client_trace = tracing.valid_traceparent(request.headers.get("traceparent"))
        spans = None
        if tracing.enabled():
            spans = tracing.start_request(f"POST {request.path}", client_trace, server=True, **{
                "pdserve.request_id": rid, "http.request.method": "POST", "url.path": request.path,
                "gen_ai.request.model": self.model_name})
            if spans is not None and not spans.recording:  # not sampled: the workers learn so from the context's flags
                client_trace, spans = spans.traceparent(), None
        with logs.request(rid, spans.trace_id if spans else None):
            return await self._generate(request, chat, endpoint, rid, spans, client_trace)

    async def _generate(self, request: web.Request, chat: bool, endpoint: str, rid: str,
                        spans: "tracing.RequestSpans | None", client_trace: str | None):
        t0 = spans.marks["start"] if spans is not None else 0
        headers: dict[str, str] = {}
        try:
            req = await self._parse(request, ChatCompletionRequest if chat else CompletionRequest)
            headers = self._ignored(req, rid)
            if chat:
                messages, tools = self.chat_messages(req)
                prompt_ids = self.chat_prompt_ids(messages, tools=tools)
            elif isinstance(req.prompt, list):
                if any(not (0 <= t < len(self.tokenizer)) for t in req.prompt):
                    raise RequestFailed(400, "prompt token ids out of the vocabulary", "invalid_request_error")
                prompt_ids = list(req.prompt)
            else:  # with the tokenizer's special tokens, as transformers and vLLM encode a prompt: BOS where
                # the model wants one (Gemma without it answers nonsense); a chat template writes its own
                prompt_ids = self.tokenizer.encode(req.prompt)
            params = self._sampling(req, len(prompt_ids), None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
        except RequestFailed as e:
            self.m_requests.labels(endpoint, str(e.status)).inc()
            if spans is not None:
                spans.child("front.parse", t0, error=e.message)
                spans.end(error=e.message, **{"http.response.status_code": e.status})
            return error_response(e.status, e.message, e.type, code=e.code, headers=headers)
        if spans is not None:
            spans.child("front.parse", t0, **{"gen_ai.usage.input_tokens": len(prompt_ids)})
        gen = Generation(self, rid, prompt_ids, params, req, spans, client_trace)
        if params.logprobs is not None:
            await asyncio.to_thread(TokenTexts.of, self.tokenizer)  # built once, off the event loop
        if req.stream:
            return await self._stream(request, gen, chat, endpoint, headers)
        return await self._unary(gen, chat, endpoint, headers)

    def _usage(self, gen: "Generation", final: bool = True) -> dict:
        """The usage object; with `final` False the running counts a chunk carries (continuous_usage_stats)."""
        done = sum(c.completion_tokens for c in gen.choices)
        u = {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": done, "total_tokens": len(gen.prompt_ids) + done}
        if not final:
            return u
        u["prompt_tokens_details"] = {"cached_tokens": gen.cached_tokens}
        if gen.prepositioned:
            u["prompt_tokens_details"]["prepositioned"] = True
        drafted = sum(c.usage.spec_draft_tokens for c in gen.choices if c.usage)
        if drafted:
            u["speculation"] = {"draft_tokens": drafted,
                                "accepted_tokens": sum(c.usage.spec_accepted_tokens for c in gen.choices if c.usage)}
            forced = sum(c.usage.forced_draft_tokens for c in gen.choices if c.usage)
            if forced:
                u["speculation"]["forced_draft_tokens"] = forced
                u["speculation"]["forced_accepted_tokens"] = sum(c.usage.forced_accepted_tokens
                                                                 for c in gen.choices if c.usage)
        return u

    def _logprobs(self, chat: bool, tokens: list[int], lps: list[TokenLogprob] | None, offset: int) -> dict | None:
        if lps is None:
            return None
        texts = TokenTexts.of(self.tokenizer)
        return chat_logprobs(tokens, lps, texts) if chat else completion_logprobs(tokens, lps, texts, offset)

    async def _unary(self, gen: "Generation", chat: bool, endpoint: str, headers: dict):
        try:
            async for _ in gen.run():
                pass
        except RequestFailed as e:
            self.m_requests.labels(endpoint, str(e.status)).inc()
            return error_response(e.status, e.message, e.type, code=e.code, headers=headers)
        self.m_requests.labels(endpoint, "200").inc()
        choices = []
        for c in gen.choices:
            lps = self._logprobs(chat, c.token_ids, c.logprobs if gen.params.logprobs is not None else None, 0)
            if chat:
                message = {"role": "assistant", "content": c.text}
                finish = c.finish_reason
                if gen.req.parses_calls:
                    content, calls = extract(self.tool_family, c.text)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": [t.openai() for t in calls]}
                        finish = "tool_calls" if finish == "stop" else finish
                choice = {"index": c.index, "message": message, "finish_reason": finish, "logprobs": lps}
            else:
                choice = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": lps}
            if gen.req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return web.json_response({
            "id": gen.rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": self._usage(gen),
        }, headers=headers)

    async def _stream(self, request: web.Request, gen: "Generation", chat: bool, endpoint: str, headers: dict):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **headers})
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        opts = gen.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and opts.continuous_usage_stats  # as vLLM: usage in every chunk

        def chunk(index: int, delta: str | None, finish: str | None, lps: dict | None = None,
                  role: bool = False, tool_calls: list[dict] | None = None) -> bytes:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
                if tool_calls:
                    d["tool_calls"] = tool_calls
                choice = {"index": index, "delta": d, "finish_reason": finish, "logprobs": lps}
            else:
                choice = {"index": index, "text": delta or "", "finish_reason": finish, "logprobs": lps}
            body = {"id": gen.rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            if continuous:
                body["usage"] = self._usage(gen, final=False)
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        started = False
        offsets = [0] * gen.params.n  # per choice: characters of its tokens' texts so far (text_offset)
        # per choice: its tool calls, parsed as they stream (their markup never reaches content)
        calls = [ToolCallStream(self.tool_family) for _ in range(gen.params.n)] if chat and gen.req.parses_calls else None
        try:
            async for c, ev in gen.run():
                if not started:
                    await resp.prepare(request)
                    started = True
                    if chat:
                        for i in range(gen.params.n):
                            await resp.write(chunk(i, None, None, role=True))
                if ev is None:  # the choice is done
                    finish = c.finish_reason
                    if calls is not None:
                        d = calls[c.index].finish()
                        if d.content or d.tool_calls:
                            await resp.write(chunk(c.index, d.content or None, None, tool_calls=d.tool_calls))
                        if calls[c.index].has_calls and finish == "stop":
                            finish = "tool_calls"
                    await resp.write(chunk(c.index, None if chat else "", finish))
                elif ev.text or ev.logprobs:
                    lps = self._logprobs(chat, ev.token_ids, ev.logprobs, offsets[c.index])
                    if lps and not chat:
                        offsets[c.index] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                    if calls is None:
                        await resp.write(chunk(c.index, ev.text, None, lps))
                        continue
                    d = calls[c.index].feed(ev.text or "")
                    if d.content or lps:
                        await resp.write(chunk(c.index, d.content, None, lps))
                    if d.tool_calls:
                        await resp.write(chunk(c.index, None, None, tool_calls=d.tool_calls))
            if not started:
                await resp.prepare(request)
            if include_usage:
                body = {"id": gen.rid, "object": obj, "created": created, "model": self.model_name,
                        "choices": [], "usage": self._usage(gen)}
                await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            self.m_requests.labels(endpoint, "200").inc()
        except RequestFailed as e:
            self.m_requests.labels(endpoint, str(e.status)).inc()
            if not started:  # nothing sent yet: a plain HTTP error is the clearest answer
                return error_response(e.status, e.message, e.type, code=e.code, headers=headers)
            # mid-stream: an error event, and no [DONE]
            await resp.write(b"data: " + json.dumps(error_body(e.message, e.type, code=e.code)).encode() + b"\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            await gen.cancel("client went away")
            raise
        await resp.write_eof()
        return resp


class Choice:
    """What the front has of one choice of a request: its text, tokens, logprobs and end."""

    def __init__(self, index: int):
        self.index = index
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.usage = None  # the worker's Usage for this choice, once done

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, ev: StreamEvent) -> None:
        self.token_ids.extend(ev.token_ids)
        if ev.logprobs:
            self.logprobs.extend(ev.logprobs)
        if ev.text:
            self.parts.append(ev.text)


class Generation:
    """One request's life at the front: dispatch, then follow its events to the end."""

    def __init__(self, front: Front, rid: str, prompt_ids: list[int], params: SamplingParams, req,
                 spans: "tracing.RequestSpans | None" = None, client_trace: str | None = None):
        self.front, self.rid, self.prompt_ids, self.params, self.req = front, rid, prompt_ids, params, req
        self.spans = spans  # this request's spans when traced (`pdserve.tracing`)
        # what the workers' spans hang under: the request's span, or the client's context passed through
        self.traceparent = spans.traceparent() if spans is not None else client_trace
        self.choices = [Choice(i) for i in range(params.n)]
        self.cached_tokens = 0  # prompt tokens prefill took from its prefix cache
        self.prepositioned = False  # … some of which pre-positioning computed ahead
        self.attempt_rid = rid  # the request id the workers know: `rid`, then `rid-m1`, … once moved
        self.first_token_at: float | None = None  # monotonic, across attempts
        self.last_token_at: float | None = None
        self.stalled_since: float | None = None  # moved, and no token since: from when the client has waited

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    async def _dispatch(self, preq: PrefillRequest, worker_id: str) -> Ack:
        """Send the prompt to the routed prefill worker; if it does not answer, to any (queue group)."""
        f, a = self.front, self.front.args
        direct = Subjects.prefill_worker(f.scope, f.model_name, worker_id)
        try:
            msg = await f.nc.request(direct, preq.encode(), timeout=min(a.dispatch_timeout, 2.0))
            return Ack.decode(msg.data)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            log.info("prefill worker %s did not take %s; dispatching to the queue group", worker_id, preq.request_id)
        try:
            msg = await f.nc.request(Subjects.prefill(f.scope, f.model_name), preq.encode(), timeout=a.dispatch_timeout)
            return Ack.decode(msg.data)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            raise RequestFailed(503, f"no prefill worker accepted the request within {a.dispatch_timeout:.0f} s",
                                "unavailable", code="no_worker")

    def _unqueue(self, queued: tuple[str, int]) -> None:
        c = self.front.prefill_inflight
        c[queued[0]] -= queued[1]
        if c[queued[0]] <= 0:
            del c[queued[0]]

    def next_turn_ids(self) -> list[int]:
        """The likeliest start of this conversation's next request: everything so far plus the answer."""
        if isinstance(self.req, ChatCompletionRequest):
            messages, tools = self.front.chat_messages(self.req)
            messages.append({"role": "assistant", "content": self.choices[0].text})
            return self.front.next_user_turn_ids(messages, tools)
        return self.prompt_ids + self.choices[0].token_ids

    def _choice(self, ev: StreamEvent) -> Choice:
        if not 0 <= ev.index < len(self.choices):
            raise RequestFailed(502, f"a worker sent choice {ev.index} of a request with n={len(self.choices)}",
                                "server_error")
        return self.choices[ev.index]

    async def cancel(self, reason: str, rid: str | None = None) -> None:
        """Tell every worker to drop the request (`rid`: one attempt of it; default: the current one)."""
        rid = rid or self.attempt_rid
        try:
            await self.front.nc.publish(Subjects.cancel(self.front.scope, rid), Cancel(request_id=rid, reason=reason).encode())
        except Exception:
            pass

    def run(self):
        """An async iterator of (choice, token event) as tokens arrive and (choice, None) as each choice ends;
        it raises RequestFailed on any failure."""
        return self._run() if self.spans is None else self._traced()

    async def _traced(self):
        """`_run`, ending the request's span with its outcome."""
        spans = self.spans
        try:
            async for item in self._run():
                yield item
        except RequestFailed as e:
            spans.end(error=e.message, **{"http.response.status_code": e.status})
            raise
        except BaseException as e:  # the client went away, the server stops
            spans.end(error=f"ended early: {type(e).__name__}")
            raise
        spans.end(**{"http.response.status_code": 200, "gen_ai.usage.output_tokens": self.completion_tokens})

    async def _run(self):
        f, a = self.front, self.front.args
        t0 = time.monotonic()
        spans = self.spans
        if spans is not None:
            t_route = tracing.now_ns()
        decode = f.registry.pick_decode(f.model_name, f.inflight, f.inflight_bytes)
        prefill, hit = f.registry.pick_prefill(f.model_name, self.prompt_ids, f.prefill_inflight)
        if decode is None or prefill is None:
            if spans is not None:
                spans.child("front.route", t_route, error="no worker")
            raise RequestFailed(503, f"no {'decode' if decode is None else 'prefill'} worker is available for "
                                     f"{f.model_name}; retry later", "unavailable", code="no_worker")
        if spans is not None:
            spans.child("front.route", t_route, **{"pdserve.prefill_worker": prefill.worker_id,
                                                   "pdserve.decode_worker": decode.worker_id,
                                                   "pdserve.prefix_hit_tokens": hit})
        spec = self.req.speculation.model_dump(exclude_none=True) if self.req.speculation else None
        preq = PrefillRequest(request_id=self.rid, model=f.model_name, prompt_token_ids=self.prompt_ids,
                              sampling=self.params, seed=self.params.seed if self.params.seed is not None
                              else secrets.randbits(63), decode_worker_id=decode.worker_id,
                              failure_policy=a.kv_failure_policy, spec=spec, traceparent=self.traceparent,
                              front_id=f.front_id)
        kv_bytes = (len(self.prompt_ids) + self.params.n * self.params.max_tokens) * f.kv_bytes_per_token
        self._account(decode.worker_id, kv_bytes, 1)
        f.m_prompt_tokens.inc(len(self.prompt_ids))
        try:
            moves = 0
            while True:
                try:
                    async for item in self._attempt(preq, prefill.worker_id, hit, t0):
                        yield item
                    return
                except WorkerLost as e:
                    lost = e
                prefill, hit, moved_to = self._move(lost, moves, decode)
                if moved_to is not decode:
                    self._account(decode.worker_id, kv_bytes, -1)
                    self._account(moved_to.worker_id, kv_bytes, 1)
                    decode = moved_to
                moves += 1
                f.m_moves.labels(lost.role).inc()
                if self.stalled_since is None:  # (moved again before a token: still the first wait)
                    self.stalled_since = self.last_token_at or t0
                self.attempt_rid = f"{self.rid}-m{moves}"
                streamed = list(self.choices[0].token_ids) if self.params.n == 1 else []
                log.warning("%s: %s; moved with %d tokens streamed, as %s (prefill %s, decode %s)", self.rid,
                            lost.failure.message, len(streamed), self.attempt_rid, prefill.worker_id, decode.worker_id)
                if spans is not None:
                    spans.event("moved", **{"pdserve.from_worker": lost.worker_id, "pdserve.streamed_tokens": len(streamed),
                                            "pdserve.prefill_worker": prefill.worker_id,
                                            "pdserve.decode_worker": decode.worker_id})
                preq = preq.model_copy(update={"request_id": self.attempt_rid, "decode_worker_id": decode.worker_id,
                                               "generated_token_ids": streamed})
        finally:
            self._account(decode.worker_id, kv_bytes, -1)

    def _account(self, decode_id: str, kv_bytes: int, sign: int) -> None:
        """Count this request at a decode worker (`sign` 1) or stop counting it there (-1): the router's
        estimate of each worker's requests and KV bytes in flight."""
        f = self.front
        f.inflight[decode_id] += sign
        f.inflight_bytes[decode_id] += sign * kv_bytes
        if f.inflight[decode_id] <= 0:
            del f.inflight[decode_id]
            f.inflight_bytes.pop(decode_id, None)

    def _count_move_kv(self, preq: PrefillRequest, cached: int, fetched: int) -> None:
        """Where a moved request's KV came from (`pdserve_request_move_kv_tokens_total`): of the tokens it needed
        (the prompt and all streamed but the last), `cached` from a prefill worker's prefix cache, `fetched` of
        those from the offload tier."""
        need = len(preq.prompt_token_ids) + max(0, len(preq.generated_token_ids) - 1)
        cached, fetched = min(cached, need), min(fetched, cached)
        m = self.front.m_move_kv
        m.labels("prefix").inc(cached - fetched)
        m.labels("offload").inc(fetched)
        m.labels("computed").inc(need - cached)

    def _move(self, lost: WorkerLost, moves: int, decode):
        """Where a request goes after the worker holding it died → (prefill worker, its cached tokens, decode
        worker); RequestFailed (the loss, worker_lost) when it cannot move: past `migration_limit` moves, with
        n > 1 once tokens were streamed (each choice would need its own continuation), or no worker to take it.

        What the client has seen goes with it: the tokens streamed so far, which the new prefill worker computes
        the KV of beside the prompt; the seed is the request's, so a sampled answer goes on as it would have."""
        f, why = self.front, None
        streamed = sum(len(c.token_ids) for c in self.choices)
        if moves >= f.args.migration_limit:
            why = f"not moved again: it has been moved {moves} of --migration-limit {f.args.migration_limit} times"
        elif streamed and self.params.n > 1:
            why = f"not moved: {streamed} tokens of its {self.params.n} choices were streamed"
        else:
            ids = self.prompt_ids + (self.choices[0].token_ids if self.params.n == 1 else [])
            if lost.role == "decode" or not f.registry.is_alive("decode", decode.worker_id):
                decode = f.registry.pick_decode(f.model_name, f.inflight, f.inflight_bytes)
            prefill, hit = f.registry.pick_prefill(f.model_name, ids, f.prefill_inflight)
            if decode is None or prefill is None:
                why = f"no other {'decode' if decode is None else 'prefill'} worker is alive"
            elif len(ids) >= f.max_context:
                why = f"its {len(ids)} tokens leave no room to go on"
        if why is not None:
            raise RequestFailed(lost.failure.status, f"{lost.failure.message}; {why}", lost.failure.type,
                                code=lost.failure.code)
        return prefill, hit, decode

    async def _attempt(self, preq: PrefillRequest, prefill_id: str, hit: int, t0: float):
        """One dispatch of the request (as `preq.request_id`) to prefill worker `prefill_id`, then its events to
        the end (`run`'s items); WorkerLost when the worker responsible for it dies."""
        f, a = self.front, self.front.args
        spans = self.spans
        rid = preq.request_id
        sub = await f.nc.subscribe(Subjects.stream(f.scope, rid))
        finished = moving = False
        queued = None  # (prefill worker, tokens) this request adds to its queue until the first token
        try:
            if spans is not None:
                t_queue = tracing.now_ns()
            try:
                ack = await self._dispatch(preq, prefill_id)
            except RequestFailed as e:
                if spans is not None:
                    spans.child("front.queue", t_queue, error=e.message)
                raise
            if spans is not None:
                spans.child("front.queue", t_queue, error=None if ack.accepted else ack.error,
                            **{"pdserve.prefill_worker": ack.worker_id, "pdserve.accepted": ack.accepted})
            if not ack.accepted:
                raise RequestFailed(ack.status, f"prefill worker {ack.worker_id} refused the request: {ack.error}",
                                    "invalid_request_error" if ack.status < 500 else "server_error")
            queued = (ack.worker_id, len(self.prompt_ids) - (hit if ack.worker_id == prefill_id else 0))
            f.prefill_inflight[queued[0]] += queued[1]
            responsible = ("prefill", ack.worker_id)
            pending: dict[int, StreamEvent] = {}
            next_seq = 0
            last_event = time.monotonic()
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.25)
                except nats.errors.TimeoutError:
                    now = time.monotonic()
                    # Following prefill, the decode worker it hands the KV to may own the request before its
                    # "handoff" event reaches us: should that worker die, nobody would say so (prefill's send fails
                    # on its side, and decode applies the failure policy) — it counts as lost here too.
                    routed = ("decode", preq.decode_worker_id)
                    gone = next((w for w in (responsible, routed) if not f.registry.is_alive(*w)), None)
                    if gone is not None and (gone is responsible or responsible[0] == "prefill"):
                        lost = RequestFailed(502, f"{gone[0]} worker {gone[1]} died while serving the request "
                                                  f"({f.registry.last_heard(*gone)})", "worker_lost", code="worker_lost")
                        moving = True
                        raise WorkerLost(lost, *gone)
                    bound = a.first_token_timeout if self.first_token_at is None else a.token_timeout
                    if now - last_event > bound:
                        raise RequestFailed(504, f"no progress from {responsible[0]} worker {responsible[1]} "
                                                 f"for {bound:.0f} s", "timeout", code="timeout")
                    continue
                try:
                    ev = StreamEvent.decode(msg.data)
                except ProtocolError as e:
                    raise RequestFailed(502, f"bad event from a worker: {e}", "server_error")
                last_event = time.monotonic()
                pending[ev.seq] = ev
                while next_seq in pending:
                    ev = pending.pop(next_seq)
                    next_seq += 1
                    if ev.kind == "error":
                        if ev.error_type == WORKER_STOPPED:  # a planned exit left it unfinished: it moves
                            moving = True
                            raise WorkerLost(RequestFailed(503, ev.error or "its worker stopped", "unavailable",
                                                           code="unavailable"), *responsible)
                        raise RequestFailed(ev.status or 500, ev.error or "worker error", ev.error_type or "server_error",
                                            code=ev.error_type)
                    if ev.kind == "handoff":
                        responsible = ("decode", ev.worker_id)
                        if preq.resumed and ev.cached_tokens is not None:
                            self._count_move_kv(preq, ev.cached_tokens, ev.fetched_tokens or 0)
                        if spans is not None:
                            spans.event("handoff", **{"pdserve.decode_worker": ev.worker_id,
                                                      "pdserve.kv_bytes": ev.kv_bytes})
                        if queued:  # prefill is done with it (a prompt handed over uncomputed: before its first token)
                            self._unqueue(queued)
                            queued = None
                        if ev.kv_bytes:
                            f.m_kv_bytes.inc(ev.kv_bytes)
                            f.m_kv_seconds.observe(ev.kv_seconds or 0.0)
                        continue
                    if ev.kind == "token":
                        now = time.monotonic()
                        if self.first_token_at is None:
                            self.first_token_at = now
                            f.m_ttft.observe(now - t0)
                            if spans is not None:
                                spans.event("first_token", **{"pdserve.worker": ev.worker_id})
                            self.cached_tokens = ev.cached_tokens or 0
                            self.prepositioned = bool(ev.prepositioned)
                            if rid != self.rid and ev.cached_tokens is not None:  # moved before its first token
                                self._count_move_kv(preq, ev.cached_tokens, 0)
                            if queued:
                                self._unqueue(queued)
                                queued = None
                        else:
                            f.m_itl.observe(now - self.last_token_at)
                        if self.stalled_since is not None:
                            f.m_move_stall.observe(now - self.stalled_since)
                            self.stalled_since = None
                        self.last_token_at = now
                        choice = self._choice(ev)
                        choice.add(ev)
                        yield choice, ev
                        continue
                    if ev.kind == "done":
                        choice = self._choice(ev)
                        if choice.finish_reason is not None:
                            raise RequestFailed(502, f"choice {ev.index} ended twice", "server_error")
                        choice.finish_reason = ev.finish_reason or "stop"
                        choice.usage = ev.usage
                        yield choice, None
                        if any(c.finish_reason is None for c in self.choices):
                            continue
                        finished = True
                        f.m_completion_tokens.inc(self.completion_tokens)
                        f.m_e2e.observe(time.monotonic() - t0)
                        if a.preposition:
                            f.spawn_hint(self, ack.worker_id)
                        return
                if len(pending) > 4096:
                    raise RequestFailed(502, f"event stream lost event {next_seq}", "server_error")
        finally:
            if queued:
                self._unqueue(queued)
            if not finished:
                await self.cancel("its worker was lost" if moving else "request ended early", rid)
            await sub.unsubscribe()


def main(argv: list[str]) -> int:
    from pdserve.workerbase import exit_now, setup_logging

    args = load(FrontConfig, argv, prog="pdserve front", description="the OpenAI-compatible HTTP front")
    setup_logging(args.log_level, args.log_format, "front")
    front = Front(args)
    log.info("front serving %s on http://%s:%d (NATS %s)", front.model_name, args.host, args.port, front.creds.url)
    web.run_app(front.app(), host=args.host, port=args.port, print=None, access_log=None,
                shutdown_timeout=args.drain_timeout)
    exit_now(0)
