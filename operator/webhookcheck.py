"""`pdserve webhook-check`: wait until the API server really reaches the admission webhook.

The operator pod being Ready says its webhook port accepts connections on the pod's own IP; it
does not say the API server can reach it through the webhook Service. Between the two lies the
cluster's service routing (kube-proxy, or whatever programs the Service's ClusterIP), which may
lag by seconds. A `kubectl apply` in that window fails with "failed calling webhook ...
connection refused" (failurePolicy Fail), or passes unchecked (Ignore). The chart runs this
command as a Helm post-install/post-upgrade hook, so `helm install --wait` / `helm upgrade`
return only once InferenceService writes are checked, as cert-manager's startupapicheck does.

How: a server-side dry run (`dryRun=All`, nothing is stored, no operator sees it) of an
InferenceService that is valid for the CRD's schema but breaks one of the webhook's cross-field
rules (decode.autoscaling.minReplicas > maxReplicas). Only the webhook's own denial proves the
path; anything else is retried until the deadline:

- "failed calling webhook" (500) or an unreachable API server: the path is not up yet;
- admitted: the webhook was skipped (failurePolicy Ignore while it is unreachable);
- 404: the CRD is not served yet.

Refused at once (retrying cannot help): 401/403 (the hook's RBAC is wrong) and a 4xx that is not
the webhook's denial (the probe object no longer fits the CRD's schema). Exit status 0 when the
webhook denied the probe, 1 otherwise, with the last answer on stderr. Nothing secret is printed:
answers are the API server's status messages.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable

from kubernetes import client

from pdserve.operator.crd import GROUP, PLURAL, VERSION
from pdserve.operator.kube import Kube, api_client, path_for

WEBHOOK_NAME = "validate.inferenceservices.pdserve.io"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
REQUEST_TIMEOUT_S = 15  # one try; a silent API server must not outlast the check's deadline


def probe_object() -> dict:
    """Valid for the CRD's schema, invalid for the webhook: min > max replicas on decode."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
        "metadata": {"generateName": "pdserve-webhook-check-",
                     "labels": {"app.kubernetes.io/component": "webhook-check"}},
        "spec": {"model": {"name": "webhook-check", "path": "webhook-check", "pvc": "webhook-check"},
                 "decode": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}},
    }


@dataclass(frozen=True)
class Outcome:
    verdict: str  # "ready" | "retry" | "refused"
    detail: str


def _message(status: int, body: str) -> str:
    try:
        return str(json.loads(body).get("message") or body)
    except (ValueError, AttributeError):
        return body.strip() or f"HTTP {status}"


def classify(status: int, body: str) -> Outcome:
    """What one answer to the dry-run create means for the webhook's path."""
    msg = _message(status, body)
    if 200 <= status < 300:
        return Outcome("retry", "the invalid probe was admitted: the webhook was not consulted "
                                "(failurePolicy Ignore while it is unreachable, or no webhook configured)")
    if f'admission webhook "{WEBHOOK_NAME}" denied the request' in msg:
        return Outcome("ready", msg)
    if status in (401, 403):
        return Outcome("refused", f"HTTP {status}: {msg} (the check's ServiceAccount may create "
                                  f"{PLURAL}.{GROUP} in this namespace)")
    if status == 404:
        return Outcome("retry", f"HTTP 404: {msg} (the CRD is not served yet)")
    if 400 <= status < 500 and status not in (408, 409, 429):
        return Outcome("refused", f"HTTP {status}: {msg} (refused before the webhook: the probe does "
                                  "not fit this CRD)")
    return Outcome("retry", f"HTTP {status}: {msg}")


def dry_run_create(api: client.ApiClient, namespace: str) -> tuple[int, str]:
    """POST the probe with dryRun=All; (status, body). Connection failures come back as status 0."""
    try:
        created = Kube(api).request("POST", path_for(f"{GROUP}/{VERSION}", "InferenceService", namespace)
                                    + "?dryRun=All", probe_object(), timeout=REQUEST_TIMEOUT_S)
        return 201, json.dumps(created)  # a 2xx (Kube.request returns the body only): admitted
    except client.ApiException as e:
        return e.status or 0, e.body.decode(errors="replace") if isinstance(e.body, bytes) else str(e.body or e.reason)
    except Exception as e:  # urllib3 connection errors: the API server itself is not reachable yet
        return 0, f"{type(e).__name__}: {e}"


def wait_ready(attempt: Callable[[], tuple[int, str]], timeout: float, interval: float = 1.0,
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> Outcome:
    """Call `attempt` until the webhook denies the probe, a refusal, or `timeout` seconds."""
    deadline = clock() + timeout
    last_logged = ""
    tries = 0
    while True:
        tries += 1
        out = classify(*attempt())
        if out.verdict != "retry":
            return out
        if out.detail != last_logged:  # each new kind of answer once, not one line a second
            log(f"webhook-check: not yet ({out.detail})")
            last_logged = out.detail
        if clock() + interval > deadline:
            return Outcome("refused", f"no webhook denial in {timeout:g} s over {tries} tries; last: {out.detail}")
        sleep(interval)


def _default_namespace() -> str:
    try:
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip()
    except OSError:
        return "default"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve webhook-check", description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default=None, help="namespace of the dry-run probe (default: this pod's)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the webhook (default 180)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between tries (default 1)")
    p.add_argument("--kubeconfig", default=None, help="outside a cluster: the kubeconfig (default $KUBECONFIG)")
    args = p.parse_args(argv)
    if args.timeout <= 0 or args.interval <= 0:
        p.error("--timeout and --interval must be positive")
    namespace = args.namespace or _default_namespace()
    api = api_client(args.kubeconfig)
    t0 = time.monotonic()
    out = wait_ready(lambda: dry_run_create(api, namespace), args.timeout, args.interval)
    if out.verdict == "ready":
        print(f"webhook-check: the API server reaches the webhook {WEBHOOK_NAME} "
              f"({time.monotonic() - t0:.1f} s)", flush=True)
        return 0
    print(f"webhook-check: FAILED: {out.detail}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
