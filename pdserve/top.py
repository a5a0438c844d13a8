"""`pdserve top`: a terminal view of a running deployment, for where no Grafana runs.

It reads the front's `/metrics` (request and token rates, TTFT/ITL/end-to-end percentiles, pool sizes,
worker restarts) and `/workers` (each worker's last load report: queue, running and waiting sequences,
KV use, TTFT, ITL, tokens/s, speculation acceptance, transfer backlog — the numbers the workers also
export as gauges), plus any worker `/metrics` given with `--metrics` (KV transfer bytes and failures,
preemptions, drafted and accepted tokens). Rates and percentiles are over the last refresh interval;
with nothing in it, percentiles are since the front started (marked "all"). Refreshes every second
with plain ANSI (no curses); `--once` prints one frame (two reads an interval apart) and exits.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

CLEAR, BOLD, DIM, RESET = "\x1b[H\x1b[2J", "\x1b[1m", "\x1b[2m", "\x1b[0m"


@dataclass
class Sample:
    """One read of the deployment: metric samples {(name, sorted labels): value} and the workers' rows."""

    at: float
    values: dict[tuple[str, tuple], float] = field(default_factory=dict)
    workers: list[dict] = field(default_factory=list)
    model: str = ""
    errors: list[str] = field(default_factory=list)

    def total(self, name: str, **labels) -> float:
        """The sum of `name`'s samples whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for (n, lab), v in self.values.items() if n == name and want <= set(lab))

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, lab), v in self.values.items():
            if n == name:
                key = dict(lab).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """A histogram's cumulative buckets [(le, count)], summed over its series, by le."""
        le = self.by(f"{name}_bucket", "le")
        return sorted((float(k), v) for k, v in le.items())


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def read(front: str, metrics: list[str], timeout: float = 5.0) -> Sample:
    """Read the front's /metrics and /workers and each extra /metrics endpoint; failures are noted, not raised."""
    s = Sample(time.monotonic())
    for url in [f"{front}/metrics", *metrics]:
        try:
            text = _get(url, timeout).decode()
        except (OSError, urllib.error.URLError) as e:
            s.errors.append(f"{url}: {e}")
            continue
        for family in text_string_to_metric_families(text):
            for smp in family.samples:
                key = (smp.name, tuple(sorted(smp.labels.items())))
                s.values[key] = s.values.get(key, 0.0) + smp.value
    try:
        body = json.loads(_get(f"{front}/workers", timeout))
        s.workers, s.model = body["workers"], body["model"]
    except (OSError, urllib.error.URLError, ValueError, KeyError) as e:
        s.errors.append(f"{front}/workers: {e}")
    return s


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative [(le, count)] buckets: linear within the bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, prev_le, prev_n = q * buckets[-1][1], 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return prev_le


def _delta(new: list[tuple[float, float]], old: list[tuple[float, float]]) -> list[tuple[float, float]]:
    before = dict(old)
    return [(le, n - before.get(le, 0.0)) for le, n in new]


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def frame(prev: Sample, cur: Sample, url: str, color: bool = True) -> str:
    """The screen for the interval between two reads."""
    b, d, r = (BOLD, DIM, RESET) if color else ("", "", "")
    dt = max(cur.at - prev.at, 1e-6)

    def rate(name: str, **labels) -> float:
        return max(0.0, cur.total(name, **labels) - prev.total(name, **labels)) / dt

    lines = [f"{b}pdserve top{r} — {url}   model {cur.model or '?'}   {time.strftime('%H:%M:%S')}   "
             f"{d}(every {dt:.1f} s; Ctrl-C quits){r}"]
    statuses = {k: (cur.by("pdserve_requests_total", "status").get(k, 0) - v) / dt
                for k, v in prev.by("pdserve_requests_total", "status").items()}
    statuses.update({k: v / dt for k, v in cur.by("pdserve_requests_total", "status").items() if k not in statuses})
    ok = statuses.pop("200", 0.0)
    errors = sum(statuses.values())
    lines.append(f"requests {ok:6.2f}/s ok  {errors:5.2f}/s errors   output {rate('pdserve_completion_tokens_total'):7.1f} "
                 f"tok/s   prompt {rate('pdserve_prompt_tokens_total'):7.1f} tok/s   in flight "
                 f"{cur.total('pdserve_queue_depth'):.0f}")
    for label, name in (("TTFT", "pdserve_time_to_first_token_seconds"), ("ITL ", "pdserve_inter_token_latency_seconds"),
                        ("e2e ", "pdserve_request_duration_seconds")):
        window = _delta(cur.buckets(name), prev.buckets(name))
        scope, hist = ("last", window) if window and window[-1][1] > 0 else ("all ", cur.buckets(name))
        qs = "  ".join(f"p{int(q * 100)} {_secs(quantile(q, hist)):>8}" for q in (0.5, 0.9, 0.99))
        lines.append(f"{label} {d}{scope}{r}  {qs}")
    pools = cur.by("pdserve_workers", "role")
    restarts = cur.by("pdserve_worker_restarts_total", "role")
    ratio = f"{pools.get('prefill', 0) / pools['decode']:.2f}" if pools.get("decode") else "-"
    lines.append(f"pools  prefill {pools.get('prefill', 0):.0f}  decode {pools.get('decode', 0):.0f}  draft "
                 f"{pools.get('draft', 0):.0f}   P:D {ratio}   restarts "
                 + " ".join(f"{k} {v:.0f}" for k, v in sorted(restarts.items())))
    drafted, accepted = rate("pdserve_spec_draft_tokens_total"), rate("pdserve_spec_accepted_tokens_total")
    if any(n.startswith("pdserve_kv_transfer_received") or n.startswith("pdserve_spec_") for n, _ in cur.values):
        lines.append(f"KV in {rate('pdserve_kv_transfer_received_bytes_total') / 1e6:7.2f} MB/s   transfer failures "
                     f"{rate('pdserve_kv_transfer_failures_total'):.2f}/s   preemptions "
                     f"{rate('pdserve_decode_preemptions_total'):.2f}/s   speculation "
                     f"{(f'{accepted / drafted:.0%} of {drafted:.1f} drafted/s') if drafted else '-'}")
    lines.append("")
    head = f"{'WORKER':<22} {'ROLE':<8} {'STATE':<8} {'QUEUE':>5} {'RUN':>4} {'WAIT':>4} {'KV':>5} {'TTFT':>8} " \
           f"{'ITL':>8} {'TOK/S':>7} {'ACCEPT':>6} {'BACKLOG':>7}"
    lines.append(f"{b}{head}{r}")
    for w in sorted(cur.workers, key=lambda w: (w["role"], w["worker_id"])):
        dec = w["role"] == "decode"
        pre = w["role"] == "prefill"
        state = "draining" if w.get("draining") else "ok"
        lines.append(
            f"{w['worker_id'][:22]:<22} {w['role']:<8} {state:<8} {w['queue_depth'] if not dec else '-':>5} "
            f"{w['running'] if dec else '-':>4} {w['waiting'] if dec else '-':>4} {_pct(w['kv_utilization']):>5} "
            f"{_secs(w['ttft_seconds']) if pre else '-':>8} {_secs(w['itl_seconds']) if dec else '-':>8} "
            f"{w['tokens_per_second'] if dec else 0:>7.1f} {_pct(w['spec_acceptance_rate']) if dec else '-':>6} "
            f"{w['transfer_backlog_handoffs']:>7}")
    if not cur.workers:
        lines.append(f"{d}(no workers registered){r}")
    for e in cur.errors:
        lines.append(f"! {e}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve top", description=__doc__.strip().split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the front's address (default: %(default)s)")
    p.add_argument("--metrics", action="append", default=[], metavar="URL",
                   help="a worker's /metrics URL too (repeatable): KV transfer, preemption and speculation rates")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--no-color", action="store_true", help="no ANSI attributes (default when not a terminal)")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be > 0")
    url = args.url.rstrip("/")
    color = sys.stdout.isatty() and not args.no_color
    prev = read(url, args.metrics)
    if prev.errors and not prev.values and not prev.workers:
        print(f"pdserve top: cannot read {url}: {prev.errors[0]}", file=sys.stderr)
        return 1
    try:
        while True:
            time.sleep(args.interval)
            cur = read(url, args.metrics)
            text = frame(prev, cur, url, color)
            if args.once:
                print(text)
                return 0
            sys.stdout.write((CLEAR if color else "\n") + text + "\n")
            sys.stdout.flush()
            prev = cur
    except KeyboardInterrupt:
        return 0
