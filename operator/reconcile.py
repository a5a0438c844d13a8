"""Reconciliation as pure functions: InferenceService -> desired child objects, children -> status.

Nothing here talks to the API server; `handlers.py` applies what these functions return.
Children of an InferenceService `<n>` (all with an owner reference to it and app.kubernetes.io/* labels):

  Deployment <n>-prefill, <n>-decode   worker pools (`pdserve prefill|decode ...`, their arguments
                                       rendered from pdserve.config's models, which the workers parse)
  Deployment <n>-front                 OpenAI-compatible HTTP front (`pdserve front ...`)
  Deployment <n>-draftpool             with spec.speculation.draftPool: the draft pool (`pdserve draftpool`),
                                       which decode pods (`--draft-pool`) ask over NATS; it listens on
                                       no port but its metrics, so no Service routes to it
  Service    <n>                       the endpoint (front), port spec.serving.port
  Service    <n>-decode                headless: stable DNS for decode pods' data/metrics ports
  HPA        <n>-prefill, <n>-decode,  Pods-type custom metrics (autoscaling/v2 or v2beta2)
             <n>-draftpool
  PDB        <n>-prefill, <n>-decode,  policy/v1 or policy/v1beta1
             <n>-draftpool
  NetworkPolicy <n>-workers            ingress to the workers: data and metrics ports from the
                                       InferenceService's own pods (metrics also from the scraper's
                                       namespace, when the chart names one), nothing else
  NetworkPolicy <n>-front              ingress to the front: its HTTP port, from anywhere
  Secret     <n>-nats                  its NATS credentials, when the spec names none: its own user,
                                       confined to its scope (`natsusers`), or with an external NATS
                                       a copy of the chart's (pods cannot read a Secret in another
                                       namespace); and the NATS server's CA when NATS speaks TLS
"""
from __future__ import annotations

import base64
import copy
import math
import re
from dataclasses import dataclass
from typing import Any

from pdserve.autoscale.policy import prefill_range
from pdserve.basetypes import selector_labels
from pdserve.config import COMMANDS, OperatorSettings, Settings, options, to_args

from .crd import GROUP, KIND, VERSION, apply_defaults
from .natsusers import user_name

MODELS_DIR = "/models"
METRICS_PORT = 9100
FRONT_CONTAINER_PORT = 8000
POOLS = ("prefill", "decode")
DRAFT_POOL = "draftpool"
# A stopping pod (rolling update, scale-down) first finishes what it holds: its drain (the
# process's `drain_timeout` setting) ends before the kubelet's SIGKILL, and the front keeps
# accepting until kube-proxy has taken it out of its Service (no Service routes to the workers:
# their `bye` on NATS stops the routers at once).
FRONT_PRE_STOP_S = 5
GRACE_MARGIN_S = 10


@dataclass(frozen=True)
class OperatorConfig:
    """What the operator knows beyond the object: chart defaults and what the server offers."""

    image: str = OperatorSettings.model_fields["image"].default
    nats_url: str = OperatorSettings.model_fields["nats_url"].default
    # The chart's NATS credentials ({"user": ..., "password": ...}, plain text), copied into
    # the InferenceService's namespace; None when NATS runs without the chart's secret.
    nats_credentials: dict[str, str] | None = None
    # The chart's NATS server gives each InferenceService a user of its own (`natsusers`): its
    # password is then desired_children's `nats_password`, and the chart's credentials are not copied.
    nats_users: bool = False
    nats_tls_ca: str | None = None  # PEM of the CA that signs the NATS server's certificate (TLS to NATS)
    hpa_api_version: str = "autoscaling/v2"
    pdb_api_version: str = "policy/v1"
    cluster_domain: str = "cluster.local"
    metrics_scraper_namespace: str | None = None  # where the Prometheus that scrapes workers' /metrics runs


def labels(name: str, component: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "pdserve-operator",
        "app.kubernetes.io/part-of": "pdserve",
        f"{GROUP}/inferenceservice": name,
    }
    if component:
        out["app.kubernetes.io/component"] = component
    return out


def owner_reference(body: dict) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": body["metadata"]["name"],
            "uid": body["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def _meta(body: dict, name: str, component: str | None) -> dict:
    return {"name": name, "namespace": body["metadata"]["namespace"],
            "labels": labels(body["metadata"]["name"], component),
            "ownerReferences": [owner_reference(body)]}


def served_model_name(body: dict, spec: dict) -> str:
    return spec["model"].get("name") or body["metadata"]["name"]


def endpoint(body: dict, spec: dict, config: OperatorConfig) -> str:
    m = body["metadata"]
    return f"http://{m['name']}.{m['namespace']}.svc.{config.cluster_domain}:{spec['serving']['port']}"


def _nats_secret(body: dict, spec: dict, config: OperatorConfig) -> tuple[str, str, str] | None:
    ref = spec.get("nats", {}).get("credentialsSecret")
    if ref:
        return ref["name"], ref.get("userKey", "user"), ref.get("passwordKey", "password")
    if _own_nats_secret(spec, config):
        return f"{body['metadata']['name']}-nats", "user", "password"
    return None


def _own_nats_secret(spec: dict, config: OperatorConfig) -> bool:
    """Whether the operator writes the InferenceService's NATS Secret: it uses the chart's NATS and
    names no credentials of its own."""
    nats = spec.get("nats", {})
    return (bool(config.nats_credentials) or config.nats_users) and not nats.get("url") \
        and not nats.get("credentialsSecret")


NATS_CA_DIR = "/etc/pdserve/nats"


def _nats_ca(spec: dict, config: OperatorConfig) -> bool:
    """Whether the pods get the NATS server's CA (in the operator's Secret, key ca.crt)."""
    return bool(config.nats_tls_ca) and _own_nats_secret(spec, config)


def binary_bytes(quantity: str) -> int:
    """A quantity the CRD allows for sizes ("512Mi", "4Gi": an integer and a binary suffix) in bytes."""
    for i, suffix in enumerate(("Ki", "Mi", "Gi", "Ti"), 1):
        if quantity.endswith(suffix):
            return int(quantity[:-2]) << (10 * i)
    raise ValueError(f"not a binary quantity: {quantity!r}")


def cpu_cores(quantity: int | float | str) -> float:
    """A CPU quantity ("2", "1500m", 0.5, "1e3m") in cores."""
    q = str(quantity).strip()
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([-+]?[0-9]+))?(m|k|M|G)?", q)
    if not m:
        raise ValueError(f"{quantity!r} is not a CPU quantity (write e.g. 2, 0.5 or 1500m)")
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}[m.group(3)]
    return float(m.group(1)) * 10 ** int(m.group(2) or 0) * scale


def draft_pool(spec: dict) -> dict | None:
    """spec.speculation.draftPool of a defaulted spec when the InferenceService runs a draft pool, else None."""
    pool = (spec.get("speculation") or {}).get("draftPool")
    return pool if pool and pool.get("enabled", True) else None


def pool_spec(spec: dict, pool: str) -> dict:
    """The part of a defaulted spec that describes `pool` (prefill, decode, front, draftpool)."""
    return spec["speculation"]["draftPool"] if pool == DRAFT_POOL else spec[pool]


def scaled_pools(spec: dict) -> tuple[str, ...]:
    """The pools of a defaulted spec that get an HPA (when autoscaled) and a disruption budget."""
    return (*POOLS, DRAFT_POOL) if draft_pool(spec) else POOLS


def deployed_pools(spec: dict) -> tuple[str, ...]:
    """Every pool (a Deployment each) of a defaulted spec: prefill, decode, front, and the draft pool if any."""
    return (*POOLS, "front", DRAFT_POOL) if draft_pool(spec) else (*POOLS, "front")


def _compute(pool_spec: dict) -> dict:
    """Device and torch threads of a worker pool: CUDA when the pool has GPUs; threads from the
    CPU the pod may use (its limit, else its request), rounded down, at least 1."""
    res = pool_spec.get("resources") or {}
    cpu = (res.get("limits") or {}).get("cpu", (res.get("requests") or {}).get("cpu"))
    out: dict[str, Any] = {"device": "cuda" if pool_spec["gpus"] else "cpu"}
    if cpu is not None:
        out["threads"] = max(1, math.floor(cpu_cores(cpu) + 1e-9))
    return out


def settings(body: dict, spec: dict, config: OperatorConfig, pool: str) -> Settings:
    """What one pool's processes run with, as the `pdserve.config` model its command parses.

    spec: the defaulted InferenceService spec. pool: "prefill", "decode", "front" or "draftpool". Raises
    pydantic's ValidationError when the spec asks for a value the pool's settings refuse."""
    t, pc, dis = spec["kvTransfer"], spec.get("prefixCache") or {}, spec.get("disaggregation") or {}
    nats: dict[str, Any] = {"url": spec.get("nats", {}).get("url") or config.nats_url}
    if _nats_ca(spec, config):
        nats["tls_ca"] = f"{NATS_CA_DIR}/ca.crt"
    values: dict[str, Any] = dict(
        model=f"{MODELS_DIR}/{spec['model']['path'].lstrip('/')}", served_model_name=served_model_name(body, spec),
        isvc=body["metadata"]["name"], pool=pool, nats=nats)
    if pool == "front":
        values.update(host="0.0.0.0", port=spec["serving"]["port"], kv_failure_policy=t["failurePolicy"],
                      migration_limit=spec["serving"].get("migrationLimit", 2),
                      preposition=pc.get("prepositioning", True), kv_dtype=spec["decode"]["kv"]["dtype"])
    elif pool == DRAFT_POOL:
        dp = spec["speculation"].get("draftPool") or {}
        index = dp.get("suffixIndex") or {}
        given = {"min_n": index.get("minN"), "max_n": index.get("maxN"), "max_tokens": index.get("maxTokens"),
                 "share_tenants": index.get("shareTenants"), "max_queue": dp.get("maxQueue")}
        values.update(metrics_port=METRICS_PORT, **{k: v for k, v in given.items() if v is not None})
    else:
        p = spec[pool]
        values.update(dtype=p["kv"]["dtype"], block_size=p["kv"]["blockSize"], data_port=p["dataPort"],
                      metrics_port=METRICS_PORT, **_compute(p))
    if pool == "prefill":
        values.update(
            preposition_budget_blocks=pc.get("prepositionBudgetBlocks", 256) if pc.get("prepositioning", True) else 0,
            prefix_offload=bool(pc.get("offload")), prefix_offload_ttl=pc.get("offloadTTLSeconds", 3600),
            defer_queue_tokens=dis.get("deferQueueTokens"),
            kv={"transports": t["transport"], "compression": t["compression"], "timeout": t["timeoutSeconds"]})
    if pool == "decode":
        s = spec["speculation"]
        draft = s.get("draft") if s["method"] == "draft" else None
        dp = draft_pool(spec)
        values.update(
            data_host="0.0.0.0", local_prefill_chunk=dis.get("localPrefillChunk", 64),
            spec={"method": s["method"], "max_k": s["maxK"],
                  **({"draft_model": f"{MODELS_DIR}/{draft['path'].lstrip('/')}"} if draft else {}),
                  **({"draft_pool": True} if dp else {}),
                  **({"draft_pool_timeout": dp["timeoutSeconds"]} if dp and "timeoutSeconds" in dp else {})},
            # idle KV segments kept in /dev/shm: half its bound, the rest for segments in use
            kv={"compression": t["compression"], "timeout": t["timeoutSeconds"],
                "shm_pool_bytes": binary_bytes(t["shmSizeLimit"]) // 2})
    return COMMANDS[pool].model_validate(values)


# What the downward API hands a pod, by the setting that reads it.
_DOWNWARD = {"pod_name": "metadata.name", "namespace": "metadata.namespace", "advertise_host": "status.podIP"}


def _env(body: dict, spec: dict, config: OperatorConfig, cfg: Settings) -> list[dict]:
    """The container's environment: the downward API and secrets, which never go in arguments."""
    kind = type(cfg)
    names = {o.path: o.env for o in options(kind)}
    env = [{"name": names[path], "valueFrom": {"fieldRef": {"fieldPath": field}}}
           for path, field in _DOWNWARD.items() if path in names]
    env.append({"name": "HOME", "value": "/tmp"})
    nats = _nats_secret(body, spec, config)
    if nats:
        secret, ukey, pkey = nats
        env += [{"name": names["nats.user"], "valueFrom": {"secretKeyRef": {"name": secret, "key": ukey}}},
                {"name": names["nats.password"], "valueFrom": {"secretKeyRef": {"name": secret, "key": pkey}}}]
    api_key = spec["serving"].get("apiKeySecret")
    if api_key and "api_key" in names:
        env.append({"name": names["api_key"],
                    "valueFrom": {"secretKeyRef": {"name": api_key["name"], "key": api_key["key"]}}})
    return env


def _resources(pool_spec: dict, gpus: int) -> dict:
    res = copy.deepcopy(pool_spec.get("resources") or {})
    out = {k: {n: str(v) for n, v in res.get(k, {}).items()} for k in ("requests", "limits") if res.get(k)}
    if gpus:
        # Extended resources are requested through limits (requests default to them).
        out.setdefault("limits", {})["nvidia.com/gpu"] = str(gpus)
        out.get("requests", {}).pop("nvidia.com/gpu", None)
    return out


def _merge(base: Any, override: Any) -> Any:
    """Deep-merge a pod-spec override: dicts recursively; lists of named items (containers,
    volumes, env) by name; anything else replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(override, list)
            and all(isinstance(x, dict) and "name" in x for x in base + override)):
        out = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out)}
        for item in override:
            if item["name"] in index:
                out[index[item["name"]]] = _merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(override)


# Ports name their protocol: server-side apply keys port lists by (port, protocol), and servers
# before 1.22 refuse an applied port without one.
def _pod_template(body: dict, spec: dict, config: OperatorConfig, pool: str) -> dict:
    name = body["metadata"]["name"]
    image = spec.get("image") or config.image
    ps = pool_spec(spec, pool)
    # The draft pool reads no weights (it drafts from reported tokens) and lands no KV.
    model_pod = pool != DRAFT_POOL
    if pool != "front":
        ports = [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]
        if pool in POOLS:
            ports.insert(0, {"name": "data", "containerPort": spec[pool]["dataPort"], "protocol": "TCP"})
        # /metrics answers once the model is loaded (the draft pool: once it subscribed) and NATS is
        # connected (prefill dials out and has no listening data port, so a TCP probe on it would never pass)
        probe = {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 5}
        gpus = ps.get("gpus", 0)
    else:
        ports = [{"name": "http", "containerPort": spec["serving"]["port"], "protocol": "TCP"}]
        probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
        gpus = 0
    cfg = settings(body, spec, config, pool)
    container = {
        "name": pool, "image": image, "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["pdserve", pool], "args": to_args(cfg),
        "env": _env(body, spec, config, cfg),
        "ports": ports,
        "readinessProbe": probe,
        "resources": _resources(ps, gpus),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "dshm", "mountPath": "/dev/shm"}] if model_pod else
                        [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if pool == "front":
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(FRONT_PRE_STOP_S)]}}}
    # /dev/shm is memory: bounded, so the KV pools in it cannot grow past what the pod was given
    volumes: list[dict] = [{"name": "tmp", "emptyDir": {}}]
    if model_pod:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     "sizeLimit": spec["kvTransfer"]["shmSizeLimit"]}})
    init: list[dict] = []
    model = spec["model"]
    if model_pod and model.get("pvc"):
        volumes.insert(0, {"name": "models", "persistentVolumeClaim": {"claimName": model["pvc"], "readOnly": True}})
    elif model_pod and model.get("image"):
        # No image volumes before Kubernetes 1.31: copy the model image's /models into an emptyDir.
        volumes.insert(0, {"name": "models", "emptyDir": {}})
        init.append({"name": "fetch-model", "image": model["image"], "imagePullPolicy": spec["imagePullPolicy"],
                     "command": ["sh", "-c", "cp -a /models/. /mnt/models/"],
                     "volumeMounts": [{"name": "models", "mountPath": "/mnt/models"}],
                     "securityContext": container["securityContext"]})
    pod_spec: dict[str, Any] = {
        "containers": [container], "volumes": volumes,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": (FRONT_PRE_STOP_S if pool == "front" else 0)
        + math.ceil(cfg.drain_timeout) + GRACE_MARGIN_S,
    }
    if init:
        pod_spec["initContainers"] = init
    if _nats_ca(spec, config):
        volumes.append({"name": "nats-ca", "secret": {"secretName": f"{name}-nats",
                                                      "items": [{"key": "ca.crt", "path": "ca.crt"}]}})
        container["volumeMounts"].append({"name": "nats-ca", "mountPath": NATS_CA_DIR, "readOnly": True})
    if pool != "front":
        if ps.get("nodeSelector"):
            pod_spec["nodeSelector"] = dict(ps["nodeSelector"])
        if ps.get("tolerations"):
            pod_spec["tolerations"] = copy.deepcopy(ps["tolerations"])
    meta = {"labels": {**labels(name, pool), **selector_labels(name, pool)},
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}
            if pool != "front" else {}}
    override = ps.get("podTemplate") or {}
    if override.get("spec"):
        pod_spec = _merge(pod_spec, override["spec"])
        for c in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
            for port in c.get("ports") or []:
                if isinstance(port, dict):
                    port.setdefault("protocol", "TCP")  # the server's default, which apply needs stated
    om = override.get("metadata") or {}
    meta["labels"] = {**om.get("labels", {}), **meta["labels"]}  # ours win: selectors depend on them
    meta["annotations"] = {**meta["annotations"], **om.get("annotations", {})}
    return {"metadata": meta, "spec": pod_spec}


def _deployment(body: dict, spec: dict, config: OperatorConfig, pool: str) -> dict:
    name = body["metadata"]["name"]
    ps = pool_spec(spec, pool)
    if pool == "front":
        replicas = ps["replicas"]
    else:
        a = ps["autoscaling"]
        replicas = a["minReplicas"] if a["enabled"] else ps["replicas"]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(body, f"{name}-{pool}", pool),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name, pool)},
            # Add capacity before removing any, so a rolling change never drops serving capacity.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": _pod_template(body, spec, config, pool),
        },
    }


def prefill_bounds_for_ratio(spec: dict, decode_replicas: int) -> tuple[int, int]:
    """Prefill HPA (min, max) keeping prefill:decode within spec.autoscaling.prefillDecodeRatio.

    Decode is the anchor (its KV capacity is the scarce resource); prefill's bounds follow the
    observed decode replica count, clamped to the prefill pool's own min/max."""
    a = spec["prefill"]["autoscaling"]
    lo, hi = a["minReplicas"], a["maxReplicas"]
    ratio = spec.get("autoscaling", {}).get("prefillDecodeRatio") or {}
    fewest, most = prefill_range(max(decode_replicas, 1), ratio.get("min"), ratio.get("max"))
    new_lo = lo if fewest is None else min(max(lo, fewest), hi)
    new_hi = hi if most is None else max(min(hi, most), new_lo)
    return new_lo, new_hi


def _hpa(body: dict, spec: dict, config: OperatorConfig, pool: str, bounds: tuple[int, int]) -> dict:
    a = pool_spec(spec, pool)["autoscaling"]
    target = a["metric"]["targetAverageValue"]
    return {
        "apiVersion": config.hpa_api_version, "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(body, f"{body['metadata']['name']}-{pool}", pool),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": f"{body['metadata']['name']}-{pool}"},
            "minReplicas": bounds[0], "maxReplicas": bounds[1],
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": a["metric"]["name"]},
                "target": {"type": "AverageValue", "averageValue": str(target)}}}],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": a["scaleDownStabilizationSeconds"]}},
        },
    }


def _pdb(body: dict, spec: dict, config: OperatorConfig, pool: str) -> dict:
    return {
        "apiVersion": config.pdb_api_version, "kind": "PodDisruptionBudget",
        "metadata": _meta(body, f"{body['metadata']['name']}-{pool}", pool),
        "spec": {"maxUnavailable": pool_spec(spec, pool)["disruptionBudget"]["maxUnavailable"],
                 "selector": {"matchLabels": selector_labels(body["metadata"]["name"], pool)}},
    }


def _services(body: dict, spec: dict) -> list[dict]:
    name = body["metadata"]["name"]
    port = spec["serving"]["port"]
    front = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(body, name, "front"),
        "spec": {"type": spec["serving"]["serviceType"], "selector": selector_labels(name, "front"),
                 "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]},
    }
    decode = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(body, f"{name}-decode", "decode"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": False,
                 "selector": selector_labels(name, "decode"),
                 "ports": [{"name": "data", "port": spec["decode"]["dataPort"], "targetPort": "data", "protocol": "TCP"},
                           {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]},
    }
    return [front, decode]


def _network_policies(body: dict, spec: dict, config: OperatorConfig) -> list[dict]:
    """Why the operator and not the chart: the ports and pod labels are each InferenceService's own.
    The workers take connections only from their own deployment's pods (prefill dials decode's data
    port); the kubelet's probes come from the node, which NetworkPolicy does not govern. Egress stays
    open: workers dial NATS and each other, wherever NATS runs."""
    name = body["metadata"]["name"]
    own = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": name}}}
    data = sorted({spec[pool]["dataPort"] for pool in POOLS})
    ingress = [{"from": [own], "ports": [{"protocol": "TCP", "port": p} for p in (*data, METRICS_PORT)]}]
    if config.metrics_scraper_namespace:
        scraper = {"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": config.metrics_scraper_namespace}}}
        ingress.append({"from": [scraper], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]})
    workers = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(body, f"{name}-workers", None),
        "spec": {"podSelector": {"matchLabels": own["podSelector"]["matchLabels"], "matchExpressions": [
                     {"key": "app.kubernetes.io/component", "operator": "In", "values": [*POOLS, DRAFT_POOL]}]},
                 "policyTypes": ["Ingress"], "ingress": ingress},
    }
    front = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(body, f"{name}-front", "front"),
        "spec": {"podSelector": {"matchLabels": selector_labels(name, "front")}, "policyTypes": ["Ingress"],
                 "ingress": [{"ports": [{"protocol": "TCP", "port": spec["serving"]["port"]}]}]},
    }
    return [workers, front]


def desired_children(body: dict, config: OperatorConfig, observed: dict[str, int] | None = None,
                     nats_password: str | None = None) -> list[dict]:
    """All child objects one InferenceService should have, in apply order.

    body: the InferenceService (metadata.name/namespace/uid, spec). observed: current replica
    counts per pool ({"decode": 3}) used only for the prefill:decode ratio bounds. nats_password:
    its NATS user's password, where the chart's NATS has a user per InferenceService."""
    spec = apply_defaults(body["spec"])
    observed = observed or {}
    out: list[dict] = []
    if _own_nats_secret(spec, config):
        m = body["metadata"]
        if config.nats_users:
            if not nats_password:
                raise ValueError("an InferenceService's own NATS user needs its password")
            creds = {"user": user_name(m["namespace"], m["name"]), "password": nats_password}
        else:
            creds = config.nats_credentials or {}
        data = {k: creds.get(k, "") for k in ("user", "password")}
        if config.nats_tls_ca:
            data["ca.crt"] = config.nats_tls_ca
        out.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": _meta(body, f"{m['name']}-nats", None),
                    "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}})
    for pool in deployed_pools(spec):
        out.append(_deployment(body, spec, config, pool))
    out += _services(body, spec)
    out += _network_policies(body, spec, config)
    for pool in scaled_pools(spec):
        a = pool_spec(spec, pool)["autoscaling"]
        if a["enabled"]:
            bounds = (a["minReplicas"], a["maxReplicas"])
            if pool == "prefill":
                decode_now = observed.get("decode", spec["decode"]["autoscaling"]["minReplicas"]
                                          if spec["decode"]["autoscaling"]["enabled"] else spec["decode"]["replicas"])
                bounds = prefill_bounds_for_ratio(spec, decode_now)
            out.append(_hpa(body, spec, config, pool, bounds))
        out.append(_pdb(body, spec, config, pool))
    return out


def autoscaled(spec: dict, pool: str) -> bool:
    """True when an HPA owns `pool`'s replica count (the operator must then not overwrite it)."""
    spec = apply_defaults(spec)
    return pool in scaled_pools(spec) and pool_spec(spec, pool)["autoscaling"]["enabled"]


# ---------------------------------------------------------------- status

def _condition(old: list[dict], type_: str, status: bool, reason: str, message: str, now: str,
               generation: int | None) -> dict:
    s = "True" if status else "False"
    prev = next((c for c in old if c.get("type") == type_), None)
    since = prev["lastTransitionTime"] if prev and prev.get("status") == s and prev.get("lastTransitionTime") else now
    c = {"type": type_, "status": s, "reason": reason, "lastTransitionTime": since}
    if message:  # an empty string would be sent as null by some clients; absent is clearer
        c["message"] = message
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def compute_status(body: dict, deployments: dict[str, dict | None], errors: list[str], now: str,
                   config: OperatorConfig | None = None, refused: list[tuple[str, str]] = ()) -> dict:
    """The InferenceService status from its Deployments (as read from the server), the validation
    errors, and the children the server refused ((its reason, message) each). now: RFC 3339 time
    used for changed conditions."""
    config = config or OperatorConfig()
    spec = apply_defaults(body["spec"])
    generation = body["metadata"].get("generation")
    old = (body.get("status") or {}).get("conditions") or []
    status: dict[str, Any] = {"observedGeneration": generation, "endpoint": endpoint(body, spec, config)}
    not_ready, progressing, failed = [], [], []
    for pool in deployed_pools(spec):
        d = deployments.get(pool)
        desired = ((d or {}).get("spec") or {}).get("replicas", 0) or 0
        st = (d or {}).get("status") or {}
        ready = st.get("readyReplicas", 0) or 0
        status[pool] = {"desiredReplicas": desired, "readyReplicas": ready, "replicas": f"{ready}/{desired}"}
        if d is None:
            not_ready.append(f"{pool}: Deployment missing")
            progressing.append(pool)
            continue
        if ready < desired or desired == 0:
            not_ready.append(f"{pool}: {ready}/{desired} ready")
        updated = st.get("updatedReplicas", 0) or 0
        if st.get("observedGeneration", 0) < d["metadata"].get("generation", 0) or updated < desired:
            progressing.append(pool)
        for c in st.get("conditions") or []:
            if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
                failed.append(f"{pool}: {c.get('message', 'progress deadline exceeded')}")
            if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
                failed.append(f"{pool}: {c.get('message', 'replica failure')}")
    if errors:
        ready_c = _condition(old, "Ready", False, "InvalidSpec", "; ".join(errors), now, generation)
        degraded = _condition(old, "Degraded", True, "InvalidSpec", "; ".join(errors), now, generation)
    elif refused:
        message = "; ".join(m for _, m in refused)
        ready_c = _condition(old, "Ready", False, "ChildRefused", message, now, generation)
        degraded = _condition(old, "Degraded", True, refused[0][0], message, now, generation)
    else:
        ready_c = _condition(old, "Ready", not not_ready, "PoolsReady" if not not_ready else "PoolsNotReady",
                             "all pools ready" if not not_ready else "; ".join(not_ready), now, generation)
        degraded = _condition(old, "Degraded", bool(failed), "PoolFailure" if failed else "AsExpected",
                              "; ".join(failed), now, generation)
    prog = _condition(old, "Progressing", bool(progressing) and not errors,
                      "RollingOut" if progressing and not errors else "Stable",
                      f"rolling out: {', '.join(progressing)}" if progressing and not errors else "", now, generation)
    status["conditions"] = [ready_c, prog, degraded]
    status["ready"] = ready_c["status"]
    return status
