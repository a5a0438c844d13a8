"""kopf handlers: thin wrappers that apply what `reconcile.py` computes and keep status current.

- create/update/resume -> apply the desired children (resume repairs drift after a restart; a
  child Deployment deleted by hand is recreated at once). No timers or deletion handlers: both
  would need a finalizer, and an InferenceService must stay deletable with the operator gone;
- Deployment events of our children -> InferenceService status, and prefill HPA bounds when a
  prefill:decode ratio is set;
- validating admission webhook -> `validation.validate_spec` (same function the reconciler uses);
- delete -> nothing to do: every child has an owner reference, the garbage collector removes them.

Configuration comes from the environment (set by the chart, or by `pdserve operator` flags):
PDSERVE_IMAGE, PDSERVE_NATS_URL, PDSERVE_NATS_SECRET (name; in PDSERVE_NATS_SECRET_NAMESPACE or the
operator's POD_NAMESPACE), PDSERVE_WEBHOOK_CERT / PDSERVE_WEBHOOK_KEY / PDSERVE_WEBHOOK_PORT /
PDSERVE_WEBHOOK_ADDR (serve the validating webhook over TLS when a certificate is given).
"""
from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import logging
import os
from typing import Any

import kopf
from kubernetes import client, config as kconfig

from .crd import GROUP, PLURAL, VERSION, apply_defaults
from .kube import Kube
from .reconcile import POOLS, OperatorConfig, autoscaled, compute_status, desired_children, prefill_bounds_for_ratio
from .validation import validate_spec

ISVC_API = f"{GROUP}/{VERSION}"
MANAGED = {"app.kubernetes.io/managed-by": "pdserve-operator"}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api_client() -> client.ApiClient:
    cfg = client.Configuration()
    try:
        kconfig.load_incluster_config(client_configuration=cfg)
    except kconfig.ConfigException:
        # KUBECONFIG read now, not at import time of kubernetes.config (which caches the default).
        kconfig.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg)
    return client.ApiClient(cfg)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # kopf's own parsers read KUBECONFIG when called (the client library fixes it at import time).
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    # Kubernetes events only for warnings and errors; successes stay in the log.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 120
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.progress_storage = kopf.SmartProgressStorage(prefix=GROUP)
    kube = Kube(_api_client())
    memo.kube = kube
    hpa = "autoscaling/v2" if "v2" in kube.served_versions("autoscaling") else "autoscaling/v2beta2"
    pdb = "policy/v1" if "v1" in kube.served_versions("policy") else "policy/v1beta1"
    memo.base_config = OperatorConfig(
        image=os.environ.get("PDSERVE_IMAGE") or OperatorConfig.image,
        nats_url=os.environ.get("PDSERVE_NATS_URL") or OperatorConfig.nats_url,
        hpa_api_version=hpa, pdb_api_version=pdb)
    secret = os.environ.get("PDSERVE_NATS_SECRET")
    memo.nats_secret = (os.environ.get("PDSERVE_NATS_SECRET_NAMESPACE") or os.environ.get("POD_NAMESPACE")
                        or "default", secret) if secret else None
    logger.info(f"pdserve operator: HPA {hpa}, PDB {pdb}, NATS {memo.base_config.nats_url}")
    cert, key = os.environ.get("PDSERVE_WEBHOOK_CERT"), os.environ.get("PDSERVE_WEBHOOK_KEY")
    if cert and key:
        settings.admission.server = kopf.WebhookServer(
            addr=os.environ.get("PDSERVE_WEBHOOK_ADDR", "0.0.0.0"),
            port=int(os.environ.get("PDSERVE_WEBHOOK_PORT", "9443")),
            certfile=cert, pkeyfile=key)
    else:
        # kopf refuses to start with admission handlers but no server; with the webhook disabled
        # (chart webhook.enabled=false), serve nothing and rely on the reconciler's validation.
        settings.admission.server = _no_admission_server


async def _no_admission_server(fn: Any) -> Any:
    await asyncio.Event().wait()
    yield  # never reached: makes this an async generator, the shape kopf expects


def _config(memo: kopf.Memo) -> OperatorConfig:
    """The operator config with the chart's NATS credentials read now (they may rotate)."""
    base: OperatorConfig = memo.base_config
    if not memo.nats_secret:
        return base
    ns, name = memo.nats_secret
    secret = memo.kube.get("v1", "Secret", ns, name)
    if not secret:
        raise kopf.TemporaryError(f"NATS credentials Secret {ns}/{name} not found", delay=10)
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return OperatorConfig(**{**base.__dict__, "nats_credentials": {"user": data.get("user", ""),
                                                                   "password": data.get("password", "")}})


def _owned_by(obj: dict, uid: str) -> bool:
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])


def _apply(kube: Kube, desired: dict, keep_replicas: bool) -> None:
    """Create the child, or replace it with the desired state keeping what others own
    (replicas under an HPA, a Service's cluster IP, foreign labels/annotations)."""
    m = desired["metadata"]
    live = kube.get(desired["apiVersion"], desired["kind"], m["namespace"], m["name"])
    if live is None:
        try:
            kube.create(desired)
            return
        except client.ApiException as e:
            if e.status != 409:
                raise
            live = kube.get(desired["apiVersion"], desired["kind"], m["namespace"], m["name"])
    uid = m["ownerReferences"][0]["uid"]
    if not _owned_by(live, uid):
        raise kopf.PermanentError(f"{desired['kind']} {m['namespace']}/{m['name']} already exists and is not "
                                  f"owned by this InferenceService; delete or rename it")
    new = copy.deepcopy(desired)
    lm = live["metadata"]
    new["metadata"]["resourceVersion"] = lm["resourceVersion"]
    new["metadata"]["labels"] = {**(lm.get("labels") or {}), **m["labels"]}
    if lm.get("annotations"):
        new["metadata"]["annotations"] = {**lm["annotations"], **(m.get("annotations") or {})}
    if desired["kind"] == "Deployment" and keep_replicas and "replicas" in live.get("spec", {}):
        new["spec"]["replicas"] = live["spec"]["replicas"]
    if desired["kind"] == "Service":
        for f in ("clusterIP", "clusterIPs", "healthCheckNodePort"):
            if f in live["spec"]:
                new["spec"][f] = live["spec"][f]
        live_ports = {p.get("name"): p for p in live["spec"].get("ports", [])}
        for p in new["spec"]["ports"]:
            if "nodePort" in live_ports.get(p["name"], {}) and new["spec"]["type"] != "ClusterIP":
                p["nodePort"] = live_ports[p["name"]]["nodePort"]
    kube.replace(new)


def _deployments(kube: Kube, namespace: str, name: str) -> dict[str, dict | None]:
    return {pool: kube.get("apps/v1", "Deployment", namespace, f"{name}-{pool}") for pool in (*POOLS, "front")}


def reconcile(body: dict, memo: kopf.Memo, logger: logging.Logger) -> dict:
    """Bring the children in line with the spec; return the new status."""
    kube: Kube = memo.kube
    body = dict(body)
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    errors = validate_spec(body["spec"])
    if errors:
        # The webhook should have refused this; it was bypassed (or the object predates it).
        kopf.warn(body, reason="InvalidSpec", message="; ".join(errors))
        return compute_status(body, _deployments(kube, ns, name), errors, _now(), memo.base_config)
    cfg = _config(memo)
    decode = kube.get("apps/v1", "Deployment", ns, f"{name}-decode")
    observed = {"decode": decode["spec"]["replicas"]} if decode else {}
    children = desired_children(body, cfg, observed)
    for child in children:
        pool = child["metadata"]["labels"].get("app.kubernetes.io/component")
        _apply(kube, child, keep_replicas=autoscaled(body["spec"], pool) if pool else False)
    # Children that the spec no longer asks for (an HPA whose pool stopped autoscaling, the NATS copy).
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
    possible = [("HorizontalPodAutoscaler", cfg.hpa_api_version, f"{name}-{p}") for p in POOLS]
    possible.append(("Secret", "v1", f"{name}-nats"))
    for kind, api, child_name in possible:
        if (kind, child_name) not in wanted:
            live = kube.get(api, kind, ns, child_name)
            if live and _owned_by(live, body["metadata"]["uid"]):
                kube.request("DELETE", f"/{'api' if api == 'v1' else 'apis'}/{api}/namespaces/{ns}/"
                             f"{'horizontalpodautoscalers' if kind != 'Secret' else 'secrets'}/{child_name}")
                logger.info(f"deleted {kind} {child_name}: no longer in the spec")
    return compute_status(body, _deployments(kube, ns, name), [], _now(), cfg)


@kopf.on.resume(GROUP, VERSION, PLURAL, backoff=10)
@kopf.on.create(GROUP, VERSION, PLURAL, backoff=10)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", backoff=10)
def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    status = reconcile(_plain(body), memo, logger)
    patch.status.update(status)


def _plain(body: Any) -> dict:
    return {"metadata": dict(body["metadata"]), "spec": copy.deepcopy(dict(body["spec"])),
            "status": copy.deepcopy(dict(body.get("status") or {}))}


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
def child_deployment_changed(body: kopf.Body, event: dict, memo: kopf.Memo, logger: logging.Logger,
                             **_: Any) -> None:
    """Keep the owner's status (and the ratio-bound prefill HPA) current as its pools change."""
    labels = body["metadata"].get("labels") or {}
    name, ns = labels.get(f"{GROUP}/inferenceservice"), body["metadata"]["namespace"]
    if not name or not hasattr(memo, "kube"):
        return
    kube: Kube = memo.kube
    isvc = kube.get(ISVC_API, "InferenceService", ns, name)
    if not isvc or isvc["metadata"].get("deletionTimestamp"):
        return
    if event.get("type") == "DELETED" and _owned_by(body, isvc["metadata"]["uid"]):
        logger.info(f"Deployment {body['metadata']['name']} deleted; recreating it")
        status = reconcile(isvc, memo, logger)
        kube.merge_patch(ISVC_API, "InferenceService", ns, name, {"status": status}, sub="status")
        return
    errors = validate_spec(isvc["spec"])
    status = compute_status(isvc, _deployments(kube, ns, name), errors, _now(), memo.base_config)
    kube.merge_patch(ISVC_API, "InferenceService", ns, name, {"status": status}, sub="status")
    if errors or labels.get("app.kubernetes.io/component") != "decode":
        return
    spec = apply_defaults(isvc["spec"])
    if spec["prefill"]["autoscaling"]["enabled"] and spec.get("autoscaling", {}).get("prefillDecodeRatio"):
        lo, hi = prefill_bounds_for_ratio(spec, (body.get("spec") or {}).get("replicas") or 1)
        cfg: OperatorConfig = memo.base_config
        hpa = kube.get(cfg.hpa_api_version, "HorizontalPodAutoscaler", ns, f"{name}-prefill")
        if hpa and (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) != (lo, hi):
            kube.merge_patch(cfg.hpa_api_version, "HorizontalPodAutoscaler", ns, f"{name}-prefill",
                             {"spec": {"minReplicas": lo, "maxReplicas": hi}})
            logger.info(f"prefill HPA bounds -> [{lo}, {hi}] for decode={body['spec']['replicas']}")


@kopf.on.validate(GROUP, VERSION, PLURAL, id="validate-inferenceservice", operations=["CREATE", "UPDATE"])
def validate(spec: kopf.Spec, **_: Any) -> None:
    errors = validate_spec(copy.deepcopy(dict(spec)))
    if errors:
        raise kopf.AdmissionError("invalid InferenceService: " + "; ".join(errors), code=422)
