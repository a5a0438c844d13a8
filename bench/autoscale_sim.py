"""Trace-driven simulation of pool autoscaling: the paired policy vs a static allocation vs utilisation HPAs.

A day's traffic shape (quiet night, morning ramp, afternoon peak, evening fall) compressed into
`--duration-s` (2 simulated hours by default), with Poisson arrivals and short bursts on top,
mixed chat/long-context prompts and lognormal output lengths. One replica is one GPU serving a
mid-size (≈14B, fp16) model on an 80 GB card:

- prefill: `prefill_tokens_per_s` tokens/s per replica, one prompt at a time, replicas pull from
  one shared FIFO queue (the NATS queue group); TTFT = queue wait + prefill (first token comes
  from prefill);
- hand-off: `transfer_s_per_token` per prompt token (≈196 KB of KV per token over ≈40 GB/s);
- decode: continuous batching, one step costs `itl_base_s + itl_per_seq_s × batch`; a sequence is
  admitted only when its whole KV (prompt + output tokens) fits in `kv_capacity_tokens` and the
  batch is below `max_num_seqs`; otherwise it waits (FIFO). A request's ITL is
  (last token − first token) ÷ (output tokens − 1), so hand-off and admission waits count;
- a new replica costs GPU time from the moment it is created and serves after `startup_s`.

Policies, each driven every `sync_s` by the HPA arithmetic of `pdserve.autoscale.policy`:
- `paired`: prefill on prompts in flight + TTFT, decode on KV utilisation + running + waiting
  sequences, with the prefill:decode ratio band (`PairedPolicy`);
- `static`: fixed replicas, the smallest (prefill first, then decode) that meets the SLO target,
  found by search on the same trace;
- `util-hpa`: each pool on its own HPA on GPU utilisation (prefill: busy fraction; decode: batch
  occupancy, running ÷ max_num_seqs — kinder than the ~100 % duty cycle decode really shows),
  target `util_target`, with the same stabilisation and scale-up limits.

Output: a table of SLO attainment (TTFT, ITL, both) and GPU-hours per policy; `--json PATH`
writes the same. Deterministic for a seed. Run: `python bench/autoscale_sim.py [--json out.json]`.
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import sys
import time
from collections import deque
from operator import attrgetter
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from pdserve.autoscale.policy import (
    DecodeSignals,
    PairedPolicy,
    PoolTargets,
    PrefillSignals,
    Stabilizer,
    hpa_ratio_replicas,
    limit_scale_up,
)


@dataclass(frozen=True)
class SimConfig:
    """Every knob of the simulation; units in the names."""

    seed: int = 0
    duration_s: float = 7200.0  # a day's shape, compressed
    drain_s: float = 300.0  # after the trace, to let in-flight requests finish (unfinished = SLO miss)
    trough_rps: float = 5.0
    peak_rps: float = 36.0
    bursts_per_hour: float = 8.0
    burst_multiplier: float = 1.8
    burst_duration_s: float = 60.0
    long_prompt_fraction: float = 0.3
    # One GPU, ≈14B fp16 model on 80 GB: ~28 GB weights, ~45 GB KV at ~196 KB/token.
    prefill_tokens_per_s: float = 6000.0
    transfer_s_per_token: float = 5e-6
    itl_base_s: float = 0.018
    itl_per_seq_s: float = 0.00012
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 230_000
    startup_s: float = 90.0
    sync_s: float = 15.0
    stabilization_s: float = 90.0  # scale-down window, both autoscaled policies
    scale_up_stabilization_s: float = 15.0  # scale-up waits until the need has lasted this long
    scale_up_percent: float = 50.0  # scale-up limit per sync, both autoscaled policies
    scale_up_pods: int = 2
    dt_s: float = 1.0  # prefill is exact per prompt; decode is advanced as a fluid per step
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.050
    slo_target: float = 0.95
    # Paired-policy targets.
    prefill_inflight_per_replica: float = 0.5
    prefill_ttft_target_s: float = 1.0
    decode_kv_utilization: float = 0.8
    decode_running_per_replica: float = 160.0
    decode_waiting_per_replica: float = 4.0
    min_ratio: float = 2.0  # prefill ÷ decode replicas
    max_ratio: float = 4.0
    min_prefill_replicas: int = 2  # autoscaled policies start here, sized for the night trough
    min_decode_replicas: int = 1
    max_replicas: int = 32
    # Utilisation-HPA baseline.
    util_target: float = 0.7


@dataclass
class Trace:
    arrival_s: np.ndarray  # [n] seconds, sorted
    prompt_tokens: np.ndarray  # [n]
    output_tokens: np.ndarray  # [n], >= 2

    def __post_init__(self):
        # The step loops index single requests; Python lists are ~10x faster than numpy scalars there.
        self.arrival = self.arrival_s.tolist()
        self.prompt = self.prompt_tokens.tolist()
        self.output = self.output_tokens.tolist()


def day_shape(x: np.ndarray) -> np.ndarray:
    """Relative load over a day, x in [0, 1): quiet night, morning ramp, lunch dip, afternoon peak."""
    base = 0.5 - 0.5 * np.cos(2 * np.pi * np.clip((x - 0.15) / 0.8, 0, 1))
    dip = 1.0 - 0.15 * np.exp(-(((x - 0.5) / 0.04) ** 2))
    return base * dip


def make_trace(cfg: SimConfig) -> Trace:
    """Bursty, diurnal, non-homogeneous Poisson arrivals (by thinning) with mixed request sizes."""
    rng = np.random.default_rng(cfg.seed)
    n_bursts = rng.poisson(cfg.bursts_per_hour * cfg.duration_s / 3600)
    burst_starts = rng.uniform(0, cfg.duration_s, n_bursts)

    def rate(t: np.ndarray) -> np.ndarray:
        r = cfg.trough_rps + (cfg.peak_rps - cfg.trough_rps) * day_shape(t / cfg.duration_s)
        in_burst = np.zeros_like(t, dtype=bool)
        for b in burst_starts:
            in_burst |= (t >= b) & (t < b + cfg.burst_duration_s)
        return np.where(in_burst, r * cfg.burst_multiplier, r)

    rmax = cfg.peak_rps * cfg.burst_multiplier
    cand = np.sort(rng.uniform(0, cfg.duration_s, rng.poisson(rmax * cfg.duration_s)))
    arrivals = cand[rng.uniform(0, rmax, cand.size) < rate(cand)]
    n = arrivals.size
    long_ = rng.uniform(size=n) < cfg.long_prompt_fraction
    prompt = np.where(long_, rng.lognormal(np.log(3000), 0.5, n), rng.lognormal(np.log(400), 0.8, n))
    output = rng.lognormal(np.log(180), 0.9, n)
    return Trace(arrivals, np.clip(prompt, 16, 16000).astype(np.int64), np.clip(output, 2, 2048).astype(np.int64))


# --------------------------------------------------------------------------------------------------
# Pools


class PrefillPool:
    """Replicas that pull prompts from one FIFO; exact per-prompt start/finish times within a step."""

    def __init__(self, cfg: SimConfig, initial: int):
        self.cfg = cfg
        self.queue: deque[int] = deque()
        self.free: list[tuple[float, int]] = []  # heap of (free_at_s, replica id) for ready replicas
        self.starting: list[tuple[float, int]] = []  # (ready_at_s, id)
        self.removed: set[int] = set()
        self.alive: set[int] = set()
        self._next_id = 0
        self.busy_s = 0.0  # service time handed out since the last sample (utilisation)
        self.ttft_sum = 0.0
        self.ttft_n = 0
        for _ in range(initial):
            self._add(0.0, 0.0)

    def _add(self, now: float, ready_at: float) -> None:
        rid = self._next_id
        self._next_id += 1
        self.alive.add(rid)
        if ready_at <= now:
            heapq.heappush(self.free, (now, rid))
        else:
            self.starting.append((ready_at, rid))

    @property
    def replicas(self) -> int:
        return len(self.alive)

    def scale_to(self, now: float, n: int, startup_s: float) -> None:
        while self.replicas < n:
            self._add(now, now + startup_s)
        if self.replicas > n:
            # Remove starting replicas first, then the ready ones that free up soonest (idle first).
            excess = self.replicas - n
            while excess and self.starting:
                _, rid = self.starting.pop()
                self.alive.discard(rid)
                excess -= 1
            for free_at, rid in sorted(e for e in self.free if e[1] not in self.removed)[:excess]:
                self.removed.add(rid)
                self.alive.discard(rid)

    def step(self, t: float, t_end: float, trace: Trace, ready_heap: list, result_ttft: list) -> None:
        cfg = self.cfg
        if self.starting:
            still = []
            for ready_at, rid in self.starting:
                if ready_at < t_end:
                    heapq.heappush(self.free, (ready_at, rid))
                else:
                    still.append((ready_at, rid))
            self.starting = still
        arr, prompt = trace.arrival, trace.prompt
        q, free = self.queue, self.free
        while q and free and free[0][0] < t_end:
            free_at, rid = heapq.heappop(free)
            if rid in self.removed:
                self.removed.discard(rid)
                continue
            i = q.popleft()
            start = max(free_at, arr[i])
            service = prompt[i] / cfg.prefill_tokens_per_s
            finish = start + service
            heapq.heappush(free, (finish, rid))
            self.busy_s += service
            ttft = finish - arr[i]
            result_ttft[i] = ttft
            self.ttft_sum += ttft
            self.ttft_n += 1
            heapq.heappush(ready_heap, (finish + prompt[i] * cfg.transfer_s_per_token, i))

    def sample(self, t: float) -> dict:
        busy = sum(1 for free_at, rid in self.free if free_at > t and rid not in self.removed)
        ttft = self.ttft_sum / self.ttft_n if self.ttft_n else 0.0
        ready = self.replicas - len(self.starting)
        out = {"inflight": len(self.queue) + busy, "ttft": ttft, "busy_s": self.busy_s, "ready": ready}
        self.busy_s = self.ttft_sum = 0.0
        self.ttft_n = 0
        return out


@dataclass
class DecodeReplica:
    ready_at: float
    clock: float = 0.0  # tokens generated per running sequence since the replica started
    heap: list = field(default_factory=list)  # (finish_clock, request)
    kv_used: int = 0
    draining: bool = False


_KV_USED = attrgetter("kv_used")


class DecodePool:
    """Continuous-batching replicas; a sequence is admitted when its whole KV fits."""

    def __init__(self, cfg: SimConfig, initial: int):
        self.cfg = cfg
        self.reps: list[DecodeReplica] = [DecodeReplica(ready_at=0.0) for _ in range(initial)]
        self.waiting: deque[tuple[float, int]] = deque()

    @property
    def replicas(self) -> int:
        return sum(1 for r in self.reps if not r.draining)

    def gpus(self) -> int:
        return len(self.reps)

    def scale_to(self, now: float, n: int, startup_s: float) -> None:
        active = [r for r in self.reps if not r.draining]
        if len(active) < n:
            # Reuse draining replicas first (they are warm), then start new ones.
            for r in self.reps:
                if r.draining and len(active) < n:
                    r.draining = False
                    active.append(r)
            while len(active) < n:
                r = DecodeReplica(ready_at=now + startup_s)
                self.reps.append(r)
                active.append(r)
        elif len(active) > n:
            # Drain the least loaded (not-yet-ready first): they stop admitting and leave when empty.
            for r in sorted(active, key=lambda r: (r.ready_at <= now, len(r.heap)))[: len(active) - n]:
                r.draining = True

    def step(self, t: float, t_end: float, trace: Trace, ready_heap: list, ttft: list, result_itl: list) -> None:
        cfg = self.cfg
        while ready_heap and ready_heap[0][0] < t_end:
            self.waiting.append(heapq.heappop(ready_heap))
        self.reps = [r for r in self.reps if not (r.draining and not r.heap)]
        ready = [r for r in self.reps if not r.draining and r.ready_at <= t]
        arr, prompt, output = trace.arrival, trace.prompt, trace.output
        cap, max_seqs = cfg.kv_capacity_tokens, cfg.max_num_seqs
        while self.waiting and ready:
            ready_at, i = self.waiting[0]
            need = int(prompt[i] + output[i])
            r = min(ready, key=_KV_USED)
            if r.kv_used + need > cap or len(r.heap) >= max_seqs:
                # The emptiest replica cannot take the head of the queue; FIFO keeps it waiting.
                break
            self.waiting.popleft()
            itl = cfg.itl_base_s + cfg.itl_per_seq_s * len(r.heap)
            late = max(0.0, ready_at - t) / itl  # tokens the batch makes before this one joins
            heapq.heappush(r.heap, (r.clock + late + output[i] - 1, i))
            r.kv_used += need
        for r in self.reps:
            if r.ready_at > t or not r.heap:
                continue
            itl = cfg.itl_base_s + cfg.itl_per_seq_s * len(r.heap)
            new_clock = r.clock + (t_end - t) / itl
            h = r.heap
            while h and h[0][0] <= new_clock:
                fc, i = heapq.heappop(h)
                finish = t + (fc - r.clock) * itl
                result_itl[i] = (finish - arr[i] - ttft[i]) / (output[i] - 1)
                r.kv_used -= int(prompt[i] + output[i])
            r.clock = new_clock

    def sample(self, t: float) -> dict:
        ready = [r for r in self.reps if not r.draining and r.ready_at <= t]
        return {
            "kv_sum": sum(r.kv_used for r in ready) / self.cfg.kv_capacity_tokens,
            "running": sum(len(r.heap) for r in ready),
            "waiting": len(self.waiting),
        }


# --------------------------------------------------------------------------------------------------
# Controllers: each returns (prefill replicas, decode replicas) at a sync.


class StaticController:
    def __init__(self, prefill: int, decode: int):
        self.p, self.d = prefill, decode

    def initial(self) -> tuple[int, int]:
        return self.p, self.d

    def __call__(self, t, p_cur, d_cur, ps, ds) -> tuple[int, int]:
        return self.p, self.d


class PairedController:
    """pdserve's policy, fed the signals the adapter serves for each pool."""

    def __init__(self, cfg: SimConfig):
        self.policy = PairedPolicy(
            prefill_targets=PoolTargets(
                cfg.min_prefill_replicas,
                cfg.max_replicas, inflight_per_replica=cfg.prefill_inflight_per_replica, ttft_seconds=cfg.prefill_ttft_target_s
            ),
            decode_targets=PoolTargets(
                cfg.min_decode_replicas,
                cfg.max_replicas,
                kv_utilization=cfg.decode_kv_utilization,
                running_per_replica=cfg.decode_running_per_replica,
                waiting_per_replica=cfg.decode_waiting_per_replica,
            ),
            min_ratio=cfg.min_ratio,
            max_ratio=cfg.max_ratio,
            stabilization_window_s=cfg.stabilization_s,
            scale_up_stabilization_s=cfg.scale_up_stabilization_s,
            scale_up_percent=cfg.scale_up_percent,
            scale_up_pods=cfg.scale_up_pods,
        )

    def initial(self) -> tuple[int, int]:
        return self.policy.prefill_targets.min_replicas, self.policy.decode_targets.min_replicas

    def __call__(self, t, p_cur, d_cur, ps, ds) -> tuple[int, int]:
        # Pods still starting report nothing; like the HPA, average over all of the pool's pods.
        return self.policy.step(
            t,
            p_cur,
            d_cur,
            # A starting pod has no TTFT yet: it counts as 0, as the HPA counts pods without metrics.
            PrefillSignals(inflight_prompts=ps["inflight"], ttft_seconds=ps["ttft"] * ps["ready"] / max(p_cur, 1)),
            DecodeSignals(kv_utilization=ds["kv_sum"] / max(d_cur, 1), running_sequences=ds["running"], waiting_sequences=ds["waiting"]),
        )


class UtilizationController:
    """Independent HPAs, one per pool, on GPU utilisation (the common default the issue complains about)."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.stab_p = Stabilizer(cfg.stabilization_s, cfg.scale_up_stabilization_s)
        self.stab_d = Stabilizer(cfg.stabilization_s, cfg.scale_up_stabilization_s)

    def initial(self) -> tuple[int, int]:
        return self.cfg.min_prefill_replicas, self.cfg.min_decode_replicas

    def __call__(self, t, p_cur, d_cur, ps, ds) -> tuple[int, int]:
        cfg = self.cfg
        p_util = min(1.0, ps["busy_s"] / (max(p_cur, 1) * cfg.sync_s))
        d_util = min(1.0, ds["running"] / (max(d_cur, 1) * cfg.max_num_seqs))
        up = dict(percent=cfg.scale_up_percent, pods=cfg.scale_up_pods)
        p = self.stab_p(t, p_cur, limit_scale_up(p_cur, hpa_ratio_replicas(p_cur, p_util, cfg.util_target), **up))
        d = self.stab_d(t, d_cur, limit_scale_up(d_cur, hpa_ratio_replicas(d_cur, d_util, cfg.util_target), **up))
        return min(max(p, cfg.min_prefill_replicas), cfg.max_replicas), min(max(d, cfg.min_decode_replicas), cfg.max_replicas)


# --------------------------------------------------------------------------------------------------


def simulate(cfg: SimConfig, trace: Trace, controller, name: str, prefill_only: bool = False) -> dict:
    """Run one policy over the trace; returns attainment (fractions), GPU-hours and replica ranges.

    prefill_only: skip decode (ITL is then undefined) — the static search sizes prefill by TTFT alone.
    """
    n = trace.arrival_s.size
    ttft = [math.inf] * n
    itl = [math.inf] * n
    p0, d0 = controller.initial()
    prefill, decode = PrefillPool(cfg, p0), DecodePool(cfg, d0)
    ready_heap: list = []
    gpu_s = 0.0
    p_range, d_range = [p0, p0], [d0, d0]
    timeline = []  # (t_s, prefill replicas, decode replicas, prefill in flight, decode waiting) per sync
    next_sync = cfg.sync_s
    arr = trace.arrival
    k = 0
    steps = int(math.ceil((cfg.duration_s + cfg.drain_s) / cfg.dt_s))
    for s in range(steps):
        t = s * cfg.dt_s
        t_end = t + cfg.dt_s
        if t >= next_sync and t < cfg.duration_s:
            next_sync += cfg.sync_s
            p_cur, d_cur = prefill.replicas, decode.replicas
            ps, ds = prefill.sample(t), decode.sample(t)
            p, d = controller(t, p_cur, d_cur, ps, ds)
            timeline.append((t, p, d, ps["inflight"], ds["waiting"]))
            if p != p_cur:
                prefill.scale_to(t, p, cfg.startup_s)
            if d != d_cur:
                decode.scale_to(t, d, cfg.startup_s)
            p_range = [min(p_range[0], p), max(p_range[1], p)]
            d_range = [min(d_range[0], d), max(d_range[1], d)]
        k2 = bisect.bisect_left(arr, t_end, lo=k)
        prefill.queue.extend(range(k, k2))
        k = k2
        prefill.step(t, t_end, trace, ready_heap, ttft)
        if prefill_only:
            ready_heap.clear()
        else:
            decode.step(t, t_end, trace, ready_heap, ttft, itl)
        if t < cfg.duration_s:
            gpu_s += (prefill.replicas + decode.gpus()) * cfg.dt_s
    ttft, itl = np.array(ttft), np.array(itl)
    ok_ttft = ttft <= cfg.slo_ttft_s
    ok_itl = itl <= cfg.slo_itl_s
    return {
        "policy": name,
        "requests": int(n),
        "ttft_ok": float(ok_ttft.mean()),
        "itl_ok": float(ok_itl.mean()),
        "slo_ok": float((ok_ttft & ok_itl).mean()),
        "ttft_p99_s": float(np.quantile(np.minimum(ttft, 1e9), 0.99)),
        "itl_p99_s": float(np.quantile(np.minimum(itl, 1e9), 0.99)),
        "gpu_hours": gpu_s / 3600.0,
        "prefill_replicas": p_range,
        "decode_replicas": d_range,
        "timeline": timeline,
    }


def smallest_static(cfg: SimConfig, trace: Trace) -> dict:
    """The cheapest static (prefill, decode) meeting `slo_target`: prefill by TTFT, then decode by both.

    TTFT depends on prefill only (the first token comes from prefill), so prefill is searched
    first without decode, then decode with that prefill; prefill grows by one if no decode count
    up to `max_replicas` reaches the target. Each search doubles until the target is met, then
    bisects.
    """

    runs: dict[tuple[int, int, bool], dict] = {}

    def run(p: int, d: int, prefill_only: bool = False) -> dict:
        if (p, d, prefill_only) not in runs:
            runs[p, d, prefill_only] = simulate(cfg, trace, StaticController(p, d), f"static p={p} d={d}", prefill_only)
        return runs[p, d, prefill_only]

    def smallest(ok) -> int | None:
        lo, hi = 0, 1  # invariant: not ok(lo) (or lo == 0), ok(hi) once found
        while not ok(hi):
            if hi >= cfg.max_replicas:
                return None
            lo, hi = hi, min(2 * hi, cfg.max_replicas)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi

    p = smallest(lambda p: run(p, 1, prefill_only=True)["ttft_ok"] >= cfg.slo_target)
    while p is not None and p <= cfg.max_replicas:
        d = smallest(lambda d: run(p, d)["slo_ok"] >= cfg.slo_target)
        if d is not None:
            result = dict(run(p, d), policy="static (smallest meeting SLO)", static=[p, d], search_runs=len(runs))
            return result
        p += 1
    raise RuntimeError(f"no static allocation up to {cfg.max_replicas} replicas per pool meets the SLO")


def run_all(cfg: SimConfig) -> dict:
    trace = make_trace(cfg)
    results = [
        simulate(cfg, trace, PairedController(cfg), "paired (pdserve)"),
        smallest_static(cfg, trace),
        simulate(cfg, trace, UtilizationController(cfg), "util-hpa (per-pool GPU util)"),
    ]
    return {"config": asdict(cfg), "results": results}


def format_table(report: dict) -> str:
    cfg = report["config"]
    rows = report["results"]
    static_h = next(r["gpu_hours"] for r in rows if r["policy"].startswith("static"))
    head = (
        f"{report['results'][0]['requests']} requests over {cfg['duration_s'] / 3600:.1f} h; "
        f"SLO: TTFT <= {cfg['slo_ttft_s']} s and ITL <= {cfg['slo_itl_s'] * 1000:.0f} ms, target {cfg['slo_target']:.0%}\n"
    )
    lines = [
        f"{'policy':32} {'TTFT ok':>8} {'ITL ok':>8} {'both ok':>8} {'GPU-h':>7} {'vs static':>9} {'prefill':>8} {'decode':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['policy']:32} {r['ttft_ok']:8.1%} {r['itl_ok']:8.1%} {r['slo_ok']:8.1%} {r['gpu_hours']:7.1f} "
            f"{r['gpu_hours'] / static_h:9.2f} {'%d-%d' % tuple(r['prefill_replicas']):>8} {'%d-%d' % tuple(r['decode_replicas']):>8}"
        )
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=SimConfig.seed)
    ap.add_argument("--duration-s", type=float, default=SimConfig.duration_s)
    ap.add_argument("--peak-rps", type=float, default=SimConfig.peak_rps)
    ap.add_argument("--startup-s", type=float, default=SimConfig.startup_s)
    ap.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="override any SimConfig field, e.g. --set prefill_tokens_per_s=9000 --set kv_capacity_tokens=400000",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    cfg = replace(SimConfig(), seed=args.seed, duration_s=args.duration_s, peak_rps=args.peak_rps, startup_s=args.startup_s)
    fields = SimConfig.__dataclass_fields__
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            ap.error(f"--set {item}: no SimConfig field {key!r}; fields: {', '.join(fields)}")
        cfg = replace(cfg, **{key: type(getattr(cfg, key))(value)})
    t0 = time.perf_counter()
    report = run_all(cfg)
    report["wall_s"] = time.perf_counter() - t0
    print(format_table(report))
    print(f"({report['wall_s']:.1f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
