"""The real HPA controller scaling a pool through our metrics adapter, registered as an aggregated API.

Real parts: kube-apiserver (aggregator) + kube-controller-manager (HPA, Deployment, ReplicaSet
controllers) from the `k8s_cluster` harness, NATS (`nats_server`), the adapter as its own process
(`pdserve metrics-adapter`) serving HTTPS with a CA the APIService's `caBundle` carries.

The one fake is the kubelet: no kubelet runs, so the test marks the ReplicaSet's Pods Running and
Ready itself (a status patch) and publishes, for each such Pod, the LoadReport its prefill worker
would (1 Hz, `pod`/`namespace`/`isvc`/`pool` from the downward API). The test drives the queue
depth in those reports; the HPA must scale the Deployment up when it rises past the target and
back down when it falls.

Routing: there is no kube-proxy, so a ClusterIP Service cannot reach the adapter, and an Endpoints
object may not hold a loopback address. The APIService points at an `ExternalName` Service whose
name is 127.0.0.1: the aggregator resolves ExternalName services to that host and the APIService's
port, and still verifies the serving certificate for `<service>.<namespace>.svc` against `caBundle`
(no `insecureSkipTLSVerify`). No extra apiserver flags are needed for this.

Front-proxy authentication: if the harness's cluster exposes `front_proxy_ca` (the path of the CA
given to the apiserver as `--requestheader-client-ca-file`, with `--proxy-client-cert-file/-key-file`
signed by it), the adapter runs with `--client-ca-file` and answers only the aggregator. The harness
does not do so yet; then the adapter serves one-way TLS.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from k8swait import wait_for

from pdserve.autoscale.certs import make_serving_cert
from pdserve.kvtransfer.protocol import LoadReport, Subjects
from pdserve.natsserver import free_port

ISVC, POOL = "llama", "prefill"
LABELS = {"pdserve.io/isvc": ISVC, "pdserve.io/pool": POOL, "pdserve.io/role": "prefill"}
SELECTOR = f"pdserve.io/isvc={ISVC},pdserve.io/pool={POOL}"
METRIC = "pdserve_prefill_queue_depth"


class FakeKubelet(threading.Thread):
    """Stands in for kubelet + worker: Pods of the pool go Running/Ready, and each one's LoadReport is
    published on NATS once a second with `queue_depth` as the test sets it."""

    def __init__(self, core, namespace: str, nats_creds):
        super().__init__(daemon=True)
        self.core, self.ns, self.creds = core, namespace, nats_creds
        self.queue_depth = 1
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self):
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced by the test
            self.error = e

    def _tick_pods(self) -> list[str]:
        pods = self.core.list_namespaced_pod(self.ns, label_selector=SELECTOR).items
        names = []
        for i, p in enumerate(pods):
            if p.metadata.deletion_timestamp:
                continue
            if p.status.phase != "Running":
                now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                status = {
                    "phase": "Running",
                    "podIP": f"10.244.0.{10 + i}",
                    "startTime": now,
                    "conditions": [
                        {"type": t, "status": "True", "lastTransitionTime": now}
                        for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                    ],
                }
                self.core.patch_namespaced_pod_status(p.metadata.name, self.ns, {"status": status})
            names.append(p.metadata.name)
        return names

    async def _main(self):
        import nats

        nc = await nats.connect(**self.creds.connect_kwargs())
        try:
            while not self.stop.is_set():
                names = await asyncio.get_running_loop().run_in_executor(None, self._tick_pods)
                for name in names:
                    r = LoadReport(
                        worker_id=name, role="prefill", model="m", isvc=ISVC, pool=POOL, pod=name, namespace=self.ns,
                        queue_depth=self.queue_depth, stale_after_s=3.0, scope=f"{self.ns}.{ISVC}",
                    )
                    await nc.publish(Subjects.load(r.scope, "prefill", name), r.encode())
                await nc.flush()
                await asyncio.sleep(1.0)
        finally:
            await nc.close()


@pytest.fixture
def adapter_process(k8s_cluster, nats_server, tmp_path, k8s_namespace):
    """`pdserve metrics-adapter` as a child process with a serving cert for the aggregator's name."""
    svc = "pdserve-metrics-adapter"
    certs = make_serving_cert(tmp_path / "tls", [f"{svc}.{k8s_namespace}.svc", "127.0.0.1", "localhost"])
    port = free_port()
    env = {**os.environ, **nats_server.creds.env()}
    log = open(tmp_path / "adapter.log", "wb")
    front_proxy_ca = getattr(k8s_cluster, "front_proxy_ca", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "metrics-adapter", "--nats-url", nats_server.creds.url,
         "--host", "127.0.0.1", "--port", str(port), "--cert", str(certs.cert), "--key", str(certs.key),
         *(["--client-ca-file", str(front_proxy_ca)] if front_proxy_ca else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    ctx = ssl.create_default_context(cafile=str(certs.ca_cert))

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"adapter exited {proc.returncode}: {(tmp_path / 'adapter.log').read_text()}")
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    wait_for(healthy, "the adapter to serve /healthz", 30)
    try:
        yield {"port": port, "certs": certs, "service": svc, "log": tmp_path / "adapter.log"}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def hpa_api_version(api_client) -> str:
    """autoscaling/v2 where served (1.23+), else v2beta2 (the harness's 1.20) — by discovery."""
    from kubernetes.client import ApisApi

    groups = {g.name: [v.version for v in g.versions] for g in ApisApi(api_client).get_api_versions().groups}
    return "autoscaling/v2" if "v2" in groups.get("autoscaling", []) else "autoscaling/v2beta2"


def test_hpa_scales_a_pool_on_our_custom_metric(k8s_cluster, k8s_api_client, k8s_namespace, k8s_tool, nats_server, adapter_process):
    from kubernetes import client, dynamic

    ns = k8s_namespace
    core, apps = client.CoreV1Api(k8s_api_client), client.AppsV1Api(k8s_api_client)
    dyn = dynamic.DynamicClient(k8s_api_client)
    kubectl = k8s_tool("kubectl")

    # 1. Register the adapter: ExternalName Service -> 127.0.0.1, APIService with the CA bundle.
    core.create_namespaced_service(ns, {
        "metadata": {"name": adapter_process["service"]},
        "spec": {"type": "ExternalName", "externalName": "127.0.0.1", "ports": [{"port": adapter_process["port"]}]},
    })
    apiservices = dyn.resources.get(api_version="apiregistration.k8s.io/v1", kind="APIService")
    names = []
    for group in ("custom.metrics.k8s.io", "external.metrics.k8s.io"):
        names.append(f"v1beta1.{group}")
        apiservices.create(body={
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": names[-1]},
            "spec": {
                "group": group, "version": "v1beta1",
                "service": {"namespace": ns, "name": adapter_process["service"], "port": adapter_process["port"]},
                "caBundle": base64.b64encode(adapter_process["certs"].ca_cert.read_bytes()).decode(),
                "groupPriorityMinimum": 100, "versionPriority": 100,
            },
        })
    kubelet = FakeKubelet(core, ns, nats_server.creds)
    kube_env = {**os.environ, "KUBECONFIG": k8s_cluster.kubeconfig}

    def raw(path: str):
        out = subprocess.run([kubectl, "get", "--raw", path], capture_output=True, text=True, env=kube_env)
        return json.loads(out.stdout) if out.returncode == 0 else None

    try:
        for name in names:
            def available():
                conds = (apiservices.get(name=name).to_dict().get("status") or {}).get("conditions") or []
                return any(c["type"] == "Available" and c["status"] == "True" for c in conds) or conds
            got = wait_for(available, f"the APIService {name} to become Available", 60)
            assert got is True, f"APIService {name} not available: {got}"

        # 2. The pool: a Deployment the controller-manager turns into a ReplicaSet and Pods.
        apps.create_namespaced_deployment(ns, {
            "metadata": {"name": f"{ISVC}-{POOL}", "labels": LABELS},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {k: LABELS[k] for k in ("pdserve.io/isvc", "pdserve.io/pool")}},
                "template": {"metadata": {"labels": LABELS},
                             "spec": {"containers": [{"name": "prefill", "image": "pdserve:test"}]}},
            },
        })
        kubelet.start()

        def pods_reported():
            doc = raw(f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{ns}/pods/*/{METRIC}"
                      f"?labelSelector={SELECTOR.replace('/', '%2F').replace('=', '%3D').replace(',', '%2C')}")
            return doc if doc and doc["items"] else False

        doc = wait_for(pods_reported, "kubectl get --raw to return our metric", 60)
        pods = {p.metadata.name for p in core.list_namespaced_pod(ns, label_selector=SELECTOR).items}
        assert doc["kind"] == "MetricValueList"
        assert {i["describedObject"]["name"] for i in doc["items"]} == pods and len(pods) == 1
        assert all(i["value"] == "1" and i["metricName"] == METRIC for i in doc["items"])
        # The same signal per pool, through the external metrics API.
        ext = raw(f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/{METRIC}?labelSelector=isvc%3D{ISVC}%2Cpool%3D{POOL}")
        assert ext["kind"] == "ExternalMetricValueList"
        assert [(i["metricLabels"], i["value"]) for i in ext["items"]] == [({"isvc": ISVC, "pool": POOL}, "1")]

        # 3. The HPA: Pods metric, AverageValue 5 prompts per pod, no stabilisation delay (test speed).
        version = hpa_api_version(k8s_api_client)
        hpas = dyn.resources.get(api_version=version, kind="HorizontalPodAutoscaler")
        fast = {"stabilizationWindowSeconds": 0, "policies": [{"type": "Percent", "value": 100, "periodSeconds": 5}]}
        hpas.create(namespace=ns, body={
            "apiVersion": version, "kind": "HorizontalPodAutoscaler", "metadata": {"name": f"{ISVC}-{POOL}"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{ISVC}-{POOL}"},
                "minReplicas": 1, "maxReplicas": 4,
                "metrics": [{"type": "Pods", "pods": {"metric": {"name": METRIC},
                                                       "target": {"type": "AverageValue", "averageValue": "5"}}}],
                "behavior": {"scaleUp": fast, "scaleDown": fast},
            },
        })

        def replicas():
            if kubelet.error:
                raise kubelet.error
            return apps.read_namespaced_deployment(f"{ISVC}-{POOL}", ns).spec.replicas

        def hpa_metric():
            st = hpas.get(name=f"{ISVC}-{POOL}", namespace=ns).to_dict().get("status") or {}
            cur = st.get("currentMetrics") or []
            return cur[0]["pods"]["current"]["averageValue"] if cur and cur[0].get("pods") else None

        # Below target: the HPA reads our metric and keeps one replica.
        wait_for(lambda: hpa_metric() == "1", "the HPA to read queue depth 1 from the adapter", 60)
        assert replicas() == 1

        # 4. Load rises: 20 queued prompts per pod against a target of 5 -> up (to max 4).
        kubelet.queue_depth = 20
        wait_for(lambda: replicas() >= 2, "the HPA to scale the pool up", 90)
        wait_for(lambda: replicas() == 4, "the HPA to reach maxReplicas", 90)
        wait_for(lambda: len([p for p in core.list_namespaced_pod(ns, label_selector=SELECTOR).items
                              if p.status.phase == "Running"]) == 4, "four Running pods", 60)

        # 5. Load falls: 0 queued -> back down to minReplicas.
        kubelet.queue_depth = 0
        wait_for(lambda: replicas() == 1, "the HPA to scale the pool back down", 120)
        assert hpa_metric() == "0"
    finally:
        kubelet.stop.set()
        if kubelet.is_alive():
            kubelet.join(10)
        for name in names:
            try:
                apiservices.delete(name=name)
            except Exception:
                pass
