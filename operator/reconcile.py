"""Reconciliation as pure functions: InferenceService -> desired child objects, children -> status.

Nothing here talks to the API server; `handlers.py` applies what these functions return.
Children of an InferenceService `<n>` (all with an owner reference to it and app.kubernetes.io/* labels):

  Deployment <n>-prefill, <n>-decode   GPU worker pools (`pdserve prefill|decode ...`)
  Deployment <n>-front                 OpenAI-compatible HTTP front (`pdserve front ...`)
  Service    <n>                       the endpoint (front), port spec.serving.port
  Service    <n>-decode                headless: stable DNS for decode pods' data/metrics ports
  HPA        <n>-prefill, <n>-decode   Pods-type custom metrics (autoscaling/v2 or v2beta2)
  PDB        <n>-prefill, <n>-decode   policy/v1 or policy/v1beta1
  Secret     <n>-nats                  copy of the chart's NATS credentials (pods cannot read
                                       a Secret in another namespace); only when the spec names none
"""
from __future__ import annotations

import base64
import copy
import math
from dataclasses import dataclass
from typing import Any

from .crd import GROUP, KIND, VERSION, apply_defaults

DEFAULT_IMAGE = "ghcr.io/pdserve/pdserve:0.1.0"
MODELS_DIR = "/models"
METRICS_PORT = 9100
FRONT_CONTAINER_PORT = 8000
POOLS = ("prefill", "decode")
# A stopping pod (rolling update, scale-down) first finishes what it holds: the workers' drain
# (PDSERVE_DRAIN_TIMEOUT_SECONDS) must end before the kubelet's SIGKILL, and the front keeps
# accepting until kube-proxy has taken it out of its Service (no Service routes to the workers:
# their `bye` on NATS stops the routers at once).
DRAIN_TIMEOUT_S = 25
FRONT_PRE_STOP_S = 5
TERMINATION_GRACE_S = FRONT_PRE_STOP_S + DRAIN_TIMEOUT_S + 10


@dataclass(frozen=True)
class OperatorConfig:
    """What the operator knows beyond the object: chart defaults and what the server offers."""

    image: str = DEFAULT_IMAGE
    nats_url: str = "nats://pdserve-nats:4222"
    # The chart's NATS credentials ({"user": ..., "password": ...}, plain text), copied into
    # the InferenceService's namespace; None when NATS runs without the chart's secret.
    nats_credentials: dict[str, str] | None = None
    hpa_api_version: str = "autoscaling/v2"
    pdb_api_version: str = "policy/v1"
    cluster_domain: str = "cluster.local"


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


def selector_labels(name: str, component: str) -> dict[str, str]:
    # Deployment selectors are immutable: only labels that never change for a pool.
    return {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


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
    if config.nats_credentials and not spec.get("nats", {}).get("url"):
        return f"{body['metadata']['name']}-nats", "user", "password"
    return None


def binary_bytes(quantity: str) -> int:
    """A quantity the CRD allows for sizes ("512Mi", "4Gi": an integer and a binary suffix) in bytes."""
    for i, suffix in enumerate(("Ki", "Mi", "Gi", "Ti"), 1):
        if quantity.endswith(suffix):
            return int(quantity[:-2]) << (10 * i)
    raise ValueError(f"not a binary quantity: {quantity!r}")


def _env(body: dict, spec: dict, config: OperatorConfig, pool: str) -> list[dict]:
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    env = [
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "POD_IP", **field("status.podIP")},
        {"name": "PDSERVE_ISVC", "value": body["metadata"]["name"]},
        {"name": "PDSERVE_POOL", "value": pool},
        {"name": "PDSERVE_MODEL_NAME", "value": served_model_name(body, spec)},
        {"name": "HOME", "value": "/tmp"},
        {"name": "PDSERVE_DRAIN_TIMEOUT_SECONDS", "value": str(DRAIN_TIMEOUT_S)},
    ]
    if pool in POOLS:
        kv, t = spec[pool]["kv"], spec["kvTransfer"]
        env += [
            {"name": "PDSERVE_KV_DTYPE", "value": kv["dtype"]},
            {"name": "PDSERVE_KV_BLOCK_SIZE", "value": str(kv["blockSize"])},
            {"name": "PDSERVE_KV_TRANSPORT", "value": t["transport"]},
            {"name": "PDSERVE_KV_COMPRESSION", "value": t["compression"]},
            {"name": "PDSERVE_KV_TIMEOUT_SECONDS", "value": str(t["timeoutSeconds"])},
            {"name": "PDSERVE_KV_FAILURE_POLICY", "value": t["failurePolicy"]},
            # idle KV segments kept in /dev/shm: half its bound, the rest for segments in use
            {"name": "PDSERVE_SHM_POOL_BYTES", "value": str(binary_bytes(t["shmSizeLimit"]) // 2)},
        ]
    pc = spec.get("prefixCache") or {}
    if pool == "front":
        env.append({"name": "PDSERVE_PREPOSITION", "value": "1" if pc.get("prepositioning", True) else "0"})
    if pool == "prefill":
        env += [
            {"name": "PDSERVE_PREPOSITION_BLOCKS",
             "value": str(pc.get("prepositionBudgetBlocks", 256) if pc.get("prepositioning", True) else 0)},
            {"name": "PDSERVE_PREFIX_OFFLOAD", "value": "1" if pc.get("offload") else "0"},
            {"name": "PDSERVE_PREFIX_OFFLOAD_TTL", "value": str(pc.get("offloadTTLSeconds", 3600))},
        ]
    nats = _nats_secret(body, spec, config)
    if nats:
        secret, ukey, pkey = nats
        env += [
            {"name": "PDSERVE_NATS_USER", "valueFrom": {"secretKeyRef": {"name": secret, "key": ukey}}},
            {"name": "PDSERVE_NATS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": secret, "key": pkey}}},
        ]
    api_key = spec["serving"].get("apiKeySecret")
    if api_key and pool == "front":
        env.append({"name": "PDSERVE_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": api_key["name"], "key": api_key["key"]}}})
    return env


def _command(spec: dict, config: OperatorConfig, pool: str) -> list[str]:
    model = f"{MODELS_DIR}/{spec['model']['path'].lstrip('/')}"
    nats_url = spec.get("nats", {}).get("url") or config.nats_url
    if pool == "front":
        return ["pdserve", "front", "--model", model, "--nats-url", nats_url,
                "--port", str(spec["serving"]["port"])]
    cmd = ["pdserve", pool, "--model", model, "--nats-url", nats_url,
           "--data-port", str(spec[pool]["dataPort"]), "--metrics-port", str(METRICS_PORT)]
    if pool == "decode":
        s = spec["speculation"]
        cmd += ["--spec-method", s["method"], "--spec-max-k", str(s["maxK"]),
                "--kv-compression", spec["kvTransfer"]["compression"]]
        if s["method"] == "draft" and s.get("draft"):
            cmd += ["--draft-model", f"{MODELS_DIR}/{s['draft']['path'].lstrip('/')}"]
    return cmd


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


def _pod_template(body: dict, spec: dict, config: OperatorConfig, pool: str) -> dict:
    name = body["metadata"]["name"]
    image = spec.get("image") or config.image
    pool_spec = spec[pool] if pool in POOLS else spec["front"]
    if pool in POOLS:
        ports = [{"name": "data", "containerPort": spec[pool]["dataPort"]},
                 {"name": "metrics", "containerPort": METRICS_PORT}]
        # /metrics answers once the model is loaded and NATS is connected (prefill dials out and has
        # no listening data port, so a TCP probe on it would never pass)
        probe = {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 5}
        gpus = pool_spec["gpus"]
    else:
        ports = [{"name": "http", "containerPort": spec["serving"]["port"]}]
        probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
        gpus = 0
    container = {
        "name": pool, "image": image, "imagePullPolicy": spec["imagePullPolicy"],
        "command": _command(spec, config, pool),
        "env": _env(body, spec, config, pool),
        "ports": ports,
        "readinessProbe": probe,
        "resources": _resources(pool_spec, gpus),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if pool == "front":
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(FRONT_PRE_STOP_S)]}}}
    # /dev/shm is memory: bounded, so the KV pools in it cannot grow past what the pod was given
    volumes: list[dict] = [{"name": "tmp", "emptyDir": {}},
                           {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                         "sizeLimit": spec["kvTransfer"]["shmSizeLimit"]}}]
    init: list[dict] = []
    model = spec["model"]
    if model.get("pvc"):
        volumes.insert(0, {"name": "models", "persistentVolumeClaim": {"claimName": model["pvc"], "readOnly": True}})
    elif model.get("image"):
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
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
    }
    if init:
        pod_spec["initContainers"] = init
    if pool in POOLS:
        if pool_spec.get("nodeSelector"):
            pod_spec["nodeSelector"] = dict(pool_spec["nodeSelector"])
        if pool_spec.get("tolerations"):
            pod_spec["tolerations"] = copy.deepcopy(pool_spec["tolerations"])
    meta = {"labels": {**labels(name, pool), **selector_labels(name, pool)},
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}
            if pool in POOLS else {}}
    override = pool_spec.get("podTemplate") or {}
    if override.get("spec"):
        pod_spec = _merge(pod_spec, override["spec"])
    om = override.get("metadata") or {}
    meta["labels"] = {**om.get("labels", {}), **meta["labels"]}  # ours win: selectors depend on them
    meta["annotations"] = {**meta["annotations"], **om.get("annotations", {})}
    return {"metadata": meta, "spec": pod_spec}


def _deployment(body: dict, spec: dict, config: OperatorConfig, pool: str) -> dict:
    name = body["metadata"]["name"]
    if pool in POOLS:
        a = spec[pool]["autoscaling"]
        replicas = a["minReplicas"] if a["enabled"] else spec[pool]["replicas"]
    else:
        replicas = spec["front"]["replicas"]
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
    d = max(decode_replicas, 1)
    new_lo = lo if "min" not in ratio else min(max(lo, math.ceil(ratio["min"] * d - 1e-9)), hi)
    new_hi = hi if "max" not in ratio else max(min(hi, math.floor(ratio["max"] * d + 1e-9)), new_lo)
    return new_lo, new_hi


def _hpa(body: dict, spec: dict, config: OperatorConfig, pool: str, bounds: tuple[int, int]) -> dict:
    a = spec[pool]["autoscaling"]
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
        "spec": {"maxUnavailable": spec[pool]["disruptionBudget"]["maxUnavailable"],
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
                 "ports": [{"name": "data", "port": spec["decode"]["dataPort"], "targetPort": "data"},
                           {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]},
    }
    return [front, decode]


def desired_children(body: dict, config: OperatorConfig, observed: dict[str, int] | None = None) -> list[dict]:
    """All child objects one InferenceService should have, in apply order.

    body: the InferenceService (metadata.name/namespace/uid, spec). observed: current replica
    counts per pool ({"decode": 3}) used only for the prefill:decode ratio bounds."""
    spec = apply_defaults(body["spec"])
    observed = observed or {}
    out: list[dict] = []
    if _nats_secret(body, spec, config) and not spec.get("nats", {}).get("credentialsSecret"):
        creds = config.nats_credentials or {}
        out.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": _meta(body, f"{body['metadata']['name']}-nats", None),
                    "data": {k: base64.b64encode(creds.get(k, "").encode()).decode() for k in ("user", "password")}})
    for pool in (*POOLS, "front"):
        out.append(_deployment(body, spec, config, pool))
    out += _services(body, spec)
    for pool in POOLS:
        a = spec[pool]["autoscaling"]
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
    return pool in POOLS and apply_defaults(spec)[pool]["autoscaling"]["enabled"]


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
                   config: OperatorConfig | None = None) -> dict:
    """The InferenceService status from its Deployments (as read from the server) and the
    cross-field validation errors. now: RFC 3339 time used for changed conditions."""
    config = config or OperatorConfig()
    spec = apply_defaults(body["spec"])
    generation = body["metadata"].get("generation")
    old = (body.get("status") or {}).get("conditions") or []
    status: dict[str, Any] = {"observedGeneration": generation, "endpoint": endpoint(body, spec, config)}
    not_ready, progressing, failed = [], [], []
    for pool in (*POOLS, "front"):
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
