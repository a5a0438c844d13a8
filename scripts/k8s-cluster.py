#!/usr/bin/env python3
"""A throwaway Kubernetes control plane on loopback: etcd + kube-apiserver + kube-controller-manager.

Used by the pytest fixtures in tests/k8s/conftest.py and runnable by hand:

    python scripts/k8s-cluster.py            # starts, prints `export KUBECONFIG=...`, Ctrl-C stops
    python scripts/k8s-cluster.py --node     # the same plus a real node: scripts/k8s-node.py

Without --node no kubelet and no scheduler run: Pods stay Pending, and tests that need "ready" workloads
patch Deployment/Pod status themselves. Binaries come from scripts/k8s-tools.sh
(cached under ~/.cache/pdserve/k8s/bin). Authentication is a static admin token
(system:masters), authorization RBAC, so RBAC objects that the chart installs are real.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CACHE_BIN = Path(os.environ.get("PDSERVE_K8S_CACHE", Path.home() / ".cache/pdserve/k8s")) / "bin"


def find_binary(name: str) -> str | None:
    """The path of a control-plane binary or tool: the pdserve cache first, then PATH."""
    p = CACHE_BIN / name
    if p.is_file() and os.access(p, os.X_OK):
        return str(p)
    return shutil.which(name)


def missing_binaries() -> list[str]:
    """Names of the binaries a cluster needs that this machine lacks (empty: can start)."""
    return [b for b in ("etcd", "kube-apiserver", "kube-controller-manager") if find_binary(b) is None]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies, even by SIGKILL, so a
    killed pytest never leaves an API server running on a shared machine (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    """One control plane in a temp dir. `start()` blocks until /readyz answers; `stop()` kills all.

    Attributes after start: `server` (https URL), `token` (admin bearer token), `kubeconfig` (path), `ca_file` (CA bundle of the server),
    `front_proxy_ca` (CA of the aggregator's front-proxy client certificate, as extension API
    servers see it: --requestheader-client-ca-file),
    `workdir` (temp dir with logs: etcd.log, apiserver.log, controller-manager.log).
    `controller_args` are appended to kube-controller-manager's command line (e.g. a shorter
    `--horizontal-pod-autoscaler-sync-period`).
    """

    controller_args: list[str] = field(default_factory=list)
    apiserver_args: list[str] = field(default_factory=list)
    workdir: Path | None = None
    server: str = ""
    token: str = ""
    kubeconfig: str = ""
    ca_file: str = ""
    front_proxy_ca: str = ""
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _own_workdir: bool = False

    def start(self, timeout: float = 60.0) -> "LocalCluster":
        missing = missing_binaries()
        if missing:
            raise FileNotFoundError(f"missing {missing}; run scripts/k8s-tools.sh")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-k8s-"))
            self._own_workdir = True
        w = self.workdir
        (w / "certs").mkdir(parents=True, exist_ok=True)
        self.token = os.urandom(16).hex()
        (w / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        subprocess.run(["openssl", "genrsa", "-out", str(w / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(w / "sa.key"), "-pubout", "-out", str(w / "sa.pub")],
                       check=True, capture_output=True)
        self._front_proxy_certs(w)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self._spawn("etcd", [
            find_binary("etcd"), "--data-dir", str(w / "etcd"), "--name", "pdserve-test",
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"pdserve-test=http://127.0.0.1:{peer_port}",
            "--quota-backend-bytes=1073741824",
        ])
        self.server = f"https://127.0.0.1:{api_port}"
        self._spawn("apiserver", [
            find_binary("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}", "--insecure-port=0",
            f"--cert-dir={w / 'certs'}",
            f"--token-auth-file={w / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={w / 'sa.pub'}",
            f"--service-account-signing-key-file={w / 'sa.key'}",
            "--disable-admission-plugins=ServiceAccount",
            "--allow-privileged=true",
            # Aggregation layer: the apiserver proxies to extension API servers (a metrics adapter)
            # with a client certificate signed by this CA; they read it from
            # kube-system/extension-apiserver-authentication.
            f"--requestheader-client-ca-file={self.front_proxy_ca}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={w / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={w / 'front-proxy-client.key'}",
            *self.apiserver_args,
        ])
        # kube-apiserver writes its self-signed serving cert (with its CA) here at start.
        self.ca_file = str(w / "certs" / "apiserver.crt")
        self.kubeconfig = str(w / "kubeconfig")
        Path(self.kubeconfig).write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: pdserve-test\n  cluster:\n    server: {self.server}\n"
            f"    certificate-authority: {self.ca_file}\n"
            f"users:\n- name: admin\n  user:\n    token: {self.token}\n"
            "contexts:\n- name: pdserve-test\n  context:\n    cluster: pdserve-test\n    user: admin\n"
            "    namespace: default\n"
            "current-context: pdserve-test\n")
        os.chmod(self.kubeconfig, 0o600)
        self._wait_ready(timeout)
        self._spawn("controller-manager", [
            find_binary("kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--port=0", f"--secure-port={free_port()}", "--bind-address=127.0.0.1",
            f"--service-account-private-key-file={w / 'sa.key'}",
            "--use-service-account-credentials=false",
            "--controllers=*,-csrsigning,-nodeipam,-cloud-node-lifecycle",
            *self.controller_args,
        ])
        return self

    def _front_proxy_certs(self, w: Path) -> None:
        def ssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True)
        ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pdserve-test-front-proxy-ca",
            "-keyout", str(w / "front-proxy-ca.key"), "-out", str(w / "front-proxy-ca.crt"))
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=front-proxy-client",
            "-keyout", str(w / "front-proxy-client.key"), "-out", str(w / "front-proxy-client.csr"))
        (w / "client.ext").write_text("extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
        ssl("x509", "-req", "-in", str(w / "front-proxy-client.csr"), "-CA", str(w / "front-proxy-ca.crt"),
            "-CAkey", str(w / "front-proxy-ca.key"), "-CAcreateserial", "-days", "2",
            "-extfile", str(w / "client.ext"), "-out", str(w / "front-proxy-client.crt"))
        self.front_proxy_ca = str(w / "front-proxy-ca.crt")

    def _spawn(self, name: str, cmd: list) -> None:
        log = open(self.workdir / f"{name}.log", "wb")
        # Own process group so that stop() ends exactly these processes and nothing else.
        self._procs.append(subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=_die_with_parent))
        log.close()  # the child holds its own descriptor

    def _wait_ready(self, timeout: float) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; logs in {self.workdir}")
            try:
                req = urllib.request.Request(self.server + "/readyz",
                                             headers={"Authorization": f"Bearer {self.token}"})
                with urllib.request.urlopen(req, context=ctx, timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception as e:  # not up yet
                last = e
            time.sleep(0.3)
        raise TimeoutError(f"kube-apiserver not ready after {timeout}s ({last}); logs in {self.workdir}")

    def stop(self) -> None:
        for p in reversed(self._procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()
        if self._own_workdir and self.workdir and not os.environ.get("PDSERVE_K8S_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> int:
    if "--node" in sys.argv[1:]:
        import importlib.util

        sys.modules.setdefault("pdserve_k8s_cluster", sys.modules[__name__])
        spec = importlib.util.spec_from_file_location("pdserve_k8s_node", Path(__file__).with_name("k8s-node.py"))
        node = sys.modules["pdserve_k8s_node"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(node)
        missing, cluster = node.missing_node_parts(), node.NodeCluster(
            controller_args=["--horizontal-pod-autoscaler-sync-period=5s"])
    else:
        missing, cluster = missing_binaries(), LocalCluster()
    if missing:
        print(f"missing {missing}; run scripts/k8s-tools.sh (and scripts/setup.sh for a node)", file=sys.stderr)
        return 1
    with cluster as c:
        # A node's workdir is what PDSERVE_K8S_NODE takes to run tests against it.
        print(f"export KUBECONFIG={c.kubeconfig}   # Ctrl-C stops the cluster; logs in {c.workdir}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
