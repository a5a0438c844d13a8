"""The node harness itself (scripts/k8s-node.py, scripts/k8s-netns.py): the loopback relay into a
network namespace, and a real node running pods behind a Service, reached from the node and from
another pod by its cluster DNS name."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from k8swait import wait_for
from nodehelpers import Tools, fresh_namespace, pod_ready, script_module

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture
def netns():
    """A bare network namespace held by a sleeping process; its path."""
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    holder = subprocess.Popen(["unshare", "--net", "sleep", "infinity"])
    path = f"/proc/{holder.pid}/ns/net"
    wait_for(lambda: os.readlink(path) != os.readlink("/proc/self/ns/net"), "the namespace", 10)
    subprocess.run(["nsenter", f"--net={path}", "ip", "link", "set", "lo", "up"], check=True)
    try:
        yield path
    finally:
        holder.kill()
        holder.wait()


def test_relay_reaches_the_namespace_and_keeps_half_closes(netns):
    netns_mod = script_module("k8s-netns.py")
    # An upper-casing server on the namespace's own loopback: the host's loopback has no such port.
    server = subprocess.Popen(["nsenter", f"--net={netns}", sys.executable, "-c", textwrap.dedent("""
        import socket, sys
        srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
        print(srv.getsockname()[1], flush=True)
        conn, _ = srv.accept()
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        conn.sendall(data.upper())
        conn.close()
    """)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        with socket.socket() as s:  # the same port on the host's loopback is not that server
            assert s.connect_ex(("127.0.0.1", port)) != 0
        relay = netns_mod.NetnsRelay(netns)
        try:
            with socket.create_connection(("127.0.0.1", relay.forward("127.0.0.1", port)), timeout=30) as c:
                payload = os.urandom(300_000).hex().encode()
                c.sendall(payload)
                c.shutdown(socket.SHUT_WR)  # the server answers only after EOF: the relay must pass it on
                got = b""
                while chunk := c.recv(65536):
                    got += chunk
            assert got == payload.upper()
        finally:
            relay.close()
    finally:
        server.kill()
        server.wait()


def test_pods_behind_a_service_answer_the_node_and_another_pod_by_dns_name(k8s_node, k8s_tool, tmp_path):
    tools = Tools(k8s_node, k8s_tool, tmp_path)
    ns = "harness"
    fresh_namespace(tools, ns)
    nats = k8s_node.images["nats"].ref
    tools.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": ns},
         "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                  "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{
                      "name": "nats", "image": nats, "imagePullPolicy": "Never", "args": ["-m", "8222"],
                      "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8222}, "periodSeconds": 1},
                      "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": ns},
         "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8222}]}}]}))
    wait_for(lambda: [p for p in tools.get("pods", "-n", ns, "-l", "app=web")["items"] if pod_ready(p)][1:],
             "two Ready pods", 180)
    ip = tools.get("service", "web", "-n", ns)["spec"]["clusterIP"]

    # From the node: the ClusterIP (kube-proxy's rules) reaches both pods.
    port = k8s_node.forward(ip, 80)
    seen = set()

    def both():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=10) as r:
                seen.add(json.loads(r.read())["server_id"])
        except OSError:  # refused until kube-proxy has written the new Service's rules
            return False
        return len(seen) == 2
    wait_for(both, "answers from both pods through the Service", 60)

    # From a pod: cluster DNS names (short, namespaced, fully qualified) and the API's own Service.
    script = textwrap.dedent(f"""
        import socket, urllib.request
        for name in ("web", "web.{ns}", "web.{ns}.svc.cluster.local", "kubernetes.default.svc.cluster.local"):
            print(name, socket.gethostbyname(name))
        print("varz", urllib.request.urlopen("http://web/varz", timeout=10).status)
    """)
    tools.kubectl("run", "client", "-n", ns, f"--image={k8s_node.images['operator'].ref}",
                  "--image-pull-policy=Never", "--restart=Never", "--command", "--", "python", "-c", script)
    wait_for(lambda: tools.get("pod", "client", "-n", ns)["status"].get("phase") in ("Succeeded", "Failed"),
             "the client pod to finish", 120)
    out = dict(line.split() for line in tools.kubectl("logs", "-n", ns, "client").stdout.splitlines())
    api_ip = tools.get("service", "kubernetes", "-n", "default")["spec"]["clusterIP"]
    assert out == {"web": ip, f"web.{ns}": ip, f"web.{ns}.svc.cluster.local": ip,
                   "kubernetes.default.svc.cluster.local": api_ip, "varz": "200"}
    tools.kubectl("delete", "namespace", ns, "--wait=false")
