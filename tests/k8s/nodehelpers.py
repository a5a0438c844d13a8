"""Test helpers for the real node (`k8s_node`): kubectl and helm against it, the chart installed
with the images built for it, the README's minimal example adapted to a CPU node, pod readiness
and streaming requests through a Service."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml
from k8swait import wait_for

REPO = Path(__file__).resolve().parents[2]
SYSTEM_NS = "pdserve-system"
RELEASE = "pd"
POD_WAIT_S = 300  # a bound: image unpack, model load and readiness probes on a busy 2-core machine


def script_module(file: str):
    """A module of scripts/ (hyphenated names, so not importable): loaded once, under the name
    the scripts use for each other (`pdserve_k8s_node` for k8s-node.py)."""
    name = "pdserve_" + file.removesuffix(".py").replace("-", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


class Tools:
    """kubectl and helm for one node cluster, each call with its kubeconfig (never the environment's)."""

    def __init__(self, node, k8s_tool, home: Path):
        self.node = node
        self.kubectl_bin, self.helm_bin = k8s_tool("kubectl"), k8s_tool("helm")
        self.env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "KUBECONFIG": node.kubeconfig,
                    "HELM_CACHE_HOME": str(home / "helm-cache"), "HELM_CONFIG_HOME": str(home / "helm-config"),
                    "HELM_DATA_HOME": str(home / "helm-data")}

    def _run(self, cmd: list[str], input: str | None, check: bool) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self.env, timeout=600)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd[:3])} ... failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return self._run([self.kubectl_bin, *args], input, check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._run([self.helm_bin, *args], None, check)

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)


def chart_values(node) -> list[str]:
    """`--set` arguments that point the chart at the images built for the node (never pulled)."""
    def split(ref: str) -> tuple[str, str]:
        repo, tag = ref.rsplit(":", 1)
        return repo, tag
    out = []
    for key, image in (("image", "pdserve"), ("operator.image", "operator"), ("nats.image", "nats")):
        repo, tag = split(node.images[image].ref)
        out += ["--set", f"{key}.repository={repo}", "--set", f"{key}.tag={tag}"]
    return out + ["--set", "image.pullPolicy=Never", "--set", "nats.image.pullPolicy=Never"]


def install_chart(tools: Tools, *extra: str) -> str:
    """`helm install` (which returns after its post-install hook, the webhook check, succeeds;
    a failure names what the check last saw), then the operator and NATS pods Ready."""
    r = tools.helm("install", RELEASE, str(REPO / "charts/pdserve"), "-n", SYSTEM_NS, "--create-namespace",
                   *chart_values(tools.node), *extra, check=False)
    if r.returncode != 0:
        logs = tools.kubectl("logs", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=webhook-check",
                             "--tail=20", check=False)
        raise AssertionError(f"helm install failed ({r.returncode}): {r.stderr.strip()}; "
                             f"webhook-check logs: {logs.stdout.strip() or logs.stderr.strip()}")
    out = r.stdout
    wait_pods_ready(tools, SYSTEM_NS, "app.kubernetes.io/component=operator", 1)
    wait_pods_ready(tools, SYSTEM_NS, "app.kubernetes.io/component=nats", 1)
    return out


def pod_ready(pod: dict) -> bool:
    return pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def pods(tools: Tools, ns: str, selector: str) -> list[dict]:
    return tools.get("pods", "-n", ns, "-l", selector)["items"]


def wait_pods_ready(tools: Tools, ns: str, selector: str, count: int, timeout: float = POD_WAIT_S) -> list[dict]:
    """Wait until exactly `count` pods match `selector`, all Ready. The failure names each pod's state."""
    def check():
        items = pods(tools, ns, selector)
        ready = [p for p in items if pod_ready(p)]
        return ready if len(ready) == count == len(items) else None
    try:
        return wait_for(check, f"{count} Ready pod(s) {selector} in {ns}", timeout)
    except AssertionError as e:
        states = [(p["metadata"]["name"], p["status"].get("phase"),
                   [(c["name"], c.get("state"), c.get("restartCount")) for c in p["status"].get("containerStatuses") or []])
                  for p in pods(tools, ns, selector)]
        raise AssertionError(f"{e}; pods: {states}") from None


def minimal_example(models_root: Path, namespace: str) -> tuple[dict, dict, dict]:
    """The README's minimal example (its PVC and InferenceService), as a CPU node must run it,
    and a hostPath PersistentVolume holding the weights that the PVC binds to.

    Adapted: `gpus: 0` (this node has no GPU, as the example's comment says); float32 KV, which
    is also the dtype the workers run the model in (bfloat16, the default, is the GPU's choice
    and the references here are float32); small CPU and memory requests so that rolling and
    scaled pods fit 2 cores; `imagePullPolicy: Never` (the images were imported, no registry
    exists). Returns (pv, pvc, isvc)."""
    pvc, isvc = list(yaml.safe_load_all((REPO / "examples/inferenceservice-minimal.yaml").read_text()))
    pvc["metadata"]["namespace"] = isvc["metadata"]["namespace"] = namespace
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "3Gi"}}
    spec = isvc["spec"]
    spec["imagePullPolicy"] = "Never"
    for pool in ("prefill", "decode"):
        spec.setdefault(pool, {}).update({"gpus": 0, "resources": small, "kv": {"dtype": "float32"}})
    spec["front"] = {"resources": small}
    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
          "metadata": {"name": f"{namespace}-models"},
          "spec": {"capacity": {"storage": pvc["spec"]["resources"]["requests"]["storage"]},
                   "accessModes": pvc["spec"]["accessModes"], "persistentVolumeReclaimPolicy": "Retain",
                   "claimRef": {"namespace": namespace, "name": pvc["metadata"]["name"]},
                   "hostPath": {"path": str(models_root), "type": "Directory"}}}
    return pv, pvc, isvc


def fresh_namespace(tools: Tools, ns: str) -> None:
    """Create `ns`, first removing one a previous run against the same node left behind."""
    tools.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true", "--timeout=300s")
    tools.kubectl("create", "namespace", ns)


def apply(tools: Tools, *objects: dict) -> None:
    tools.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def sse_events(url: str, body: dict, timeout: float):
    """POST a streaming request; yield each SSE `data:` payload (str) as it arrives."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: "):
                yield line[len("data: "):]


class Load:
    """Steady streaming load through the front: `concurrency` threads, each sending one request
    after another until stop(). A request succeeds when its stream ends with [DONE], carries no
    error event and holds `max_tokens` tokens (ignore_eos); anything else is recorded as a failure."""

    def __init__(self, url: str, model: str, concurrency: int, max_tokens: int, read_timeout: float = 120):
        import threading

        self.url, self.model, self.max_tokens, self.read_timeout = url, model, max_tokens, read_timeout
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(concurrency)]

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def _loop(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            outcome = self._one(f"Request {i}.{n}: tell me a long story about the sea.")
            with self._lock:
                if outcome is None:
                    self.ok += 1
                else:
                    self.failures.append(outcome)

    def _one(self, prompt: str) -> str | None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        tokens, done = 0, False
        try:
            for data in sse_events(self.url + "/v1/completions", body, self.read_timeout):
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return f"error event: {event['error']}"
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        except Exception as e:  # refused, reset, HTTP error status, timeout: all failures
            return f"{type(e).__name__}: {e}"
        if not done or tokens != self.max_tokens:
            return f"stream ended early: done={done}, {tokens}/{self.max_tokens} tokens"
        return None

    def stop(self) -> tuple[int, list[str]]:
        self._stop.set()
        for t in self._threads:
            t.join()
        return self.ok, self.failures

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.ok, len(self.failures)
