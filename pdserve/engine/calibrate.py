"""Step-cost calibration: what one engine step of N rows costs on this machine, and which weight layout is fastest.

Speculative verification feeds k + 1 rows per sequence, and what that costs relative to a one-row
step depends on the processor (oneDNN's packed weights make a 5-row step as cheap as a 1-row one on
some CPUs and not on others; a GPU is flat over these sizes). So instead of fixed row-count ranges,
the engine measures at first use: for each row count and each weight layout the model holds, one
step of that many rows for a sequence of `context_tokens` tokens, then a rollback, best of
`repeats` by the step's own clock (`step_clock`: thread CPU time on a one-thread CPU) (rounds interleave the layouts and sizes so drift on a shared machine hits all alike).
The fastest layout per row count becomes the model's step plan, and the per-row-count costs feed the
speculation latency model (`pdserve.decode.speculation.LatencyModel(step_costs=...)`).

The result is cached as JSON under `cache_dir()/calibration`, keyed by model fingerprint, device
(CPU model name or GPU name), dtype, torch version and threads; a cached profile is used without
measuring again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("pdserve.engine.calibrate")

PROFILE_VERSION = 1
CALIBRATION_SEQ = "__pdserve_calibration__"


@dataclass
class StepProfile:
    """Measured cost of one engine step by row count (seconds; one sequence of `context_tokens` tokens).

    `seconds[rows]`: the step with the fastest layout; `layouts[rows]`: that layout (`model.LAYOUTS`);
    `by_layout[layout][rows]`: every measurement, for the record. Row counts between or past the
    measured ones are interpolated / extrapolated linearly (`cost`).
    """

    key: str
    device: str
    context_tokens: int
    seconds: dict[int, float]
    layouts: dict[int, str] = field(default_factory=dict)
    by_layout: dict[str, dict[int, float]] = field(default_factory=dict)
    measured_s: float = 0.0  # how long the calibration took

    def cost(self, rows: int) -> float:
        """Seconds of a step of `rows` rows (≥ 1), from the measured points."""
        pts = sorted(self.seconds.items())
        if not pts:
            raise ValueError("an empty step profile")
        rows = max(int(rows), pts[0][0])
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if r0 <= rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        if len(pts) == 1:
            return pts[0][1] * rows / pts[0][0]
        (r0, s0), (r1, s1) = pts[-2], pts[-1]
        return max(s1 + max(s1 - s0, 0.0) / (r1 - r0) * (rows - r1), s1)

    def plan(self) -> tuple[str, ...]:
        """The layout per row count (index = rows) for `HFPagedModel.set_step_plan`: measured sizes take their
        winner; a size between two measured ones takes the next larger's (past the last, `CpuLinear` takes the
        last's)."""
        if not self.layouts:
            return ()
        top = max(self.layouts)
        out = []
        for rows in range(top + 1):
            nxt = min((r for r in self.layouts if r >= rows), default=top)
            out.append(self.layouts[nxt])
        return tuple(out)

    def summary(self) -> str:
        """One line per measured size: rows, cost, ratio to one row, chosen layout (what benchmarks print)."""
        one = self.seconds.get(1) or next(iter(self.seconds.values()))
        parts = [f"{r} rows {s * 1e3:.1f} ms ({s / one:.2f}x, {self.layouts.get(r, '-')})"
                 for r, s in sorted(self.seconds.items())]
        return f"step cost on {self.device} at {self.context_tokens} tokens of context: " + "; ".join(parts)

    def to_json(self) -> str:
        return json.dumps({"version": PROFILE_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "StepProfile":
        d = json.loads(text)
        if d.pop("version", None) != PROFILE_VERSION:
            raise ValueError("step profile of another version")
        d["seconds"] = {int(k): float(v) for k, v in d["seconds"].items()}
        d["layouts"] = {int(k): v for k, v in d.get("layouts", {}).items()}
        d["by_layout"] = {name: {int(k): float(v) for k, v in m.items()} for name, m in d.get("by_layout", {}).items()}
        return cls(**d)


def device_name(device: torch.device | str) -> str:
    """What the cost depends on: the GPU's name, or the CPU's model name and architecture."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def engine_device(engine) -> torch.device:
    """The device an engine computes on (`PagedRunner.device`, or its `ModelRunner`'s)."""
    return torch.device(engine.device)


def profile_key(fingerprint: str, device: torch.device | str, dtype: str, row_counts: list[int],
                layouts: tuple[str, ...]) -> str:
    """The cache key of a profile: everything its numbers depend on."""
    parts = [fingerprint, device_name(device), str(dtype), torch.__version__, f"threads={torch.get_num_threads()}",
             "rows=" + ",".join(map(str, row_counts)), "layouts=" + ",".join(layouts)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


BATCH_ROWS = (1, 2, 4, 8, 16, 32)  # batched decode steps (one row per sequence), measured whatever max_k is


def default_row_counts(max_k: int) -> list[int]:
    """Rows a decode worker with speculation up to `max_k` steps with: 1..max_k+1 (one sequence verifying),
    twice that (two verifying), and `BATCH_ROWS` (plain batched steps), so the plan covers the sizes a worker
    runs and batched steps extrapolate from measured points."""
    top = max(int(max_k), 0) + 1
    return sorted(set(range(1, top + 1)) | {2 * top} | set(BATCH_ROWS))


def step_clock(device: torch.device):
    """The clock a step is timed with: on a CPU computing with one thread, that thread's CPU time (what the
    step costs, whatever neighbours on a shared machine do); otherwise wall time, the device synchronised."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    if device.type == "cuda":
        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return clock
    return time.perf_counter


def measure(engine, row_counts: list[int], *, context_tokens: int = 128, repeats: int = 2) -> StepProfile:
    """Measure `engine.step` of each row count (and each weight layout its model holds); see the module doc.

    `engine`: a `pdserve.engine.Engine` (a `PagedRunner` offers its model's layouts through `step_layouts()`;
    any other engine is measured as it is). Leaves the engine as it found it, the step plan set to the
    measured winners. Raises OutOfBlocks if the engine cannot hold one sequence of the context plus
    the largest row count.
    """
    layouts = engine.step_layouts()
    vocab = engine.vocab_size
    # a deterministic, non-repeating prompt: token ids spread over the vocabulary
    prompt = [(7919 * i + 13) % vocab for i in range(context_tokens)]
    clock = step_clock(engine_device(engine))
    t0 = time.perf_counter()
    best: dict[str, dict[int, float]] = {name: {} for name in layouts}
    engine.prefill(CALIBRATION_SEQ, prompt)
    try:
        base = engine.num_tokens(CALIBRATION_SEQ)
        for _ in range(max(repeats, 1)):  # the minimum discounts the first round's warm-up (allocator, oneDNN)
            for name in layouts:
                if len(layouts) > 1:
                    engine.set_step_plan((name,) * (max(row_counts) + 1))
                for rows in row_counts:
                    ids = prompt[-rows:] if rows <= len(prompt) else (prompt * (rows // len(prompt) + 1))[:rows]
                    s = clock()
                    engine.step([(CALIBRATION_SEQ, ids)])
                    dt = clock() - s
                    engine.rollback(CALIBRATION_SEQ, base)
                    best[name][rows] = min(best[name].get(rows, float("inf")), dt)
    finally:
        engine.free(CALIBRATION_SEQ)
    seconds, chosen = {}, {}
    for rows in row_counts:
        name = min(layouts, key=lambda n: best[n][rows])
        seconds[rows], chosen[rows] = best[name][rows], name
    prof = StepProfile(key="", device=device_name(engine_device(engine)), context_tokens=context_tokens,
                       seconds=seconds, layouts=chosen if len(layouts) > 1 else {}, by_layout=best,
                       measured_s=time.perf_counter() - t0)
    if len(layouts) > 1:
        engine.set_step_plan(prof.plan())
    return prof


def calibrated(engine, *, max_k: int, cache: Path | None = None, context_tokens: int = 128,
               repeats: int = 2) -> StepProfile:
    """The engine's step profile for speculation up to `max_k`: from the cache if measured before on this
    model, device, dtype and torch build, else measured now (`measure`) and cached. The engine's step plan
    is set to the profile's in both cases."""
    from pdserve.modelstore import cache_dir

    layouts = engine.step_layouts()
    rows = default_row_counts(max_k)
    device = engine_device(engine)
    key = profile_key(engine.layout.model_fingerprint, device, engine.layout.dtype, rows, layouts)
    path = (cache or cache_dir() / "calibration") / f"{key}.json"
    try:
        prof = StepProfile.from_json(path.read_text())
        if prof.key == key:
            if prof.layouts:
                engine.set_step_plan(prof.plan())
            return prof
    except (OSError, ValueError, KeyError, TypeError) as e:
        if path.exists():
            log.warning("step profile %s unreadable (%s); measuring again", path, e)
    log.info("calibrating the step cost on %s (rows %s, layouts %s)", device_name(device),
             rows, ", ".join(layouts))
    prof = measure(engine, rows, context_tokens=context_tokens, repeats=repeats)
    prof.key = key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(prof.to_json())
    tmp.replace(path)
    log.info("%s (measured in %.1f s)", prof.summary(), prof.measured_s)
    return prof
