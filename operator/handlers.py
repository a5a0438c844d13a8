"""kopf handlers: thin wrappers that apply what `reconcile.py` computes and keep status current.

- startup -> apply this version's InferenceService CRD (Helm never upgrades a chart's `crds/`, so
  an upgraded operator brings its own schema), discover the served API versions;
- create/update/resume -> apply the desired children with server-side apply (resume repairs
  drift after a restart; a child Deployment deleted by hand is recreated at once). No timers or
  deletion handlers: both would need a finalizer, and an InferenceService must stay deletable
  with the operator gone;
- Deployment events of our children -> InferenceService status, and prefill HPA bounds when a
  prefill:decode ratio is set;
- validating admission webhook -> `validation.validate` (same function the reconciler uses);
- delete -> the garbage collector removes the children (every one has an owner reference); the
  chart's NATS server forgets the InferenceService's user (`natsusers`), at once when the operator
  sees the deletion, else at its next start.

A child the API server refuses is never retried in silence: the InferenceService turns Degraded
with the server's reason and message, and a Warning event says the same. A refusal that only a
spec change can mend (the server found the object invalid) waits for that change; any other
(forbidden, a foreign object in the way) is tried again after `REFUSED_RETRY_S`.

Status has one writer, `publish_status`, called under the InferenceService's lock (kopf runs the
handlers on a thread pool): a Deployment event cannot read the status before a reconcile in
flight has published it, and then publish an older picture over it. Settings come from the
environment (`pdserve.config.OperatorSettings`: set by the chart, or by `pdserve operator` flags).
"""
from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import collections
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
from kubernetes import client

from pdserve.config import OperatorSettings, from_environ

from .crd import GROUP, KIND, PLURAL, VERSION, apply_defaults, crd
from . import natsusers
from .kube import Kube, api_client, path_for
from .reconcile import (DRAFT_POOL, POOLS, OperatorConfig, autoscaled, compute_status, desired_children,
                        prefill_bounds_for_ratio)
from .validation import validate

ISVC_API = f"{GROUP}/{VERSION}"
MANAGED = {"app.kubernetes.io/managed-by": "pdserve-operator"}
REFUSED_RETRY_S = 60.0


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # kopf's own parsers read KUBECONFIG when called (the client library fixes it at import time).
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def apply_crd(kube: Kube, logger: logging.Logger) -> None:
    """Bring the server's InferenceService CRD to this version's schema (server-side apply, ours
    winning over whoever installed it, e.g. Helm's `crds/`)."""
    try:
        kube.apply(crd(), force=True)
    except client.ApiException as e:
        if e.status != 403:
            raise
        # The chart grants this; a cluster whose admin manages the CRD may withhold it.
        logger.warning(f"not allowed to apply the InferenceService CRD ({_server_message(e)}); the CRD on the "
                       "server stays as it is")
        return
    logger.info(f"InferenceService CRD {crd()['metadata']['name']} applied")


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    # Kubernetes events only for warnings and errors; successes stay in the log.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 120
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.progress_storage = kopf.SmartProgressStorage(prefix=GROUP)
    opts = from_environ(OperatorSettings)
    kube = Kube(api_client())
    memo.kube = kube
    memo.locks = collections.defaultdict(threading.RLock)  # (namespace, name) -> that InferenceService's lock
    if opts.manage_crd:
        apply_crd(kube, logger)
    hpa = "autoscaling/v2" if "v2" in kube.served_versions("autoscaling") else "autoscaling/v2beta2"
    pdb = "policy/v1" if "v1" in kube.served_versions("policy") else "policy/v1beta1"
    nats_ns = opts.nats_secret_namespace or opts.own_namespace or "default"
    memo.nats_users = (nats_ns, opts.nats_users_secret) if opts.nats_users_secret else None
    memo.base_config = OperatorConfig(image=opts.image, nats_url=opts.nats_url, hpa_api_version=hpa,
                                      pdb_api_version=pdb, nats_users=memo.nats_users is not None,
                                      metrics_scraper_namespace=opts.metrics_scraper_namespace,
                                      nats_tls_ca=Path(opts.nats_tls_ca).read_text() if opts.nats_tls_ca else None)
    # with a user per InferenceService the chart's credentials are the metrics adapter's, never copied
    memo.nats_secret = (nats_ns, opts.nats_secret) if opts.nats_secret and not memo.nats_users else None
    if memo.nats_users:
        natsusers.sync(kube, memo.nats_users, None, None)  # users of InferenceServices deleted meanwhile
    logger.info(f"pdserve operator: HPA {hpa}, PDB {pdb}, NATS {opts.nats_url}")
    if opts.webhook_cert and opts.webhook_key:
        settings.admission.server = kopf.WebhookServer(addr=opts.webhook_addr, port=opts.webhook_port,
                                                       certfile=opts.webhook_cert, pkeyfile=opts.webhook_key)
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
    if not getattr(memo, "nats_secret", None):
        return base
    ns, name = memo.nats_secret
    secret = memo.kube.get("v1", "Secret", ns, name)
    if not secret:
        raise kopf.TemporaryError(f"NATS credentials Secret {ns}/{name} not found", delay=10)
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return OperatorConfig(**{**base.__dict__, "nats_credentials": {"user": data.get("user", ""),
                                                                   "password": data.get("password", "")}})


def _nats_user(kube: Kube, memo: kopf.Memo, body: dict, cfg: OperatorConfig) -> str | None:
    """The password of the InferenceService's own NATS user (kept from its Secret, else new), made
    known to the NATS server first; None where the chart's NATS has no user per InferenceService."""
    m = body["metadata"]
    if not memo.nats_users or not _uses_own_nats_user(body, cfg):
        return None
    secret = kube.get("v1", "Secret", m["namespace"], f"{m['name']}-nats")
    owned = secret is not None and _owned_by(secret, m["uid"])
    password = (natsusers.existing_password(secret, natsusers.user_name(m["namespace"], m["name"]))
                if owned else None) or natsusers.new_password()
    try:
        natsusers.sync(kube, memo.nats_users, body, password)
    except (RuntimeError, client.ApiException) as e:
        raise kopf.TemporaryError(f"cannot give {m['namespace']}/{m['name']} a NATS user: "
                                  f"{e if isinstance(e, RuntimeError) else _server_message(e)}", delay=10)
    return password


def _uses_own_nats_user(body: dict, cfg: OperatorConfig) -> bool:
    nats = apply_defaults(body["spec"]).get("nats", {})
    return cfg.nats_users and not nats.get("url") and not nats.get("credentialsSecret")


def _owned_by(obj: dict, uid: str) -> bool:
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])


def _server_message(e: client.ApiException) -> str:
    try:
        return json.loads(e.body).get("message") or str(e.reason)
    except (TypeError, ValueError):
        return str(e.reason)


@dataclass(frozen=True)
class Refusal:
    """A child the API server (or an object in its way) would not let us apply."""

    kind: str
    name: str
    reason: str  # the server's reason ("Invalid", "Forbidden"), or "NotOwned"
    message: str
    retry: bool  # False when only a spec change can mend it

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.message}"


def _apply(kube: Kube, desired: dict, keep_replicas: bool) -> Refusal | None:
    """Server-side apply one child, ours winning over other managers (a hand edit), but only over
    an object this InferenceService owns: one of the same name that it does not own is reported,
    never touched (apply would merge our fields into it). keep_replicas: an HPA owns the
    Deployment's replica count, so apply the one it set."""
    m = desired["metadata"]
    try:
        live = kube.get(desired["apiVersion"], desired["kind"], m["namespace"], m["name"])
        if live is not None and not _owned_by(live, m["ownerReferences"][0]["uid"]):
            return Refusal(desired["kind"], m["name"], "NotOwned",
                           f"{desired['kind']} {m['namespace']}/{m['name']} already exists and is not owned by "
                           "this InferenceService; delete or rename it", retry=True)
        if live is not None and keep_replicas and "replicas" in live.get("spec", {}):
            desired["spec"]["replicas"] = live["spec"]["replicas"]
        kube.apply(desired, force=True)
    except client.ApiException as e:
        if e.status in (400, 422):
            reason = "Invalid"
        elif e.status in (403, 404, 409):
            reason = "Forbidden" if e.status == 403 else "NotFound" if e.status == 404 else "Conflict"
        else:
            raise  # the server or the network failing: kopf retries soon
        try:
            reason = json.loads(e.body).get("reason") or reason
        except (TypeError, ValueError):
            pass
        return Refusal(desired["kind"], m["name"], reason, _server_message(e), retry=e.status not in (400, 422))
    return None


def _deployments(kube: Kube, namespace: str, name: str) -> dict[str, dict | None]:
    return {pool: kube.get("apps/v1", "Deployment", namespace, f"{name}-{pool}")
            for pool in (*POOLS, "front", DRAFT_POOL)}


def publish_status(kube: Kube, isvc: dict, status: dict) -> None:
    """The one writer of InferenceService status (server-side apply of the status subresource)."""
    m = isvc["metadata"]
    kube.apply({"apiVersion": ISVC_API, "kind": KIND, "metadata": {"name": m["name"], "namespace": m["namespace"]},
                "status": status}, force=True, sub="status")


def reconcile(body: dict, memo: kopf.Memo, logger: logging.Logger) -> None:
    """Bring the children in line with the spec and publish the status. Raises kopf.TemporaryError
    when a refused child should be tried again."""
    with memo.locks[body["metadata"]["namespace"], body["metadata"]["name"]]:
        _reconcile(body, memo, logger)


def _reconcile(body: dict, memo: kopf.Memo, logger: logging.Logger) -> None:
    kube: Kube = memo.kube
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    errors = validate(body)
    if errors:
        # The webhook should have refused this; it was bypassed (or the object predates it).
        kopf.warn(body, reason="InvalidSpec", message="; ".join(errors))
        publish_status(kube, body, compute_status(body, _deployments(kube, ns, name), errors, _now(),
                                                  memo.base_config))
        return
    cfg = _config(memo)
    decode = kube.get("apps/v1", "Deployment", ns, f"{name}-decode") if autoscaled(body["spec"], "decode") else None
    observed = {"decode": decode["spec"]["replicas"]} if decode else {}
    children = desired_children(body, cfg, observed, nats_password=_nats_user(kube, memo, body, cfg))
    refused: list[Refusal] = []
    for child in children:
        pool = child["metadata"]["labels"].get("app.kubernetes.io/component")
        keep = child["kind"] == "Deployment" and bool(pool) and autoscaled(body["spec"], pool)
        refusal = _apply(kube, child, keep_replicas=keep)
        if refusal:
            refused.append(refusal)
    # Children that the spec no longer asks for (an HPA whose pool stopped autoscaling, the NATS copy,
    # a draft pool turned off).
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
    possible = [("HorizontalPodAutoscaler", cfg.hpa_api_version, f"{name}-{p}") for p in (*POOLS, DRAFT_POOL)]
    possible += [("Secret", "v1", f"{name}-nats"), ("Deployment", "apps/v1", f"{name}-{DRAFT_POOL}"),
                 ("PodDisruptionBudget", cfg.pdb_api_version, f"{name}-{DRAFT_POOL}")]
    for kind, api, child_name in possible:
        if (kind, child_name) not in wanted:
            obj = kube.get(api, kind, ns, child_name)
            if obj and _owned_by(obj, body["metadata"]["uid"]):
                kube.request("DELETE", path_for(api, kind, ns, child_name))
                logger.info(f"deleted {kind} {child_name}: no longer in the spec")
    status = compute_status(body, _deployments(kube, ns, name), [], _now(), cfg,
                            refused=[(r.reason, str(r)) for r in refused])
    publish_status(kube, body, status)
    if refused:
        message = "; ".join(str(r) for r in refused)
        kopf.warn(body, reason=refused[0].reason, message=message)
        if any(r.retry for r in refused):
            raise kopf.TemporaryError(f"children refused: {message}", delay=REFUSED_RETRY_S)


@kopf.on.resume(GROUP, VERSION, PLURAL, backoff=10)
@kopf.on.create(GROUP, VERSION, PLURAL, backoff=10)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", backoff=10)
def on_change(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    reconcile(_plain(body), memo, logger)


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_event(event: dict, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """The NATS server forgets the user of a deleted InferenceService. A watch event, not a deletion
    handler: kopf runs those only behind a finalizer, and an InferenceService must stay deletable with
    the operator gone (one deleted meanwhile loses its user at the operator's next start)."""
    if event.get("type") == "DELETED" and getattr(memo, "nats_users", None) \
            and natsusers.sync(memo.kube, memo.nats_users, None, None):
        logger.info("NATS user of a deleted InferenceService removed")


def _plain(body: Any) -> dict:
    return {"apiVersion": ISVC_API, "kind": KIND, "metadata": dict(body["metadata"]),
            "spec": copy.deepcopy(dict(body["spec"])), "status": copy.deepcopy(dict(body.get("status") or {}))}


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
def child_deployment_changed(body: kopf.Body, event: dict, memo: kopf.Memo, logger: logging.Logger,
                             **_: Any) -> None:
    """Keep the owner's status (and the ratio-bound prefill HPA) current as its pools change."""
    labels = body["metadata"].get("labels") or {}
    name, ns = labels.get(f"{GROUP}/inferenceservice"), body["metadata"]["namespace"]
    if not name or not hasattr(memo, "kube"):
        return
    kube: Kube = memo.kube
    with memo.locks[ns, name]:
        isvc = kube.get(ISVC_API, "InferenceService", ns, name)
        if not isvc or isvc["metadata"].get("deletionTimestamp"):
            return
        if event.get("type") == "DELETED" and _owned_by(body, isvc["metadata"]["uid"]):
            logger.info(f"Deployment {body['metadata']['name']} deleted; recreating it")
            try:
                reconcile(isvc, memo, logger)
            except kopf.TemporaryError:
                pass  # reported in status and events; the InferenceService's own handler retries
            return
        errors = validate(isvc)
        publish_status(kube, isvc, compute_status(isvc, _deployments(kube, ns, name), errors, _now(),
                                                  memo.base_config, refused=_standing_refusals(isvc)))
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


def _standing_refusals(isvc: dict) -> list[tuple[str, str]]:
    """The refusals the last reconcile reported for this generation: a pool's change does not
    clear them, only the next apply does."""
    for c in (isvc.get("status") or {}).get("conditions") or []:
        if (c.get("type") == "Degraded" and c.get("status") == "True" and c.get("reason") not in
                ("InvalidSpec", "PoolFailure") and c.get("observedGeneration") == isvc["metadata"].get("generation")):
            return [(c["reason"], c.get("message", ""))]
    return []


@kopf.on.validate(GROUP, VERSION, PLURAL, id="validate-inferenceservice", operations=["CREATE", "UPDATE"])
def validate_admission(body: kopf.Body, **_: Any) -> None:
    errors = validate({"metadata": dict(body["metadata"]), "spec": copy.deepcopy(dict(body.get("spec") or {}))})
    if errors:
        raise kopf.AdmissionError("invalid InferenceService: " + "; ".join(errors), code=422)
