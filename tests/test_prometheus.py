"""The chart's dashboard and alerts against real parts: Debian's Prometheus scraping a local deployment's
/metrics under load evaluates every panel's query (each must return data) and every alert expression (each
must parse and evaluate), and promtool checks the rendered rules. `pdserve top` reads the same deployment."""
from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import time

import pytest
import yaml

from bench.promlocal import Prometheus, binaries
from pdserve.local import LocalCluster
from pdserve.natsserver import free_port
from servinghelpers import post, wait_for
from test_chart import MONITORING_CRDS, MONITORING_ON, _dashboard_map, render

pytestmark = pytest.mark.model

RATE_WINDOW = "1m"  # what Grafana's $__rate_interval stands for here (1 s scrapes)


def _tools() -> tuple[str, str]:
    found = binaries()
    if found is None:
        pytest.skip("prometheus/promtool absent: scripts/setup.sh test installs Debian's prometheus package "
                    "(apt-get install prometheus)")
    return found


@pytest.fixture(scope="module")
def monitoring():
    """(dashboard JSON, PrometheusRule spec) as the chart renders them with everything on."""
    docs = render(*MONITORING_ON, *MONITORING_CRDS)
    rules = next(d for d in docs if d["kind"] == "PrometheusRule")
    return json.loads(_dashboard_map(docs)["data"]["pdserve.json"]), rules["spec"]


@pytest.fixture(scope="module")
def deployment(nats_server, model_dir):
    """A local deployment whose workers serve /metrics too (decode speculating): (cluster, worker metric ports)."""
    ports = {"prefill": free_port(), "decode": free_port()}
    cluster = LocalCluster(str(model_dir), prefill_workers=1, decode_workers=1, nats=nats_server.creds,
                           worker_args={"prefill": ["--metrics-port", str(ports["prefill"])],
                                        "decode": ["--metrics-port", str(ports["decode"]), "--spec-method", "ngram",
                                                   "--spec-k-policy", "fixed", "--spec-max-k", "4"]})
    cluster.start()
    yield cluster, ports
    cluster.stop()


@pytest.fixture(scope="module")
def prometheus(deployment, monitoring, tmp_path_factory):
    prom_bin, _ = _tools()
    cluster, ports = deployment
    targets = {"front": f"127.0.0.1:{cluster.port}", **{k: f"127.0.0.1:{v}" for k, v in ports.items()}}
    with Prometheus(targets, tmp_path_factory.mktemp("prometheus"), rule_groups=monitoring[1], binary=prom_bin) as prom:
        prom.wait_scraping()
        yield cluster, prom


def _load(url: str, requests: int = 8, concurrency: int = 2) -> None:
    """A little streaming-free load: repetitive prompts (speculation drafts from them), ignore_eos."""
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    prompts = [f"count: {' '.join(str(j) for j in range(i, i + 30))} {' '.join(str(j) for j in range(i, i + 10))}"
               for i in range(requests)]
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for status, out in pool.map(lambda p: post(url + "/v1/completions", {**body, "prompt": p}), prompts):
            assert status == 200, out


def test_promtool_accepts_the_rendered_rules(monitoring, tmp_path):
    _, promtool = _tools()
    f = tmp_path / "rules.yaml"
    f.write_text(yaml.safe_dump(monitoring[1]))
    r = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in monitoring[1]['groups'])} rules found" in r.stdout


def test_every_panel_returns_data_and_every_alert_evaluates_under_load(prometheus, monitoring):
    cluster, prom = prometheus
    _load(cluster.url)
    # two scrapes after the load ended: every counter's rate has its points inside the window
    t_end = time.time()
    wait_for(lambda: float(prom.query("max(timestamp(up))")["data"]["result"][0]["value"][1]) > t_end + 2,
             "two more scrapes", 30)
    dashboard, rules = monitoring
    empty, failed = [], []
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_WINDOW)
            out = prom.query(expr)
            if out["status"] != "success":
                failed.append(f"{panel['title']}: {expr}: {out.get('error')}")
            elif not out["data"]["result"]:
                empty.append(f"{panel['title']}: {expr}")
    assert not failed, "panel queries Prometheus refused:\n" + "\n".join(failed)
    assert not empty, "panel queries with no data under load:\n" + "\n".join(empty)
    for group in rules["groups"]:
        for rule in group["rules"]:
            out = prom.query(rule["expr"])
            assert out["status"] == "success", f"alert {rule['alert']}: {out.get('error')}"
    # the SLO burn rules read the bucket the objective names: it exists (a typo'd le would read nothing)
    for metric, le in (("pdserve_time_to_first_token_seconds", "2.0"), ("pdserve_inter_token_latency_seconds", "0.2")):
        assert prom.query(f'{metric}_bucket{{le="{le}"}}')["data"]["result"], f"{metric} has no bucket le={le}"

    # Prometheus itself evaluates the loaded rules every second: none fails
    def evaluated():
        rules_seen = prom.rules()
        return rules_seen if rules_seen and all(r.get("lastEvaluation", "").startswith("20") for r in rules_seen) \
            else None
    seen = wait_for(evaluated, "Prometheus evaluating the alert rules", 30)
    assert {r["health"] for r in seen} == {"ok"}, [(r["name"], r.get("lastError")) for r in seen if r["health"] != "ok"]
    assert len(seen) == sum(len(g["rules"]) for g in rules["groups"])


def test_pdserve_top_once_shows_the_deployment(deployment):
    """`pdserve top --once` reads the front's /metrics and /workers (and the workers' /metrics) of a live deployment."""
    cluster, ports = deployment
    _load(cluster.url, requests=2, concurrency=1)
    out = subprocess.run([sys.executable, "-P", "-m", "pdserve.cli", "top", "--url", cluster.url, "--once",
                          "--interval", "0.5", *(a for p in ports.values() for a in ("--metrics", f"http://127.0.0.1:{p}/metrics"))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "\x1b[" not in text, "no ANSI codes when the output is not a terminal"
    assert "model SmolLM2-135M-Instruct" in text
    assert re.search(r"pools  prefill 1  decode 1 .* P:D 1\.00", text), text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("prefill-0", "decode-0"))}
    assert rows["prefill-0"][1:3] == ["prefill", "ok"] and rows["decode-0"][1:3] == ["decode", "ok"], text
    ttft = re.search(r"^TTFT \S+\s+p50\s+(\d+) (ms|s)", text, re.M)
    assert ttft and float(ttft.group(1)) > 0, text
    assert "speculation" in text and "! " not in text, text


def test_pdserve_top_says_when_there_is_no_deployment():
    out = subprocess.run([sys.executable, "-P", "-m", "pdserve.cli", "top", "--url", f"http://127.0.0.1:{free_port()}",
                          "--once"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot read" in out.stderr
