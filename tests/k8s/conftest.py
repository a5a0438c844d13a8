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

- `k8s_node` -> `NodeCluster` (scripts/k8s-node.py): a second, separate cluster with a real node
  (kubelet, containerd, kube-proxy, cluster DNS) in a network namespace of its own, with the
  images of scripts/k8s-images.py imported (`k8s_node.images[name].ref`; built, when a selected
  test needs the node, right after collection, before any test's timeout runs). Its `kubeconfig` points
  at a loopback relay; `k8s_node.forward(ip, port)` gives a loopback port for a Service or pod as
  seen from the node. It does not touch `KUBECONFIG`: pass `k8s_node.kubeconfig` explicitly.
  The control-plane-only tests keep `k8s_cluster`: they stand in for a kubelet (status patches)
  and serve webhooks and metrics APIs on the host's loopback, which a node would contradict and
  its namespaced API server could not reach. Skipped with the reason when a part is missing.
  `PDSERVE_K8S_NODE=<workdir>` attaches to a node started by hand (`scripts/k8s-cluster.py --node`
  prints its workdir) instead of starting one: the tests then leave it running.

Another test module in tests/k8s/ can simply request these fixtures by name.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from nodehelpers import script_module

k8s_cluster_module = script_module("k8s-cluster.py")
# The node's images, built once collection is final (so outside every test's timeout: a cold build
# takes many minutes) when a selected test uses the node: name -> Image, or the build's error.
_node_images: dict = {}


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.k8s)


def pytest_collection_finish(session):
    if session.config.option.collectonly or os.environ.get("PDSERVE_K8S_NODE"):
        return
    if any("k8s_node" in getattr(i, "fixturenames", ()) for i in session.items):
        node = script_module("k8s-node.py")
        if not node.missing_node_parts():
            try:
                _node_images["images"] = node.images_mod.build_images()
            except Exception as e:  # the k8s_node fixture raises it: an error in the tests that need it
                _node_images["error"] = e


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
def k8s_node():
    node = script_module("k8s-node.py")
    missing = node.missing_node_parts()
    if missing:
        pytest.skip(f"node parts absent ({', '.join(missing)}); run scripts/k8s-tools.sh "
                    "(make test runs it through scripts/setup.sh)")
    if os.environ.get("PDSERVE_K8S_NODE"):
        cluster = node.NodeCluster.attach(os.environ["PDSERVE_K8S_NODE"])
    else:
        if "error" in _node_images:
            raise _node_images["error"]
        cluster = node.NodeCluster(images=_node_images.get("images") or {},
                                   controller_args=["--horizontal-pod-autoscaler-sync-period=5s"])
        cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


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
