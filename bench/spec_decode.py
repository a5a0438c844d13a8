"""Speculative decoding benchmark through the real serving path (issue #4's acceptance table).

For each workload in bench/workloads.py (free chat, code editing, agent traces) and each of its
prompts, one run prints side by side: decode tokens/s and acceptance of
  - pdserve plain decode (speculation disabled on the request),
  - pdserve speculative decode (n-gram drafter, adaptive k),
  - transformers assisted generation with prompt lookup (in-process, same greedy prompts),
plus the ratios. Decode tokens/s counts tokens after the first one over the time after it, so
prefill (the same work everywhere) is excluded. Greedy throughout, so all three generate the
same tokens (checked). One torch thread everywhere.

The three runs of one prompt follow each other (transformers in this process, while the idle
cluster waits), in an order that rotates from prompt to prompt: on a shared machine the load
drifts over minutes, and ratios are only meaningful between runs made in the same minutes.
``--repeat N`` runs everything N times and reports the median of each ratio. Two tables: wall
clock (what a user sees), and CPU seconds of the decoding process (the decode worker's, read
from /proc at the first and last token; the transformers thread's), which is what the work
costs whatever the neighbours on a shared machine are doing.

    python bench/spec_decode.py [--workloads code_edit agent_trace] [--limit 3] [--repeat 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.append(str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.sse import sse_events  # noqa: E402
from bench.workloads import get_workloads  # noqa: E402


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_request(url: str, model: str, messages, max_tokens: int, spec: bool, cpu_clock=None) -> dict:
    """One streamed chat completion; ``cpu_clock()`` (the decode worker's CPU seconds) is read
    at the first and the last content delta, as the wall clock is."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
            "speculation": {"enabled": spec}}
    t0 = time.perf_counter()
    first = last = None
    cpu_first = cpu_last = 0.0
    text, usage = [], {}
    for ev in sse_events(url, "/v1/chat/completions", body):
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            if ch["delta"].get("content"):
                now = time.perf_counter()
                cpu = cpu_clock() if cpu_clock else 0.0
                if first is None:
                    first, cpu_first = now, cpu
                last, cpu_last = now, cpu
                text.append(ch["delta"]["content"])
    n = usage.get("completion_tokens", 0)
    spec_u = usage.get("speculation", {})
    return {"tokens": n, "ttft_s": (first or t0) - t0, "decode_s": (last - first) if first else 0.0,
            "decode_cpu_s": cpu_last - cpu_first, "text": "".join(text), "draft": spec_u.get("draft_tokens", 0), "accepted": spec_u.get("accepted_tokens", 0)}


def hf_assisted(model, tok, messages, max_tokens: int, lookup: int) -> dict:
    ids = torch.tensor([tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                   add_special_tokens=False)])
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.thread_time()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=tok.eos_token_id)
        t1, c1 = time.perf_counter(), time.thread_time()
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id,
                             prompt_lookup_num_tokens=lookup)
        t2, c2 = time.perf_counter(), time.thread_time()
    gen = out[0, ids.shape[1]:]
    text = tok.decode(gen, skip_special_tokens=True)
    return {"tokens": len(gen), "ttft_s": t1 - t0, "decode_s": max(1e-9, (t2 - t1) - (t1 - t0)),
            "decode_cpu_s": max(1e-9, (c2 - c1) - (c1 - c0)), "text": text}


def rate(r: dict, clock: str = "decode_s") -> float:
    return (r["tokens"] - 1) / r[clock] if r["tokens"] > 1 and r[clock] > 0 else float("nan")


def table(results: list[dict], workloads, a, name: str, clock: str) -> list[dict]:
    """Print the acceptance table for one clock: "decode_s" (wall) or "decode_cpu_s" (CPU seconds
    of the decode worker process / of the transformers thread: what the work costs, whatever
    the neighbours on a shared machine do)."""
    what = "wall clock" if clock == "decode_s" else "CPU seconds of the decoding process"
    print(f"\nspeculative decoding, {name}, greedy, n-gram drafter (max k {a.max_k}) vs transformers prompt lookup "
          f"({a.lookup}); decode tokens/s (after the first token), one torch thread, {a.dtype}; " + what
          + (f"; medians of {a.repeat} repeats" if a.repeat > 1 else ""))
    hdr = (f"{'workload':<12} {'prompts':>7} {'tokens':>7} | {'plain':>7} {'spec':>7} {'HF-PL':>7} | "
           f"{'spec/plain':>10} {'spec/HF':>8} | {'accept':>6} {'same':>5}")
    print(hdr + "\n" + "-" * len(hdr))
    summary = []
    for w in workloads:
        per_repeat = []
        for rep in range(a.repeat):
            rows = [r for r in results if r["workload"] == w.name and r["repeat"] == rep]

            def agg(key):  # total tokens over total decode time: long answers weigh more, as in serving
                return sum(r[key]["tokens"] - 1 for r in rows) / sum(r[key][clock] for r in rows)

            plain_r, spec_r, hf_r = agg("plain"), agg("spec"), agg("hf_assisted")
            drafted = sum(r["spec"]["draft"] for r in rows)
            per_repeat.append({"plain_tok_s": plain_r, "spec_tok_s": spec_r, "hf_prompt_lookup_tok_s": hf_r,
                               "spec_over_plain": spec_r / plain_r, "spec_over_hf": spec_r / hf_r,
                               "acceptance": sum(r["spec"]["accepted"] for r in rows) / drafted if drafted else 0.0,
                               "spec_equals_plain": all(r["spec"]["text"] == r["plain"]["text"] for r in rows),
                               "tokens": sum(r["spec"]["tokens"] for r in rows), "prompts": len(rows)})
        s = {key: statistics.median(r[key] for r in per_repeat)
             for key in ("plain_tok_s", "spec_tok_s", "hf_prompt_lookup_tok_s", "spec_over_plain", "spec_over_hf",
                         "acceptance")}
        s.update({"workload": w.name, "prompts": per_repeat[0]["prompts"], "tokens": per_repeat[0]["tokens"],
                  "spec_equals_plain": all(r["spec_equals_plain"] for r in per_repeat),
                  "target_spec_over_plain": w.target_speedup, "repeats": per_repeat})
        summary.append(s)
        print(f"{w.name:<12} {s['prompts']:>7} {s['tokens']:>7} | {s['plain_tok_s']:>7.2f} {s['spec_tok_s']:>7.2f} "
              f"{s['hf_prompt_lookup_tok_s']:>7.2f} | {s['spec_over_plain']:>9.2f}x {s['spec_over_hf']:>7.2f}x | "
              f"{s['acceptance']:>6.2f} {str(s['spec_equals_plain']):>5}")
        if a.repeat > 1:
            sp = ", ".join(f"{r['spec_over_plain']:.2f}" for r in per_repeat)
            sh = ", ".join(f"{r['spec_over_hf']:.2f}" for r in per_repeat)
            print(f"{'':<12} spec/plain per repeat: {sp}; spec/HF: {sh}")
    return summary


def calibration_note(model_dir, max_k: int, dtype: torch.dtype) -> str:
    """What the decode worker's calibration chose on this machine (the same cached profile it loads at
    start, measured here first if there is none yet): step cost and weight layout per row count."""
    from pdserve.engine.calibrate import calibrated
    from pdserve.engine.runner import PagedRunner

    engine = PagedRunner(model_dir, dtype=dtype, num_blocks=64, prefix_cache=False)
    prof = calibrated(engine, max_k=max_k)
    del engine
    return "calibration: " + prof.summary()


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.local import LocalCluster
    from pdserve.modelstore import resolve_model

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--workloads", nargs="*", default=None)
    p.add_argument("--limit", type=int, default=None, help="prompts per workload")
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--lookup", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    p.add_argument("--repeat", type=int, default=1, help="run everything N times; report median ratios")
    p.add_argument("--json", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="of pdserve's workers and transformers' model alike (the workers' own default, auto, "
                        "is bfloat16 on a CPU with native bf16)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="decode without the step-cost calibration (the fixed layout ranges and the linear cost fit)")
    a = p.parse_args()
    torch.set_num_threads(1)
    model_dir = resolve_model(a.model)
    name = model_dir.name
    workloads = get_workloads(a.workloads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype = getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if not a.no_calibrate:
        print(calibration_note(model_dir, a.max_k, dtype), flush=True)
    results = []
    decode_args = ["--spec-method", "ngram", "--spec-max-k", str(a.max_k),
                   *(["--no-spec-calibrate"] if a.no_calibrate else [])]
    with LocalCluster(str(model_dir), worker_args={"decode": decode_args}, env={"PDSERVE_DTYPE": a.dtype}) as c:
        decode_pid = c.procs["decode-0"].pid
        cpu = lambda: process_cpu_seconds(decode_pid)  # noqa: E731
        runners = {
            "plain": lambda wp: stream_request(c.url, name, wp.messages, wp.max_new_tokens, spec=False, cpu_clock=cpu),
            "spec": lambda wp: stream_request(c.url, name, wp.messages, wp.max_new_tokens, spec=True, cpu_clock=cpu),
            "hf_assisted": lambda wp: hf_assisted(model, tok, wp.messages, wp.max_new_tokens, a.lookup),
        }
        order = list(runners)
        # first-request costs (connections, allocator, the HF generate path) are not decode speed
        warm = workloads[0].prompts[0]
        for key in order:
            runners[key](type(warm)(warm.name, warm.messages, 4))
        for rep in range(a.repeat):
            i = 0
            for w in workloads:
                for wp in w.prompts[: a.limit]:
                    row = {"repeat": rep, "workload": w.name, "prompt": wp.name}
                    for key in order[i % 3:] + order[: i % 3]:  # rotate which runs first
                        row[key] = runners[key](wp)
                    i += 1
                    results.append(row)
                    print(f"  [{rep + 1}/{a.repeat}] {w.name}/{wp.name}: plain {rate(row['plain']):.2f} tok/s, "
                          f"spec {rate(row['spec']):.2f} tok/s, HF-PL {rate(row['hf_assisted']):.2f} tok/s "
                          f"(per CPU second: {rate(row['plain'], 'decode_cpu_s'):.2f}, "
                          f"{rate(row['spec'], 'decode_cpu_s'):.2f}, {rate(row['hf_assisted'], 'decode_cpu_s'):.2f})",
                          flush=True)

    summary = {clock: table(results, workloads, a, name, clock) for clock in ("decode_s", "decode_cpu_s")}
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary["decode_s"], "summary_cpu": summary["decode_cpu_s"],
                                            "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
