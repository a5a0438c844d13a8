"""Every pod template pdserve renders (the operator's worker and front Deployments, the chart's NATS,
operator and metrics adapter) passes the "restricted" Pod Security Standard, and keeps its root
filesystem read-only with every path the code writes on a volume of its own.

The checker follows the published rules (kubernetes.io/docs/concepts/security/pod-security-standards,
policy version "latest"): the baseline controls, which "restricted" includes, then the restricted
ones. The chart's templates need helm (skipped without it, as in test_chart.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdserve.operator.reconcile import OperatorConfig, desired_children

REPO = Path(__file__).resolve().parents[1]

# Baseline: capabilities a container may add; restricted narrows this to NET_BIND_SERVICE.
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    """The rules of the restricted profile that a pod spec breaks, each naming where ([] = none)."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    containers = [(f"{kind[:-1]} {c['name']}", c) for kind in ("containers", "initContainers", "ephemeralContainers")
                  for c in pod.get(kind) or []]
    contexts = [("pod", psc)] + [(where, c.get("securityContext") or {}) for where, c in containers]
    # ---- baseline
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"pod: {key}")
    for where, sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: windowsOptions.hostProcess")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}: seLinuxOptions {se}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}: seccompProfile Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}: appArmorProfile Unconfined")
    for where, c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPS:
            out.append(f"{where}: capabilities beyond the baseline's")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{where}: procMount {sc['procMount']}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']}")
    for key, value in ((pod.get("metadata") or {}).get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
                value == "runtime/default" or value.startswith("localhost/")):
            out.append(f"annotation {key}: {value}")
    for s in psc.get("sysctls") or []:
        if s["name"] not in SAFE_SYSCTLS:
            out.append(f"pod: sysctl {s['name']}")
    # ---- restricted
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {', '.join(sorted(kinds - RESTRICTED_VOLUMES))}")
    pod_nonroot, pod_seccomp = psc.get("runAsNonRoot"), (psc.get("seccompProfile") or {}).get("type")
    if pod_nonroot is False:
        out.append("pod: runAsNonRoot false")
    for where, sc in contexts:
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")
    for where, c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation not false")
        if sc.get("runAsNonRoot", pod_nonroot) is not True:
            out.append(f"{where}: runAsNonRoot not true (pod or container)")
        if (sc.get("seccompProfile") or {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile not RuntimeDefault or Localhost (pod or container)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities.drop lacks ALL")
        added = set(caps.get("add") or [])
        if added - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: capabilities.add {sorted(added - {'NET_BIND_SERVICE'})}")
    return out


def writable_root_violations(pod: dict) -> list[str]:
    """Beyond the standard, as pdserve requires: every container's root filesystem is read-only and
    /tmp (HOME, and so the Triton, torch and HF caches under it) is a volume."""
    out = []
    for kind in ("containers", "initContainers"):
        for c in pod.get(kind) or []:
            if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
                out.append(f"{c['name']}: readOnlyRootFilesystem not true")
            mounts = {m["mountPath"] for m in c.get("volumeMounts") or []}
            env = {e["name"]: e.get("value") for e in c.get("env") or []}
            for path in {"/tmp", env.get("HOME") or "/tmp"}:
                if kind == "containers" and path not in mounts:
                    out.append(f"{c['name']}: {path} is not a volume")
    return out


def _isvc(spec: dict) -> dict:
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1}, "spec": spec}


OPERATOR_CASES = {
    "pvc": ({"model": {"path": "m", "pvc": "models"}}, OperatorConfig()),
    "model-image-gpu-tls": ({"model": {"path": "m", "image": "registry/models:1"}, "decode": {"gpus": 1},
                             "prefill": {"gpus": 1}},
                            OperatorConfig(nats_users=False, nats_credentials={"user": "u", "password": "p"},
                                           nats_tls_ca="-----BEGIN CERTIFICATE-----")),
    "draft-pool-tls": ({"model": {"path": "m", "image": "registry/models:1"}, "speculation": {"draftPool": {}}},
                       OperatorConfig(nats_users=False, nats_credentials={"user": "u", "password": "p"},
                                      nats_tls_ca="-----BEGIN CERTIFICATE-----")),
}


def _operator_pods() -> list[tuple[str, dict]]:
    """Every pod template the operator renders in OPERATOR_CASES: each pool, the draft pool included."""
    out = []
    for case, (spec, cfg) in OPERATOR_CASES.items():
        for child in desired_children(_isvc(spec), cfg):
            if child["kind"] == "Deployment":
                t = child["spec"]["template"]
                out.append((f"{case}/{child['metadata']['name']}", {**t["spec"], "metadata": t["metadata"]}))
    return out


def test_every_pool_is_checked():
    assert {n.split("/")[1] for n, _ in _operator_pods()} == {"llama-prefill", "llama-decode", "llama-front",
                                                              "llama-draftpool"}


@pytest.mark.parametrize("name,pod", _operator_pods(), ids=lambda x: x if isinstance(x, str) else "")
def test_operator_pods_are_restricted_with_a_read_only_root(name, pod):
    assert restricted_violations(pod) == []
    assert writable_root_violations(pod) == []


def _chart_pods() -> list[tuple[str, dict]]:
    from test_chart import render

    out = []
    for case, values in (("default", []), ("tls", ["--set", "nats.tls.enabled=true"]),
                         ("adapter", ["--set", "metricsAdapter.enabled=true"])):
        for d in render(*values):
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
                t = d["spec"]["template"]
                out.append((f"{case}/{d['metadata']['name']}", {**t["spec"], "metadata": t.get("metadata") or {}}))
    return out


@pytest.mark.k8s
def test_chart_pods_are_restricted_with_a_read_only_root():
    pods = _chart_pods()
    names = {n.split("/")[1] for n, _ in pods}
    assert {"rel-pdserve-nats", "rel-pdserve-operator"} <= names, names
    for name, pod in pods:
        assert restricted_violations(pod) == [], name
        assert writable_root_violations(pod) == [], name


BAD = [
    ({"hostNetwork": True}, "pod: hostNetwork"),
    ({"securityContext": {"runAsNonRoot": False}}, "pod: runAsNonRoot false"),
    ({"securityContext": {"runAsNonRoot": True, "runAsUser": 0}}, "pod: runAsUser 0"),
    ({"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "Unconfined"}}}, "seccompProfile"),
    ({"volumes": [{"name": "host", "hostPath": {"path": "/"}}]}, "volume host: hostPath"),
    ({"c": {"privileged": True}}, "container c: privileged"),
    ({"c": {"allowPrivilegeEscalation": True}}, "allowPrivilegeEscalation not false"),
    ({"c": {"capabilities": {"drop": ["NET_RAW"]}}}, "capabilities.drop lacks ALL"),
    ({"c": {"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}}, "capabilities.add ['SYS_ADMIN']"),
    ({"c": {"runAsNonRoot": False}}, "container c: runAsNonRoot not true"),
    ({"c": {"seLinuxOptions": {"type": "spc_t"}}}, "seLinuxOptions"),
    ({"c": {"procMount": "Unmasked"}}, "procMount Unmasked"),
    ({"securityContext": {"runAsNonRoot": True, "sysctls": [{"name": "kernel.msgmax", "value": "1"}]}},
     "sysctl kernel.msgmax"),
    ({"nosec": True}, "seccompProfile not RuntimeDefault"),
]


@pytest.mark.parametrize("change,expected", BAD, ids=[e for _, e in BAD])
def test_the_checker_finds_each_rule_broken(change, expected):
    """A compliant pod passes; breaking any one rule is found and named."""
    sc = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    pod = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
           "containers": [{"name": "c", "image": "i", "securityContext": dict(sc),
                           "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
           "volumes": [{"name": "tmp", "emptyDir": {}}]}
    assert restricted_violations(pod) == [] and writable_root_violations(pod) == []
    change = dict(change)
    if "c" in change:
        pod["containers"][0]["securityContext"].update(change.pop("c"))
    if change.pop("nosec", False):
        del pod["securityContext"]["seccompProfile"]
    if "volumes" in change:
        pod["volumes"] += change.pop("volumes")
    pod.update(change)
    found = restricted_violations(pod)
    assert any(expected in v for v in found), found


def test_a_writable_root_or_unmounted_tmp_is_found():
    pod = {"containers": [{"name": "c", "securityContext": {"readOnlyRootFilesystem": False},
                           "env": [{"name": "HOME", "value": "/home/app"}],
                           "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}]}
    assert writable_root_violations(pod) == ["c: readOnlyRootFilesystem not true", "c: /home/app is not a volume"]
