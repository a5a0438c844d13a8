"""The loopback control plane itself: API reachable with the admin token, RBAC enforced,
owner-reference garbage collection running (kube-controller-manager)."""
from __future__ import annotations

import pytest
from kubernetes import client

pytestmark = pytest.mark.k8s


def test_admin_can_write_and_anonymous_is_refused(k8s_cluster, k8s_api_client, k8s_namespace):
    core = client.CoreV1Api(k8s_api_client)
    core.create_namespaced_config_map(k8s_namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="probe"), data={"k": "v"}))
    assert core.read_namespaced_config_map("probe", k8s_namespace).data == {"k": "v"}

    anon_cfg = client.Configuration()
    anon_cfg.host = k8s_cluster.server
    anon_cfg.ssl_ca_cert = k8s_cluster.ca_file
    with client.ApiClient(anon_cfg) as anon:
        with pytest.raises(client.ApiException) as err:
            client.CoreV1Api(anon).list_namespaced_config_map(k8s_namespace)
    assert err.value.status in (401, 403)


def test_garbage_collector_deletes_owned_objects(k8s_api_client, k8s_namespace):
    import time

    core = client.CoreV1Api(k8s_api_client)
    owner = core.create_namespaced_config_map(k8s_namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="owner")))
    core.create_namespaced_config_map(k8s_namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(
        name="child", owner_references=[client.V1OwnerReference(
            api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid)])))
    core.delete_namespaced_config_map("owner", k8s_namespace)
    for _ in range(300):  # a bound on waiting, not a timing assertion
        names = [c.metadata.name for c in core.list_namespaced_config_map(k8s_namespace).items]
        if "child" not in names:
            break
        time.sleep(0.2)
    assert "child" not in names
