"""Fixtures for tests against a REAL Kubernetes control plane (etcd + kube-apiserver v1.20 +
kube-controller-manager on loopback; no kubelet, no scheduler). Binaries come from
`scripts/k8s-tools.sh`; the start/stop logic is `scripts/k8s-cluster.py` (usable by hand too).

Fixtures (all session-scoped unless noted):

- `k8s_cluster` -> `LocalCluster`: the running control plane. Attributes: `server` (https URL),
  `token` (admin bearer token, group system:masters), `kubeconfig` (path), `ca_file` (server CA),
  `front_proxy_ca` (CA of the aggregator's front-proxy client cert; the apiserver runs with
  --requestheader-client-ca-file and --proxy-client-cert-file, so aggregated APIs can demand it), `workdir` (temp dir
  with etcd/apiserver/controller-manager logs). `KUBECONFIG` is exported to it for the whole
  session (kopf's `KopfRunner`, kubectl and helm pick it up; `kubernetes.config`'s default path
  too, so `load_kube_config()` without arguments works). Tests are SKIPPED with the reason
  when the binaries are absent. The controller manager runs every default controller
  (garbage collector, deployment/replicaset, HPA with `--horizontal-pod-autoscaler-sync-period=5s`).
  Set `PDSERVE_K8S_KEEP=1` to keep the temp dir (logs) after the session.
- `k8s_api_client` -> `kubernetes.client.ApiClient` configured for that cluster.
- `k8s_namespace` (function-scoped) -> str: a fresh namespace for one test, deleted afterwards.
- `k8s_tool` -> callable `name -> path` of a cached tool (`helm`, `kubectl`); skips if absent.

Another test module in tests/k8s/ can simply request these fixtures by name.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_cluster_module():
    name = "pdserve_k8s_cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "k8s-cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


k8s_cluster_module = _load_cluster_module()


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def k8s_cluster():
    missing = k8s_cluster_module.missing_binaries()
    if missing:
        pytest.skip(f"Kubernetes binaries absent ({', '.join(missing)}); run scripts/k8s-tools.sh")
    cluster = k8s_cluster_module.LocalCluster(
        controller_args=["--horizontal-pod-autoscaler-sync-period=5s"])
    cluster.start()
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = cluster.kubeconfig
    # kubernetes.config fixed its default path at import time; point it here too, so that
    # `load_kube_config()` without arguments (kopf's client-library login, other tests) finds it.
    import kubernetes.config.kube_config as kc
    old_default = kc.KUBE_CONFIG_DEFAULT_LOCATION
    kc.KUBE_CONFIG_DEFAULT_LOCATION = cluster.kubeconfig
    try:
        yield cluster
    finally:
        cluster.stop()
        kc.KUBE_CONFIG_DEFAULT_LOCATION = old_default
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old


@pytest.fixture(scope="session")
def k8s_api_client(k8s_cluster):
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=k8s_cluster.kubeconfig, client_configuration=cfg)
    api = client.ApiClient(cfg)
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def k8s_namespace(k8s_api_client):
    from kubernetes import client

    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(k8s_api_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        try:
            core.delete_namespace(name)
        except client.ApiException:
            pass


@pytest.fixture(scope="session")
def k8s_tool():
    def find(name: str) -> str:
        path = k8s_cluster_module.find_binary(name)
        if path is None:
            pytest.skip(f"{name} absent; run scripts/k8s-tools.sh")
        return path

    return find
