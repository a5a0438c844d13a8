"""The operator against a real kube-apiserver (v1.20) + kube-controller-manager, run by kopf's
KopfRunner: children with owner references, status following the pools, spec changes, restart,
garbage collection; the CRD schema and the validating webhook refusing bad objects.

Stand-ins (no kubelet or GPU here): tests mark Pods Ready by patching their status, as a kubelet
would; the Deployment/ReplicaSet controllers then compute Deployment status for real.
"""
from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from k8swait import wait_for
from kubernetes import client

from pdserve.operator.kube import Kube

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[2]
API = "pdserve.io/v1alpha1"


@pytest.fixture(scope="module")
def kube(k8s_api_client):
    k = Kube(k8s_api_client)
    crd = yaml.safe_load((REPO / "charts/pdserve/crds/inferenceservices.yaml").read_text())
    ext = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    try:
        k.request("POST", ext, crd)
    except client.ApiException as e:
        if e.status != 409:
            raise

    def established():
        c = k.request("GET", f"{ext}/{crd['metadata']['name']}")
        return any(x["type"] == "Established" and x["status"] == "True" for x in (c.get("status") or {}).get("conditions") or [])
    wait_for(established, "CRD Established")

    def fields(schema: dict) -> dict:
        return {name: fields(sub) for name, sub in (schema.get("properties") or {}).items()}

    def published():  # kubectl validates against the server's OpenAPI, which follows Established by a while
        definitions = k.request("GET", "/openapi/v2").get("definitions") or {}
        served = definitions.get(f"io.pdserve.v1alpha1.{crd['spec']['names']['kind']}")
        ours = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        return served and fields(served["properties"].get("spec") or {}) == fields(ours)
    wait_for(published, "this version's CRD schema in the server's OpenAPI")
    return k


@pytest.fixture(scope="module")
def operator_env(kube):
    """The chart's environment for the operator: NATS URL and a credentials Secret."""
    ns = "pdserve-system"
    try:
        kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pdserve-nats", "namespace": ns},
                     "stringData": {"user": "pdserve", "password": "test-password-123"}})
    except client.ApiException as e:
        if e.status != 409:
            raise
    env = {"PDSERVE_NATS_URL": "nats://pdserve-nats.pdserve-system:4222", "PDSERVE_NATS_SECRET": "pdserve-nats",
           "PDSERVE_NATS_SECRET_NAMESPACE": ns, "PDSERVE_IMAGE": "ghcr.io/pdserve/pdserve:0.1.0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run_operator(*namespaces: str):
    """The operator in this process, over every namespace or only `namespaces` (a test that counts
    writes to a shared object watches only its own: the session's cluster holds other tests' leftovers)."""
    from kopf.testing import KopfRunner

    scope = [a for ns in namespaces for a in ("-n", ns)] or ["--all-namespaces"]
    return KopfRunner(["run", "--standalone", *scope, "-m", "pdserve.operator.handlers"], timeout=60)


def isvc(name: str, ns: str, **spec) -> dict:
    body = {"model": {"path": "tiny-llama", "pvc": "models"}}
    body.update(spec)
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name, "namespace": ns}, "spec": body}


def get_isvc(kube, ns, name):
    return kube.get(API, "InferenceService", ns, name)


def mark_pods_ready(kube, ns: str, component: str) -> int:
    """Stand in for the kubelet: every Pod of the pool becomes Running and Ready."""
    pods = kube.request("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector="
                               f"app.kubernetes.io/component={component}")["items"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for i, p in enumerate(pods):
        kube.merge_patch("v1", "Pod", ns, p["metadata"]["name"], {"status": {
            "phase": "Running", "podIP": f"10.1.0.{i + 2}", "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                           {"type": "ContainersReady", "status": "True", "lastTransitionTime": now}]}},
            sub="status")
    return len(pods)


def test_lifecycle_children_status_update_restart_delete(kube, operator_env, k8s_namespace, k8s_tool, k8s_cluster):
    ns, name = k8s_namespace, "llama"

    with run_operator() as runner:
        kube.create(isvc(name, ns, decode={"gpus": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
                         speculation={"draftPool": {"autoscaling": {"maxReplicas": 5}, "suffixIndex": {"minN": 3}}}))
        deps = {p: wait_for(lambda p=p: kube.get("apps/v1", "Deployment", ns, f"{name}-{p}"), f"{p} Deployment")
                for p in ("prefill", "decode", "front", "draftpool")}
        # The PDBs are applied last: once they exist, every child does.
        wait_for(lambda: kube.get("policy/v1beta1", "PodDisruptionBudget", ns, f"{name}-draftpool"), "draftpool PDB")
        owner = get_isvc(kube, ns, name)
        uid = owner["metadata"]["uid"]
        children = [*deps.values(),
                    kube.get("v1", "Service", ns, name), kube.get("v1", "Service", ns, f"{name}-decode"),
                    kube.get("v1", "Secret", ns, f"{name}-nats"),
                    kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, f"{name}-workers"),
                    kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, f"{name}-front")]
        # The test server is v1.20: discovery must have picked autoscaling/v2beta2 and policy/v1beta1.
        for pool in ("prefill", "decode", "draftpool"):
            children.append(kube.get("autoscaling/v2beta2", "HorizontalPodAutoscaler", ns, f"{name}-{pool}"))
            children.append(kube.get("policy/v1beta1", "PodDisruptionBudget", ns, f"{name}-{pool}"))
        for c in children:
            assert c is not None
            assert [o["uid"] for o in c["metadata"]["ownerReferences"]] == [uid], c["metadata"]["name"]
            assert c["metadata"]["labels"]["app.kubernetes.io/instance"] == name
        # the server took the workers' policy as rendered: ingress from the deployment's own pods only
        netpol = kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, f"{name}-workers")["spec"]
        assert netpol["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": name}}}]
        dec = deps["decode"]["spec"]["template"]["spec"]["containers"][0]
        assert dec["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert deps["prefill"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        hpa = kube.get("autoscaling/v2beta2", "HorizontalPodAutoscaler", ns, f"{name}-decode")
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pdserve_decode_kv_utilization"
        assert hpa["spec"]["maxReplicas"] == 3
        # the draft pool: its own HPA and metric, `pdserve draftpool` with the spec's settings, decode asking it
        hpa = kube.get("autoscaling/v2beta2", "HorizontalPodAutoscaler", ns, f"{name}-draftpool")
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pdserve_draftpool_requests_per_second"
        assert (hpa["spec"]["scaleTargetRef"]["name"], hpa["spec"]["maxReplicas"]) == (f"{name}-draftpool", 5)
        pool = deps["draftpool"]["spec"]["template"]["spec"]["containers"][0]
        assert pool["command"] == ["pdserve", "draftpool"] and pool["args"][pool["args"].index("--min-n") + 1] == "3"
        assert "--draft-pool" in dec["args"]
        assert "draftpool" in netpol["podSelector"]["matchExpressions"][0]["values"]  # its metrics port: the workers'

        # Nothing is ready yet: pods exist (ReplicaSet controller) but stay Pending.
        st = wait_for(lambda: (get_isvc(kube, ns, name).get("status") or {}).get("decode"), "status.decode")
        assert st["readyReplicas"] == 0
        assert get_isvc(kube, ns, name)["status"]["ready"] == "False"

        for pool in ("prefill", "decode", "front", "draftpool"):
            wait_for(lambda pool=pool: mark_pods_ready(kube, ns, pool) >= 1, f"{pool} pods")

        def ready():
            s = get_isvc(kube, ns, name).get("status") or {}
            return s.get("ready") == "True" and s
        st = wait_for(ready, "InferenceService Ready=True")
        assert st["prefill"]["replicas"] == "1/1" and st["decode"]["replicas"] == "1/1"
        assert st["draftpool"]["replicas"] == "1/1"
        assert st["endpoint"] == f"http://{name}.{ns}.svc.cluster.local:8000"
        assert st["observedGeneration"] == get_isvc(kube, ns, name)["metadata"]["generation"]
        # What an admin sees: the printer columns.
        out = subprocess.run([k8s_tool("kubectl"), "--kubeconfig", k8s_cluster.kubeconfig, "-n", ns, "get", "pdis"],
                             capture_output=True, text=True, check=True).stdout
        header, row = out.splitlines()[:2]
        assert header.split() == ["NAME", "MODEL", "PREFILL", "DECODE", "READY", "AGE"]
        assert row.split()[:5] == [name, "tiny-llama", "1/1", "1/1", "True"]

        # A child deleted by hand comes back.
        old_uid = kube.get("apps/v1", "Deployment", ns, f"{name}-prefill")["metadata"]["uid"]
        kube.request("DELETE", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}-prefill")
        wait_for(lambda: (kube.get("apps/v1", "Deployment", ns, f"{name}-prefill") or {"metadata": {"uid": old_uid}})
                 ["metadata"]["uid"] != old_uid, "prefill Deployment recreated")

        # A spec change rolls the pools: new GPU count, HPA bounds, decode autoscaling off, the draft pool off.
        kube.merge_patch(API, "InferenceService", ns, name, {"spec": {
            "prefill": {"gpus": 4, "autoscaling": {"maxReplicas": 6}},
            "decode": {"replicas": 2, "autoscaling": {"enabled": False}},
            "speculation": {"draftPool": {"enabled": False}}}})
        wait_for(lambda: kube.get("apps/v1", "Deployment", ns, f"{name}-prefill")["spec"]["template"]["spec"]
                 ["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4", "prefill GPUs 4")
        wait_for(lambda: kube.get("autoscaling/v2beta2", "HorizontalPodAutoscaler", ns,
                                  f"{name}-prefill")["spec"]["maxReplicas"] == 6, "prefill HPA max 6")
        wait_for(lambda: kube.get("autoscaling/v2beta2", "HorizontalPodAutoscaler", ns, f"{name}-decode") is None,
                 "decode HPA removed")
        wait_for(lambda: kube.get("apps/v1", "Deployment", ns, f"{name}-decode")["spec"]["replicas"] == 2,
                 "decode replicas 2")
        wait_for(lambda: get_isvc(kube, ns, name)["status"]["decode"]["desiredReplicas"] == 2, "status desired 2")
        wait_for(lambda: all(kube.get(api, kind, ns, f"{name}-draftpool") is None for api, kind in (
            ("apps/v1", "Deployment"), ("autoscaling/v2beta2", "HorizontalPodAutoscaler"),
            ("policy/v1beta1", "PodDisruptionBudget"))), "the draft pool's children removed")
        assert "--draft-pool" not in kube.get("apps/v1", "Deployment", ns, f"{name}-decode")["spec"]["template"][
            "spec"]["containers"][0]["args"]
    assert runner.exception is None

    # Operator down: the spec changes anyway; a restarted operator converges.
    kube.merge_patch(API, "InferenceService", ns, name, {"spec": {"front": {"replicas": 3}}})
    kube.request("DELETE", f"/apis/policy/v1beta1/namespaces/{ns}/poddisruptionbudgets/{name}-decode")
    with run_operator() as runner:
        wait_for(lambda: kube.get("apps/v1", "Deployment", ns, f"{name}-front")["spec"]["replicas"] == 3,
                 "front replicas 3 after restart")
        wait_for(lambda: kube.get("policy/v1beta1", "PodDisruptionBudget", ns, f"{name}-decode"),
                 "PDB deleted while the operator was down is back")

        kube.request("DELETE", f"/apis/{API}/namespaces/{ns}/inferenceservices/{name}")

        def collected():
            left = [kube.get("apps/v1", "Deployment", ns, f"{name}-{p}") for p in ("prefill", "decode", "front")]
            left += [kube.get("v1", "Service", ns, name), kube.get("v1", "Secret", ns, f"{name}-nats"),
                     kube.get("autoscaling/v2beta2", "HorizontalPodAutoscaler", ns, f"{name}-prefill"),
                     kube.get("policy/v1beta1", "PodDisruptionBudget", ns, f"{name}-prefill"),
                     kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, f"{name}-workers")]
            return all(x is None for x in left)
        wait_for(collected, "children garbage-collected")
    assert runner.exception is None


def _kubectl_apply(k8s_tool, k8s_cluster, obj: dict):
    return subprocess.run([k8s_tool("kubectl"), "--kubeconfig", k8s_cluster.kubeconfig, "apply", "-f", "-"],
                          input=yaml.safe_dump(obj), capture_output=True, text=True)


@pytest.mark.parametrize("spec,message", [
    ({"model": None}, "spec.model: Required value"),
    ({"prefill": {"replicas": "two"}}, "spec.prefill.replicas: Invalid value"),
    ({"kvTransfer": {"compression": "zstd"}}, 'spec.kvTransfer.compression: Unsupported value: "zstd"'),
    ({"decode": {"gpus": -1}}, "spec.decode.gpus: Invalid value: -1"),
    ({"model": {"pvc": "models"}}, "spec.model.path: Required value"),
    ({"speculation": {"draftPool": {"drafter": "model"}}}, 'spec.speculation.draftPool.drafter: Unsupported value'),
])
def test_schema_refuses_invalid_objects(kube, k8s_namespace, spec, message):
    body = isvc("bad", k8s_namespace)
    body["spec"].update(spec)
    body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
    with pytest.raises(client.ApiException) as err:
        kube.create(body)
    assert err.value.status == 422
    assert message in json.loads(err.value.body)["message"]


def test_unknown_fields_refused_by_kubectl_and_pruned_by_server(kube, k8s_namespace, k8s_tool, k8s_cluster):
    body = isvc("typo", k8s_namespace, decode={"replica": 3})
    out = _kubectl_apply(k8s_tool, k8s_cluster, body)
    assert out.returncode != 0 and 'unknown field "replica" in io.pdserve.v1alpha1.InferenceService.spec.decode' in out.stderr, out.stderr
    # A client that skips validation: the structural schema prunes the unknown field (v1.20 has
    # no server-side strict field validation), so it can never reach the operator.
    kube.create(body)
    assert "replica" not in get_isvc(kube, k8s_namespace, "typo")["spec"]["decode"]


def _webhook_certs(tmp: Path) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1, generated here (the apiserver must trust it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (tmp / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    return str(tmp / "tls.crt"), str(tmp / "tls.key"), ca.public_bytes(serialization.Encoding.PEM).decode()


def test_webhook_refuses_cross_field_mistakes_and_reconciler_reports_bypass(
        kube, operator_env, k8s_namespace, tmp_path, monkeypatch):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cert, key, ca = _webhook_certs(tmp_path)
    monkeypatch.setenv("PDSERVE_WEBHOOK_CERT", cert)
    monkeypatch.setenv("PDSERVE_WEBHOOK_KEY", key)
    monkeypatch.setenv("PDSERVE_WEBHOOK_PORT", str(port))
    monkeypatch.setenv("PDSERVE_WEBHOOK_ADDR", "127.0.0.1")
    ns = k8s_namespace
    kube.request("PATCH", f"/api/v1/namespaces/{ns}", {"metadata": {"labels": {"pdserve-webhook": "on"}}},
                 content_type="application/merge-patch+json")
    vwc = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
           "metadata": {"name": f"pdserve-test-{ns}"},
           "webhooks": [{
               "name": "validate.inferenceservices.pdserve.io",
               "clientConfig": {"url": f"https://127.0.0.1:{port}/validate-inferenceservice",
                                "caBundle": base64.b64encode(ca.encode()).decode()},
               "rules": [{"apiGroups": ["pdserve.io"], "apiVersions": ["v1alpha1"],
                          "operations": ["CREATE", "UPDATE"], "resources": ["inferenceservices"]}],
               "namespaceSelector": {"matchLabels": {"pdserve-webhook": "on"}},
               "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"],
               "timeoutSeconds": 10}]}
    vwc_path = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
    kube.request("POST", vwc_path, vwc)
    bypass_ns = f"{ns}-nowebhook"
    kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": bypass_ns}})
    try:
        with run_operator() as runner:
            # The webhook may take a moment to listen: wait until a valid object is admitted.
            wait_for(lambda: kube.create(isvc("good", ns)), "webhook admitting a valid object")
            cases = [
                ({"decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
                 "spec.decode.autoscaling.minReplicas (5) is greater than spec.decode.autoscaling.maxReplicas (2)"),
                ({"decode": {"kv": {"dtype": "float16"}}},
                 "spec.prefill.kv.dtype (bfloat16) differs from spec.decode.kv.dtype (float16)"),
                ({"model": {"path": "m", "pvc": "p", "tokenizer": "llama3"},
                  "speculation": {"method": "draft", "draft": {"path": "d", "tokenizer": "gpt2"}}},
                 "must share the target's tokenizer"),
                ({"decode": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
                 "spec.decode.resources.limits.nvidia.com/gpu is set; a pool's GPUs come from spec.decode.gpus"),
                ({"prefill": {"gpus": 0, "resources": {"requests": {"nvidia.com/gpu": 1}}}},
                 "spec.prefill.resources.requests.nvidia.com/gpu is set"),
                ({"speculation": {"method": "none", "draftPool": {}}},
                 "spec.speculation.draftPool is set but spec.speculation.method is 'none'"),
            ]
            for spec, message in cases:
                with pytest.raises(client.ApiException) as err:
                    kube.create(isvc("bad", ns, **spec))
                assert err.value.status == 422, err.value.body
                text = json.loads(err.value.body)["message"]
                assert "denied the request" in text and message in text, text
            # An UPDATE that breaks a rule is refused too, and the stored object is unchanged.
            with pytest.raises(client.ApiException) as err:
                kube.merge_patch(API, "InferenceService", ns, "good", {"spec": {"prefill": {"kv": {"blockSize": 32}}}})
            assert "same KV block size" in json.loads(err.value.body)["message"]
            assert get_isvc(kube, ns, "good")["spec"]["prefill"]["kv"]["blockSize"] == 16

            # Where the webhook does not reach, the reconciler refuses to build pools and says why.
            kube.create(isvc("mismatch", bypass_ns, decode={"kv": {"dtype": "float16"}}))

            def degraded():
                conds = (get_isvc(kube, bypass_ns, "mismatch").get("status") or {}).get("conditions") or []
                return next((c for c in conds if c["type"] == "Degraded" and c["status"] == "True"), None)
            cond = wait_for(degraded, "Degraded condition")
            assert cond["reason"] == "InvalidSpec" and "kv.dtype" in cond["message"]
            assert kube.get("apps/v1", "Deployment", bypass_ns, "mismatch-decode") is None
            events = wait_for(lambda: [e for e in kube.request("GET", f"/api/v1/namespaces/{bypass_ns}/events")["items"]
                                       if e.get("reason") == "InvalidSpec"], "InvalidSpec event")
            assert events[0]["type"] == "Warning" and "kv.dtype" in events[0]["message"]
        assert runner.exception is None
    finally:
        kube.request("DELETE", f"{vwc_path}/pdserve-test-{ns}")
        kube.request("DELETE", f"/api/v1/namespaces/{bypass_ns}")


def test_prefill_hpa_bounds_follow_decode_within_ratio(kube, operator_env, k8s_namespace):
    """prefill:decode in [0.5, 1.0]: as decode grows from 2 to 6 replicas, the operator moves the
    prefill HPA's bounds from [1, 2] to [3, 6] (decode pinned here, so no metrics are needed)."""
    ns, name = k8s_namespace, "ratio"
    hpa_of = lambda: kube.get("autoscaling/v2beta2", "HorizontalPodAutoscaler", ns, f"{name}-prefill")  # noqa: E731
    with run_operator() as runner:
        kube.create(isvc(name, ns, prefill={"autoscaling": {"minReplicas": 1, "maxReplicas": 10}},
                         decode={"replicas": 2, "autoscaling": {"enabled": False}},
                         autoscaling={"prefillDecodeRatio": {"min": 0.5, "max": 1.0}}))
        wait_for(lambda: (h := hpa_of()) and (h["spec"]["minReplicas"], h["spec"]["maxReplicas"]) == (1, 2),
                 "prefill HPA [1, 2] for decode=2")
        kube.merge_patch(API, "InferenceService", ns, name, {"spec": {"decode": {"replicas": 6}}})
        wait_for(lambda: (h := hpa_of()) and (h["spec"]["minReplicas"], h["spec"]["maxReplicas"]) == (3, 6),
                 "prefill HPA [3, 6] for decode=6")
    assert runner.exception is None


@pytest.mark.parametrize("name", ["a" * 100, "a" * 57, "qwen.v2", "Qwen"])
def test_names_the_children_could_not_carry_are_refused_at_apply(kube, k8s_namespace, name):
    """No webhook needed: the CRD schema holds metadata.name to what every child name allows
    (a Service is named after the InferenceService; <name>-decode must fit 63 characters)."""
    with pytest.raises(client.ApiException) as err:
        kube.create(isvc(name, k8s_namespace))
    assert err.value.status == 422
    assert "metadata.name" in json.loads(err.value.body)["message"]
    kube.create(isvc("a" * 56, k8s_namespace))  # the longest that fits


def _condition(kube, ns, name, type_):
    conds = (get_isvc(kube, ns, name).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == type_), None)


def _warnings(kube, ns, name, reason):
    return [e for e in kube.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
            if e.get("type") == "Warning" and e.get("reason") == reason and e["involvedObject"]["name"] == name]


def test_a_refused_child_degrades_the_service_with_the_servers_reason_and_an_event(
        kube, operator_env, k8s_namespace):
    """A spec that passes every rule can still render a child the API server refuses (here a pod
    template override it finds invalid): the other children are applied, Degraded says which child
    and why in the server's words, a Warning event says the same, and fixing the spec heals it."""
    ns, name = k8s_namespace, "bad-pod"
    with run_operator() as runner:
        kube.create(isvc(name, ns, prefill={"podTemplate": {"spec": {"dnsPolicy": "Sometimes"}}}))
        cond = wait_for(lambda: (c := _condition(kube, ns, name, "Degraded")) and c["status"] == "True" and c,
                        "Degraded=True")
        assert cond["reason"] == "Invalid", cond
        assert f"Deployment {name}-prefill" in cond["message"] and "dnsPolicy" in cond["message"], cond
        assert _condition(kube, ns, name, "Ready")["status"] == "False"
        event = wait_for(lambda: _warnings(kube, ns, name, "Invalid"), "Warning event")[0]
        assert "dnsPolicy" in event["message"] and event["involvedObject"]["kind"] == "InferenceService"
        assert kube.get("apps/v1", "Deployment", ns, f"{name}-decode") is not None, "the rest is applied"
        assert kube.get("apps/v1", "Deployment", ns, f"{name}-prefill") is None

        kube.merge_patch(API, "InferenceService", ns, name, {"spec": {"prefill": {"podTemplate": None}}})
        wait_for(lambda: kube.get("apps/v1", "Deployment", ns, f"{name}-prefill"), "prefill Deployment after the fix")
        wait_for(lambda: _condition(kube, ns, name, "Degraded")["status"] == "False", "Degraded=False after the fix")
    assert runner.exception is None


def test_children_are_server_side_applied_and_foreign_objects_left_alone(kube, operator_env, k8s_namespace):
    """The operator's fields belong to its field manager: a hand edit of one is undone at the
    next apply. An object of the same name that the InferenceService does not own is never
    taken over: Degraded (NotOwned) and a Warning event say so, and it stays as it was."""
    ns, name = k8s_namespace, "ssa"
    foreign = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
               "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 80}]}}
    kube.create(foreign)
    with run_operator() as runner:
        kube.create(isvc(name, ns))
        cond = wait_for(lambda: (c := _condition(kube, ns, name, "Degraded")) and c["status"] == "True" and c,
                        "Degraded=True")
        assert cond["reason"] == "NotOwned" and f"Service {ns}/{name} already exists" in cond["message"], cond
        wait_for(lambda: _warnings(kube, ns, name, "NotOwned"), "Warning event")
        svc = kube.get("v1", "Service", ns, name)
        assert svc["spec"]["selector"] == {"app": "someone-else"} and not svc["metadata"].get("ownerReferences")

        dep = wait_for(lambda: kube.get("apps/v1", "Deployment", ns, f"{name}-decode"), "decode Deployment")
        managers = {(f["manager"], f["operation"]) for f in dep["metadata"]["managedFields"]}
        assert ("pdserve-operator", "Apply") in managers, managers
        kube.merge_patch("apps/v1", "Deployment", ns, f"{name}-decode", {"spec": {"template": {"spec": {
            "containers": [{"name": "decode", "image": "someone/else:1"}]}}}})
        # The foreign Service goes; the next apply (a spec change) takes the name and undoes the edit.
        kube.request("DELETE", f"/api/v1/namespaces/{ns}/services/{name}")
        kube.merge_patch(API, "InferenceService", ns, name, {"spec": {"front": {"replicas": 2}}})
        wait_for(lambda: (kube.get("v1", "Service", ns, name) or {}).get("metadata", {}).get("ownerReferences"),
                 "front Service applied once the name is free")
        wait_for(lambda: kube.get("apps/v1", "Deployment", ns, f"{name}-decode")["spec"]["template"]["spec"]
                 ["containers"][0]["image"] == "ghcr.io/pdserve/pdserve:0.1.0", "hand edit undone")
        wait_for(lambda: _condition(kube, ns, name, "Degraded")["status"] == "False", "Degraded=False")
    assert runner.exception is None
