"""A local Prometheus (Debian's `prometheus` binary) scraping given /metrics targets, and its HTTP query API.

Used by the dashboard test (tests/test_prometheus.py) and the dashboard plot (bench/dashboard_plot.py).
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml


def binaries() -> tuple[str, str] | None:
    """(prometheus, promtool) on PATH, or None."""
    prom, promtool = shutil.which("prometheus"), shutil.which("promtool")
    return (prom, promtool) if prom and promtool else None


class Prometheus:
    """A Prometheus on a free loopback port scraping `targets` ({pool: "host:port"}, label `pool`) every
    `scrape_s` seconds, evaluating `rule_groups` (a PrometheusRule's spec.groups) if given. Its data and log
    live in `workdir`. Use as a context manager; `stop()` ends it."""

    def __init__(self, targets: dict[str, str], workdir: Path, rule_groups: dict | None = None,
                 scrape_s: float = 1.0, binary: str | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        config: dict = {"global": {"scrape_interval": f"{scrape_s:g}s", "evaluation_interval": f"{scrape_s:g}s"},
                        "scrape_configs": [{"job_name": "pdserve", "static_configs": [
                            {"targets": [t], "labels": {"pool": pool}} for pool, t in targets.items()]}]}
        if rule_groups is not None:
            (workdir / "rules.yaml").write_text(yaml.safe_dump(rule_groups))
            config["rule_files"] = [str(workdir / "rules.yaml")]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.targets = targets
        self._log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary or shutil.which("prometheus") or "prometheus", f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--storage.tsdb.retention.time=1d"], stdout=self._log, stderr=subprocess.STDOUT)

    def wait_scraping(self, timeout: float = 60) -> None:
        """Until every target has been scraped successfully (`up` = 1); RuntimeError past `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with status {self.proc.returncode}")
            try:
                up = self.query("up")["data"]["result"]
                if len(up) == len(self.targets) and all(r["value"][1] == "1" for r in up):
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"prometheus did not scrape all of {self.targets} within {timeout:.0f} s")

    def _get(self, path: str, **params) -> dict:
        url = f"{self.base}{path}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422: a parse or evaluation error, with its message
            return json.loads(e.read())

    def query(self, expr: str) -> dict:
        """The instant query API's JSON answer (status "error" for an expression that does not parse)."""
        return self._get("/api/v1/query", query=expr)

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        return self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")

    def rules(self) -> list[dict]:
        """Every loaded rule with its health and last evaluation."""
        return [r for g in self._get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
