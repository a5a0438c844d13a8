"""The Helm chart offline: `helm lint`, the values schema, and `helm template` output validated
with kubernetes-validate --strict against several Kubernetes versions; examples against the CRD.
Needs helm (scripts/k8s-tools.sh caches it); skipped with the reason when it is absent."""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "pdserve"
K8S_VERSIONS = ["1.28.0", "1.31.0", "1.34.0"]

pytestmark = pytest.mark.k8s

NON_DEFAULT = ["--set", "nats.enabled=false", "--set", "nats.external.url=nats://nats.infra:4222",
               "--set", "nats.external.existingSecret=infra-nats", "--set", "webhook.enabled=false",
               "--set", "operator.watchNamespaces={ml,research}", "--set", "operator.verbose=true",
               "--set", "image.tag=0.1.1", "--set", "serviceAccount.name=pdserve-op",
               "--set", "operator.podAnnotations.team=ml", "--set", "operator.metricsScraperNamespace=monitoring",
               "--set", "metricsAdapter.enabled=true", "--set", "metricsAdapter.registerExternalMetrics=false"]


def _helm() -> str:
    cached = Path.home() / ".cache/pdserve/k8s/bin/helm"
    path = str(cached) if cached.exists() else shutil.which("helm")
    if not path:
        pytest.skip("helm absent; run scripts/k8s-tools.sh")
    return path


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([_helm(), *args], capture_output=True, text=True, check=check)


def render(*extra: str) -> list[dict]:
    out = helm("template", "rel", str(CHART), "--namespace", "pdserve-system", "--include-crds", *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_helm_lint_default_and_non_default():
    helm("lint", str(CHART), "--strict")
    helm("lint", str(CHART), "--strict", *NON_DEFAULT)


def test_values_schema_refuses_bad_values():
    bad = helm("template", "rel", str(CHART), "--set", "webhook.failurePolicy=Maybe", check=False)
    assert bad.returncode != 0 and "failurePolicy" in bad.stderr
    bad = helm("template", "rel", str(CHART), "--set", "nats.enabled=false", check=False)
    assert bad.returncode != 0 and "existingSecret" in bad.stderr
    bad = helm("template", "rel", str(CHART), "--set", "operator.replica=2", check=False)
    assert bad.returncode != 0 and "replica" in bad.stderr


@pytest.mark.parametrize("values", [[], NON_DEFAULT, ["--set", "nats.tls.enabled=true"],
                                    ["--set", "monitoring.dashboard.enabled=true"]],
                         ids=["default", "non-default", "nats-tls", "dashboard"])
def test_rendered_manifests_validate_strictly(values, tmp_path):
    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.skip("kubernetes-validate absent; run scripts/k8s-tools.sh")
    docs = render(*values)
    files = []
    for i, d in enumerate(docs):
        f = tmp_path / f"{i:02d}-{d['kind']}.yaml"
        f.write_text(yaml.safe_dump(d))
        files.append(str(f))
    for version in K8S_VERSIONS:
        r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", version, *files],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"k8s {version}:\n{r.stdout}\n{r.stderr}"


def test_default_render_is_secure_and_complete():
    docs = render()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("CustomResourceDefinition", "inferenceservices.pdserve.io") in kinds
    assert ("ValidatingWebhookConfiguration", "rel-pdserve-pdserve-system") in kinds
    assert ("Deployment", "rel-pdserve-nats") in kinds and ("Deployment", "rel-pdserve-operator") in kinds
    op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pdserve-operator")
    pod = op["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["PDSERVE_NATS_URL"] == "nats://rel-pdserve-nats.pdserve-system.svc.cluster.local:4222"
    assert env["PDSERVE_IMAGE"] == "ghcr.io/pdserve/pdserve:0.1.0"
    # NATS: auth on, JetStream in memory, no PVC anywhere, password generated (not a fixed default).
    conf = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    assert "authorization" in conf and "max_file_store: 0" in conf
    # the users it accepts: the chart's own, its password from the server's environment
    users = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "rel-pdserve-nats-users")
    assert 'include "../users/users.conf"' in conf
    assert "$NATS_PASSWORD" in base64.b64decode(users["data"]["users.conf"]).decode()
    assert not any(d["kind"] in ("PersistentVolumeClaim", "StatefulSet") for d in docs)
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "rel-pdserve-nats-credentials")
    assert len(secret["data"]["password"]) >= 40
    again = next(d for d in render() if d["kind"] == "Secret" and d["metadata"]["name"] == secret["metadata"]["name"])
    assert again["data"]["password"] != secret["data"]["password"]  # random, not a fixed default
    # RBAC: nothing cluster-admin-like.
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    # Webhook: the bundled CA signs the served certificate (same render).
    vwc = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    tls = next(d for d in docs if d["kind"] == "Secret" and d["type"] == "kubernetes.io/tls")
    assert vwc["webhooks"][0]["clientConfig"]["caBundle"] == tls["data"]["ca.crt"]
    assert vwc["webhooks"][0]["clientConfig"]["service"]["path"] == "/validate-inferenceservice"
    # ... for the name the API server dials (<service>.<namespace>.svc).
    from cryptography import x509

    ca = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    svc = vwc["webhooks"][0]["clientConfig"]["service"]
    assert f"{svc['name']}.{svc['namespace']}.svc" in sans


def test_webhook_check_hook_runs_after_install_with_one_right():
    """The post-install/post-upgrade Job that waits for the API server to reach the webhook: a
    hook (so `helm install --wait` waits for it), deleted when it succeeds, its ServiceAccount
    allowed exactly `create` on InferenceServices in the release namespace, and absent when
    the webhook or the check is off."""
    docs = render("--set", "webhook.startupCheck.timeoutSeconds=45")
    hooks = [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "webhook-check"]
    assert sorted(d["kind"] for d in hooks) == ["Job", "Role", "RoleBinding", "ServiceAccount"]
    for d in hooks:
        ann = d["metadata"]["annotations"]
        assert ann["helm.sh/hook"] == "post-install,post-upgrade"
        assert "hook-succeeded" in ann["helm.sh/hook-delete-policy"]
        assert d["metadata"]["namespace"] == "pdserve-system"
    weight = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in hooks}
    assert weight["Job"] > max(weight["Role"], weight["RoleBinding"], weight["ServiceAccount"])
    role = next(d for d in hooks if d["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": ["pdserve.io"], "resources": ["inferenceservices"], "verbs": ["create"]}]
    binding = next(d for d in hooks if d["kind"] == "RoleBinding")
    sa = next(d for d in hooks if d["kind"] == "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "pdserve-system"}]
    job = next(d for d in hooks if d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] and pod["restartPolicy"] == "Never"
    c = pod["containers"][0]
    assert c["image"] == "ghcr.io/pdserve/pdserve-operator:0.1.0"  # the slim operator image
    assert c["command"] == ["pdserve", "webhook-check", "--namespace=pdserve-system", "--timeout=45"]
    assert job["spec"]["activeDeadlineSeconds"] > 45 and job["spec"]["backoffLimit"] == 0
    # the command it runs exists in the package (a renamed subcommand would fail every install),
    # and waits for the denial of the webhook this chart registers (a renamed one would time out)
    from pdserve.cli import SUBCOMMANDS
    from pdserve.operator.webhookcheck import WEBHOOK_NAME

    assert "webhook-check" in SUBCOMMANDS
    vwc = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    assert [w["name"] for w in vwc["webhooks"]] == [WEBHOOK_NAME]
    for off in (["--set", "webhook.startupCheck.enabled=false"], NON_DEFAULT):
        assert not any(d["kind"] == "Job" for d in render(*off))
    bad = helm("template", "rel", str(CHART), "--set", "webhook.startupCheck.timeoutSeconds=0", check=False)
    assert bad.returncode != 0 and "timeoutSeconds" in bad.stderr


def test_operator_environment_is_its_settings():
    """Every variable the chart sets on the operator is one of its typed settings (a misspelt
    one would be ignored), and the CRD is applied at start unless turned off."""
    from pdserve.config import OperatorSettings, options

    known = {o.env for o in options(OperatorSettings)}
    for values in ([], NON_DEFAULT, ["--set", "operator.manageCRD=false"]):
        op = next(d for d in render(*values) if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pdserve-operator")
        env = {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert set(env) <= known, set(env) - known
        assert env["PDSERVE_MANAGE_CRD"] == ("false" if "operator.manageCRD=false" in values else "true")


def test_non_default_render_uses_external_nats_and_no_webhook():
    docs = render(*NON_DEFAULT)
    assert not any(d["kind"] == "ValidatingWebhookConfiguration" for d in docs)
    assert not any(d["metadata"]["name"].endswith("-nats") for d in docs if d["kind"] == "Deployment")
    op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pdserve-operator")
    c = op["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PDSERVE_NATS_URL"] == "nats://nats.infra:4222" and env["PDSERVE_NATS_SECRET"] == "infra-nats"
    assert env["PDSERVE_METRICS_SCRAPER_NAMESPACE"] == "monitoring"  # the workers' NetworkPolicy admits it
    assert c["args"] == ["--namespace=ml", "--namespace=research", "--verbose"]
    # image.* is the workers' image, which the operator hands on; the operator runs its own slim one.
    assert env["PDSERVE_IMAGE"] == "ghcr.io/pdserve/pdserve:0.1.1"
    assert c["image"] == "ghcr.io/pdserve/pdserve-operator:0.1.0"
    assert op["spec"]["template"]["spec"]["serviceAccountName"] == "pdserve-op"
    apis = {d["metadata"]["name"] for d in docs if d["kind"] == "APIService"}
    assert apis == {"v1beta1.custom.metrics.k8s.io"}  # the metrics adapter, external group turned off


def test_chart_crd_matches_the_operator():
    from pdserve.operator import crd

    assert yaml.safe_load((CHART / "crds/inferenceservices.yaml").read_text()) == crd.crd()


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid_inferenceservices(example):
    """Examples validate against the CRD's own openAPIV3Schema and the cross-field rules."""
    jsonschema = pytest.importorskip("jsonschema")
    from pdserve.operator import crd
    from pdserve.operator.validation import validate

    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def strict(s):  # no unknown fields, like kubectl --validate=strict
        s = dict(s)
        if s.get("type") == "object" and "properties" in s and not s.get("x-kubernetes-preserve-unknown-fields"):
            s["additionalProperties"] = False
        if "properties" in s:
            # metadata is the server's: the CRD constrains its name only
            s["properties"] = {k: v if k == "metadata" else strict(v) for k, v in s["properties"].items()}
        if isinstance(s.get("items"), dict):
            s["items"] = strict(s["items"])
        s.pop("x-kubernetes-int-or-string", None)
        s.pop("x-kubernetes-preserve-unknown-fields", None)
        if s.get("exclusiveMinimum") is True:
            s.pop("exclusiveMinimum")
        return s

    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    isvcs = [d for d in docs if d["kind"] == "InferenceService"]
    assert isvcs
    for d in isvcs:
        jsonschema.validate(d, strict(schema))
        assert validate(d) == []


def _nats_files(docs: list[dict], root: Path) -> tuple[Path, dict[str, str]]:
    """Lay the chart's NATS config, users file and certificate out as the NATS pod mounts them, under
    `root` (absolute paths rewritten into it). → (nats.conf, the server's environment)."""
    conf = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-nats-config"))
    text = conf["data"]["nats.conf"]
    # one pass: `root` itself may lie under /tmp
    text = re.sub(r"(?<![\w/])(/etc/nats/|/var/run/nats/|/tmp/)", lambda m: f"{root}{m.group(1)}", text)
    (root / "etc/nats/config").mkdir(parents=True)
    (root / "var/run/nats").mkdir(parents=True)
    (root / "etc/nats/config/nats.conf").write_text(text)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    for name, folder in (("rel-pdserve-nats-users", "users"), ("rel-pdserve-nats-tls", "tls")):
        if name in secrets:
            (root / "etc/nats" / folder).mkdir()
            for key, value in secrets[name]["data"].items():
                (root / "etc/nats" / folder / key).write_bytes(base64.b64decode(value))
    creds = secrets["rel-pdserve-nats-credentials"]["data"]
    env = {"NATS_USER": base64.b64decode(creds["user"]).decode(),
           "NATS_PASSWORD": base64.b64decode(creds["password"]).decode()}
    return root / "etc/nats/config/nats.conf", env


@pytest.mark.parametrize("values", [[], ["--set", "nats.tls.enabled=true"],
                                    ["--set", "nats.userPerInferenceService=false"]],
                         ids=["default", "tls", "shared-user"])
def test_the_charts_nats_config_is_one_nats_server_accepts(values, tmp_path):
    """The rendered nats.conf, with the users file and certificate it includes, passes the real
    nats-server's own check; the first users file is the one the operator renders, so the chart's
    user reads load reports and nothing more until the operator adds InferenceServices."""
    from pdserve.natsserver import nats_server_binary
    from pdserve.operator.natsusers import render as operator_users

    docs = render(*values)
    conf, env = _nats_files(docs, tmp_path)
    out = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stdout + out.stderr
    users = tmp_path / "etc/nats/users/users.conf"
    if "nats.userPerInferenceService=false" in values:
        assert not users.exists()
    else:
        assert users.read_text() == operator_users({})
    if "nats.tls.enabled=true" in values:
        from cryptography import x509

        tls = tmp_path / "etc/nats/tls"
        cert = x509.load_pem_x509_certificate((tls / "tls.crt").read_bytes())
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate((tls / "ca.crt").read_bytes()))
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "rel-pdserve-nats.pdserve-system.svc.cluster.local" in sans.get_values_for_type(x509.DNSName)
        op = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pdserve-operator")
        env_op = {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env_op["PDSERVE_NATS_TLS_CA"] == "/etc/pdserve/nats/ca.crt"


# -- monitoring: the Grafana dashboard, alerts and scrape targets ---------------------------------------

MONITORING_CRDS = ["--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
                   "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
                   "--api-versions", "monitoring.coreos.com/v1/PodMonitor"]
MONITORING_ON = ["--set", "monitoring.dashboard.enabled=true", "--set", "monitoring.prometheusRule.enabled=true",
                 "--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.podMonitor.enabled=true"]
MONITORING_KINDS = {"PrometheusRule", "ServiceMonitor", "PodMonitor"}


def _dashboard_map(docs: list[dict]) -> dict | None:
    return next((d for d in docs if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]), None)


def test_monitoring_is_off_by_default_and_needs_its_crds():
    assert _dashboard_map(render()) is None
    assert not MONITORING_KINDS & {d["kind"] for d in render(*MONITORING_CRDS)}
    # switched on where the Prometheus operator is absent: only the dashboard (a plain ConfigMap)
    kinds = {d["kind"] for d in render(*MONITORING_ON)}
    assert not MONITORING_KINDS & kinds and _dashboard_map(render(*MONITORING_ON)) is not None
    assert MONITORING_KINDS <= {d["kind"] for d in render(*MONITORING_ON, *MONITORING_CRDS)}


def test_dashboard_configmap_is_what_scripts_dashboard_writes():
    spec = importlib.util.spec_from_file_location("dashboard", REPO / "scripts" / "dashboard.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (CHART / "dashboards" / "pdserve.json").read_text() == gen.render(), \
        "the committed dashboard is stale: run python scripts/dashboard.py"
    cm = _dashboard_map(render("--set", "monitoring.dashboard.enabled=true", "--set", "monitoring.dashboard.folder=LLM",
                               "--set", "monitoring.dashboard.namespace=monitoring"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["annotations"]["grafana_folder"] == "LLM"
    assert json.loads(cm["data"]["pdserve.json"]) == gen.dashboard()
    titles = {p["title"] for p in gen.dashboard()["panels"]}
    for want in ("Time to first token", "Inter-token latency", "End-to-end request latency", "Tokens per second",
                 "Queue depths per pool", "KV pool use", "Transfer bandwidth", "Transfer failures and backlog",
                 "Speculation acceptance", "P:D ratio", "Autoscaler: workers per pool and their signals"):
        assert want in titles


def exported_metric_names() -> set[str]:
    """Every metric name the serving code declares (`"pdserve_..."` in its sources), with the series names
    prometheus_client derives from it (histograms' _bucket/_count/_sum, a counter family's _total)."""
    names = set()
    for folder in ("pdserve", "front", "prefill", "decode", "kvtransfer", "autoscale"):
        for path in (REPO / folder).rglob("*.py"):
            names |= set(re.findall(r'"(pdserve_[a-z0-9_]+)"', path.read_text()))
    derived = {n + s for n in names for s in ("_bucket", "_count", "_sum")}
    derived |= {n + "_total" for n in names if not n.endswith("_total")}
    return names | derived


def monitoring_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard query and alert expression the chart renders."""
    docs = render(*MONITORING_ON, *MONITORING_CRDS)
    dash = json.loads(_dashboard_map(docs)["data"]["pdserve.json"])
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]
    rules = next(d for d in docs if d["kind"] == "PrometheusRule")
    out += [(f"alert {r['alert']}", r["expr"]) for g in rules["spec"]["groups"] for r in g["rules"]]
    return out


def test_every_metric_the_dashboard_and_alerts_read_is_one_the_code_exports():
    known = exported_metric_names()
    for where, expr in monitoring_queries():
        used = set(re.findall(r"\bpdserve_[a-z0-9_]+", expr))
        assert used, f"{where} reads no pdserve metric"
        assert not used - known, f"{where} reads {sorted(used - known)}, which no serving code exports"


def test_alert_rules_cover_the_failure_modes_and_take_their_thresholds():
    docs = render(*MONITORING_ON, *MONITORING_CRDS, "--set-string", "monitoring.prometheusRule.slo.ttftSeconds=0.5",
                  "--set-json", "monitoring.prometheusRule.kvUtilization=0.8", "--set",
                  "monitoring.prometheusRule.labels.release=kube-prometheus-stack")
    rules = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rules["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = {r["alert"]: r for g in rules["spec"]["groups"] for r in g["rules"]}
    for want in ("PdserveTTFTBudgetBurn", "PdserveITLBudgetBurn", "PdserveTTFTBudgetBurnSlow", "PdserveKVTransfersStalled",
                 "PdserveKVTransferFailures", "PdserveDecodePoolAtCapacity", "PdservePrefillPoolAtCapacity",
                 "PdserveWorkersFlapping"):
        assert want in alerts
    assert 'le="0.5"' in alerts["PdserveTTFTBudgetBurn"]["expr"]
    assert alerts["PdserveDecodePoolAtCapacity"]["expr"].endswith("> 0.8")
    assert all(r["labels"]["severity"] for r in alerts.values())
    # an objective that is not a bucket bound could never be measured: refused
    bad = helm("template", "rel", str(CHART), "--set-string", "monitoring.prometheusRule.slo.ttftSeconds=3",
               check=False)
    assert bad.returncode != 0 and "ttftSeconds" in bad.stderr


def test_scrape_targets_select_the_operators_pods_and_services():
    docs = render(*MONITORING_ON, *MONITORING_CRDS, "--set", "monitoring.podMonitor.interval=30s")
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    for mon, endpoints in ((pm, "podMetricsEndpoints"), (sm, "endpoints")):
        assert mon["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "pdserve",
                                                          "app.kubernetes.io/managed-by": "pdserve-operator"}
        assert mon["spec"]["namespaceSelector"] == {"any": True}
        # the workers' port and the front's (see operator/reconcile.py)
        assert [e["port"] for e in mon["spec"][endpoints]] == ["metrics", "http"]
        assert {"pool", "isvc"} <= {r["targetLabel"] for r in mon["spec"][endpoints][0]["relabelings"]}
    assert {e["interval"] for e in pm["spec"]["podMetricsEndpoints"]} == {"30s"}
    from pdserve.operator.reconcile import labels

    assert labels("x", "decode")["app.kubernetes.io/managed-by"] == "pdserve-operator"
