"""The paired scaling policy (pure functions) and the trace-driven simulation built on it."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from pdserve.autoscale.policy import (
    DecodeSignals,
    PairedPolicy,
    PoolTargets,
    PrefillSignals,
    Stabilizer,
    decode_desired,
    hpa_ratio_replicas,
    limit_scale_up,
    paired_replicas,
    prefill_desired,
    ratio_bounds,
)

PREFILL = PoolTargets(1, 20, inflight_per_replica=0.5, ttft_seconds=1.0)
DECODE = PoolTargets(1, 20, kv_utilization=0.8, running_per_replica=160, waiting_per_replica=4)
IDLE_P = PrefillSignals(inflight_prompts=0, ttft_seconds=0.2)
IDLE_D = DecodeSignals(kv_utilization=0.1, running_sequences=10, waiting_sequences=0)


def test_hpa_formula_and_tolerance():
    assert hpa_ratio_replicas(4, 1.0, 0.5) == 8
    assert hpa_ratio_replicas(4, 0.52, 0.5) == 4  # inside the 10 % tolerance: no change
    assert hpa_ratio_replicas(4, 0.1, 0.5) == 1
    assert hpa_ratio_replicas(3, 0.75, 0.5) == 5  # ceil(4.5)
    with pytest.raises(ValueError):
        hpa_ratio_replicas(1, 1.0, 0.0)


def test_each_pool_scales_on_its_own_signal():
    # A decode bottleneck (KV full, sequences waiting) moves decode and leaves prefill alone...
    hot_d = DecodeSignals(kv_utilization=0.98, running_sequences=4 * 150, waiting_sequences=200)
    assert decode_desired(4, hot_d, DECODE) > 4
    assert prefill_desired(4, IDLE_P, PREFILL) <= 4
    # ...and a prefill backlog moves prefill and leaves decode alone.
    hot_p = PrefillSignals(inflight_prompts=40, ttft_seconds=3.0)
    assert prefill_desired(4, hot_p, PREFILL) > 4
    assert decode_desired(4, IDLE_D, DECODE) < 4
    # Each metric on its own drives its pool (the max over metrics).
    assert prefill_desired(2, PrefillSignals(0, 4.0), PREFILL) == 8  # TTFT 4x its target
    assert prefill_desired(2, PrefillSignals(10, 0.0), PREFILL) == 20  # 5 per replica vs 0.5
    assert decode_desired(2, DecodeSignals(0.0, 0, 40), DECODE) == 10  # 20 waiting per replica vs 4
    assert decode_desired(2, DecodeSignals(0.8 * 2, 0, 0), DECODE) == 4  # KV at 2x its target


def test_ratio_bounds_raise_the_lagging_pool():
    assert ratio_bounds(8, 2, 2.0, 4.0) == (4, 2)
    assert ratio_bounds(20, 2, 2.0, 4.0) == (4, 5)  # decode floor ceil(20/4)
    assert ratio_bounds(2, 6, 2.0, 4.0) == (12, 1)  # prefill floor 2*6; decode floor ceil(2/4)
    with pytest.raises(ValueError):
        ratio_bounds(1, 1, 3.0, 2.0)


@pytest.mark.parametrize("p,d", [(1, 1), (20, 1), (1, 12), (7, 3), (30, 30), (0, 9), (13, 2)])
def test_paired_replicas_keep_ratio_and_bounds(p, d):
    P, D = PoolTargets(1, 16, inflight_per_replica=1), PoolTargets(1, 6, kv_utilization=0.8)
    pp, dd = paired_replicas(p, d, P, D, 2.0, 4.0)
    assert 1 <= pp <= 16 and 1 <= dd <= 6
    assert 2.0 <= pp / dd <= 4.0
    # Never cut a pool below what it asked for, unless its own maximum (or the other's) forces it.
    if p <= 16 and d <= 6 and 2 * d <= 16 and p / 4 <= 6:
        assert pp >= min(max(p, 1), 16) and dd >= max(d, 1)


def test_stabilisation_delays_scale_down_not_scale_up():
    st = Stabilizer(window_s=60, up_window_s=0)
    assert st(0, 4, 10) == 10  # up at once
    assert st(15, 10, 3) == 10  # down held: 10 is still in the window
    assert st(45, 10, 3) == 10
    assert st(61, 10, 3) == 3  # the 10 of t=0 has left the 60 s window
    # Scale-up stabilisation: a one-sync spike does not scale up; a sustained need does.
    st = Stabilizer(window_s=60, up_window_s=15)
    assert st(0, 4, 4) == 4
    assert st(15, 4, 12) == 4
    assert st(30, 4, 12) == 12


def test_limit_scale_up():
    assert limit_scale_up(2, 100) == 6  # max(2x, +4)
    assert limit_scale_up(10, 100) == 20
    assert limit_scale_up(10, 100, percent=50, pods=2) == 15
    assert limit_scale_up(10, 3) == 3


def test_paired_policy_holds_ratio_while_decode_is_the_bottleneck():
    pol = PairedPolicy(PREFILL, DECODE, min_ratio=2.0, max_ratio=4.0, stabilization_window_s=60)
    hot_d = DecodeSignals(kv_utilization=0.99, running_sequences=2 * 150, waiting_sequences=100)
    p, d = pol.step(0, 4, 2, IDLE_P, hot_d)
    assert d > 2  # decode scaled on its own signal
    assert p >= 2 * d  # prefill raised by the ratio band, not by decode's metric
    assert prefill_desired(4, IDLE_P, PREFILL) < p
    # Load gone: held for the window, then down, still in the band.
    for t in (15, 30, 45):
        assert pol.step(t, p, d, IDLE_P, IDLE_D) == (p, d)
    p2, d2 = pol.step(120, p, d, IDLE_P, IDLE_D)
    assert (p2, d2) != (p, d) and 2.0 <= p2 / d2 <= 4.0


# ---------------------------------------------------------------------------------------------
# The simulation (bench/autoscale_sim.py), on its default trace: 2 simulated hours, ~130k requests.


def _load_sim():
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "autoscale_sim.py"
    spec = importlib.util.spec_from_file_location("autoscale_sim", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sim():
    return _load_sim()


@pytest.fixture(scope="module")
def sim_report(sim):
    return sim.run_all(sim.SimConfig())


def test_trace_is_deterministic_and_bursty(sim):
    cfg = sim.SimConfig(duration_s=1200)
    a, b = sim.make_trace(cfg), sim.make_trace(cfg)
    assert (a.arrival_s == b.arrival_s).all() and (a.prompt_tokens == b.prompt_tokens).all()
    c = sim.make_trace(sim.SimConfig(duration_s=1200, seed=1))
    assert c.arrival_s.size != a.arrival_s.size or (c.arrival_s != a.arrival_s).any()


@pytest.mark.slow  # the whole simulation, three policies over the trace
def test_simulation_paired_beats_static_and_utilisation(sim, sim_report):
    res = {r["policy"].split()[0]: r for r in sim_report["results"]}
    ours, static, util = res["paired"], res["static"], res["util-hpa"]
    target = sim_report["config"]["slo_target"]
    assert static["slo_ok"] >= target  # the search found an allocation that meets the SLO...
    p, d = static["static"]
    smaller = sim.simulate(sim.SimConfig(), sim.make_trace(sim.SimConfig()), sim.StaticController(p - 1, d), "")
    assert smaller["slo_ok"] < target  # ...and it is the smallest in prefill
    assert ours["slo_ok"] >= target
    assert ours["gpu_hours"] < static["gpu_hours"]
    assert util["slo_ok"] < ours["slo_ok"] and util["slo_ok"] < target
    # It scaled both ways, and the table shows all three.
    assert ours["prefill_replicas"][1] > ours["prefill_replicas"][0]
    assert ours["decode_replicas"][1] > ours["decode_replicas"][0]
    table = sim.format_table(sim_report)
    assert all(name in table for name in ("paired", "static", "util-hpa"))
