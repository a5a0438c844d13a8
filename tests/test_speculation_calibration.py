"""Speculation tuned by measurement: the step-cost profile, the layout plan it sets, and k chosen from it.

The controller tests fake cost profiles unlike this machine's (verification nearly free; every row
as dear as a whole step; a CPU where 2-3 rows cost more than 5) and check the k it picks against
an argmax of expected tokens per second computed here, independently of the controller's code.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.decode.speculation import LatencyModel, SpeculationController
from pdserve.engine.calibrate import StepProfile, calibrated, measure

MAX_K = 8


def brute_force_k(alpha: float, cost, max_k: int, min_gain: float) -> int:
    """argmax_k E[tokens] / cost(k + 1) by direct summation; 0 unless it beats plain by min_gain."""
    plain = 1.0 / cost(1)
    best_k, best = 0, plain * min_gain
    for k in range(1, max_k + 1):
        tokens = sum(alpha**i for i in range(k + 1))  # accepted drafts (geometric) + the target's token
        r = tokens / cost(k + 1)
        if r > best * (1 + 1e-9):
            best_k, best = k, r
    return best_k


def controller_for(cost) -> SpeculationController:
    # a drafter that costs nothing, so the choice is the verification profile's alone
    return SpeculationController(latency=LatencyModel(step_costs=cost, draft_priors={"ngram": (0.0, 0.0)}))


# measured on an AMD EPYC (AVX-512; /work/shared/MEASUREMENTS.md): 2-3 rows dearer than 5
EPYC = {1: 0.0525, 2: 0.1244, 3: 0.1554, 4: 0.0505, 5: 0.0500, 6: 0.0560, 7: 0.0590, 8: 0.0620, 9: 0.0662}
PROFILES = {
    "verification nearly free": lambda rows: 0.040 + 1e-5 * rows,
    "every row a whole step": lambda rows: 0.040 * rows,
    "EPYC, 2-3 rows dear": EPYC.__getitem__,
    "steep then flat": lambda rows: 0.05 if rows == 1 else 0.09 + 0.001 * rows,
}


@pytest.mark.parametrize("name", list(PROFILES))
@pytest.mark.parametrize("alpha", [0.2, 0.45, 0.6, 0.75, 0.9])
def test_controller_picks_the_k_that_maximises_tokens_per_second(name, alpha):
    cost = PROFILES[name]
    ctl = controller_for(cost)
    want = brute_force_k(alpha, cost, MAX_K, ctl.min_gain)
    assert ctl.best_k(alpha, batch_size=1, max_k=MAX_K) == want


def test_profiles_lead_to_different_choices():
    """The profile decides: at one acceptance the same controller speculates fully, not at all, or skips
    the dear small sizes, depending only on the measured costs."""
    alpha = 0.6
    picks = {name: controller_for(cost).best_k(alpha, 1, MAX_K) for name, cost in PROFILES.items()}
    assert picks["verification nearly free"] == MAX_K
    assert picks["every row a whole step"] == 0
    assert picks["EPYC, 2-3 rows dear"] >= 3  # 1-2 draft tokens (2-3 rows) cost more than 3+ here


def test_observed_steps_rescale_the_measured_shape():
    """Steps observed at twice the profile's cost (a loaded machine, a longer context) scale every
    prediction by ~2 and keep the shape."""
    lat = LatencyModel(step_costs=EPYC.__getitem__)
    for _ in range(400):
        for rows in (1, 5, 9):
            lat.observe_verify(1, rows, 2.0 * EPYC[rows])
    for k in range(MAX_K + 1):
        assert lat.verify_seconds(1, k) / EPYC[k + 1] == pytest.approx(2.0, rel=0.05)


def test_profile_interpolates_extrapolates_and_plans():
    p = StepProfile(key="k", device="test", context_tokens=8, seconds={1: 0.01, 2: 0.03, 4: 0.05, 8: 0.07},
                    layouts={1: "t", 2: "rows", 4: "packed", 8: "t"})
    assert p.cost(3) == pytest.approx(0.04)
    assert p.cost(12) == pytest.approx(0.07 + 0.005 * 4)  # the last segment's slope per row
    assert p.cost(0) == pytest.approx(0.01)
    # unmeasured sizes take the next larger measured size's layout; index = rows
    assert p.plan() == ("t", "t", "rows", "packed", "packed", "t", "t", "t", "t")
    again = StepProfile.from_json(p.to_json())
    assert again == p


@pytest.fixture(scope="module")
def runner(model_dir):
    from pdserve.engine.runner import PagedRunner

    return PagedRunner(model_dir, num_blocks=32, prefix_cache=False)


def test_calibration_on_the_real_model_sets_the_measured_plan(runner, tmp_path):
    rows = [1, 2, 5]
    prof = measure(runner, rows, context_tokens=32, repeats=1)
    layouts = runner.model.step_layouts()
    assert set(prof.by_layout) == set(layouts)
    for r in rows:
        assert prof.seconds[r] == min(prof.by_layout[n][r] for n in layouts)
        if len(layouts) > 1:
            assert prof.by_layout[prof.layouts[r]][r] == prof.seconds[r]
            assert runner.model.step_plan[r] == prof.layouts[r]
    assert "__pdserve_calibration__" not in runner  # the measuring sequence is gone


def test_every_layout_computes_the_same_step(runner):
    """A plan only changes speed: logits of a 5-row step agree across layouts (relative to their scale)."""
    layouts = runner.model.step_layouts()
    prompt = list(range(100, 140))
    outs = {}
    for name in layouts:
        runner.model.set_step_plan((name,) * 8)
        runner.prefill("s", prompt)
        (logits,) = runner.step([("s", [5, 6, 7, 8, 9])])
        runner.free("s")
        outs[name] = logits
    ref = outs["t"]
    for name, out in outs.items():
        assert (out - ref).abs().max() <= 1e-4 * ref.abs().max(), name
        assert torch.equal(out.argmax(-1), ref.argmax(-1)), name
    with pytest.raises(ValueError, match="unknown weight layout"):
        runner.model.set_step_plan(("t", "fast"))


def test_calibrated_caches_by_key(runner, tmp_path, monkeypatch):
    import pdserve.engine.calibrate as cal

    calls = []
    real = cal.measure

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(cal, "measure", counting)
    first = calibrated(runner, max_k=1, cache=tmp_path, context_tokens=16, repeats=1)
    runner.model.set_step_plan(("t",) * 4)
    second = calibrated(runner, max_k=1, cache=tmp_path, context_tokens=16, repeats=1)
    assert len(calls) == 1  # the second came from the cache
    assert second == first
    if first.layouts:
        assert runner.model.step_plan == first.plan()  # ... and set the cached plan again
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_layouts_the_plan_never_uses_are_released(model_dir):
    from pdserve.engine.runner import PagedRunner

    r = PagedRunner(model_dir, num_blocks=16, prefix_cache=False)
    if r.model.step_layouts() == ("t",):
        pytest.skip("this CPU's torch keeps no extra layouts")
    r.model.set_step_plan(("t", "t", "rows", "rows"))
    r.model.release_unplanned_layouts()
    assert r.model.step_layouts() == ("t", "rows")
    r.prefill("s", list(range(100, 120)))
    (logits,) = r.step([("s", [1, 2, 3, 4, 5, 6])])  # past the plan: x @ W_t
    assert logits.shape[0] == 6 and torch.isfinite(logits).all()
