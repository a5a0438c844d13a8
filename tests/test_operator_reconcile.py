"""The operator's pure parts, without a cluster: desired children, status, cross-field validation,
the CRD schema defaults, and the chart's CRD file being generated from the Python one."""
from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from pdserve.operator import crd
from pdserve.operator.reconcile import (OperatorConfig, compute_status, desired_children,
                                        prefill_bounds_for_ratio)
from pdserve.operator.validation import validate_spec

REPO = Path(__file__).resolve().parents[1]


def isvc(spec: dict | None = None, name: str = "llama", ns: str = "ml") -> dict:
    base = {"model": {"path": "llama-3-8b", "pvc": "models"}}
    base.update(spec or {})
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": ns, "uid": "uid-1", "generation": 3}, "spec": base}


CFG = OperatorConfig(image="ghcr.io/pdserve/pdserve:0.1.0", nats_url="nats://pdserve-nats.sys:4222",
                     nats_credentials={"user": "pdserve", "password": "s3cret"},
                     hpa_api_version="autoscaling/v2beta2", pdb_api_version="policy/v1beta1")


def by_kind_name(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def container(children, name):
    return by_kind_name(children)[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]


def test_children_set_owner_refs_and_labels():
    children = desired_children(isvc(), CFG)
    keys = set(by_kind_name(children))
    assert keys == {
        ("Secret", "llama-nats"),
        ("Deployment", "llama-prefill"), ("Deployment", "llama-decode"), ("Deployment", "llama-front"),
        ("Service", "llama"), ("Service", "llama-decode"),
        ("HorizontalPodAutoscaler", "llama-prefill"), ("HorizontalPodAutoscaler", "llama-decode"),
        ("PodDisruptionBudget", "llama-prefill"), ("PodDisruptionBudget", "llama-decode"),
    }
    for c in children:
        assert c["metadata"]["namespace"] == "ml"
        [ref] = c["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService", "name": "llama",
                       "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
        assert c["metadata"]["labels"]["app.kubernetes.io/instance"] == "llama"
        assert c["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pdserve-operator"
    hpa = by_kind_name(children)[("HorizontalPodAutoscaler", "llama-decode")]
    assert hpa["apiVersion"] == "autoscaling/v2beta2"
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "pdserve_decode_kv_utilization"},
        "target": {"type": "AverageValue", "averageValue": "800m"}}}]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    prefill_hpa = by_kind_name(children)[("HorizontalPodAutoscaler", "llama-prefill")]
    assert prefill_hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pdserve_prefill_queue_depth"
    assert by_kind_name(children)[("PodDisruptionBudget", "llama-decode")]["apiVersion"] == "policy/v1beta1"


def test_worker_command_lines_env_and_gpus():
    children = desired_children(isvc({"decode": {"gpus": 2}}), CFG)
    p = container(children, "llama-prefill")
    assert p["command"] == ["pdserve", "prefill", "--model", "/models/llama-3-8b", "--nats-url",
                            "nats://pdserve-nats.sys:4222", "--data-port", "7100", "--metrics-port", "9100"]
    d = container(children, "llama-decode")
    assert d["command"] == ["pdserve", "decode", "--model", "/models/llama-3-8b", "--nats-url",
                            "nats://pdserve-nats.sys:4222", "--data-port", "7200", "--metrics-port", "9100",
                            "--spec-method", "ngram", "--spec-max-k", "8", "--kv-compression", "none"]
    f = container(children, "llama-front")
    assert f["command"] == ["pdserve", "front", "--model", "/models/llama-3-8b", "--nats-url",
                            "nats://pdserve-nats.sys:4222", "--port", "8000"]
    assert p["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert d["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "nvidia.com/gpu" not in f["resources"].get("limits", {})
    env = {e["name"]: e for e in d["env"]}
    assert env["PDSERVE_POOL"]["value"] == "decode" and env["PDSERVE_ISVC"]["value"] == "llama"
    penv = {e["name"]: e.get("value") for e in p["env"]}
    # Both ends of a KV transfer must agree on its layout and encoding.
    assert (penv["PDSERVE_KV_DTYPE"], penv["PDSERVE_KV_BLOCK_SIZE"], penv["PDSERVE_KV_COMPRESSION"]) == ("bfloat16", "16", "none")
    assert penv["PDSERVE_KV_FAILURE_POLICY"] == "recompute" and penv["PDSERVE_POOL"] == "prefill"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PDSERVE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "llama-nats", "key": "password"}
    # Secrets never appear in arguments or plain env values.
    for c in (p, d, f):
        flat = " ".join(c["command"]) + " ".join(str(e.get("value", "")) for e in c["env"])
        assert "s3cret" not in flat
    secret = by_kind_name(children)[("Secret", "llama-nats")]
    assert base64.b64decode(secret["data"]["password"]).decode() == "s3cret"
    pod = by_kind_name(children)[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    assert pod["volumes"][0] == {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_shared_memory_is_bounded_and_the_kv_pool_fits_in_it():
    """/dev/shm is memory counted against the pod: the operator bounds it (kvTransfer.shmSizeLimit) and
    tells the workers to keep at most half of it as idle KV segments."""
    for spec, limit, pool_bytes in (({}, "4Gi", 2 << 30), ({"kvTransfer": {"shmSizeLimit": "768Mi"}}, "768Mi", 384 << 20)):
        children = desired_children(isvc(spec), CFG)
        for name in ("llama-prefill", "llama-decode"):
            pod = by_kind_name(children)[("Deployment", name)]["spec"]["template"]["spec"]
            assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": limit}} in pod["volumes"]
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            assert env["PDSERVE_SHM_POOL_BYTES"] == str(pool_bytes)
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pattern = schema["properties"]["spec"]["properties"]["kvTransfer"]["properties"]["shmSizeLimit"]["pattern"]
    import re
    assert all(re.match(pattern, q) for q in ("64Mi", "4Gi", "1Ti"))
    assert not any(re.match(pattern, q) for q in ("4G", "4gi", "-1Gi", "1.5Gi", "4Gi; rm", ""))


def test_api_key_external_nats_and_overrides():
    spec = {
        "serving": {"port": 9000, "apiKeySecret": {"name": "api", "key": "token"}},
        "nats": {"url": "nats://ext:4222", "credentialsSecret": {"name": "ext-nats"}},
        "speculation": {"method": "draft", "maxK": 4, "draft": {"path": "tiny", "tokenizer": "llama3"}},
        "model": {"path": "big", "image": "registry/models:big", "tokenizer": "llama3"},
        "prefill": {"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                    "resources": {"requests": {"cpu": "4", "memory": "32Gi"}},
                    "podTemplate": {"metadata": {"annotations": {"a": "b"}},
                                    "spec": {"priorityClassName": "serving",
                                             "containers": [{"name": "prefill", "workingDir": "/tmp"}]}}},
    }
    children = desired_children(isvc(spec), CFG)
    kinds = by_kind_name(children)
    assert ("Secret", "llama-nats") not in kinds  # user-named secret used as-is
    f = container(children, "llama-front")
    assert f["command"][-2:] == ["--port", "9000"]
    assert "--nats-url" in f["command"] and "nats://ext:4222" in f["command"]
    fenv = {e["name"]: e for e in f["env"]}
    assert fenv["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "api", "key": "token"}
    assert fenv["PDSERVE_NATS_USER"]["valueFrom"]["secretKeyRef"] == {"name": "ext-nats", "key": "user"}
    d = container(children, "llama-decode")
    assert d["command"][-8:] == ["--spec-method", "draft", "--spec-max-k", "4", "--kv-compression", "none",
                                 "--draft-model", "/models/tiny"]
    pre = kinds[("Deployment", "llama-prefill")]["spec"]["template"]
    assert pre["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pre["spec"]["priorityClassName"] == "serving"
    assert pre["spec"]["containers"][0]["workingDir"] == "/tmp"
    assert pre["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "4", "memory": "32Gi"}
    assert pre["spec"]["initContainers"][0]["image"] == "registry/models:big"
    assert pre["metadata"]["annotations"]["a"] == "b"
    assert kinds[("Service", "llama")]["spec"]["ports"][0]["port"] == 9000


def test_autoscaling_disabled_uses_replicas_and_drops_hpa():
    children = desired_children(isvc({"decode": {"replicas": 3, "autoscaling": {"enabled": False}}}), CFG)
    kinds = by_kind_name(children)
    assert ("HorizontalPodAutoscaler", "llama-decode") not in kinds
    assert kinds[("Deployment", "llama-decode")]["spec"]["replicas"] == 3


@pytest.mark.parametrize("decode,ratio,expected", [
    (4, {"min": 0.5, "max": 1.0}, (2, 4)),
    (10, {"min": 0.5, "max": 1.0}, (5, 8)),    # clamped by the prefill pool's max of 8
    (1, {"min": 2.0}, (2, 8)),
    (3, {}, (1, 8)),
    (8, {"min": 2.0, "max": 3.0}, (8, 8)),     # can't satisfy: bounds stay ordered
])
def test_ratio_bounds(decode, ratio, expected):
    spec = crd.apply_defaults({"model": {"path": "m"}, "prefill": {"autoscaling": {"maxReplicas": 8}},
                               "autoscaling": {"prefillDecodeRatio": ratio}})
    assert prefill_bounds_for_ratio(spec, decode) == expected


def test_ratio_bounds_reach_the_prefill_hpa():
    body = isvc({"prefill": {"autoscaling": {"maxReplicas": 10}},
                 "autoscaling": {"prefillDecodeRatio": {"min": 1.0, "max": 2.0}}})
    hpa = by_kind_name(desired_children(body, CFG, observed={"decode": 3}))[("HorizontalPodAutoscaler", "llama-prefill")]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 6)


def _dep(replicas, ready, gen=1, observed=1, updated=None):
    return {"metadata": {"generation": gen}, "spec": {"replicas": replicas},
            "status": {"readyReplicas": ready, "observedGeneration": observed,
                       "updatedReplicas": replicas if updated is None else updated}}


def test_status_follows_deployments():
    body = isvc()
    st = compute_status(body, {"prefill": _dep(2, 1), "decode": _dep(1, 1), "front": _dep(1, 1)}, [], "T0")
    assert st["prefill"] == {"desiredReplicas": 2, "readyReplicas": 1, "replicas": "1/2"}
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Ready"]["status"] == "False" and "prefill: 1/2" in conds["Ready"]["message"]
    assert st["ready"] == "False" and st["observedGeneration"] == 3
    assert st["endpoint"] == "http://llama.ml.svc.cluster.local:8000"
    body["status"] = st
    st2 = compute_status(body, {"prefill": _dep(2, 2), "decode": _dep(1, 1), "front": _dep(1, 1)}, [], "T1")
    conds2 = {c["type"]: c for c in st2["conditions"]}
    assert conds2["Ready"]["status"] == "True" and conds2["Ready"]["lastTransitionTime"] == "T1"
    assert conds2["Degraded"]["status"] == "False"
    assert conds2["Degraded"]["lastTransitionTime"] == "T0"  # unchanged condition keeps its time
    st3 = compute_status(body, {"prefill": _dep(2, 2, gen=2, observed=1), "decode": _dep(1, 1),
                                "front": None}, [], "T2")
    conds3 = {c["type"]: c for c in st3["conditions"]}
    assert conds3["Progressing"]["status"] == "True" and "prefill" in conds3["Progressing"]["message"]
    st4 = compute_status(body, {"prefill": _dep(1, 1), "decode": _dep(1, 1), "front": _dep(1, 1)},
                         ["spec.x is wrong"], "T3")
    conds4 = {c["type"]: c for c in st4["conditions"]}
    assert conds4["Degraded"]["status"] == "True" and conds4["Degraded"]["reason"] == "InvalidSpec"
    assert conds4["Ready"]["status"] == "False"


def test_validation_accepts_a_good_spec():
    assert validate_spec(isvc()["spec"]) == []


@pytest.mark.parametrize("spec,needle", [
    ({"decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}, "spec.decode.autoscaling.minReplicas (5)"),
    ({"decode": {"kv": {"dtype": "float16"}}}, "spec.prefill.kv.dtype (bfloat16) differs from spec.decode.kv.dtype"),
    ({"prefill": {"kv": {"blockSize": 32}}}, "same KV block size"),
    ({"kvTransfer": {"compression": "fp8"}, "decode": {"kv": {"compressions": ["none", "int8"]}}},
     "spec.decode.kv.compressions"),
    ({"speculation": {"method": "draft"}}, "spec.speculation.draft.path is not set"),
    ({"model": {"path": "m", "pvc": "p", "tokenizer": "llama3"},
      "speculation": {"method": "draft", "draft": {"path": "d", "tokenizer": "gpt2"}}}, "must share the target's tokenizer"),
    ({"model": {"path": "m"}}, "spec.model needs a source for /models"),
    ({"autoscaling": {"prefillDecodeRatio": {"min": 2, "max": 1}}}, "prefillDecodeRatio.min (2)"),
])
def test_validation_refuses_cross_field_mistakes(spec, needle):
    errors = validate_spec(isvc(spec)["spec"])
    assert any(needle in e for e in errors), errors


def test_chart_crd_is_generated_from_python():
    path = REPO / "charts/pdserve/crds/inferenceservices.yaml"
    assert yaml.safe_load(path.read_text()) == crd.crd()


def test_crd_schema_is_structural_and_defaults_match():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["properties"]["spec"]["required"] == ["model"]
    spec = crd.apply_defaults({"model": {"path": "m"}})
    assert spec["decode"]["autoscaling"]["metric"]["name"] == "pdserve_decode_kv_utilization"
    assert spec["prefill"]["dataPort"] == 7100 and spec["speculation"] == {"method": "ngram", "maxK": 8}

    def walk(s, path="$"):
        # Structural schema: every node has a type, except int-or-string and preserve-unknown nodes.
        assert "type" in s or s.get("x-kubernetes-int-or-string"), path
        for k, sub in (s.get("properties") or {}).items():
            walk(sub, f"{path}.{k}")
        if isinstance(s.get("items"), dict):
            walk(s["items"], f"{path}[]")
        if isinstance(s.get("additionalProperties"), dict):
            walk(s["additionalProperties"], f"{path}{{}}")
    walk(schema)


def test_default_config_targets_current_apis():
    cfg = OperatorConfig()
    kinds = {c["kind"]: c["apiVersion"] for c in desired_children(isvc(), cfg)}
    assert kinds["HorizontalPodAutoscaler"] == "autoscaling/v2" and kinds["PodDisruptionBudget"] == "policy/v1"
    img = container(desired_children(isvc(), cfg), "llama-decode")["image"]
    assert img == "ghcr.io/pdserve/pdserve:0.1.0"
    assert container(desired_children(isvc({"image": "my/img:1"}), cfg), "llama-decode")["image"] == "my/img:1"


def test_operator_main_maps_flags_to_env_and_runs_kopf(monkeypatch):
    import kopf

    from pdserve.cli import main as cli_main

    calls = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: calls.update(kw))
    for k in ("PDSERVE_IMAGE", "PDSERVE_NATS_URL", "PDSERVE_WEBHOOK_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so the values main() sets are undone after the test
        monkeypatch.delenv(k)
    assert cli_main(["operator", "--namespace", "ml", "--image", "x/y:1", "--nats-url", "nats://n:4222",
                     "--webhook-port", "9555"]) == 0
    import os
    assert os.environ["PDSERVE_IMAGE"] == "x/y:1" and os.environ["PDSERVE_NATS_URL"] == "nats://n:4222"
    assert os.environ["PDSERVE_WEBHOOK_PORT"] == "9555"
    assert calls["namespaces"] == ["ml"] and calls["clusterwide"] is False and calls["standalone"] is True



def test_stopping_pods_drain_before_the_kubelet_kills_them():
    """Zero-failure rolls and scale-downs: every pod is told its drain bound, gets a grace period
    above it (plus the front's pre-stop wait), and the front keeps accepting until kube-proxy has
    dropped it from its Service; Deployments never go below their serving capacity."""
    children = by_kind_name(desired_children(isvc(), CFG))
    for pool in ("prefill", "decode", "front"):
        d = children[("Deployment", f"llama-{pool}")]["spec"]
        assert d["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        pod = d["template"]["spec"]
        (c,) = pod["containers"]
        drain = float({e["name"]: e.get("value") for e in c["env"]}["PDSERVE_DRAIN_TIMEOUT_SECONDS"])
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
        assert pre_stop[0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + drain
        assert (float(pre_stop[1]) > 0) == (pool == "front")


def test_worker_readiness_probes_the_metrics_endpoint():
    """Prefill dials decode and listens on no data port; both pools serve /metrics once the model
    is loaded and NATS is connected, so that is what readiness waits for."""
    children = by_kind_name(desired_children(isvc(), CFG))
    for name in ("llama-prefill", "llama-decode"):
        container = children[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        assert {"name": "metrics", "containerPort": 9100} in container["ports"]


def test_prefix_cache_settings_reach_front_and_prefill():
    def envs(spec):
        children = desired_children(isvc(spec), OperatorConfig())
        return ({e["name"]: e.get("value") for e in container(children, "llama-front")["env"]},
                {e["name"]: e.get("value") for e in container(children, "llama-prefill")["env"]})

    front, prefill = envs(None)  # defaults: pre-positioning on, offload off
    assert front["PDSERVE_PREPOSITION"] == "1" and prefill["PDSERVE_PREPOSITION_BLOCKS"] == "256"
    assert prefill["PDSERVE_PREFIX_OFFLOAD"] == "0"
    front, prefill = envs({"prefixCache": {"prepositioning": False, "offload": True, "offloadTTLSeconds": 60}})
    assert front["PDSERVE_PREPOSITION"] == "0" and prefill["PDSERVE_PREPOSITION_BLOCKS"] == "0"
    assert (prefill["PDSERVE_PREFIX_OFFLOAD"], prefill["PDSERVE_PREFIX_OFFLOAD_TTL"]) == ("1", "60")
