"""A small JSON client over `kubernetes.client.ApiClient` for the few kinds the operator writes.

Why not the typed APIs: their PATCH picks `application/json-patch+json` for dict bodies, and the
operator works on plain dicts produced by `reconcile.py` anyway. Writes are server-side apply under
one field manager: the API server merges our fields with everyone else's (an HPA's replicas, a
Service's cluster IP, foreign labels). Every call is synchronous; kopf runs sync handlers in its
thread pool.
"""
from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client
from kubernetes import config as kconfig

PLURALS = {
    "Deployment": "deployments", "Service": "services", "Secret": "secrets",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers", "PodDisruptionBudget": "poddisruptionbudgets",
    "InferenceService": "inferenceservices", "Event": "events", "Pod": "pods",
    "ServiceAccount": "serviceaccounts", "NetworkPolicy": "networkpolicies", "CustomResourceDefinition": "customresourcedefinitions",
}
FIELD_MANAGER = "pdserve-operator"


def path_for(api_version: str, kind: str, namespace: str | None, name: str | None = None,
             sub: str | None = None) -> str:
    """The REST path of an object (namespace None: a cluster-scoped kind)."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    p = f"{base}/namespaces/{namespace}/{PLURALS[kind]}" if namespace else f"{base}/{PLURALS[kind]}"
    if name:
        p += f"/{name}"
    if sub:
        p += f"/{sub}"
    return p


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """A client for this pod's ServiceAccount in a cluster; outside one, `kubeconfig` (default
    $KUBECONFIG, read now, not at import time of kubernetes.config, which caches the default)."""
    cfg = client.Configuration()
    try:
        kconfig.load_incluster_config(client_configuration=cfg)
    except kconfig.ConfigException:
        kconfig.load_kube_config(config_file=kubeconfig or os.environ.get("KUBECONFIG") or None,
                                 client_configuration=cfg)
    return client.ApiClient(cfg)


class Kube:
    """JSON in, JSON out. Raises `kubernetes.client.ApiException` on HTTP errors (404 -> None in get)."""

    def __init__(self, api_client: client.ApiClient):
        self.api = api_client

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                timeout: float | None = None) -> Any:
        """One call; `timeout` (seconds) bounds connecting and reading (None: the client's default, none)."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        if hasattr(self.api, "param_serialize"):  # kubernetes >= 34 (new generator)
            m, url, h, b, _ = self.api.param_serialize(method=method, resource_path=path, header_params=headers,
                                                       body=body, auth_settings=["BearerToken"])
            resp = self.api.call_api(m, url, header_params=h, body=b, _request_timeout=timeout)
            data = resp.read()
            if not 200 <= resp.status < 300:
                raise client.ApiException(http_resp=resp)
        else:  # older clients
            resp = self.api.call_api(path, method, path_params={}, query_params=[], header_params=headers,
                                     body=body, auth_settings=["BearerToken"], _preload_content=False,
                                     _return_http_data_only=True, _request_timeout=timeout)
            data = resp.data
        return json.loads(data) if data else None

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        try:
            return self.request("GET", path_for(api_version, kind, namespace, name))
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, obj: dict) -> dict:
        m = obj["metadata"]
        return self.request("POST", path_for(obj["apiVersion"], obj["kind"], m["namespace"]), obj)

    def apply(self, obj: dict, force: bool = False, sub: str | None = None) -> dict:
        """Server-side apply of `obj` (or of its `sub`resource, e.g. "status") as FIELD_MANAGER.

        Without `force` the server refuses (409) to change a field another manager set to
        another value; with it, ours win."""
        m = obj["metadata"]
        query = f"?fieldManager={FIELD_MANAGER}" + ("&force=true" if force else "")
        # JSON is YAML: the body goes as text, which the client sends as it is.
        return self.request("PATCH", path_for(obj["apiVersion"], obj["kind"], m.get("namespace"), m["name"], sub)
                            + query, json.dumps(obj), content_type="application/apply-patch+yaml")

    def merge_patch(self, api_version: str, kind: str, namespace: str, name: str, body: dict,
                    sub: str | None = None) -> dict:
        return self.request("PATCH", path_for(api_version, kind, namespace, name, sub), body,
                            content_type="application/merge-patch+json")

    def served_versions(self, group: str) -> list[str]:
        """Versions the server offers for an API group (e.g. "autoscaling" -> ["v1", "v2beta1", ...])."""
        try:
            g = self.request("GET", f"/apis/{group}")
        except client.ApiException as e:
            if e.status == 404:
                return []
            raise
        return [v["version"] for v in g.get("versions", [])]
