"""The paired prefill/decode scaling policy, as pure functions of per-pool signals and targets.

Each pool scales on the signal of its own phase — prefill on prompts in flight (queue depth)
and TTFT, decode on KV utilisation, running and waiting sequences — and the pair is then held
inside a prefill:decode ratio band. The arithmetic is the HPA's own (`desired = ceil(current ×
value / target)` per metric, the maximum over metrics, a ±10 % tolerance, scale-down to the
highest recommendation of a stabilisation window, scale-up limited to max(2×, +4) per sync),
so that what the simulator (`bench/autoscale_sim.py`) shows is what HPAs rendered from the same
targets do in a cluster. The band's arithmetic lives in `prefill_range` and `decode_range`: the
operator bounds the prefill pool's HPA with `prefill_range` of the decode pool's replicas (decode,
whose KV capacity is the scarce resource, is the anchor); `PairedPolicy` holds the band for both
pools in one place, for the simulator and for anyone who drives replica counts directly.

Ratios are prefill replicas ÷ decode replicas. Nothing here talks to Kubernetes or NATS.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# The HPA controller's default tolerance: a ratio within 1 ± 0.1 of target changes nothing.
HPA_TOLERANCE = 0.1


@dataclass(frozen=True)
class PrefillSignals:
    """What the prefill pool reports, summed or averaged over its ready pods.

    inflight_prompts: prompts queued or being prefilled, summed over the pool (count).
    ttft_seconds: recent mean time to first token over the pool (seconds).
    """

    inflight_prompts: float
    ttft_seconds: float


@dataclass(frozen=True)
class DecodeSignals:
    """What the decode pool reports.

    kv_utilization: mean fraction (0..1) of KV capacity in use across the pool's pods.
    running_sequences: sequences being decoded, summed over the pool (count).
    waiting_sequences: sequences handed off but not yet admitted, summed over the pool (count).
    """

    kv_utilization: float
    running_sequences: float
    waiting_sequences: float


@dataclass(frozen=True)
class PoolTargets:
    """Per-pool targets (the numbers an HPA's `metrics:` list carries) and replica bounds.

    Prefill: `inflight_per_replica` (prompts, AverageValue) and `ttft_seconds` (Value).
    Decode: `kv_utilization` (0..1, AverageValue), `running_per_replica` and `waiting_per_replica`
    (sequences, AverageValue). A target left at None is not used by that pool.
    """

    min_replicas: int = 1
    max_replicas: int = 64
    inflight_per_replica: float | None = None
    ttft_seconds: float | None = None
    kv_utilization: float | None = None
    running_per_replica: float | None = None
    waiting_per_replica: float | None = None

    def __post_init__(self):
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")


def hpa_ratio_replicas(current: int, value: float, target: float, tolerance: float = HPA_TOLERANCE) -> int:
    """The HPA formula for one metric: ceil(current × value / target), unchanged within tolerance.

    `value` is the pool's per-replica average for AverageValue metrics (or the single value for a
    Value metric); `current` the ready replicas (at least 1 is assumed, as a pool scaled to zero
    has no pods to report).
    """
    if target <= 0:
        raise ValueError(f"target must be > 0, got {target}")
    current = max(current, 1)
    ratio = value / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil(current * ratio - 1e-9)


def prefill_desired(current: int, signals: PrefillSignals, targets: PoolTargets) -> int:
    """Desired prefill replicas from prefill's own signals only (max over its metrics), unclamped."""
    n = max(current, 1)
    recs = []
    if targets.inflight_per_replica is not None:
        recs.append(hpa_ratio_replicas(n, signals.inflight_prompts / n, targets.inflight_per_replica))
    if targets.ttft_seconds is not None:
        recs.append(hpa_ratio_replicas(n, signals.ttft_seconds, targets.ttft_seconds))
    if not recs:
        raise ValueError("prefill targets need inflight_per_replica and/or ttft_seconds")
    return max(recs)


def decode_desired(current: int, signals: DecodeSignals, targets: PoolTargets) -> int:
    """Desired decode replicas from decode's own signals only (max over its metrics), unclamped."""
    n = max(current, 1)
    recs = []
    if targets.kv_utilization is not None:
        recs.append(hpa_ratio_replicas(n, signals.kv_utilization, targets.kv_utilization))
    if targets.running_per_replica is not None:
        recs.append(hpa_ratio_replicas(n, signals.running_sequences / n, targets.running_per_replica))
    if targets.waiting_per_replica is not None:
        recs.append(hpa_ratio_replicas(n, signals.waiting_sequences / n, targets.waiting_per_replica))
    if not recs:
        raise ValueError("decode targets need kv_utilization, running_per_replica and/or waiting_per_replica")
    return max(recs)


def prefill_range(decode: int, min_ratio: float | None, max_ratio: float | None) -> tuple[int | None, int | None]:
    """The prefill replica counts (fewest, most) that keep prefill ÷ decode within [min_ratio, max_ratio]
    beside `decode` decode replicas: (ceil(min_ratio × decode), floor(max_ratio × decode)); None for a
    side of the band that is not set."""
    fewest = None if min_ratio is None else math.ceil(min_ratio * decode - 1e-9)
    most = None if max_ratio is None else math.floor(max_ratio * decode + 1e-9)
    return fewest, most


def decode_range(prefill: int, min_ratio: float, max_ratio: float) -> tuple[int, int]:
    """The decode replica counts (fewest, most) that keep prefill ÷ decode within [min_ratio, max_ratio]
    beside `prefill` prefill replicas: (ceil(prefill ÷ max_ratio), floor(prefill ÷ min_ratio))."""
    return math.ceil(prefill / max_ratio - 1e-9), math.floor(prefill / min_ratio + 1e-9)


def ratio_bounds(prefill_desired: int, decode_desired: int, min_ratio: float, max_ratio: float) -> tuple[int, int]:
    """Floors that keep prefill ÷ decode within [min_ratio, max_ratio]: (prefill_min, decode_min).

    The ratio is restored by raising the pool that fell behind, never by cutting the one that
    asked for capacity: prefill_min = ceil(min_ratio × decode_desired), decode_min =
    ceil(prefill_desired ÷ max_ratio). `paired_replicas` raises the pools to these.
    """
    if not 0 < min_ratio <= max_ratio:
        raise ValueError(f"need 0 < min_ratio <= max_ratio, got {min_ratio}, {max_ratio}")
    prefill_min = prefill_range(decode_desired, min_ratio, max_ratio)[0]
    return prefill_min, decode_range(prefill_desired, min_ratio, max_ratio)[0]


def paired_replicas(
    prefill: int, decode: int, prefill_targets: PoolTargets, decode_targets: PoolTargets, min_ratio: float, max_ratio: float
) -> tuple[int, int]:
    """Clamp both pools to their bounds and enforce the ratio band jointly.

    The band is restored by raising the lagging pool up to its max_replicas; if that is not enough
    (a pool is pinned at its maximum), the other pool is lowered to fit, because max_replicas is a
    hard budget the user set.
    """
    p = min(max(prefill, prefill_targets.min_replicas), prefill_targets.max_replicas)
    d = min(max(decode, decode_targets.min_replicas), decode_targets.max_replicas)
    p_min, d_min = ratio_bounds(p, d, min_ratio, max_ratio)
    p = min(max(p, p_min), prefill_targets.max_replicas)
    d = min(max(d, d_min), decode_targets.max_replicas)
    # Still outside the band only when a pool hit its maximum: bring the other one down to fit.
    if d > 0 and p / d < min_ratio:
        d = max(decode_targets.min_replicas, decode_range(p, min_ratio, max_ratio)[1])
    if d > 0 and p / d > max_ratio:
        p = max(prefill_targets.min_replicas, prefill_range(d, min_ratio, max_ratio)[1])
    return p, d


def limit_scale_up(current: int, desired: int, percent: float = 100.0, pods: int = 4) -> int:
    """The HPA's scale-up policies: at most max(current × (1 + percent/100), current + pods) per sync.

    The defaults are the HPA's own (100 % or 4 pods per 15 s).
    """
    return min(desired, max(math.ceil(current * (1 + percent / 100.0) - 1e-9), current + pods))


@dataclass
class Stabilizer:
    """The HPA's stabilisation windows (`behavior.scaleUp/scaleDown.stabilizationWindowSeconds`).

    Scale-down goes only as low as the highest recommendation of the last `window_s` seconds;
    scale-up goes only as high as the lowest recommendation of the last `up_window_s` seconds
    (0: at once), so a burst shorter than a pod's start-up does not buy pods that arrive after it.
    """

    window_s: float = 300.0
    up_window_s: float = 0.0
    _recs: deque = field(default_factory=deque)

    def __call__(self, now_s: float, current: int, recommendation: int) -> int:
        self._recs.append((now_s, recommendation))
        horizon = max(self.window_s, self.up_window_s)
        while self._recs and self._recs[0][0] < now_s - horizon:
            self._recs.popleft()
        down = max(r for t, r in self._recs if t >= now_s - self.window_s)
        up = min(r for t, r in self._recs if t >= now_s - self.up_window_s)
        if current < up:
            return up
        if current > down:
            return down
        return current


@dataclass
class PairedPolicy:
    """The whole policy for one InferenceService: own-signal desires → stabilise → ratio band.

    Call `step(now_s, prefill_current, decode_current, prefill_signals, decode_signals)` once per
    sync period; it returns (prefill_replicas, decode_replicas).
    """

    prefill_targets: PoolTargets
    decode_targets: PoolTargets
    min_ratio: float = 0.5
    max_ratio: float = 4.0
    stabilization_window_s: float = 300.0
    scale_up_stabilization_s: float = 0.0
    scale_up_percent: float = 100.0
    scale_up_pods: int = 4
    _prefill_stab: Stabilizer = field(init=False)
    _decode_stab: Stabilizer = field(init=False)

    def __post_init__(self):
        ratio_bounds(1, 1, self.min_ratio, self.max_ratio)  # validates the band
        self._prefill_stab = Stabilizer(self.stabilization_window_s, self.scale_up_stabilization_s)
        self._decode_stab = Stabilizer(self.stabilization_window_s, self.scale_up_stabilization_s)

    def step(
        self, now_s: float, prefill_current: int, decode_current: int, prefill: PrefillSignals, decode: DecodeSignals
    ) -> tuple[int, int]:
        up = dict(percent=self.scale_up_percent, pods=self.scale_up_pods)
        p = limit_scale_up(prefill_current, prefill_desired(prefill_current, prefill, self.prefill_targets), **up)
        d = limit_scale_up(decode_current, decode_desired(decode_current, decode, self.decode_targets), **up)
        p = self._prefill_stab(now_s, prefill_current, p)
        d = self._decode_stab(now_s, decode_current, d)
        return paired_replicas(p, d, self.prefill_targets, self.decode_targets, self.min_ratio, self.max_ratio)
