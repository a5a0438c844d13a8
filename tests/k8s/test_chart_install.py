"""`helm install` of charts/pdserve against the real API server, and the operator running under
the chart's own (least-privilege) RBAC: it must be able to do its whole job with that token,
including bringing the CRD up to its own version on an upgrade (Helm never upgrades `crds/`).

No kubelet runs, so the chart's pods never start; the operator runs in-process (KopfRunner) with
the ServiceAccount token the token controller minted for the chart's ServiceAccount.
"""
from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from k8swait import wait_for

from pdserve.operator.kube import Kube

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[2]
API = "pdserve.io/v1alpha1"


def test_helm_install_upgrade_and_operator_under_chart_rbac(k8s_cluster, k8s_api_client, k8s_tool, tmp_path):
    kube = Kube(k8s_api_client)
    helm = k8s_tool("helm")
    ns, rel = "pdserve-helm", "pd"
    env = {**os.environ, "KUBECONFIG": k8s_cluster.kubeconfig, "HELM_CACHE_HOME": str(tmp_path / "c"),
           "HELM_CONFIG_HOME": str(tmp_path / "cfg"), "HELM_DATA_HOME": str(tmp_path / "d")}

    def run(*args):
        r = subprocess.run([helm, *args], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout

    # The previous chart version: its CRD lacks a field this one has (kvTransfer.shmSizeLimit).
    old_chart = tmp_path / "pdserve-old"
    shutil.copytree(REPO / "charts/pdserve", old_chart)
    old_crd = yaml.safe_load((old_chart / "crds/inferenceservices.yaml").read_text())
    kv_props = old_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "kvTransfer"]["properties"]
    del kv_props["shmSizeLimit"]
    (old_chart / "crds/inferenceservices.yaml").write_text(yaml.safe_dump(old_crd))
    crd_path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferenceservices.pdserve.io"

    def served_kv_fields():
        crd = kube.request("GET", crd_path)
        return set(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
                   ["kvTransfer"]["properties"])

    # Helm installs crds/ only where the CRD is absent; where an earlier test made it, put the
    # previous version's in its place, as a cluster that ran that version would have it.
    current = kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, "inferenceservices.pdserve.io")
    if current:
        kube.request("PUT", crd_path, {**old_crd, "metadata": {**old_crd["metadata"],
                                                                "resourceVersion": current["metadata"]["resourceVersion"]}})
    # Ignore: no operator pod can serve the webhook here (no kubelet); Fail is the chart default.
    # No startup check either: its hook Job would never run, and Helm waits for hook Jobs. (The
    # node tests run it for real; below it runs from this process, where it must not pass.)
    values = ["--set", "webhook.failurePolicy=Ignore", "--set", "webhook.startupCheck.enabled=false"]
    out = run("install", rel, str(old_chart), "-n", ns, "--create-namespace", *values)
    assert "kubectl get pdis" in out  # NOTES.txt
    try:
        crd = kube.request("GET", crd_path)
        assert crd["spec"]["names"]["shortNames"] == ["pdis"]
        for api, kind, name in [("apps/v1", "Deployment", "pd-pdserve-operator"), ("apps/v1", "Deployment", "pd-pdserve-nats"),
                                ("v1", "Service", "pd-pdserve-nats"), ("v1", "Service", "pd-pdserve-webhook"),
                                ("v1", "Secret", "pd-pdserve-nats-credentials"), ("v1", "Secret", "pd-pdserve-webhook-tls")]:
            assert kube.get(api, kind, ns, name) is not None, (kind, name)
        assert kube.request("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles/pd-pdserve-operator")
        vwc = kube.request("GET", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/pd-pdserve-{ns}")
        tls = kube.get("v1", "Secret", ns, "pd-pdserve-webhook-tls")
        assert vwc["webhooks"][0]["clientConfig"]["caBundle"] == tls["data"]["ca.crt"]
        password = kube.get("v1", "Secret", ns, "pd-pdserve-nats-credentials")["data"]["password"]

        # The install hook's check, run here: no operator serves the webhook, so with Ignore the
        # API server admits the invalid probe, and an admission is no proof: it must fail, and
        # say why. Its dry run stored nothing.
        check = subprocess.run([sys.executable, "-P", "-m", "pdserve.cli", "webhook-check", f"--namespace={ns}",
                                "--timeout=3", f"--kubeconfig={k8s_cluster.kubeconfig}"],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 1, (check.stdout, check.stderr)
        assert "FAILED: no webhook denial in 3 s" in check.stderr and "admitted" in check.stderr, check.stderr
        assert kube.request("GET", f"/apis/{API}/namespaces/{ns}/inferenceservices")["items"] == []

        # Upgrade: generated credentials and certificates survive (lookup).
        run("upgrade", rel, str(REPO / "charts/pdserve"), "-n", ns, *values, "--set", "operator.verbose=true")
        assert kube.get("v1", "Secret", ns, "pd-pdserve-nats-credentials")["data"]["password"] == password
        assert kube.get("v1", "Secret", ns, "pd-pdserve-webhook-tls")["data"]["ca.crt"] == tls["data"]["ca.crt"]
        assert "shmSizeLimit" not in served_kv_fields(), "Helm leaves crds/ as first installed"

        # The operator with the chart ServiceAccount's token, nothing more.
        sa = wait_for(lambda: (kube.get("v1", "ServiceAccount", ns, "pd-pdserve-operator") or {}).get("secrets"),
                      "ServiceAccount token secret")
        token = base64.b64decode(kube.get("v1", "Secret", ns, sa[0]["name"])["data"]["token"]).decode()
        sa_kubeconfig = tmp_path / "sa-kubeconfig"
        sa_kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: c\n  cluster:\n    server: {k8s_cluster.server}\n"
            f"    certificate-authority: {k8s_cluster.ca_file}\n"
            f"users:\n- name: sa\n  user:\n    token: {token}\n"
            "contexts:\n- name: c\n  context:\n    cluster: c\n    user: sa\ncurrent-context: c\n")
        app_ns = "pdserve-helm-app"
        kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": app_ns}})
        # Written under the old schema: the server prunes the field it does not know.
        kube.create({"apiVersion": API, "kind": "InferenceService", "metadata": {"name": "qwen", "namespace": app_ns},
                     "spec": {"model": {"path": "qwen", "pvc": "models"}, "kvTransfer": {"shmSizeLimit": "1Gi"}}})
        assert "shmSizeLimit" not in kube.get(API, "InferenceService", app_ns, "qwen")["spec"].get("kvTransfer", {})
        from kopf.testing import KopfRunner

        saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "PDSERVE_NATS_SECRET", "PDSERVE_NATS_SECRET_NAMESPACE",
                                                "PDSERVE_NATS_URL", "PDSERVE_WEBHOOK_CERT", "PDSERVE_WEBHOOK_KEY")}
        os.environ.update({"KUBECONFIG": str(sa_kubeconfig), "PDSERVE_NATS_SECRET": "pd-pdserve-nats-credentials",
                           "PDSERVE_NATS_SECRET_NAMESPACE": ns,
                           "PDSERVE_NATS_URL": f"nats://pd-pdserve-nats.{ns}.svc.cluster.local:4222"})
        os.environ.pop("PDSERVE_WEBHOOK_CERT", None)
        os.environ.pop("PDSERVE_WEBHOOK_KEY", None)
        try:
            with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "pdserve.operator.handlers"],
                            timeout=60) as runner:
                for kind, api, name in [("Deployment", "apps/v1", "qwen-decode"), ("Service", "v1", "qwen"),
                                        ("HorizontalPodAutoscaler", "autoscaling/v2beta2", "qwen-prefill"),
                                        ("PodDisruptionBudget", "policy/v1beta1", "qwen-decode"),
                                        ("NetworkPolicy", "networking.k8s.io/v1", "qwen-workers")]:
                    wait_for(lambda: kube.get(api, kind, app_ns, name), f"{kind} {name} under chart RBAC")
                copied = wait_for(lambda: kube.get("v1", "Secret", app_ns, "qwen-nats"), "NATS credentials copy")
                assert copied["data"]["password"] == password
                wait_for(lambda: (kube.get(API, "InferenceService", app_ns, "qwen").get("status") or {}).get("endpoint"),
                         "status written under chart RBAC")
                # The operator brought its CRD: the new field now reaches the server and stays.
                assert "shmSizeLimit" in served_kv_fields()
                kube.merge_patch(API, "InferenceService", app_ns, "qwen", {"spec": {"kvTransfer": {"shmSizeLimit": "1Gi"}}})
                assert kube.get(API, "InferenceService", app_ns, "qwen")["spec"]["kvTransfer"]["shmSizeLimit"] == "1Gi"
                crd = kube.request("GET", crd_path)
                assert any(f["manager"] == "pdserve-operator" for f in crd["metadata"]["managedFields"])
            assert runner.exception is None
            # No secret in the operator's log.
            assert base64.b64decode(password).decode() not in runner.output
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            kube.request("DELETE", f"/api/v1/namespaces/{app_ns}")
    finally:
        subprocess.run([helm, "uninstall", rel, "-n", ns], capture_output=True, env=env)
