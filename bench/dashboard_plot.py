"""The chart's Grafana dashboard, panel by panel, plotted from a real Prometheus under load (where no Grafana runs).

Starts a local deployment (one prefill and one decode worker speculating with prompt lookup, the front; every
process's /metrics), a Prometheus (Debian's package) scraping them every second, drives closed-loop streaming
load through phases of rising concurrency, then asks Prometheus' range API for every query of
charts/pdserve/dashboards/pdserve.json over the run and draws each panel with matplotlib:

    python bench/dashboard_plot.py [--phase-s 40] [--concurrency 1,2,4] [--out docs/dashboard.png]

`$__rate_interval` (Grafana's rate window) is `--rate-window` (default 15s, 15 scrapes).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "charts" / "pdserve" / "dashboards" / "pdserve.json"

UNIT_SCALE = {"s": ("ms", 1000.0), "Bps": ("MB/s", 1e-6), "percentunit": ("%", 100.0)}


def say(msg: str) -> None:
    print(f"dashboard: {msg}", file=sys.stderr, flush=True)


def drive(url: str, model: str, tok, concurrency: list[int], phase_s: float) -> list[tuple[float, float, int]]:
    """Closed-loop streaming load, each concurrency for `phase_s` seconds: [(start, end, concurrency)]."""
    from bench.load import request_set, stream

    reqs = request_set(tok, 512, seed=3)
    phases = []
    for c in concurrency:
        t0 = time.time()
        stop_at = time.monotonic() + phase_s
        next_req = iter(reqs * 4)
        lock = threading.Lock()

        def client():
            while time.monotonic() < stop_at:
                with lock:
                    ids, n = next(next_req)
                # the prompt repeated once: prompt lookup has something to draft from
                stream(url, model, {"prompt": ids[:64] + ids[:64], "max_tokens": min(n, 48)})

        threads = [threading.Thread(target=client) for _ in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        phases.append((t0, time.time(), c))
        say(f"concurrency {c}: {time.time() - t0:.0f} s")
    return phases


def plot(prom, dashboard: dict, start: float, end: float, phases, rate_window: str, out: Path) -> int:
    """Every panel's queries over [start, end] in one figure; → the number of series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    step = max(1.0, (end - start) / 300)
    drawn = 0
    for ax, panel in zip(axes.flat, panels):
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        label, scale = UNIT_SCALE.get(unit, (unit if unit not in ("short", "reqps") else "", 1.0))
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", rate_window)
            res = prom.query_range(expr, start, end, step)
            if res.get("status") != "success":
                raise RuntimeError(f"{panel['title']}: {expr}: {res.get('error')}")
            for series in res["data"]["result"]:
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) * scale for _, v in series["values"]]
                name = target.get("legendFormat", "")
                for k, v in series["metric"].items():
                    name = name.replace("{{" + k + "}}", v)
                ax.plot(xs, ys, label=name or expr, linewidth=1.2)
                drawn += 1
        for t0, _, c in phases:
            ax.axvline(t0 - start, color="0.85", linewidth=0.8, zorder=0)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="upper left")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the run", fontsize=8)
    conc = ", ".join(f"{c} from {t0 - start:.0f} s" for t0, _, c in phases)
    fig.suptitle(f"pdserve dashboard queries from Prometheus under load (concurrency {conc}; "
                 f"$__rate_interval = {rate_window})", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    return drawn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase-s", type=float, default=40.0, help="seconds of load at each concurrency")
    p.add_argument("--concurrency", default="1,2,4", help="closed-loop concurrency of each phase")
    p.add_argument("--rate-window", default="15s", help="what $__rate_interval stands for")
    p.add_argument("--out", default=str(REPO / "docs" / "dashboard.png"))
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from bench.promlocal import Prometheus, binaries
    from pdserve.local import LocalCluster
    from pdserve.modelstore import resolve_model
    from pdserve.natsserver import free_port

    tools = binaries()
    if tools is None:
        say("prometheus is not installed (apt-get install prometheus)")
        return 2
    model_dir = resolve_model("default")
    tok = AutoTokenizer.from_pretrained(model_dir)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-dashboard-"))
    (workdir / "logs").mkdir()
    ports = {"prefill": free_port(), "decode": free_port()}
    cluster = LocalCluster(str(model_dir), log_dir=str(workdir / "logs"),
                           worker_args={"prefill": ["--metrics-port", str(ports["prefill"])],
                                        "decode": ["--metrics-port", str(ports["decode"]), "--spec-method", "ngram"]})
    say(f"logs in {workdir}")
    cluster.start()
    try:
        targets = {"front": f"127.0.0.1:{cluster.port}", **{k: f"127.0.0.1:{v}" for k, v in ports.items()}}
        with Prometheus(targets, workdir / "prometheus", binary=tools[0]) as prom:
            prom.wait_scraping()
            start = time.time()
            phases = drive(cluster.url, model_dir.name, tok, [int(c) for c in args.concurrency.split(",")],
                           args.phase_s)
            time.sleep(5)  # the last scrapes
            drawn = plot(prom, json.loads(DASHBOARD.read_text()), start, time.time(), phases, args.rate_window,
                         Path(args.out))
    finally:
        cluster.stop()
    say(f"wrote {args.out}: {drawn} series")
    return 0


if __name__ == "__main__":
    sys.path.append(str(REPO))  # appended: the checkout's kernels/ must not shadow the `kernels` package transformers reads
    sys.exit(main())
