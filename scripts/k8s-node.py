"""A real single-node Kubernetes cluster inside one network namespace the harness creates.

    python scripts/k8s-cluster.py --node     # starts, prints `export KUBECONFIG=...`, Ctrl-C stops

Inside the namespace (addresses exist only there; it has no link to the host or beyond):
  etcd, kube-apiserver (10.99.0.1:6443), kube-controller-manager, kube-scheduler,
  containerd + runc + CNI (bridge cni0, host-local, portmap), kubelet, kube-proxy (iptables),
  cluster DNS: dnsmasq on the node address behind the usual kube-dns Service 10.96.0.10.
  Node 10.99.0.1/32 on an `ifb` device, pods 10.88.0.0/16, Services 10.96.0.0/16.

Cluster DNS: Debian packages no CoreDNS or kube-dns, so dnsmasq answers
`<svc>.<ns>.svc.cluster.local` (ClusterIPs; ready addresses of headless Services) from a hosts
folder that a watch on Services and Endpoints keeps current (dnsmasq rereads it by inotify), and
answers NXDOMAIN for every other cluster.local name so that resolv.conf's search list moves on.
No pod, SRV or ExternalName records.

(Just over our ~600-line norm: the node is one life cycle — namespaces, daemons, images, relays —
whose start and stop must mirror each other step for step; the netns and cgroup mechanics are
already apart in k8s-netns.py.)

The host reaches the cluster through loopback relays (`forward`): a listener on 127.0.0.1 whose
connections are dialled from sockets made inside the namespace (`setns` on one thread; a socket
keeps the namespace it was made in). The kubeconfig points at such a relay, so kubectl, helm,
the kubernetes client and in-process kopf runners work unchanged, and traffic to a Service
leaves from the node itself.

Daemons share one mount namespace (a slave of the host's: kubelet's volume mounts must be seen
by runc) in which private overlays cover /run, /var/lib and /var/log, the paths containerd,
the CNI plugins and the kubelet hard-code, and private files shadow the kernel settings the
kubelet writes; the host's files, mounts and sysctls stay as they are. Every process, pods
included, runs in cgroups under /pdserve-node-<harness pid>: stop() kills that tree and removes
it; a harness killed outright is swept by the next one (owner pid dead). Daemons also get
SIGTERM when the harness dies (`_die_with_parent`).

Images (scripts/k8s-images.py) are imported into containerd's store under ~/.cache/pdserve/k8s/node,
kept across runs so a warm start imports nothing; a second node running at the same time gets a
private store of its own.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODE_IP = "10.99.0.1"
NODE_NAME = "pdserve-node"
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
API_SERVICE_IP = "10.96.0.1"
DNS_SERVICE_IP = "10.96.0.10"
API_PORT = 6443
# containerd's image store, kept across runs (one node at a time uses it; others get their own)
NODE_STORE = Path(os.environ.get("PDSERVE_K8S_CACHE", Path.home() / ".cache/pdserve/k8s")) / "node"
CLUSTER_DOMAIN = "cluster.local"
# What the kubelet sets at start when it may (protectKernelDefaults false): shadowed by private files.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
NODE_PACKAGES = {"containerd": "containerd", "runc": "runc", "ctr": "containerd", "iptables": "iptables",
                 "conntrack": "conntrack", "dnsmasq": "dnsmasq-base", "nsenter": "util-linux",
                 "/usr/lib/cni/bridge": "containernetworking-plugins",
                 # the images' offline build (scripts/k8s-images.py)
                 "buildah": "buildah", "debootstrap": "debootstrap", "gcc": "gcc"}


def _load(name: str, file: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


cluster_mod = _load("pdserve_k8s_cluster", "k8s-cluster.py")
images_mod = _load("pdserve_k8s_images", "k8s-images.py")
netns_mod = _load("pdserve_k8s_netns", "k8s-netns.py")
NetnsRelay = netns_mod.NetnsRelay


def missing_node_parts() -> list[str]:
    """What this machine lacks to run the node (binaries, the Debian packages that hold them, root)."""
    out = [] if os.geteuid() == 0 else ["root (the node creates network namespaces, mounts and cgroups)"]
    out += [b for b in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
           if cluster_mod.find_binary(b) is None]
    for binary, package in NODE_PACKAGES.items():
        if not (Path(binary).exists() if binary.startswith("/") else shutil.which(binary)):
            out.append(f"{binary} (apt-get install {package})")
    return out


# ---------------------------------------------------------------- the cluster

@dataclass
class NodeCluster(cluster_mod.LocalCluster):
    """Control plane + one node in a private network namespace. After start(): `server`,
    `token`, `kubeconfig`, `ca_file`, `front_proxy_ca`, `workdir` as for LocalCluster (the server
    is a loopback relay), `images` (name -> images_mod.Image, imported into the node),
    `node_kubeconfig` (the same admin identity at the in-namespace address, for commands run in
    the node with `node_exec`)."""

    images: dict = field(default_factory=dict)
    node_kubeconfig: str = ""
    _holder: subprocess.Popen | None = None
    _relay: NetnsRelay | None = None
    _cgroup: str = ""
    _dns_stop: threading.Event = field(default_factory=threading.Event)
    _dns_error: list = field(default_factory=list)
    _images_error: list = field(default_factory=list)
    _store_lock: object = None
    _attached: bool = False

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 120.0) -> "NodeCluster":
        missing = missing_node_parts()
        if missing:
            raise FileNotFoundError(f"missing {missing}; run scripts/k8s-tools.sh and scripts/setup.sh")
        if not self.images:
            self.images = images_mod.build_images()
        netns_mod.sweep_stale_nodes()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-node-"))
            self._own_workdir = True
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        w = self.workdir
        self._cgroup = f"{netns_mod.CGROUP_PREFIX}{os.getpid()}"
        netns_mod.make_cgroups(self._cgroup)
        self._credentials(w)
        self._namespace(w)
        self._relay = NetnsRelay(f"/proc/{self._holder.pid}/ns/net")
        self.server = f"https://127.0.0.1:{self._relay.forward(NODE_IP, API_PORT)}"
        self.kubeconfig = self._write_kubeconfig(w / "kubeconfig", self.server, self.token)
        self.node_kubeconfig = self._write_kubeconfig(w / "node-kubeconfig", f"https://{NODE_IP}:{API_PORT}", self.token)
        self._containerd(w)
        # Loading images (seconds when the node's image store already holds them, minutes for a
        # new worker image) overlaps the control plane's start; no pod exists before start() returns.
        images = threading.Thread(target=self._sync_images, name="node-images", daemon=True)
        images.start()
        self._control_plane(w)
        self._wait_ready(timeout)
        self._bootstrap_rbac()
        self._node_daemons(w)
        self._dns(w)
        images.join()
        if self._images_error:
            raise self._images_error[0]
        self._wait_node_ready(time.monotonic() + timeout)
        (w / "node.json").write_text(json.dumps({
            "holder": self._holder.pid, "kubeconfig": self.kubeconfig, "node_kubeconfig": self.node_kubeconfig,
            "ca_file": self.ca_file, "token": self.token, "server": self.server,
            "images": {n: [i.ref, str(i.archive)] for n, i in self.images.items()}}))

    @classmethod
    def attach(cls, workdir: str) -> "NodeCluster":
        """The node another process started (its workdir, see main()), for tests run by hand
        against it: forward() works, stop() leaves it running."""
        state = json.loads((Path(workdir) / "node.json").read_text())
        node = cls(workdir=Path(workdir), images={n: images_mod.Image(n, ref, Path(a))
                                                  for n, (ref, a) in state["images"].items()})
        for key in ("kubeconfig", "node_kubeconfig", "ca_file", "token", "server"):
            setattr(node, key, state[key])
        node._relay = NetnsRelay(f"/proc/{state['holder']}/ns/net")
        node._attached = True
        return node

    def stop(self) -> None:
        if self._attached:
            self._relay.close()
            return
        self._dns_stop.set()
        if self._relay:
            self._relay.close()
            self._relay = None
        if self._cgroup:
            netns_mod.kill_cgroups(self._cgroup)  # daemons, shims, containers: every process of the node
        for p in self._procs:
            p.wait()
        self._procs.clear()
        if self._holder:
            self._holder.wait()
            self._holder = None
        if self._cgroup:
            netns_mod.remove_cgroups(self._cgroup)  # once our own children are reaped
            self._cgroup = ""
        if self._store_lock is not None:
            self._store_lock.close()  # the next node may use the image store
            self._store_lock = None
        if self._own_workdir and self.workdir and not os.environ.get("PDSERVE_K8S_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------ public helpers

    def forward(self, host: str, port: int) -> int:
        """A host loopback port relaying to host:port as seen from the node (a Service's
        ClusterIP, a pod IP)."""
        return self._relay.forward(host, port)

    def tag_image(self, ref: str, new_ref: str) -> None:
        """Give an imported image a second name in the node's image store (a name left by an earlier run moves)."""
        self._ctr("images", "tag", "--force", ref, new_ref)

    def _ctr(self, *args: str) -> str:
        out = subprocess.run(["ctr", "--address", str(self.workdir / "containerd/containerd.sock"), "-n", "k8s.io",
                              *args], capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def node_exec(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """Run a command on the node (its network and mount namespaces)."""
        return subprocess.run(self._in_node(cmd), **kw)

    # ------------------------------------------------------------ steps

    def _credentials(self, w: Path) -> None:
        from pdserve.autoscale.certs import make_client_cert, make_serving_cert

        pki = w / "pki"
        # One CA: the API server's serving certificate (for the relay's loopback address, the node
        # address and the in-cluster names) and the client certificate it shows kubelets.
        self.ca = make_serving_cert(pki, ["kubernetes", "127.0.0.1", NODE_IP, API_SERVICE_IP, "localhost",
                                          "kubernetes.default", "kubernetes.default.svc",
                                          f"kubernetes.default.svc.{CLUSTER_DOMAIN}"], days=2)
        self.ca_file = str(self.ca.ca_cert)
        self.kubelet_client = make_client_cert(self.ca, pki, "kube-apiserver-kubelet-client", days=2)
        self.token = os.urandom(16).hex()
        self.node_token, self.proxy_token = os.urandom(16).hex(), os.urandom(16).hex()
        (w / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n'
                                      f'{self.node_token},system:node:{NODE_NAME},node,"system:nodes"\n'
                                      f'{self.proxy_token},system:kube-proxy,kube-proxy\n')
        subprocess.run(["openssl", "genrsa", "-out", str(w / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(w / "sa.key"), "-pubout", "-out", str(w / "sa.pub")],
                       check=True, capture_output=True)
        self._front_proxy_certs(w)

    def _write_kubeconfig(self, path: Path, server: str, token: str) -> str:
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: pdserve-node\n  cluster:\n    server: {server}\n"
            f"    certificate-authority: {self.ca_file}\n"
            f"users:\n- name: u\n  user:\n    token: {token}\n"
            "contexts:\n- name: pdserve-node\n  context:\n    cluster: pdserve-node\n    user: u\n"
            "    namespace: default\n"
            "current-context: pdserve-node\n")
        os.chmod(path, 0o600)
        return str(path)

    def _namespace(self, w: Path) -> None:
        """The holder process owns the node's network and mount namespaces; set them up."""
        self._holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "slave", "sleep", "infinity"],
            preexec_fn=self._child_setup, start_new_session=True)
        for _ in range(100):  # unshare has made the namespaces once /proc shows another netns
            if os.readlink(f"/proc/{self._holder.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                break
            time.sleep(0.02)
        layers = []
        for path in ("/run", "/var/lib", "/var/log"):
            upper, work = w / "overlay" / path.strip("/").replace("/", "-"), w / "overlay" / f"{path.strip('/').replace('/', '-')}.work"
            upper.mkdir(parents=True)
            work.mkdir()
            layers.append(f"mount -t overlay overlay -o lowerdir={path},upperdir={upper},workdir={work} {path}")
        shadows = []
        for key in KUBELET_SYSCTLS:
            f = w / "sysctl" / key.replace("/", ".")
            f.parent.mkdir(exist_ok=True)
            f.write_text(Path("/proc/sys", key).read_text())
            shadows.append(f"mount --bind {f} /proc/sys/{key}")
        script = "\n".join([
            "set -e",
            *layers, *shadows,
            "ip link set lo up",
            "ip link add pdnode0 type ifb",
            f"ip addr add {NODE_IP}/32 dev pdnode0",
            "ip link set pdnode0 up",
            # Services are DNATed after the route lookup: the node needs a route for their range
            # (the ifb device leads nowhere, so nothing unmatched leaves).
            f"ip route add {SERVICE_CIDR} dev pdnode0",
            "sysctl -q -w net.ipv4.ip_forward=1",  # this namespace's own setting
        ])
        out = subprocess.run(self._in_node(["sh", "-c", script]), capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"node namespace set-up failed: {out.stderr.strip()}")

    def _in_node(self, cmd: list) -> list[str]:
        pid = self._holder.pid
        return ["nsenter", f"--net=/proc/{pid}/ns/net", f"--mount=/proc/{pid}/ns/mnt", "--", *map(str, cmd)]

    def _child_setup(self) -> None:
        """In each child before exec: join the node's cgroups, die with the harness."""
        for h in netns_mod.hierarchies():
            try:
                (h / self._cgroup / "system" / "cgroup.procs").write_text(str(os.getpid()))
            except OSError:
                pass
        cluster_mod._die_with_parent()

    def _spawn_node(self, name: str, cmd: list) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")
        p = subprocess.Popen(self._in_node(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=self._child_setup)
        log.close()
        self._procs.append(p)
        return p

    def _control_plane(self, w: Path) -> None:
        self._spawn_node("etcd", [
            cluster_mod.find_binary("etcd"), "--data-dir", w / "etcd", "--name", "pdserve-node",
            "--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
            "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
            "--initial-cluster", "pdserve-node=http://127.0.0.1:2380", "--quota-backend-bytes=1073741824",
        ])
        crt, key = self.kubelet_client
        self._spawn_node("apiserver", [
            cluster_mod.find_binary("kube-apiserver"),
            "--etcd-servers=http://127.0.0.1:2379",
            "--bind-address=0.0.0.0", f"--advertise-address={NODE_IP}", f"--secure-port={API_PORT}",
            "--insecure-port=0",
            f"--tls-cert-file={self.ca.cert}", f"--tls-private-key-file={self.ca.key}",
            f"--client-ca-file={self.ca.ca_cert}",
            f"--token-auth-file={w / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer=https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
            f"--service-account-key-file={w / 'sa.pub'}",
            f"--service-account-signing-key-file={w / 'sa.key'}",
            "--allow-privileged=true",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--kubelet-client-certificate={crt}", f"--kubelet-client-key={key}",
            f"--requestheader-client-ca-file={self.front_proxy_ca}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={w / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={w / 'front-proxy-client.key'}",
            *self.apiserver_args,
        ])

    def _bootstrap_rbac(self) -> None:
        """What kubeadm grants too: the API server's client identity may use the kubelet's API
        (logs, exec, port-forward)."""
        from kubernetes import client

        client.RbacAuthorizationV1Api(self._api()).create_cluster_role_binding({
            "metadata": {"name": "pdserve-node:kube-apiserver-kubelet-client"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:kubelet-api-admin"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": "kube-apiserver-kubelet-client"}]})

    def _node_daemons(self, w: Path) -> None:
        admin = self.node_kubeconfig
        self._spawn_node("controller-manager", [
            cluster_mod.find_binary("kube-controller-manager"),
            f"--kubeconfig={admin}", f"--authentication-kubeconfig={admin}", f"--authorization-kubeconfig={admin}",
            "--leader-elect=false", "--port=0", "--secure-port=10257", "--bind-address=127.0.0.1",
            f"--service-account-private-key-file={w / 'sa.key'}", f"--root-ca-file={self.ca.ca_cert}",
            "--use-service-account-credentials=false", f"--cluster-cidr={POD_CIDR}",
            "--controllers=*,-csrsigning,-nodeipam,-cloud-node-lifecycle",
            *self.controller_args,
        ])
        self._spawn_node("scheduler", [
            cluster_mod.find_binary("kube-scheduler"), f"--kubeconfig={admin}", "--leader-elect=false",
            "--port=0", "--secure-port=10259", "--bind-address=127.0.0.1",
            f"--authentication-kubeconfig={admin}", f"--authorization-kubeconfig={admin}",
        ])
        node_kc = self._write_kubeconfig(w / "kubelet.kubeconfig", f"https://{NODE_IP}:{API_PORT}", self.node_token)
        (w / "resolv.conf").write_text("")  # dnsPolicy Default pods get no upstream: nothing leaves
        (w / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self._cgroup}", "failSwapOn": False,
            "clusterDNS": [DNS_SERVICE_IP], "clusterDomain": CLUSTER_DOMAIN, "resolvConf": str(w / "resolv.conf"),
            "address": NODE_IP, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.ca.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            # Imported images cannot be pulled again: never collect them; the disk is the host's.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "serializeImagePulls": False, "maxPods": 40,
            "nodeStatusUpdateFrequency": "4s",
        }))
        self._spawn_node("kubelet", [
            cluster_mod.find_binary("kubelet"), f"--config={w / 'kubelet.yaml'}", f"--kubeconfig={node_kc}",
            "--container-runtime=remote", f"--container-runtime-endpoint=unix://{w / 'containerd/containerd.sock'}",
            f"--pod-infra-container-image={self.images['pause'].ref}", f"--root-dir={w / 'kubelet'}",
            f"--cert-dir={w / 'kubelet/pki'}", f"--node-ip={NODE_IP}", f"--hostname-override={NODE_NAME}",
        ])
        proxy_kc = self._write_kubeconfig(w / "kube-proxy.kubeconfig", f"https://{NODE_IP}:{API_PORT}", self.proxy_token)
        (w / "kube-proxy.yaml").write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": proxy_kc}, "mode": "iptables", "clusterCIDR": POD_CIDR,
            "hostnameOverride": NODE_NAME, "bindAddress": NODE_IP,
            "healthzBindAddress": "127.0.0.1:10256", "metricsBindAddress": "127.0.0.1:10249",
            # nf_conntrack_max and the conntrack timeouts are the host's (read-only in a namespace)
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        }))
        self._spawn_node("kube-proxy", [cluster_mod.find_binary("kube-proxy"), f"--config={w / 'kube-proxy.yaml'}"])

    def _containerd(self, w: Path) -> None:
        c = w / "containerd"
        root = self._image_store(c)
        (w / "cni/net.d").mkdir(parents=True)
        (w / "cni/net.d/10-pdserve.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "pdserve",
            "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                                  "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(w / "cni/ipam")}},
                        {"type": "portmap", "capabilities": {"portMappings": True}}]}))
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (w / "containerd.toml").write_text("\n".join([
            "version = 2",
            f'root = "{root}"', f'state = "{c}/state"',
            "[grpc]", f'  address = "{c}/containerd.sock"',
            "[ttrpc]", f'  address = "{c}/containerd.sock.ttrpc"',
            f'[plugins."io.containerd.internal.v1.opt"]', f'  path = "{c}/opt"',
            f"[{cri}]",
            f'  sandbox_image = "{self.images["pause"].ref}"',
            # These machines withhold CAP_SYS_RESOURCE: runc may only raise oom_score_adj.
            "  restrict_oom_score_adj = true",
            "  disable_apparmor = true",
            "  netns_mounts_under_state_dir = true",
            f"[{cri}.containerd]", '  snapshotter = "overlayfs"',
            f"[{cri}.containerd.runtimes.runc]", '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]", "  SystemdCgroup = false",
            f"[{cri}.cni]", '  bin_dir = "/usr/lib/cni"', f'  conf_dir = "{w / "cni/net.d"}"',
            "",
        ]))
        self._spawn_node("containerd", ["containerd", "--config", w / "containerd.toml"])
        sock = c / "containerd.sock"
        for _ in range(300):
            if sock.exists():
                return
            self._check_alive()
            time.sleep(0.1)
        raise TimeoutError(f"containerd did not start; log: {w / 'containerd.log'}")

    def _image_store(self, c: Path) -> Path:
        """containerd's root: the machine's node image store when no other node holds it (images
        already imported stay), else a private one that starts empty."""
        import fcntl

        NODE_STORE.mkdir(parents=True, exist_ok=True)
        lock = open(NODE_STORE / "lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return c / "root"
        self._store_lock = lock  # held until stop()
        return NODE_STORE / "root"

    def _sync_images(self) -> None:
        """Make the node's images exactly `self.images`: import what is missing, drop the test
        registry's other images, and remove containers a previous node left in the store."""
        try:
            targets = dict(line.split()[::2][:2] for line in self._ctr("images", "ls").splitlines()[1:])
            have = set(targets)
            keep = {targets[i.ref] for i in self.images.values() if i.ref in targets}
            # by manifest digest: the runtime's own `sha256:` names of an image go with its name
            stale = sorted(ref for ref, digest in targets.items() if digest not in keep)
            if stale:
                self._ctr("images", "rm", *stale)
            leftovers = self._ctr("containers", "ls", "-q").split()
            if leftovers:
                self._ctr("containers", "rm", *leftovers)
            for image in self.images.values():
                if image.ref not in have:
                    self._ctr("images", "import", str(image.archive))
        except BaseException as e:
            self._images_error.append(e)

    def _dns(self, w: Path) -> None:
        hosts = w / "dns"
        hosts.mkdir()
        self._spawn_node("dnsmasq", [
            "dnsmasq", "--keep-in-foreground", "--log-facility=-", "--conf-file=/dev/null", "--user=root",
            f"--pid-file={w / 'dnsmasq.pid'}", "--no-resolv", "--no-hosts", f"--hostsdir={hosts}",
            f"--listen-address={NODE_IP}", "--bind-interfaces", "--port=53",
            f"--local=/{CLUSTER_DOMAIN}/", "--no-negcache",
        ])
        from kubernetes import client

        api = self._api()
        core = client.CoreV1Api(api)
        core.create_namespaced_service("kube-system", {
            "metadata": {"name": "kube-dns", "labels": {"k8s-app": "kube-dns"}},
            "spec": {"clusterIP": DNS_SERVICE_IP, "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                                                            {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}})
        core.create_namespaced_endpoints("kube-system", {
            "metadata": {"name": "kube-dns"},
            "subsets": [{"addresses": [{"ip": NODE_IP}],
                         "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                                   {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}]})
        ready = threading.Event()
        threading.Thread(target=self._dns_sync, args=(hosts, ready), name="dns-sync", daemon=True).start()
        if not ready.wait(30):
            raise TimeoutError(f"cluster DNS records not written: {self._dns_error}")

    def _api(self):
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        return client.ApiClient(cfg)

    def _dns_sync(self, hosts: Path, ready: threading.Event) -> None:
        """Keep dnsmasq's hosts folder equal to the Services (watch, relist on expiry)."""
        from kubernetes import client, watch

        core = client.CoreV1Api(self._api())
        while not self._dns_stop.is_set():
            try:
                services = core.list_service_for_all_namespaces()
                endpoints = core.list_endpoints_for_all_namespaces()
                svc = {(s.metadata.namespace, s.metadata.name): s for s in services.items}
                eps = {(e.metadata.namespace, e.metadata.name): e for e in endpoints.items}
                with self._hosts_lock:
                    self._write_hosts(hosts, svc, eps)
                ready.set()
                stream = watch.Watch().stream(core.list_service_for_all_namespaces,
                                              resource_version=services.metadata.resource_version,
                                              timeout_seconds=60)
                ep_watch = threading.Thread(target=self._watch_endpoints,
                                            args=(core, endpoints.metadata.resource_version, hosts, svc, eps),
                                            daemon=True)
                ep_watch.start()
                for event in stream:
                    self._record(event, svc, hosts, svc, eps)
                    if self._dns_stop.is_set():
                        return
                ep_watch.join()
            except Exception as e:  # the API server restarting, a watch expiring: relist
                self._dns_error.append(repr(e))
                if self._dns_stop.wait(0.5):
                    return

    def _watch_endpoints(self, core, rv: str, hosts: Path, svc: dict, eps: dict) -> None:
        from kubernetes import watch

        try:
            for event in watch.Watch().stream(core.list_endpoints_for_all_namespaces, resource_version=rv,
                                              timeout_seconds=60):
                self._record(event, eps, hosts, svc, eps)
                if self._dns_stop.is_set():
                    return
        except Exception as e:
            self._dns_error.append(repr(e))

    _hosts_lock = threading.Lock()

    def _record(self, event: dict, into: dict, hosts: Path, svc: dict, eps: dict) -> None:
        """Apply one watch event to its cache (services or endpoints) and rewrite the records."""
        obj = event["object"]
        key = (obj.metadata.namespace, obj.metadata.name)
        with self._hosts_lock:
            if event["type"] == "DELETED":
                into.pop(key, None)
            else:
                into[key] = obj
            self._write_hosts(hosts, svc, eps)

    def _write_hosts(self, hosts: Path, svc: dict, eps: dict) -> None:
        """dnsmasq's records from the caches; the caller holds _hosts_lock."""
        lines = []
        for (ns, name), s in sorted(svc.items()):
            fqdn = f"{name}.{ns}.svc.{CLUSTER_DOMAIN}"
            if s.spec.cluster_ip and s.spec.cluster_ip != "None":
                lines.append(f"{s.spec.cluster_ip} {fqdn}")
            elif (e := eps.get((ns, name))) is not None:
                for subset in e.subsets or []:
                    lines += [f"{a.ip} {fqdn}" for a in subset.addresses or []]
        tmp = hosts.parent / "hosts.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(hosts / "services")  # one inotify event for a whole new file

    def _check_alive(self) -> None:
        for p in self._procs:
            if p.poll() is not None:
                name = Path(p.args[4] if len(p.args) > 4 else p.args[0]).name
                raise RuntimeError(f"{name} exited with {p.returncode}; logs in {self.workdir}")

    def _wait_node_ready(self, deadline: float) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self._api())
        last = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                node = core.read_node(NODE_NAME)
                ready = [c for c in node.status.conditions or [] if c.type == "Ready"]
                if ready and ready[0].status == "True":
                    return
                last = ready[0].message if ready else "no Ready condition"
            except client.ApiException as e:
                last = e.reason
            time.sleep(0.5)
        raise TimeoutError(f"node {NODE_NAME} not Ready ({last}); logs in {self.workdir}")
