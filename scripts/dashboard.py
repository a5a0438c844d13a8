"""The Grafana dashboard the chart ships (charts/pdserve/dashboards/pdserve.json), written from the panel list here.

Each panel's queries use only metrics the serving processes export (tests/test_prometheus.py evaluates
every one against a real Prometheus scraping a local deployment, and checks each returns data under load).
`$__rate_interval` is Grafana's rate window. Run `python scripts/dashboard.py` after changing PANELS;
tests/test_chart.py fails while the committed JSON differs from what this writes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "charts" / "pdserve" / "dashboards" / "pdserve.json"
W = "[$__rate_interval]"


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{W})))", f"p{int(q * 100)}")
            for q in (0.5, 0.9, 0.99)]


# (row, title, unit, [(PromQL, legend)], description)
PANELS: list[tuple[str, str, str, list[tuple[str, str]], str]] = [
    ("Latency", "Time to first token", "s", _quantiles("pdserve_time_to_first_token_seconds"),
     "At the front: request received to first token streamed."),
    ("Latency", "Inter-token latency", "s", _quantiles("pdserve_inter_token_latency_seconds"),
     "At the front: between two streamed token events."),
    ("Latency", "End-to-end request latency", "s", _quantiles("pdserve_request_duration_seconds"),
     "At the front: request received to last token."),
    ("Throughput", "Tokens per second", "short", [
        (f"sum(rate(pdserve_completion_tokens_total{W}))", "output tokens/s"),
        (f"sum(rate(pdserve_prompt_tokens_total{W}))", "prompt tokens/s"),
        (f"sum(rate(pdserve_decode_tokens_total{W}))", "decode tokens/s (workers)")],
     "Generated and prompt tokens per second over every front and decode worker."),
    ("Throughput", "Requests per second by status", "reqps", [
        (f"sum by (status) (rate(pdserve_requests_total{W}))", "{{status}}")],
     "HTTP requests answered by the fronts, by status code."),
    ("Pools", "Queue depths per pool", "short", [
        ("sum(pdserve_queue_depth)", "front: in flight"),
        ("sum(pdserve_prefill_queue_depth)", "prefill: prompts waiting"),
        ("sum(pdserve_decode_waiting_sequences)", "decode: waiting"),
        ("sum(pdserve_decode_running_sequences)", "decode: running")],
     "Requests in flight at the fronts, prompts waiting for prefill, sequences waiting for and running in decode."),
    ("Pools", "KV pool use", "percentunit", [
        ("max(pdserve_decode_kv_utilization)", "decode: fullest worker"),
        ("avg(pdserve_decode_kv_utilization)", "decode: mean"),
        ("max(pdserve_prefill_kv_utilization)", "prefill: fullest worker")],
     "Share of each worker's KV pool in use (0-1)."),
    ("Pools", "P:D ratio", "short", [
        ('max(pdserve_workers{role="prefill"}) / max(pdserve_workers{role="decode"})', "prefill ÷ decode")],
     "Prefill workers per decode worker, as the fronts' registries see them."),
    ("Pools", "Autoscaler: workers per pool and their signals", "short", [
        ("max by (role) (pdserve_workers)", "{{role}} workers"),
        ("sum(pdserve_prefill_queue_depth)", "prefill signal: queue depth"),
        ("avg(pdserve_decode_kv_utilization)", "decode signal: KV utilisation")],
     "Replicas that registered (what the HPAs decided, as it took effect) beside the signals they scale on."),
    ("KV transfer", "Transfer bandwidth", "Bps", [
        (f"sum(rate(pdserve_kv_transfer_received_bytes_total{W}))", "KV bytes/s received"),
        (f"sum by (transport) (rate(pdserve_kv_transfer_wire_bytes_total{W}))", "wire {{transport}}")],
     "KV bytes handed from prefill to decode per second, and what they took on the wire per transport."),
    ("KV transfer", "Transfer time", "s", _quantiles("pdserve_kv_transfer_seconds"),
     "Handoff time: offer to acknowledgement at prefill, as reported to the fronts."),
    ("KV transfer", "Transfer failures and backlog", "short", [
        (f"sum by (side) (rate(pdserve_kv_transfer_failures_total{W}))", "failures/s ({{side}})"),
        (f"sum(rate(pdserve_kv_recompute_total{W}))", "recomputed/s"),
        (f"sum by (outcome) (rate(pdserve_decode_handoffs_total{W}))", "handoffs {{outcome}}/s"),
        ("sum(pdserve_transfer_backlog_handoffs)", "handoffs in flight")],
     "Failed transfers by side, KV recomputed after a loss, offers taken or refused, and handoffs in flight."),
    ("Speculation", "Speculation acceptance", "percentunit", [
        (f"sum(rate(pdserve_spec_accepted_tokens_total{W})) / sum(rate(pdserve_spec_draft_tokens_total{W}))",
         "accepted ÷ drafted"),
        (f"sum by (span) (rate(pdserve_spec_accepted_tokens_total{W})) / "
         f"sum by (span) (rate(pdserve_spec_draft_tokens_total{W}))", "{{span}}")],
     "Draft tokens accepted per drafted, overall and by span kind."),
    ("Speculation", "Drafted and accepted tokens", "short", [
        (f"sum(rate(pdserve_spec_draft_tokens_total{W}))", "drafted/s"),
        (f"sum(rate(pdserve_spec_accepted_tokens_total{W}))", "accepted/s")],
     "Speculative tokens proposed and accepted per second."),
    ("Health", "Worker restarts", "short", [
        (f"sum by (role) (increase(pdserve_worker_restarts_total{W}))", "{{role}}")],
     "Workers seen again under a newer generation: a crash loop shows here."),
]


def dashboard() -> dict:
    panels, y, row = [], 0, None
    pid = 1
    for i, (row_title, title, unit, queries, desc) in enumerate(PANELS):
        if row_title != row:
            if row is not None:
                y += 8
            panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            pid += 1
            y += 1
            row, x = row_title, 0
        if x >= 24:
            x, y = 0, y + 8
        panels.append({
            "id": pid, "type": "timeseries", "title": title, "description": desc,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(queries)],
        })
        pid += 1
        x += 8
    return {
        "title": "pdserve", "uid": "pdserve-serving", "tags": ["pdserve", "llm-serving"],
        "description": "Disaggregated prefill/decode serving: latency, throughput, pools, KV transfer, speculation.",
        "editable": True, "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def queries(dash: dict) -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL) of every query of a dashboard."""
    return [(p["title"], t.get("legendFormat", ""), t["expr"])
            for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT} ({len(PANELS)} panels)", file=sys.stderr)
