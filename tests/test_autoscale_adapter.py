"""The metrics adapter over real NATS (authenticated) and real HTTPS on loopback.

LoadReports are published on NATS by a separate client, exactly as workers do; the adapter is
queried with an aiohttp client that trusts only the test CA.
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time

import aiohttp
import nats
import pytest

from pdserve.autoscale.adapter import METRICS, MetricsAdapter, parse_selector, matches, quantity
from pdserve.autoscale.certs import make_serving_cert
from pdserve.kvtransfer.protocol import LoadReport, Subjects
from pdserve.operator.reconcile import OperatorConfig, desired_children

NS = "team-a"
CUSTOM = "/apis/custom.metrics.k8s.io/v1beta1"
EXTERNAL = "/apis/external.metrics.k8s.io/v1beta1"


def report(pod, role="prefill", pool=None, isvc="llama", ns=NS, **kw) -> LoadReport:
    return LoadReport(
        worker_id=f"w-{pod}", role=role, model="m", isvc=isvc, pool=pool or role, pod=pod, namespace=ns,
        scope=f"{ns}.{isvc}", **kw
    )


class Harness:
    def __init__(self, adapter, nc, session, base):
        self.adapter, self.nc, self.session, self.base = adapter, nc, session, base

    async def publish(self, r: LoadReport | bytes, subject: str | None = None):
        data = r if isinstance(r, bytes) else r.encode()
        subject = subject or Subjects.load(r.scope, r.role, r.worker_id)
        await self.nc.publish(subject, data)
        await self.nc.flush()

    async def get(self, path, **params):
        async with self.session.get(self.base + path, params=params or None) as resp:
            return resp.status, await resp.json(content_type=None)

    async def until(self, cond, what: str, timeout: float = 10.0):
        """Poll a condition (with a bound): NATS delivery to the adapter is asynchronous."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await cond():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")


def run_with_adapter(nats_server, tmp_path, body):
    certs = make_serving_cert(tmp_path, ["127.0.0.1", "localhost"])

    async def main():
        adapter = MetricsAdapter()
        await adapter.connect_nats(nats_server.creds)
        port = await adapter.start("127.0.0.1", 0, str(certs.cert), str(certs.key))
        ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
        nc = await nats.connect(**nats_server.creds.connect_kwargs())
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
                await body(Harness(adapter, nc, session, f"https://127.0.0.1:{port}"))
        finally:
            await nc.close()
            await adapter.close()

    asyncio.run(main())


def test_discovery_lists_every_metric(nats_server, tmp_path):
    async def body(h):
        code, doc = await h.get(CUSTOM)
        assert code == 200 and doc["kind"] == "APIResourceList" and doc["groupVersion"] == "custom.metrics.k8s.io/v1beta1"
        names = {r["name"] for r in doc["resources"]}
        assert names == {f"pods/{m}" for m in METRICS}
        assert "pods/pdserve_decode_kv_utilization" in names and "pods/pdserve_prefill_queue_depth" in names
        assert all(r["namespaced"] and r["kind"] == "MetricValueList" for r in doc["resources"])
        code, doc = await h.get(EXTERNAL)
        assert code == 200 and "pdserve_transfer_backlog_bytes" in {r["name"] for r in doc["resources"]}

    run_with_adapter(nats_server, tmp_path, body)


def test_pod_metrics_match_reports_and_selectors(nats_server, tmp_path):
    async def body(h):
        await h.publish(report("p-0", queue_depth=3, running=1, ttft_seconds=0.25))
        await h.publish(report("p-1", queue_depth=7, running=1, ttft_seconds=1.5))
        await h.publish(report("p-other", isvc="other", queue_depth=50))
        await h.publish(report("d-0", role="decode", kv_utilization=0.73, running=12, waiting=2, transfer_backlog_bytes=4096))
        await h.publish(report("p-elsewhere", ns="team-b", queue_depth=99))

        async def seen():
            return len(h.adapter.store) == 5

        await h.until(seen, "five reports")
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/pdserve_prefill_queue_depth",
                                labelSelector="pdserve.io/isvc=llama,pdserve.io/pool=prefill")
        assert code == 200 and doc["kind"] == "MetricValueList"
        got = {i["describedObject"]["name"]: i["value"] for i in doc["items"]}
        assert got == {"p-0": "3", "p-1": "7"}  # not the other isvc, not the decode pod, not team-b
        item = doc["items"][0]
        assert item["describedObject"] == {"kind": "Pod", "namespace": NS, "name": "p-0", "apiVersion": "/v1"}
        assert item["metricName"] == "pdserve_prefill_queue_depth" and item["timestamp"].endswith("Z")
        # No selector: every prefill pod of the namespace; set-based selectors work.
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/pdserve_prefill_queue_depth")
        assert {i["describedObject"]["name"] for i in doc["items"]} == {"p-0", "p-1", "p-other"}
        # The selector an HPA sends for the operator's prefill Deployment of `llama` (its matchLabels).
        deployment = next(c for c in desired_children(
            {"metadata": {"name": "llama", "namespace": NS, "uid": "u"}, "spec": {"model": {"path": "m", "pvc": "p"}}},
            OperatorConfig()) if c["kind"] == "Deployment" and c["metadata"]["name"] == "llama-prefill")
        hpa_selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/pdserve_prefill_queue_depth",
                                labelSelector=hpa_selector)
        assert {i["describedObject"]["name"]: i["value"] for i in doc["items"]} == {"p-0": "3", "p-1": "7"}
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/pdserve_prefill_queue_depth",
                                labelSelector="pdserve.io/isvc notin (llama)")
        assert [i["describedObject"]["name"] for i in doc["items"]] == ["p-other"]
        # Derived and milli-quantity values.
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/pdserve_prefill_inflight_prompts",
                                labelSelector="pdserve.io/isvc=llama")
        assert {i["describedObject"]["name"]: i["value"] for i in doc["items"]} == {"p-0": "4", "p-1": "8"}
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/d-0/pdserve_decode_kv_utilization")
        assert code == 200 and [i["value"] for i in doc["items"]] == ["730m"]
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/p-1/pdserve_prefill_ttft_seconds")
        assert [i["value"] for i in doc["items"]] == ["1500m"]
        # External, per pool: sums counts/bytes, averages latencies.
        code, doc = await h.get(f"{EXTERNAL}/namespaces/{NS}/pdserve_prefill_queue_depth", labelSelector="isvc=llama,pool=prefill")
        assert code == 200 and doc["kind"] == "ExternalMetricValueList"
        assert [(i["metricLabels"], i["value"]) for i in doc["items"]] == [({"isvc": "llama", "pool": "prefill"}, "10")]
        code, doc = await h.get(f"{EXTERNAL}/namespaces/{NS}/pdserve_prefill_ttft_seconds", labelSelector="isvc=llama")
        assert [i["value"] for i in doc["items"]] == ["875m"]
        code, doc = await h.get(f"{EXTERNAL}/namespaces/{NS}/pdserve_transfer_backlog_bytes", labelSelector="isvc=llama,pool=decode")
        assert [i["value"] for i in doc["items"]] == ["4096"]

    run_with_adapter(nats_server, tmp_path, body)


def test_stale_reports_and_bye_are_dropped(nats_server, tmp_path):
    async def body(h):
        await h.publish(report("p-old", queue_depth=5, stale_after_s=0.5))
        await h.publish(report("p-live", queue_depth=2, stale_after_s=60))
        await h.publish(report("p-leaving", queue_depth=9, stale_after_s=60))
        path = f"{CUSTOM}/namespaces/{NS}/pods/*/pdserve_prefill_queue_depth"

        async def names():
            return {i["describedObject"]["name"] for i in (await h.get(path))[1]["items"]}

        async def all_three():
            return await names() == {"p-old", "p-live", "p-leaving"}

        await h.until(all_three, "three pods served")
        # A clean shutdown removes the pod at once.
        await h.publish(report("p-leaving"), subject=Subjects.bye(f"{NS}.llama", "prefill", "w-p-leaving"))

        async def only_live():
            return await names() == {"p-live"}

        await h.until(only_live, "the stale and departed pods to go")  # p-old is dead 0.5 s after arrival
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/p-old/pdserve_prefill_queue_depth")
        assert code == 404 and doc["kind"] == "Status" and doc["reason"] == "NotFound"

    run_with_adapter(nats_server, tmp_path, body)


def test_bad_paths_unknown_metrics_and_malformed_reports(nats_server, tmp_path):
    async def body(h):
        for path in (
            f"{CUSTOM}/namespaces/{NS}/pods/*/no_such_metric",
            f"{EXTERNAL}/namespaces/{NS}/no_such_metric",
            f"{CUSTOM}/namespaces/{NS}/services/*/pdserve_prefill_queue_depth",
            "/apis/custom.metrics.k8s.io/v1beta2",
            "/nothing/here",
        ):
            code, doc = await h.get(path)
            assert code == 404, path
            assert doc["kind"] == "Status" and doc["apiVersion"] == "v1" and doc["status"] == "Failure"
            assert doc["reason"] == "NotFound" and doc["code"] == 404
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/pdserve_prefill_queue_depth", labelSelector="a in (b")
        assert code == 400 and doc["reason"] == "BadRequest"
        # Malformed reports: counted, ignored, and the adapter keeps serving good ones after them.
        before = h.adapter.malformed_reports
        await h.publish(b"{not json", subject=Subjects.load(f"{NS}.llama", "prefill", "junk"))
        await h.publish(json.dumps({"v": 2, "worker_id": "x", "role": "prefill"}).encode(), subject=Subjects.load(f"{NS}.llama", "prefill", "x"))
        await h.publish(json.dumps({"v": 99, "worker_id": "x", "role": "prefill", "model": "m"}).encode(), subject=Subjects.load(f"{NS}.llama", "prefill", "x"))
        await h.publish(report("p-good", queue_depth=1))

        async def good_served():
            return h.adapter.malformed_reports - before == 3 and len(h.adapter.store) >= 1

        await h.until(good_served, "three malformed reports counted and the good one stored")
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/p-good/pdserve_prefill_queue_depth")
        assert code == 200 and doc["items"][0]["value"] == "1"
        async with h.session.get(h.base + "/metrics") as resp:
            text = await resp.text()
        assert 'pdserve_metrics_adapter_reports_total{result="malformed"}' in text

    run_with_adapter(nats_server, tmp_path, body)


def test_tls_is_required_and_verified(nats_server, tmp_path):
    """Plain HTTP is refused and a client that does not trust the adapter's CA fails the handshake."""

    async def body(h):
        port = h.base.rsplit(":", 1)[1]
        async with aiohttp.ClientSession() as plain:
            with pytest.raises(aiohttp.ClientError):
                async with plain.get(f"http://127.0.0.1:{port}{CUSTOM}") as resp:
                    await resp.read()
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with plain.get(f"https://127.0.0.1:{port}{CUSTOM}") as resp:
                    await resp.read()

    run_with_adapter(nats_server, tmp_path, body)


def test_selector_and_quantity_units():
    lb = {"pdserve.io/isvc": "a", "pdserve.io/pool": "prefill"}
    assert matches(parse_selector("pdserve.io/isvc=a"), lb)
    assert matches(parse_selector("pdserve.io/isvc==a,pdserve.io/pool in (prefill, decode)"), lb)
    assert not matches(parse_selector("pdserve.io/isvc!=a"), lb)
    assert matches(parse_selector("pdserve.io/pool,!app"), lb)
    assert not matches(parse_selector("app"), lb)
    assert quantity(0.73) == "730m" and quantity(12) == "12" and quantity(12.0) == "12" and quantity(0.0004) == "0m"


def test_prometheus_adapter_rules_serve_our_names():
    """The prometheus-adapter config parses and only produces names from the adapter's METRICS table."""
    import pathlib
    import re

    import yaml

    path = pathlib.Path(__file__).resolve().parents[1] / "autoscale" / "prometheus-adapter-rules.yaml"
    cfg = yaml.safe_load(path.read_text())
    produced = set()
    for rule in cfg["rules"] + cfg["externalRules"]:
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]
        alt = re.search(r'__name__=~?"([^"]+)"', rule["seriesQuery"]).group(1)
        names = alt.split("|")
        produced |= set(names) if rule["name"]["as"] == "${1}" else {rule["name"]["as"]}
    assert produced <= set(METRICS), produced - set(METRICS)
    assert set(METRICS) - produced == {"pdserve_prefill_inflight_prompts"}  # documented: no worker gauge for it


def test_front_proxy_client_certificate_required_on_apis(nats_server, tmp_path):
    """With --client-ca-file, /apis answers only a client holding a cert from that CA (the aggregator)."""
    from pdserve.autoscale.certs import make_client_cert

    serving = make_serving_cert(tmp_path / "serving", ["127.0.0.1"])
    front_proxy = make_serving_cert(tmp_path / "front-proxy", ["front-proxy-ca"])
    stranger = make_serving_cert(tmp_path / "stranger", ["other-ca"])
    good = make_client_cert(front_proxy, tmp_path / "clients", "front-proxy-client")
    bad = make_client_cert(stranger, tmp_path / "strangers", "intruder")

    async def main():
        adapter = MetricsAdapter(client_ca_file=str(front_proxy.ca_cert))
        port = await adapter.start("127.0.0.1", 0, str(serving.cert), str(serving.key))
        base = f"https://127.0.0.1:{port}"
        try:
            def ctx(client=None):
                c = ssl.create_default_context(cafile=str(serving.ca_cert))
                if client:
                    c.load_cert_chain(str(client[0]), str(client[1]))
                return c

            async with aiohttp.ClientSession() as s:
                async with s.get(base + CUSTOM, ssl=ctx()) as r:
                    assert r.status == 401 and (await r.json())["reason"] == "Unauthorized"
                async with s.get(base + "/healthz", ssl=ctx()) as r:
                    assert r.status == 200  # probes carry no client certificate
                async with s.get(base + CUSTOM, ssl=ctx(good)) as r:
                    assert r.status == 200 and (await r.json())["kind"] == "APIResourceList"
                with pytest.raises(aiohttp.ClientError):  # a cert from another CA fails the handshake
                    async with s.get(base + CUSTOM, ssl=ctx(bad)) as r:
                        await r.read()
        finally:
            await adapter.close()

    asyncio.run(main())


def test_the_draft_pools_asks_per_second_reach_its_hpa(nats_server, tmp_path):
    """A real draft pool (its heartbeat, on NATS) as the operator configures it: the adapter serves its
    rate of draft asks and its queue under the metric its HPA names, to the selector that HPA sends,
    and forgets the replica at its `bye`."""
    from pdserve.config import DraftPoolConfig
    from pdserve.draftpool.server import DraftPool
    from pdserve.kvtransfer.protocol import DraftRequest

    children = {(c["kind"], c["metadata"]["name"]): c for c in desired_children(
        {"metadata": {"name": "llama", "namespace": NS, "uid": "u"},
         "spec": {"model": {"path": "m", "pvc": "p"}, "speculation": {"draftPool": {}}}}, OperatorConfig())}
    hpa = children[("HorizontalPodAutoscaler", "llama-draftpool")]["spec"]
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    selector = ",".join(f"{k}={v}" for k, v in
                        children[("Deployment", "llama-draftpool")]["spec"]["selector"]["matchLabels"].items())

    async def body(h):
        pool = DraftPool(DraftPoolConfig(isvc="llama", pool="draftpool", namespace=NS, pod_name="llama-draftpool-x"))
        pool_nc = await nats.connect(**nats_server.creds.connect_kwargs())
        await pool.start(pool_nc)
        asks = 0

        async def asked():
            nonlocal asks
            for i in range(20):
                await h.nc.request(pool.subject, DraftRequest(request_id=f"r{asks}", tenant="t", tail=[1, 2], k=2,
                                                              timeout_ms=5000).encode(), timeout=5)
                asks += 1
            code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/{metric}", labelSelector=selector)
            return code == 200 and doc["items"] and doc["items"][0]["value"] not in ("0", "0m")

        await h.until(asked, "a non-zero rate of draft asks")
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/{metric}", labelSelector=selector)
        [item] = doc["items"]
        assert item["describedObject"]["name"] == "llama-draftpool-x"
        rate = float(item["value"].removesuffix("m")) / (1000 if item["value"].endswith("m") else 1)
        assert 0 < rate <= asks / 0.05  # asks over at least the 50 ms the test polls apart, at most all of them

        async def drained():  # every ask was answered: a heartbeat after the last one shows an empty queue
            code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/pdserve_draftpool_queue_depth",
                                    labelSelector=selector)
            assert code == 200 and len(doc["items"]) == 1, doc  # one pool replica, under the HPA's metric
            return doc["items"][0]["value"] == "0"
        # a heartbeat taken while an ask waited for its pass says 1; the next one, a second later, 0
        await h.until(drained, "the pool's queue depth back at 0", 5)
        # prefill's metric does not count the pool's pod, nor the pool's decode's
        code, doc = await h.get(f"{CUSTOM}/namespaces/{NS}/pods/*/pdserve_prefill_queue_depth")
        assert doc["items"] == []

        await pool.close()

        async def forgotten():
            return len(h.adapter.store) == 0
        await h.until(forgotten, "the pool's bye")
        await pool_nc.close()

    run_with_adapter(nats_server, tmp_path, body)
