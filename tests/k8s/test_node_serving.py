"""pdserve on a real node, as a user runs it (issue 14's acceptance): `helm install` of the chart,
the operator pod serving its admission webhook through its Service, the README's minimal
InferenceService brought to Ready by real probes, and an OpenAI request through the front's
Service answered token for token as `transformers` `generate` answers it.

Real parts only: the `k8s_node` cluster (kubelet, containerd, kube-proxy, cluster DNS), the images
scripts/k8s-images.py builds from the Dockerfile, the default model's weights on a hostPath
PersistentVolume. The tests run in file order and share one release and one InferenceService.
"""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from k8swait import wait_for
from nodehelpers import (RELEASE, SYSTEM_NS, Load, Tools, apply, fresh_namespace, install_chart, minimal_example,
                         pod_ready, pods, wait_pods_ready)

from servinghelpers import hf_greedy, post, stream

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(1800)]

APP_NS = "pdserve-app"


@pytest.fixture(scope="module")
def tools(k8s_node, k8s_tool, tmp_path_factory):
    return Tools(k8s_node, k8s_tool, tmp_path_factory.mktemp("node-tools"))


@pytest.fixture(scope="module")
def release(tools):
    # The metrics adapter serves the pools' HPAs (custom.metrics.k8s.io through the aggregator).
    notes = install_chart(tools, "--set", "metricsAdapter.enabled=true")
    yield notes
    tools.helm("uninstall", RELEASE, "-n", SYSTEM_NS, check=False)


@pytest.fixture(scope="module")
def isvc(tools, release, model_dir):
    """The minimal example applied in APP_NS, its pods and status Ready; yields (name, spec as applied)."""
    fresh_namespace(tools, APP_NS)
    pv, pvc, obj = minimal_example(model_dir.parent, APP_NS)
    tools.kubectl("delete", "pv", pv["metadata"]["name"], "--ignore-not-found")
    name = obj["metadata"]["name"]
    try:
        apply(tools, pv, pvc, obj)
        for pool in ("prefill", "decode", "front"):
            wait_pods_ready(tools, APP_NS, selector(name, pool), 1)
        wait_for(lambda: (tools.get("pdis", name, "-n", APP_NS).get("status") or {}).get("ready") == "True",
                 "InferenceService Ready", 120)
        yield name, obj
    finally:
        tools.kubectl("delete", "namespace", APP_NS, "--wait=false", check=False)
        tools.kubectl("delete", "pv", pv["metadata"]["name"], "--wait=false", check=False)


def selector(name: str, pool: str) -> str:
    return f"app.kubernetes.io/instance={name},app.kubernetes.io/component={pool}"


def front_url(k8s_node, tools, name: str) -> str:
    """The front Service's ClusterIP and port, reached from the node through a loopback relay."""
    svc = tools.get("service", name, "-n", APP_NS)
    port = svc["spec"]["ports"][0]["port"]
    return f"http://127.0.0.1:{k8s_node.forward(svc['spec']['clusterIP'], port)}"


def test_helm_install_operator_ready_and_webhook_refuses_invalid_spec(tools, release):
    assert "kubectl get pdis" in release  # NOTES.txt
    (operator,) = pods(tools, SYSTEM_NS, "app.kubernetes.io/component=operator")
    assert pod_ready(operator)
    # The slim image: the operator pod runs the Dockerfile's `operator` target, without torch.
    assert operator["spec"]["containers"][0]["image"] == tools.node.images["operator"].ref
    r = tools.kubectl("exec", "-n", SYSTEM_NS, operator["metadata"]["name"], "--", "python", "-c",
                      "import importlib.util as u; print([m for m in ('torch', 'transformers') if u.find_spec(m)])")
    assert r.stdout.strip() == "[]"

    # helm install returned after its post-install hook saw the webhook deny a dry-run probe
    # through the Service; the succeeded hook and its one-right ServiceAccount are gone.
    assert tools.get("jobs,serviceaccounts,roles", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=webhook-check")["items"] == []

    # So the first apply right after the install reaches the webhook (before the hook, kube-proxy
    # could still be programming the Service's ClusterIP: "connection refused").
    fresh_namespace(tools, "pdserve-invalid")
    bad = {"apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "bad", "namespace": "pdserve-invalid"},
           "spec": {"model": {"path": "m", "pvc": "models"},
                    "decode": {"gpus": 0, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}}}
    r = tools.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    # Refused by the webhook itself (reached through its Service, TLS verified against the chart's
    # caBundle): an unreachable webhook would say "failed calling webhook" instead.
    assert r.returncode != 0
    assert 'admission webhook "validate.inferenceservices.pdserve.io" denied the request' in r.stderr, r.stderr
    assert "spec.decode.autoscaling.minReplicas (3) is greater than" in r.stderr
    assert tools.kubectl("get", "pdis", "-n", "pdserve-invalid", "-o", "name").stdout.strip() == ""
    tools.kubectl("delete", "namespace", "pdserve-invalid", "--wait=false")


def test_minimal_example_pods_ready_through_real_probes(tools, isvc):
    name, _ = isvc
    for pool in ("prefill", "decode", "front"):
        (pod,) = pods(tools, APP_NS, selector(name, pool))
        assert pod_ready(pod)
        (container,) = pod["spec"]["containers"]
        assert container["readinessProbe"]["httpGet"]  # Ready came from the kubelet probing it
        assert pod["spec"]["nodeName"] == "pdserve-node"
    table = tools.kubectl("get", "pdis", "-n", APP_NS).stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "MODEL", "PREFILL", "DECODE", "READY"]
    assert table[1].split()[:5] == [name, "SmolLM2-135M-Instruct", "1/1", "1/1", "True"]


def test_openai_request_through_the_front_service_equals_generate(k8s_node, tools, isvc, hf):
    name, obj = isvc
    tok, _ = hf
    url = front_url(k8s_node, tools, name)
    model = obj["spec"]["model"]["name"]
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        models = json.loads(r.read())
    assert [m["id"] for m in models["data"]] == [model]

    prompt = "Once upon a time, in a village by the sea,"
    ids = tok.encode(prompt, add_special_tokens=False)
    status, out = post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 24,
                                                 "temperature": 0, "return_token_ids": True})
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == hf_greedy(hf, ids, 24)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    status, out = post(url + "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 16,
                                                      "temperature": 0, "return_token_ids": True})
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == hf_greedy(hf, chat_ids, 16)

    # The image has no compiler: its workers serve the native kernels built into it, the best variant this
    # node's CPU runs (the node is this machine), as each says on its own /metrics.
    for pool in ("prefill", "decode"):
        (pod,) = pods(tools, APP_NS, selector(name, pool))
        info = _engine_info(k8s_node, pod)
        assert info["kernels"] == "prebuilt" and info["isa"] == _best_variant(), (pool, info)

    # Cluster DNS as pods see it: the Service's name resolves to its ClusterIP inside the front pod.
    (front,) = pods(tools, APP_NS, selector(name, "front"))
    fqdn = f"{name}.{APP_NS}.svc.cluster.local"
    r = tools.kubectl("exec", "-n", APP_NS, front["metadata"]["name"], "--", "python", "-c",
                      f"import socket; print(socket.gethostbyname({fqdn!r}), socket.gethostbyname({name!r}))")
    ip = tools.get("service", name, "-n", APP_NS)["spec"]["clusterIP"]
    assert r.stdout.split() == [ip, ip]


def test_decode_pod_deleted_mid_stream_is_invisible_to_the_client_and_its_replacement_serves(
        k8s_node, tools, isvc, hf):
    """Two decode pods; the one decoding a stream is deleted without a grace period (the kubelet's SIGKILL follows
    its SIGTERM within 2 s, too soon to finish). The front moves the request to the other pod with the tokens
    already streamed, and the client's stream goes on to its last token: the same tokens `generate` gives."""
    name, obj = isvc
    tok, _ = hf
    url, model = front_url(k8s_node, tools, name), obj["spec"]["model"]["name"]
    # Decode pinned to two replicas for this test: the HPA's own behaviour is the scaling test's subject.
    pin = lambda least, most: tools.kubectl("patch", "pdis", name, "-n", APP_NS, "--type=merge", "-p",  # noqa: E731
                                            json.dumps({"spec": {"decode": {"autoscaling": {
                                                "minReplicas": least, "maxReplicas": most}}}}))
    before = (obj["spec"].get("decode", {}).get("autoscaling") or {})
    pin(2, 2)
    try:
        _delete_decode_mid_stream_then_serve(k8s_node, tools, name, url, model, tok, hf)
    finally:
        pin(before.get("minReplicas", 1), before.get("maxReplicas", 4))


def _delete_decode_mid_stream_then_serve(k8s_node, tools, name, url, model, tok, hf):
    decodes = wait_pods_ready(tools, APP_NS, selector(name, "decode"), 2)
    body = {"model": model, "prompt": "Tell me a story about a lighthouse keeper.", "max_tokens": 300,
            "ignore_eos": True, "temperature": 0}
    deleted = []

    def delete_the_decoding_pod(i, event):
        if i == 1:  # prefill's first token, then decode's: a decode pod holds the request now
            (holder,) = [p for p in decodes if _pod_metric(k8s_node, p, "pdserve_decode_running_sequences") == 1]
            tools.kubectl("delete", "pod", "-n", APP_NS, holder["metadata"]["name"], "--grace-period=0", "--force")
            deleted.append(holder)

    events, _ = stream(url + "/v1/completions", body, timeout=120, on_event=delete_the_decoding_pod)
    assert deleted, "the stream ended before a decode pod held it"
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    # the uninterrupted answer (the replacement's greedy equals generate's: checked below)
    status, whole = post(url + "/v1/completions", body)
    assert status == 200, whole
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == whole["choices"][0]["text"]
    front_log = "".join(tools.kubectl("logs", "-n", APP_NS, p["metadata"]["name"]).stdout
                        for p in pods(tools, APP_NS, selector(name, "front")))
    assert "moved with" in front_log

    replacement = [p for p in wait_pods_ready(tools, APP_NS, selector(name, "decode"), 2)
                   if p["metadata"]["uid"] not in {d["metadata"]["uid"] for d in decodes}]
    assert len(replacement) == 1
    prompt = "Once upon a time, in a village by the sea,"
    status, out = post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16,
                                                 "temperature": 0, "return_token_ids": True})
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == hf_greedy(hf, tok.encode(prompt, add_special_tokens=False), 16)


def _best_variant() -> str:
    """The prebuilt kernel variant a worker on this machine's CPU loads."""
    from pdserve.kernels import native_build

    return native_build.runnable_variants()[0]


def _pod_metrics(k8s_node, pod: dict) -> str:
    """A worker pod's /metrics text, read from the node."""
    port = k8s_node.forward(pod["status"]["podIP"], 9100)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def _pod_metric(k8s_node, pod: dict, name: str) -> float:
    """The sum of a worker pod's metric `name` over its labels."""
    return sum(float(line.split()[-1]) for line in _pod_metrics(k8s_node, pod).splitlines()
               if line.startswith(name))


def _engine_info(k8s_node, pod: dict) -> dict[str, str]:
    """The labels of a worker pod's `pdserve_engine_info`."""
    (line,) = [x for x in _pod_metrics(k8s_node, pod).splitlines() if x.startswith("pdserve_engine_info{")]
    return dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))


def test_real_load_scales_decode_up_and_back_down_without_a_failed_request(k8s_node, tools, isvc):
    """The HPA reads decode's running sequences through the metrics adapter (the workers' own load
    reports); a target of 1 per pod makes three concurrent streams a reason for a second pod."""
    name, obj = isvc
    url, model = front_url(k8s_node, tools, name), obj["spec"]["model"]["name"]
    autoscaling = {"minReplicas": 1, "maxReplicas": 2, "scaleDownStabilizationSeconds": 10,
                   "metric": {"name": "pdserve_decode_running_sequences", "targetAverageValue": "1"}}
    tools.kubectl("patch", "pdis", name, "-n", APP_NS, "--type=merge",
                  "-p", json.dumps({"spec": {"decode": {"autoscaling": autoscaling}}}))
    hpa = "horizontalpodautoscalers.v2beta2.autoscaling"  # kubectl's default, v1, has no custom metrics
    wait_for(lambda: tools.get(hpa, f"{name}-decode", "-n", APP_NS)["spec"]["metrics"][0]["pods"]["metric"]["name"]
             == "pdserve_decode_running_sequences", "decode HPA on running sequences", 60)
    (first,) = wait_pods_ready(tools, APP_NS, selector(name, "decode"), 1)

    heavy = Load(url, model, concurrency=3, max_tokens=300).start()
    light = None
    try:
        wait_for(lambda: tools.get("deployment", f"{name}-decode", "-n", APP_NS)["spec"]["replicas"] == 2,
                 "the HPA scaling decode to 2", 240)
        both = wait_pods_ready(tools, APP_NS, selector(name, "decode"), 2)
        (new,) = [p for p in both if p["metadata"]["uid"] != first["metadata"]["uid"]]
        wait_for(lambda: _pod_metric(k8s_node, new, "pdserve_decode_handoffs_total") > 0,
                 "a request handed to the new decode pod", 240)
        # Load drops to one short stream at a time: the HPA scales back while requests are in flight.
        light = Load(url, model, concurrency=1, max_tokens=32).start()
        ok, failures = heavy.stop()
        assert failures == [] and ok > 0
        wait_for(lambda: tools.get("deployment", f"{name}-decode", "-n", APP_NS)["spec"]["replicas"] == 1,
                 "the HPA scaling decode back to 1", 300)
        wait_pods_ready(tools, APP_NS, selector(name, "decode"), 1)
        done_before = light.snapshot()[0]
        wait_for(lambda: light.snapshot()[0] > done_before, "a request served after the scale-down", 120)
    finally:
        heavy.stop()
        ok, failures = light.stop() if light else (0, [])
    assert failures == [] and ok > 0


def test_helm_upgrade_rolls_the_workers_under_load_without_a_failed_request(k8s_node, tools, isvc):
    """A new worker image (the same content under a new tag, as an upgrade would bring) reaches the
    operator through `helm upgrade`; the operator rolls prefill, decode and front, surging one
    pod at a time, while requests keep flowing."""
    name, obj = isvc
    url, model = front_url(k8s_node, tools, name), obj["spec"]["model"]["name"]
    old_ref = tools.node.images["pdserve"].ref
    new_ref = old_ref + "-upgrade"
    k8s_node.tag_image(old_ref, new_ref)
    before = {pool: {p["metadata"]["uid"] for p in wait_pods_ready(tools, APP_NS, selector(name, pool), 1)}
              for pool in ("prefill", "decode", "front")}

    load = Load(url, model, concurrency=2, max_tokens=64).start()
    try:
        tools.helm("upgrade", RELEASE, str(REPO / "charts/pdserve"), "-n", SYSTEM_NS, "--reuse-values",
                   "--set", f"image.tag={new_ref.rsplit(':', 1)[1]}")
        for pool in ("prefill", "decode", "front"):
            def rolled(pool=pool):
                items = pods(tools, APP_NS, selector(name, pool))
                return items if items and all(
                    pod_ready(p) and p["spec"]["containers"][0]["image"] == new_ref
                    and p["metadata"]["uid"] not in before[pool] for p in items) else None
            wait_for(rolled, f"{pool} rolled to {new_ref}", 600)
        done_before = load.snapshot()[0]
        wait_for(lambda: load.snapshot()[0] > done_before + 2, "requests served after the roll", 120)
    finally:
        ok, failures = load.stop()
    # a failure names what the node saw meanwhile (kills, probes, OOM), which a pod deleted by the roll
    # no longer shows in its logs
    assert failures == [], (failures, "" if not failures else tools.kubectl(
        "get", "events", "-n", APP_NS, "--sort-by=.lastTimestamp", check=False).stdout[-6000:])
    assert ok > 0


def test_deleting_the_service_then_uninstalling_leaves_only_what_helm_keeps(tools, isvc):
    """Helm keeps what its chart's crds/ installed (the CRD), what carries `helm.sh/resource-policy:
    keep` (the NATS credentials, which workers may still hold) and the namespace `--create-namespace`
    made; everything else of ours goes: children by owner reference, the release by Helm."""
    name, _ = isvc
    tools.kubectl("delete", "pdis", name, "-n", APP_NS, "--wait=true", "--timeout=120s")
    wait_for(lambda: not tools.get("all", "-n", APP_NS, "-l", f"app.kubernetes.io/instance={name}")["items"],
             "the InferenceService's children gone", 180)
    tools.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "180s")
    wait_for(lambda: not pods(tools, SYSTEM_NS, "app.kubernetes.io/part-of=pdserve"), "release pods gone", 180)

    kinds = [k for k in tools.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
             if k.split(".")[0] not in ("events", "componentstatuses")]

    def ours_left():
        left = []
        for item in tools.get(",".join(kinds), "-A")["items"]:
            meta = item["metadata"]
            labels = meta.get("labels") or {}
            if (labels.get("app.kubernetes.io/part-of") == "pdserve"
                    or labels.get("app.kubernetes.io/instance") in (RELEASE, name)
                    or meta["name"] == name or meta["name"].startswith(("pd-pdserve", f"{name}-"))):
                left.append((item["kind"], meta.get("namespace"), meta["name"]))
        return sorted(left, key=str)
    # The token controller removes the operator ServiceAccount's token Secret after the account.
    credentials = f"{RELEASE}-pdserve-nats-credentials"
    expected = [("CustomResourceDefinition", None, "inferenceservices.pdserve.io"),
                ("Secret", SYSTEM_NS, credentials)]
    try:
        wait_for(lambda: ours_left() == expected, "only what Helm keeps left", 120)
    except AssertionError:
        assert ours_left() == expected
    secret = tools.get("secret", credentials, "-n", SYSTEM_NS)
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert tools.get("namespace", SYSTEM_NS)["status"]["phase"] == "Active"
