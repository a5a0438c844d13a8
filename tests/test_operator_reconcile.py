"""The operator's pure parts, without a cluster: desired children, status, cross-field validation,
the CRD schema defaults, and the chart's CRD file being generated from the Python one.

(Longer than our ~600-line norm: every case here renders the same InferenceService fixture through the
one `desired_children` and reads the objects back; split by child kind, each file would repeat the
fixture and its helpers.)"""
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
        ("NetworkPolicy", "llama-workers"), ("NetworkPolicy", "llama-front"),
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


# What a kubelet would put in the downward-API and Secret variables of a pod.
FAKE_POD = {"metadata.name": "llama-pod-abcde", "metadata.namespace": "ml", "status.podIP": "10.1.2.3"}


def parsed(children, pool: str, name: str = "llama"):
    """The settings a pool's container starts with: its args and env parsed by the parser its
    command (`pdserve <pool>`) uses, with downward-API fields and Secret keys filled in."""
    from pdserve import config

    c = container(children, f"{name}-{pool}")
    assert c["command"] == ["pdserve", pool] and "args" in c
    env = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = FAKE_POD[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = f"{ref['name']}/{ref['key']}"
    return config.load(config.COMMANDS[pool], c["args"], env)


def test_worker_command_lines_env_and_gpus():
    children = desired_children(isvc({"decode": {"gpus": 2}}), CFG)
    p, d, f = (parsed(children, pool) for pool in ("prefill", "decode", "front"))
    for cfg, port in ((p, 7100), (d, 7200)):
        assert (cfg.model, cfg.nats.url) == ("/models/llama-3-8b", "nats://pdserve-nats.sys:4222")
        assert (cfg.data_port, cfg.metrics_port, cfg.device) == (port, 9100, "cuda")
    assert (d.spec.method, d.spec.max_k, d.kv.compression, d.data_host) == ("ngram", 8, "none", "0.0.0.0")
    assert d.advertise_host == "10.1.2.3", "decode advertises its pod IP to prefill"
    assert (f.model, f.nats.url, f.port, f.host) == ("/models/llama-3-8b", "nats://pdserve-nats.sys:4222", 8000,
                                                     "0.0.0.0")
    pc, dc, fc = (container(children, f"llama-{pool}") for pool in ("prefill", "decode", "front"))
    assert pc["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert dc["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "nvidia.com/gpu" not in fc["resources"].get("limits", {})
    assert (d.pool, d.isvc, d.worker_id or d.pod_name, d.deployment_scope) == ("decode", "llama", "llama-pod-abcde",
                                                                                "ml.llama")
    assert (p.pool, f.pool, f.deployment_scope) == ("prefill", "front", "ml.llama")
    # Both ends of a KV transfer must agree on its layout and encoding.
    assert (p.dtype, p.block_size, p.kv.compression) == (d.dtype, d.block_size, d.kv.compression) == ("bfloat16", 16, "none")
    assert (f.kv_failure_policy, f.kv_dtype) == ("recompute", "bfloat16")
    env = {e["name"]: e for e in dc["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PDSERVE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "llama-nats", "key": "password"}
    assert d.nats.password.get_secret_value() == "llama-nats/password" and d.nats.user == "llama-nats/user"
    # Secrets never appear in arguments or plain env values.
    for c in (pc, dc, fc):
        flat = " ".join(c["command"] + c["args"]) + " ".join(str(e.get("value", "")) for e in c["env"])
        assert "s3cret" not in flat
    secret = by_kind_name(children)[("Secret", "llama-nats")]
    assert base64.b64decode(secret["data"]["password"]).decode() == "s3cret"
    pod = by_kind_name(children)[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    assert pod["volumes"][0] == {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_shared_memory_is_bounded_and_the_kv_pool_fits_in_it():
    """/dev/shm is memory counted against the pod: the operator bounds it (kvTransfer.shmSizeLimit) and
    tells decode, whose receiver keeps the pool of idle KV segments there, to keep at most half of it."""
    for spec, limit, pool_bytes in (({}, "4Gi", 2 << 30), ({"kvTransfer": {"shmSizeLimit": "768Mi"}}, "768Mi", 384 << 20)):
        children = desired_children(isvc(spec), CFG)
        for name in ("llama-prefill", "llama-decode"):
            pod = by_kind_name(children)[("Deployment", name)]["spec"]["template"]["spec"]
            assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": limit}} in pod["volumes"]
        assert parsed(children, "decode").kv.shm_pool_bytes == pool_bytes
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pattern = schema["properties"]["spec"]["properties"]["kvTransfer"]["properties"]["shmSizeLimit"]["pattern"]
    import re
    assert all(re.match(pattern, q) for q in ("64Mi", "4Gi", "1Ti"))
    assert not any(re.match(pattern, q) for q in ("4G", "4gi", "-1Gi", "1.5Gi", "4Gi; rm", ""))


def test_api_key_external_nats_and_overrides():
    spec = {
        "serving": {"port": 9000, "apiKeySecret": {"name": "api", "key": "token"}, "migrationLimit": 5},
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
    f = parsed(children, "front")
    assert (f.port, f.nats.url, f.migration_limit) == (9000, "nats://ext:4222", 5)
    assert f.api_key.get_secret_value() == "api/token", "the API key comes from the user's Secret"
    assert (f.nats.user, f.nats.password.get_secret_value()) == ("ext-nats/user", "ext-nats/password")
    d = parsed(children, "decode")
    assert (d.spec.method, d.spec.max_k, d.kv.compression, d.spec.draft_model) == ("draft", 4, "none", "/models/tiny")
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
    ({"speculation": {"method": "none", "draftPool": {}}},
     "spec.speculation.draftPool is set but spec.speculation.method is 'none'"),
    ({"speculation": {"draftPool": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}}},
     "spec.speculation.draftPool.autoscaling.minReplicas (3) is greater than"),
    ({"speculation": {"draftPool": {"suffixIndex": {"minN": 12}}}},
     "spec.speculation.draftPool.suffixIndex.minN (12) is greater than .maxN (8, its default)"),
    ({"speculation": {"draftPool": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}},
     "spec.speculation.draftPool.resources.limits.nvidia.com/gpu is set; the suffix drafter runs on the CPU"),
    ({"speculation": {"draftPool": {"resources": {"requests": {"cpu": "lots"}}}}},
     "spec.speculation.draftPool.resources.requests.cpu: 'lots' is not a CPU quantity"),
    ({"speculation": {"draftPool": {"suffixIndex": {"maxTokens": 10 ** 12}, "maxQueue": 10 ** 9}}}, None),
])
def test_validation_refuses_cross_field_mistakes(spec, needle):
    errors = validate_spec(isvc(spec)["spec"])
    assert (errors == []) if needle is None else any(needle in e for e in errors), errors


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
    """Zero-failure rolls and scale-downs: every pod gets a grace period above the drain bound its
    process runs with (plus the front's pre-stop wait), and the front keeps accepting until
    kube-proxy has dropped it from its Service; Deployments never go below their serving capacity."""
    children = desired_children(isvc(), CFG)
    for pool in ("prefill", "decode", "front"):
        d = by_kind_name(children)[("Deployment", f"llama-{pool}")]["spec"]
        assert d["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        pod = d["template"]["spec"]
        (c,) = pod["containers"]
        drain = parsed(children, pool).drain_timeout
        assert drain > 0
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
        assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in container["ports"]


def test_prefix_cache_settings_reach_front_and_prefill():
    def settings(spec):
        children = desired_children(isvc(spec), OperatorConfig())
        return parsed(children, "front"), parsed(children, "prefill")

    front, prefill = settings(None)  # defaults: pre-positioning on, offload off
    assert front.preposition is True and prefill.preposition_budget_blocks == 256
    assert prefill.prefix_offload is False
    front, prefill = settings({"prefixCache": {"prepositioning": False, "offload": True, "offloadTTLSeconds": 60}})
    assert front.preposition is False and prefill.preposition_budget_blocks == 0
    assert (prefill.prefix_offload, prefill.prefix_offload_ttl) == (True, 60)


def test_conditional_disaggregation_settings_reach_prefill_and_decode():
    def settings(spec):
        children = desired_children(isvc(spec), OperatorConfig())
        return parsed(children, "prefill"), parsed(children, "decode")

    prefill, decode = settings(None)  # the worker's default: on for GPUs, off on CPUs
    assert (prefill.defer_queue_tokens, decode.local_prefill_chunk) == (None, 64)
    prefill, decode = settings({"disaggregation": {"deferQueueTokens": 0, "localPrefillChunk": 32}})
    assert (prefill.defer_queue_tokens, decode.local_prefill_chunk) == (0, 32)


@pytest.mark.parametrize("pool_spec,device,threads", [
    ({}, "cuda", 1),                                                        # gpus default 1, no CPU given
    ({"gpus": 0, "resources": {"limits": {"cpu": "2500m"}}}, "cpu", 2),      # rounded down
    ({"gpus": 0, "resources": {"limits": {"cpu": "500m"}}}, "cpu", 1),       # at least one
    ({"gpus": 0, "resources": {"requests": {"cpu": 4}}}, "cpu", 4),          # no limit: the request
    ({"gpus": 0, "resources": {"requests": {"cpu": "8"}, "limits": {"cpu": "6"}}}, "cpu", 6),
    ({"gpus": 2, "resources": {"limits": {"cpu": "16"}}}, "cuda", 16),
])
def test_device_follows_gpus_and_threads_follow_the_cpu_limit(pool_spec, device, threads):
    """Pools with GPUs run on CUDA; CPU pools take their torch threads from the CPU they were given."""
    children = desired_children(isvc({"prefill": pool_spec, "decode": pool_spec}), CFG)
    for pool in ("prefill", "decode"):
        cfg = parsed(children, pool)
        assert (cfg.device, cfg.threads) == (device, threads)


def test_cpu_quantities():
    from pdserve.operator.reconcile import cpu_cores

    assert [cpu_cores(q) for q in ("2", "1500m", 0.5, "0.25", "1e3m", 3)] == [2, 1.5, 0.5, 0.25, 1, 3]
    with pytest.raises(ValueError, match="not a CPU quantity"):
        cpu_cores("2 cores")


@pytest.mark.parametrize("spec,needle", [
    ({"decode": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
     "spec.decode.resources.limits.nvidia.com/gpu is set; a pool's GPUs come from spec.decode.gpus (now 1)"),
    ({"prefill": {"gpus": 0, "resources": {"requests": {"nvidia.com/gpu": "1"}}}},
     "spec.prefill.resources.requests.nvidia.com/gpu is set"),
    ({"decode": {"resources": {"limits": {"cpu": "lots"}}}}, "spec.decode.resources.limits.cpu: 'lots' is not a CPU"),
    ({"prefill": {"gpus": 0, "kv": {"dtype": "auto"}}, "decode": {"kv": {"dtype": "auto"}}},
     "only one pool has GPUs"),
    ({"nats": {"url": "nats-host:4222"}},
     "the spec gives the prefill, decode, front pools --nats-url 'nats-host:4222': 'nats-host:4222' is not a NATS URL"),
])
def test_validation_refuses_what_the_pods_could_not_run(spec, needle):
    errors = validate_spec(isvc(spec)["spec"])
    assert any(needle in e for e in errors), errors


def test_dtype_auto_is_allowed_where_both_pools_resolve_it_alike():
    assert validate_spec(isvc({"prefill": {"kv": {"dtype": "auto"}}, "decode": {"kv": {"dtype": "auto"}}})["spec"]) == []


@pytest.mark.parametrize("name,needle", [
    ("a" * 100, "has 100 characters; at most 56 fit, since the Service name built from it ('<name>-decode') may "
                "have at most 63"),
    ("a" * 60, "has 60 characters; at most 56 fit"),
    ("qwen.v2", "makes the Service name 'qwen.v2', which must be a DNS-1035 label"),
    ("Llama", "which must be a DNS-1035 label"),
    ("7b", "which must be a DNS-1035 label"),
])
def test_names_that_cannot_name_every_child_are_refused(name, needle):
    from pdserve.operator.validation import validate

    errors = validate(isvc(name=name))
    assert any(needle in e for e in errors), errors
    assert any("use e.g. '" in e for e in errors)
    assert validate(isvc(name="a" * 56)) == [] and validate(isvc(name="qwen-v2")) == []


def test_the_crd_name_rule_is_the_validation_rule():
    """The CRD states the same rule on metadata.name as the webhook applies, so the API server
    refuses such names even where no webhook runs."""
    import random
    import re

    from pdserve.operator.validation import name_errors

    rule = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"]["properties"]["name"]
    rng = random.Random(3)
    alphabet = "abcxyz0189-.A_"
    names = ["a", "qwen", "qwen.v2", "a-", "-a", "a" * 56, "a" * 57, "9a", "a9", "a--b"]
    names += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 70))) for _ in range(300)]
    for n in names:
        by_schema = len(n) <= rule["maxLength"] and re.search(rule["pattern"], n) is not None
        assert by_schema == (name_errors(n) == []), (n, name_errors(n))


def test_status_reports_refused_children():
    body = isvc()
    ready = {"prefill": _dep(1, 1), "decode": _dep(1, 1), "front": _dep(1, 1)}
    st = compute_status(body, ready, [], "T0", refused=[("Invalid", "Service llama-decode: name too long")])
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "Invalid")
    assert conds["Degraded"]["message"] == "Service llama-decode: name too long"
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "ChildRefused"
    body["status"] = st
    st2 = compute_status(body, ready, [], "T1")
    assert {c["type"]: c["status"] for c in st2["conditions"]}["Degraded"] == "False"


def test_the_operator_loads_neither_torch_nor_the_workers():
    """The operator renders pods from pdserve.config alone, so its image can leave out torch."""
    import subprocess
    import sys

    code = ("import sys, pdserve.operator.handlers, pdserve.operator.main; "
            "print(sorted(m for m in ('torch', 'triton', 'transformers', 'pdserve.workerbase') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_each_inferenceservice_gets_its_own_nats_user_and_the_nats_ca():
    """With a NATS user per InferenceService: the Secret holds that user (named for its scope) and the
    password the handler keeps, never the chart's; with TLS to NATS the pods get the CA, mounted, and
    the setting that points at it. The pods' scope is the one the user is confined to."""
    from pdserve.operator.natsusers import scope_of, user_name

    cfg = OperatorConfig(nats_url="nats://pdserve-nats.sys:4222", nats_users=True, nats_tls_ca="-----BEGIN CA-----")
    with pytest.raises(ValueError, match="needs its password"):
        desired_children(isvc(), cfg)
    children = desired_children(isvc(), cfg, nats_password="pw-of-llama")
    data = {k: base64.b64decode(v).decode() for k, v in by_kind_name(children)[("Secret", "llama-nats")]["data"].items()}
    assert data == {"user": user_name("ml", "llama"), "password": "pw-of-llama", "ca.crt": "-----BEGIN CA-----"}
    assert user_name("ml", "llama") == "isvc-ml_llama" != user_name("ml-llama", "x")
    for pool in ("prefill", "decode", "front"):
        cfg_ = parsed(children, pool)
        assert cfg_.nats.tls_ca == "/etc/pdserve/nats/ca.crt" and cfg_.deployment_scope == scope_of("ml", "llama")
        pod = by_kind_name(children)[("Deployment", f"llama-{pool}")]["spec"]["template"]["spec"]
        assert {"name": "nats-ca", "secret": {"secretName": "llama-nats", "items": [{"key": "ca.crt",
                                                                                     "path": "ca.crt"}]}} in pod["volumes"]
        assert {"name": "nats-ca", "mountPath": "/etc/pdserve/nats", "readOnly": True} in \
            pod["containers"][0]["volumeMounts"]
    # an InferenceService on a NATS of its own gets neither the user nor the CA
    own = desired_children(isvc({"nats": {"url": "nats://ext:4222", "credentialsSecret": {"name": "ext"}}}), cfg)
    assert ("Secret", "llama-nats") not in by_kind_name(own) and parsed(own, "decode").nats.tls_ca is None


def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists) against labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def test_network_policies_admit_only_the_deployments_own_pods_to_the_workers():
    """The workers' data and metrics ports take connections from their own InferenceService's pods (and
    metrics from the scraper's namespace, when named); the front's port from anyone; nothing selects
    another InferenceService's pods, nor lets them in."""
    spec = {"decode": {"dataPort": 7001}, "prefill": {"dataPort": 7002}, "serving": {"port": 8080}}
    mine = by_kind_name(desired_children(isvc(spec), CFG))
    theirs = by_kind_name(desired_children(isvc(name="other"), CFG))
    pod_labels = {n: c["spec"]["template"]["metadata"]["labels"] for (k, n), c in {**mine, **theirs}.items()
                  if k == "Deployment"}
    workers, front = mine[("NetworkPolicy", "llama-workers")], mine[("NetworkPolicy", "llama-front")]
    selected = {n for n, lab in pod_labels.items() if _selects(workers["spec"]["podSelector"], lab)}
    assert selected == {"llama-prefill", "llama-decode"}
    assert {n for n, lab in pod_labels.items() if _selects(front["spec"]["podSelector"], lab)} == {"llama-front"}
    assert workers["spec"]["policyTypes"] == ["Ingress"]
    [rule] = workers["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {7001, 7002, 9100}
    admitted = {n for n, lab in pod_labels.items() if any(_selects(f["podSelector"], lab) for f in rule["from"])}
    assert admitted == {"llama-prefill", "llama-decode", "llama-front"}
    assert all(set(f) == {"podSelector"} for f in rule["from"])  # same namespace: no namespaceSelector
    assert front["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8080}]}]
    assert workers["metadata"]["ownerReferences"][0]["uid"] == "uid-1"

    import dataclasses
    scraped = by_kind_name(desired_children(isvc(spec), dataclasses.replace(CFG, metrics_scraper_namespace="monitoring")))
    rules = scraped[("NetworkPolicy", "llama-workers")]["spec"]["ingress"]
    assert rules[0] == rule and rules[1] == {
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "ports": [{"protocol": "TCP", "port": 9100}]}


@pytest.mark.k8s
def test_children_validate_strictly_against_kubernetes(tmp_path):
    """Every child, NetworkPolicies included, passes kubernetes-validate --strict (as the chart's do)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.skip("kubernetes-validate absent; run scripts/k8s-tools.sh")
    cfg = OperatorConfig(metrics_scraper_namespace="monitoring")  # autoscaling/v2, policy/v1
    files = []
    spec = {"decode": {"autoscaling": {"enabled": True}}, "speculation": {"draftPool": {}}}
    for i, d in enumerate(desired_children(isvc(spec), cfg)):
        f = tmp_path / f"{i:02d}-{d['kind']}.yaml"
        f.write_text(yaml.safe_dump(d))
        files.append(str(f))
    assert any("NetworkPolicy" in f for f in files)
    for version in ("1.28.0", "1.34.0"):
        r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", version, *files],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"k8s {version}:\n{r.stdout}\n{r.stderr}"


# ---------------------------------------------------------------- the draft pool

DRAFT_POOL_SPEC = {"draftPool": {"suffixIndex": {"minN": 3, "maxTokens": 100000, "shareTenants": True},
                                 "maxQueue": 64, "timeoutSeconds": 0.01,
                                 "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                                 "nodeSelector": {"pool": "cpu"},
                                 "autoscaling": {"minReplicas": 2, "maxReplicas": 5,
                                                 "metric": {"targetAverageValue": "1500"}}}}


def test_the_draft_pool_is_rendered_with_its_hpa_and_pdb_and_decode_asks_it():
    """spec.speculation.draftPool: a `pdserve draftpool` Deployment whose settings come from the spec, an
    HPA on the pool's own metric, a PDB; decode pods get --draft-pool and ask the very subject the pool
    answers (same scope, same served model name). The pool talks only over NATS: no Service."""
    from pdserve.draftpool.server import served_name
    from pdserve.kvtransfer.protocol import Subjects

    children = desired_children(isvc({"speculation": DRAFT_POOL_SPEC}), CFG)
    kinds = by_kind_name(children)
    assert {k for k in kinds if k[1] == "llama-draftpool"} == {
        ("Deployment", "llama-draftpool"), ("HorizontalPodAutoscaler", "llama-draftpool"),
        ("PodDisruptionBudget", "llama-draftpool")}
    assert not [k for k in kinds if k[0] == "Service" and "draft" in k[1]]
    pool, d = parsed(children, "draftpool"), parsed(children, "decode")
    assert (pool.min_n, pool.max_n, pool.max_tokens, pool.share_tenants, pool.max_queue) == (3, 8, 100000, True, 64)
    assert (pool.isvc, pool.pool, pool.metrics_port, pool.pod_name) == ("llama", "draftpool", 9100, "llama-pod-abcde")
    assert (pool.nats.url, pool.nats.user, pool.nats.password.get_secret_value()) == (
        "nats://pdserve-nats.sys:4222", "llama-nats/user", "llama-nats/password")
    assert (d.spec.method, d.spec.draft_pool, d.spec.draft_pool_timeout) == ("ngram", True, 0.01)
    assert pool.deployment_scope == d.deployment_scope == "ml.llama"
    assert Subjects.draft(pool.deployment_scope, served_name(pool)) == Subjects.draft(d.deployment_scope,
                                                                                      d.served_model_name)

    dep = kinds[("Deployment", "llama-draftpool")]
    assert dep["spec"]["replicas"] == 2  # the HPA's minimum; the HPA owns it from there
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["pdserve", "draftpool"]
    assert c["ports"] == [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    # it reads no weights: no model volume (nor its copy from an image), no /dev/shm
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["tmp"] and "initContainers" not in pod["spec"]
    hpa = kinds[("HorizontalPodAutoscaler", "llama-draftpool")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "llama-draftpool" and (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 5)
    assert hpa["metrics"] == [{"type": "Pods", "pods": {"metric": {"name": "pdserve_draftpool_requests_per_second"},
                                                        "target": {"type": "AverageValue", "averageValue": "1500"}}}]
    workers = kinds[("NetworkPolicy", "llama-workers")]["spec"]["podSelector"]
    assert _selects(workers, pod["metadata"]["labels"]), "its metrics port gets the workers' policy"

    # a model from an image: the other pools copy it, the pool still does not
    image = by_kind_name(desired_children(isvc({"model": {"path": "m", "image": "reg/models:1"},
                                                "speculation": {"draftPool": {}}}), CFG))
    assert "initContainers" not in image[("Deployment", "llama-draftpool")]["spec"]["template"]["spec"]
    assert "initContainers" in image[("Deployment", "llama-decode")]["spec"]["template"]["spec"]


@pytest.mark.parametrize("speculation", [{}, {"draftPool": {"enabled": False, "maxQueue": 8}}])
def test_no_draft_pool_unless_asked(speculation):
    children = desired_children(isvc({"speculation": speculation}), CFG)
    assert not [k for k in by_kind_name(children) if "draftpool" in k[1]]
    assert parsed(children, "decode").spec.draft_pool is False


def test_a_draft_pool_without_autoscaling_and_its_status():
    body = isvc({"speculation": {"draftPool": {"replicas": 3, "autoscaling": {"enabled": False}}}})
    kinds = by_kind_name(desired_children(body, CFG))
    assert ("HorizontalPodAutoscaler", "llama-draftpool") not in kinds
    assert kinds[("Deployment", "llama-draftpool")]["spec"]["replicas"] == 3
    assert ("PodDisruptionBudget", "llama-draftpool") in kinds
    ready = {"prefill": _dep(1, 1), "decode": _dep(1, 1), "front": _dep(1, 1)}
    st = compute_status(body, {**ready, "draftpool": _dep(3, 1)}, [], "T0")
    assert st["draftpool"] == {"desiredReplicas": 3, "readyReplicas": 1, "replicas": "1/3"}
    assert st["ready"] == "False" and "draftpool: 1/3 ready" in st["conditions"][0]["message"]
    assert compute_status(body, {**ready, "draftpool": _dep(3, 3)}, [], "T1")["ready"] == "True"
    assert "draftpool" not in compute_status(isvc(), ready, [], "T2")
