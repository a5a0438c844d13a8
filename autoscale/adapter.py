"""The metrics adapter: serves `custom.metrics.k8s.io` and `external.metrics.k8s.io` (v1beta1) from worker LoadReports.

It subscribes (authenticated) to `Subjects.LOAD_ANY` and `Subjects.BYE_ANY` on NATS, keeps the
latest report of each pod, drops a report `stale_after_s` seconds after it was *received* (the
adapter's own monotonic clock, so worker clock skew cannot keep a dead pod alive) and drops a pod
at once on its `bye`. The kube-apiserver calls it as an aggregated API (an APIService per group)
over TLS; the HPA controller reads:

- Pods metrics, per pod: `GET /apis/custom.metrics.k8s.io/v1beta1/namespaces/{ns}/pods/{pod|*}/{metric}
  ?labelSelector=...` → `MetricValueList`;
- External metrics, per pool: `GET /apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/{metric}
  ?labelSelector=isvc=...,pool=...` → `ExternalMetricValueList`, one item per (isvc, pool), summed
  (counts, bytes) or averaged (ratios, latencies) over the pool's fresh pods.

Label selectors are evaluated against labels the adapter knows from the reports themselves —
`pdserve.io/isvc`, `pdserve.io/pool`, `pdserve.io/role`, and the selector labels the operator gives
each pool's pods (`app.kubernetes.io/name|instance|component`: what an HPA on an operator-made
Deployment sends); for external metrics the short keys `isvc`, `pool`, `role` work too — so the
adapter needs no RBAC on pods. A selector on any other key matches nothing.

Authentication: with `--client-ca-file` (the apiserver's `--requestheader-client-ca-file`, i.e. the
front-proxy CA), `/apis/...` requires a client certificate signed by it — only the aggregator gets
through; the kube-apiserver has already authenticated and authorised the caller (RBAC on the
`custom.metrics.k8s.io` resources) before proxying. Without it (tests), TLS is one-way.
`/healthz`, `/readyz`, `/livez` and `/metrics` (Prometheus, the adapter's own counters) need no
client certificate.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import re
import signal
import ssl
import time
from dataclasses import dataclass
from typing import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.kvtransfer.protocol import LoadReport, ProtocolError, Subjects, scope_token
from pdserve.natsserver import NatsCredentials
from pdserve.basetypes import selector_labels

log = logging.getLogger("pdserve.autoscale.adapter")

CUSTOM_GROUP = "custom.metrics.k8s.io"
EXTERNAL_GROUP = "external.metrics.k8s.io"
VERSION = "v1beta1"
LABEL_ISVC, LABEL_POOL, LABEL_ROLE = "pdserve.io/isvc", "pdserve.io/pool", "pdserve.io/role"


@dataclass(frozen=True)
class MetricDef:
    """One served metric: which workers report it, how to read it from a LoadReport, how pools aggregate it."""

    role: str | None  # None: any role (transfer backlog is reported by senders and receivers)
    read: Callable[[LoadReport], float]
    aggregate: str  # "sum" | "mean" — external metrics over a pool's pods


# THE table: every metric the adapter serves and the LoadReport field(s) behind it.
METRICS: dict[str, MetricDef] = {
    "pdserve_prefill_queue_depth": MetricDef("prefill", lambda r: r.queue_depth, "sum"),
    "pdserve_prefill_inflight_prompts": MetricDef("prefill", lambda r: r.queue_depth + r.running, "sum"),
    "pdserve_prefill_queue_wait_seconds": MetricDef("prefill", lambda r: r.queue_wait_seconds, "mean"),
    "pdserve_prefill_ttft_seconds": MetricDef("prefill", lambda r: r.ttft_seconds, "mean"),
    "pdserve_decode_running_sequences": MetricDef("decode", lambda r: r.running, "sum"),
    "pdserve_decode_waiting_sequences": MetricDef("decode", lambda r: r.waiting, "sum"),
    "pdserve_decode_kv_utilization": MetricDef("decode", lambda r: r.kv_utilization, "mean"),
    "pdserve_decode_itl_seconds": MetricDef("decode", lambda r: r.itl_seconds, "mean"),
    "pdserve_transfer_backlog_handoffs": MetricDef(None, lambda r: r.transfer_backlog_handoffs, "sum"),
    "pdserve_transfer_backlog_bytes": MetricDef(None, lambda r: r.transfer_backlog_bytes, "sum"),
    "pdserve_spec_acceptance_rate": MetricDef("decode", lambda r: r.spec_acceptance_rate, "mean"),
    "pdserve_draftpool_requests_per_second": MetricDef("draft", lambda r: r.requests_per_second, "sum"),
    "pdserve_draftpool_queue_depth": MetricDef("draft", lambda r: r.queue_depth, "sum"),
}


def quantity(value: float) -> str:
    """A Kubernetes quantity: integers as is, anything else in milli-units (0.73 → "730m")."""
    if value == int(value) and abs(value) < 2**62:
        return str(int(value))
    return f"{round(value * 1000)}m"


# --- label selectors -----------------------------------------------------------------------------

_REQ = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9._/-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<val>[A-Za-z0-9._-]*)|\s+(?P<setop>in|notin)\s*\((?P<set>[^)]*)\))?\s*$"
)


class SelectorError(ValueError):
    pass


def parse_selector(text: str | None) -> list[Callable[[dict[str, str]], bool]]:
    """Parse a Kubernetes label selector (`a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a`, `!a`)."""
    if not text or not text.strip():
        return []
    # Split on commas outside parentheses.
    parts, depth, cur = [], 0, ""
    for c in text:
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    parts.append(cur)
    reqs = []
    for p in parts:
        m = _REQ.match(p)
        if not m or (m.group("neg") and (m.group("op") or m.group("setop"))):
            raise SelectorError(f"unable to parse requirement {p.strip()!r} in label selector {text!r}")
        key, op, val = m.group("key"), m.group("op"), m.group("val")
        if m.group("neg"):
            reqs.append(lambda lb, k=key: k not in lb)
        elif op in ("=", "=="):
            reqs.append(lambda lb, k=key, v=val: lb.get(k) == v)
        elif op == "!=":
            reqs.append(lambda lb, k=key, v=val: lb.get(k) != v)
        elif m.group("setop"):
            values = {s.strip() for s in m.group("set").split(",") if s.strip()}
            if m.group("setop") == "in":
                reqs.append(lambda lb, k=key, vs=values: lb.get(k) in vs)
            else:
                reqs.append(lambda lb, k=key, vs=values: lb.get(k) not in vs)
        else:
            reqs.append(lambda lb, k=key: k in lb)
    return reqs


def matches(reqs: list[Callable[[dict[str, str]], bool]], labels: dict[str, str]) -> bool:
    return all(r(labels) for r in reqs)


# --- the store -------------------------------------------------------------------------------------


@dataclass
class _Entry:
    report: LoadReport
    received: float  # time.monotonic()
    received_wall: float  # time.time(), for the API's timestamp


def report_labels(r: LoadReport, short: bool = False) -> dict[str, str]:
    lb = selector_labels(r.isvc, r.pool) if r.isvc and r.pool else {}
    for key, val in ((LABEL_ISVC, r.isvc), (LABEL_POOL, r.pool), (LABEL_ROLE, r.role)):
        if val:
            lb[key] = val
            if short:
                lb[key.split("/", 1)[1]] = val
    return lb


class ReportStore:
    """Latest LoadReport per (namespace, pod); a report is dead `stale_after_s` after it arrived."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._by_pod: dict[tuple[str, str], _Entry] = {}
        self._clock = clock

    def put(self, r: LoadReport) -> bool:
        if not r.pod or not r.namespace:
            return False  # not a Kubernetes pod (local `pdserve up`): nothing to serve
        self._by_pod[(r.namespace, r.pod)] = _Entry(r, self._clock(), time.time())
        return True

    def remove(self, r: LoadReport) -> None:
        if r.pod and r.namespace:
            cur = self._by_pod.get((r.namespace, r.pod))
            if cur and cur.report.worker_id == r.worker_id:
                del self._by_pod[(r.namespace, r.pod)]

    def fresh(self, namespace: str) -> list[_Entry]:
        now = self._clock()
        out = []
        for key, e in list(self._by_pod.items()):
            if now - e.received > e.report.stale_after_s:
                del self._by_pod[key]
            elif key[0] == namespace:
                out.append(e)
        return out

    def __len__(self) -> int:
        return len(self._by_pod)


# --- the HTTP API ----------------------------------------------------------------------------------


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code}
    return web.json_response(body, status=code)


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _from_own_scope(r: LoadReport, subject: str) -> bool:
    """Whether a report came on its own scope's subject, and (for a pod of an InferenceService) that
    scope is the InferenceService's own ("namespace.name", as the operator leaves it)."""
    if Subjects.scope_of(subject) != scope_token(r.scope):
        return False
    return r.isvc is None or r.scope == f"{r.namespace or 'default'}.{r.isvc}"


class MetricsAdapter:
    """The adapter: a ReportStore fed from NATS and an aiohttp app serving the two metrics APIs."""

    def __init__(self, client_ca_file: str | None = None):
        self.store = ReportStore()
        self.client_ca_file = client_ca_file
        self.registry = CollectorRegistry()
        self.reports_total = Counter(
            "pdserve_metrics_adapter_reports_total", "LoadReports received, by result", ["result"], registry=self.registry
        )
        self.requests_total = Counter(
            "pdserve_metrics_adapter_requests_total", "metrics API requests, by HTTP code", ["code"], registry=self.registry
        )
        Gauge("pdserve_metrics_adapter_pods", "pods with a report (fresh or not yet swept)", registry=self.registry).set_function(
            lambda: len(self.store)
        )
        self._nc = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # NATS ------------------------------------------------------------------------------------------
    def on_report(self, data: bytes, bye: bool = False, subject: str | None = None) -> None:
        """Handle one LoadReport payload (from `subject`); a malformed one is counted and logged, never raised.

        A report must come from its own deployment's subjects: NATS lets a deployment's credentials
        publish only there, so a worker cannot speak for another InferenceService's pods (and move its
        autoscaler) by naming them in its report."""
        try:
            r = LoadReport.decode(data)
        except ProtocolError as e:
            self.reports_total.labels("malformed").inc()
            log.warning("ignoring a malformed LoadReport: %s", str(e)[:300])
            return
        if subject is not None and not _from_own_scope(r, subject):
            self.reports_total.labels("foreign").inc()
            log.warning("ignoring a LoadReport of %s/%s (scope %r) sent on %s", r.namespace, r.isvc, r.scope,
                        subject[:200])
            return
        if bye:
            self.store.remove(r)
            self.reports_total.labels("bye").inc()
        elif self.store.put(r):
            self.reports_total.labels("accepted").inc()
        else:
            self.reports_total.labels("no_pod").inc()

    @property
    def malformed_reports(self) -> int:
        return int(self.reports_total.labels("malformed")._value.get())

    async def connect_nats(self, creds: NatsCredentials) -> None:
        self._nc = await creds.connect(name="pdserve-metrics-adapter", max_reconnect_attempts=-1)

        async def on_load(msg):
            self.on_report(msg.data, subject=msg.subject)

        async def on_bye(msg):
            self.on_report(msg.data, bye=True, subject=msg.subject)

        await self._nc.subscribe(Subjects.LOAD_ANY, cb=on_load)
        await self._nc.subscribe(Subjects.BYE_ANY, cb=on_bye)
        await self._nc.flush(timeout=5)

    # HTTP ------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        r = app.router
        for p in ("/healthz", "/readyz", "/livez"):
            r.add_get(p, self._ok)
        r.add_get("/metrics", self._metrics)
        r.add_get(f"/apis/{CUSTOM_GROUP}/{VERSION}", self._custom_discovery)
        r.add_get(f"/apis/{CUSTOM_GROUP}/{VERSION}/namespaces/{{ns}}/pods/{{pod}}/{{metric}}", self._custom_pods)
        r.add_get(f"/apis/{EXTERNAL_GROUP}/{VERSION}", self._external_discovery)
        r.add_get(f"/apis/{EXTERNAL_GROUP}/{VERSION}/namespaces/{{ns}}/{{metric}}", self._external)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if request.path.startswith("/apis") and self.client_ca_file:
            peer = request.transport.get_extra_info("peercert") if request.transport else None
            if not peer:
                resp = _status(401, "Unauthorized", "a client certificate from the front-proxy CA is required")
                self.requests_total.labels("401").inc()
                return resp
        try:
            resp = await handler(request)
        except web.HTTPNotFound:
            resp = _status(404, "NotFound", f"the server could not find the requested resource ({request.path})")
        except web.HTTPMethodNotAllowed:
            resp = _status(405, "MethodNotAllowed", f"{request.method} is not supported on {request.path}")
        self.requests_total.labels(str(resp.status)).inc()
        return resp

    async def _ok(self, request):
        return web.Response(text="ok")

    async def _metrics(self, request):
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _custom_discovery(self, request):
        return web.json_response(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"{CUSTOM_GROUP}/{VERSION}",
                "resources": [
                    {"name": f"pods/{m}", "singularName": "", "namespaced": True, "kind": "MetricValueList", "verbs": ["get"]}
                    for m in METRICS
                ],
            }
        )

    async def _external_discovery(self, request):
        return web.json_response(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"{EXTERNAL_GROUP}/{VERSION}",
                "resources": [
                    {"name": m, "singularName": "", "namespaced": True, "kind": "ExternalMetricValueList", "verbs": ["get"]}
                    for m in METRICS
                ],
            }
        )

    def _entries(self, ns: str, metric: str, selector: str | None, short_labels: bool):
        mdef = METRICS.get(metric)
        if mdef is None:
            raise KeyError(metric)
        reqs = parse_selector(selector)
        return mdef, [
            e
            for e in self.store.fresh(ns)
            if (mdef.role is None or e.report.role == mdef.role) and matches(reqs, report_labels(e.report, short_labels))
        ]

    async def _custom_pods(self, request: web.Request):
        ns, pod, metric = request.match_info["ns"], request.match_info["pod"], request.match_info["metric"]
        selector = request.query.get("labelSelector")
        try:
            mdef, entries = self._entries(ns, metric, selector, short_labels=False)
        except KeyError:
            return _status(404, "NotFound", f"the server could not find the metric {metric} for pods")
        except SelectorError as e:
            return _status(400, "BadRequest", str(e))
        if pod != "*":
            entries = [e for e in entries if e.report.pod == pod]
            if not entries:
                return _status(404, "NotFound", f"the server could not find the metric {metric} for pods {pod}")
        items = [
            {
                "describedObject": {"kind": "Pod", "namespace": ns, "name": e.report.pod, "apiVersion": "/v1"},
                "metricName": metric,
                "timestamp": _rfc3339(e.received_wall),
                "value": quantity(mdef.read(e.report)),
                # No "selector": in v1beta1 it is a LabelSelector object, and the HPA needs none.
            }
            for e in sorted(entries, key=lambda e: e.report.pod)
        ]
        return web.json_response(
            {"kind": "MetricValueList", "apiVersion": f"{CUSTOM_GROUP}/{VERSION}", "metadata": {}, "items": items}
        )

    async def _external(self, request: web.Request):
        ns, metric = request.match_info["ns"], request.match_info["metric"]
        try:
            mdef, entries = self._entries(ns, metric, request.query.get("labelSelector"), short_labels=True)
        except KeyError:
            return _status(404, "NotFound", f"the server could not find the external metric {metric}")
        except SelectorError as e:
            return _status(400, "BadRequest", str(e))
        pools: dict[tuple[str, str], list[_Entry]] = {}
        for e in entries:
            pools.setdefault((e.report.isvc or "", e.report.pool or ""), []).append(e)
        items = []
        for (isvc, pool), es in sorted(pools.items()):
            vals = [mdef.read(e.report) for e in es]
            value = sum(vals) if mdef.aggregate == "sum" else sum(vals) / len(vals)
            items.append(
                {
                    "metricName": metric,
                    "metricLabels": {"isvc": isvc, "pool": pool},
                    "timestamp": _rfc3339(max(e.received_wall for e in es)),
                    "value": quantity(value),
                }
            )
        return web.json_response(
            {"kind": "ExternalMetricValueList", "apiVersion": f"{EXTERNAL_GROUP}/{VERSION}", "metadata": {}, "items": items}
        )

    # Lifecycle -------------------------------------------------------------------------------------
    def ssl_context(self, cert: str, key: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert, key)
        if self.client_ca_file:
            ctx.load_verify_locations(self.client_ca_file)
            ctx.verify_mode = ssl.CERT_OPTIONAL  # probes come without one; /apis demands it (middleware)
        return ctx

    async def start(self, host: str, port: int, cert: str, key: str) -> int:
        """Serve HTTPS on host:port (0: a free port); returns the port."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self.ssl_context(cert, key))
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def close(self) -> None:
        if self._nc is not None:
            try:
                await self._nc.drain()
            except Exception as e:  # NATS gone or reconnecting: nothing left to drain
                log.info("NATS drain skipped at shutdown: %s", type(e).__name__)
                await self._nc.close()
            self._nc = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def front_proxy_ca_from_cluster() -> str:
    """Write the apiserver's requestheader client CA (from its well-known ConfigMap) to a file; return the path."""
    import tempfile

    from kubernetes import client, config

    config.load_incluster_config()
    cm = client.CoreV1Api().read_namespaced_config_map("extension-apiserver-authentication", "kube-system")
    pem = (cm.data or {}).get("requestheader-client-ca-file")
    if not pem:
        raise SystemExit(
            "kube-system/extension-apiserver-authentication has no requestheader-client-ca-file: the apiserver "
            "runs without --requestheader-client-ca-file; drop --client-ca-from-cluster (metricsAdapter.requireFrontProxyCert=false)"
        )
    fd, path = tempfile.mkstemp(prefix="front-proxy-ca-", suffix=".crt")
    with open(fd, "w") as f:
        f.write(pem)
    return path


def main(argv: list[str] | None = None) -> int:
    """`pdserve metrics-adapter`: NATS credentials come from PDSERVE_NATS_USER/PDSERVE_NATS_PASSWORD."""
    ap = argparse.ArgumentParser(prog="pdserve metrics-adapter", description=__doc__.splitlines()[0])
    ap.add_argument("--nats-url", default=None, help="NATS URL (default: $PDSERVE_NATS_URL)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=6443)
    ap.add_argument("--cert", required=True, help="serving certificate (PEM)")
    ap.add_argument("--key", required=True, help="its private key (PEM)")
    ap.add_argument("--client-ca-file", default=None, help="front-proxy CA: require its client certificate on /apis")
    ap.add_argument(
        "--client-ca-from-cluster",
        action="store_true",
        help="in a pod: read the front-proxy CA from kube-system/extension-apiserver-authentication",
    )
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format='{"level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}')

    if args.client_ca_from_cluster:
        args.client_ca_file = front_proxy_ca_from_cluster()

    async def run() -> None:
        adapter = MetricsAdapter(client_ca_file=args.client_ca_file)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await adapter.connect_nats(NatsCredentials.from_env(args.nats_url))
        port = await adapter.start(args.host, args.port, args.cert, args.key)
        log.info("serving %s and %s on %s:%d", CUSTOM_GROUP, EXTERNAL_GROUP, args.host, port)
        await stop.wait()
        await adapter.close()

    asyncio.run(run())
    return 0
