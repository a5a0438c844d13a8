"""`pdserve bench`: the disaggregated path vs in-process `transformers` generate, side by side in one run.

For each prompt: TTFT and decode tokens/s of both, and the KV handoff: its bytes, and what it adds
to the critical path. Prefill streams the first token itself while the KV travels (layer by layer),
so the handoff delays the SECOND token: its cost is the gap between the first two tokens minus one
steady inter-token interval, reported as a share of TTFT. Decode tokens/s is the steady rate after
the second token (HF's: n - 1 tokens over generate's time after its first).

Every repeat sends a different prompt (one token changed near the start, the same variants for
`generate`), so no repeat hits the prefix cache, and the front sends no pre-positioning hints: on
these 2-core machines a hint computed in the background shares memory bandwidth with the decode
being timed. Torch runs one thread everywhere (workers and the baseline): on these 2-core machines
two threads made small matmuls slower under load.

`--inprocess` leaves the serving path out: batch-1 decode of `PagedRunner.step` against `generate`
in one process, the two interleaved repeat by repeat so both see the same neighbours, timed in CPU
seconds of this thread (what the work cost) and wall seconds.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import urllib.request
from pathlib import Path

import torch

MODEL_PROMPTS = {
    "chat-40": [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
    "doc-300": None,  # filled from the long prompt's head
    "doc-1000": None,
}


def _prompts(tok) -> dict[str, list[int]]:
    long_text = (Path(__file__).resolve().parents[1] / "tests" / "data" / "long_prompt.txt").read_text()
    long_ids = tok.encode(long_text, add_special_tokens=False)
    tail = tok.encode("\n\nSummarise the text above in one sentence:", add_special_tokens=False)
    chat = tok.encode(tok.apply_chat_template(MODEL_PROMPTS["chat-40"], add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)
    return {"chat-40": chat, "doc-300": long_ids[:300 - len(tail)] + tail, "doc-1000": long_ids[:1000 - len(tail)] + tail}


def _variants(ids: list[int], repeats: int, vocab_size: int) -> list[list[int]]:
    """`repeats` versions of a prompt that differ from each other in their second token (so from its first block on)."""
    return [ids[:1] + [(ids[1] + 7 * r) % vocab_size] + ids[2:] for r in range(repeats)]


def _hf(model, variants: list[list[int]], n: int) -> dict:
    t1, tn = [], []
    with torch.inference_mode():
        for ids in variants:
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, do_sample=False, pad_token_id=0)
            t1.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            tn.append(time.perf_counter() - t0)
    ttft, total = statistics.median(t1), statistics.median(tn)
    return {"ttft_s": ttft, "decode_tok_s": (n - 1) / max(1e-9, total - ttft)}


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _pdserve(url: str, model: str, variants: list[list[int]], n: int) -> dict:
    ttfts, rates, stalls, kv_b = [], [], [], []
    for ids in variants:
        b0 = _metric(url, "pdserve_kv_transfer_moved_bytes_total")
        body = json.dumps({"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                           "stream": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        stamps = []
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                if raw.startswith(b"data: {") and b'"finish_reason": null' in raw:
                    stamps.append(time.perf_counter())
        gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
        ttfts.append(stamps[0] - t0)
        rates.append(len(gaps) / (stamps[-1] - stamps[1]))
        stalls.append(max(0.0, stamps[1] - stamps[0] - statistics.median(gaps)))
        kv_b.append(_metric(url, "pdserve_kv_transfer_moved_bytes_total") - b0)
    return {"ttft_s": statistics.median(ttfts), "decode_tok_s": statistics.median(rates),
            "kv_bytes": statistics.median(kv_b), "handoff_stall_s": statistics.median(stalls)}


class _Clock:
    """CPU seconds of this thread and wall seconds of a block."""

    def __enter__(self):
        self.cpu0, self.wall0 = time.thread_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.cpu, self.wall = time.thread_time() - self.cpu0, time.perf_counter() - self.wall0


def _inprocess(model_dir: Path, prompts: dict[str, list[int]], n: int, repeats: int) -> list[dict]:
    """Per prompt: batch-1 decode tokens/s of `PagedRunner.step` and of `generate` (median of `repeats`).

    `generate` runs with no stop token (exactly n new tokens, greedy), so both sides do the same work
    and their tokens must agree; its decode time is that of n tokens minus that of 1 (the prefill).
    """
    from transformers import AutoModelForCausalLM

    from pdserve.engine.runner import PagedRunner
    from pdserve.basetypes import DEFAULT_BLOCK_SIZE

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    configs = {}
    for k in (1, n):
        configs[k] = copy.deepcopy(model.generation_config)
        configs[k].update(eos_token_id=[], do_sample=False, pad_token_id=0, max_new_tokens=k, min_new_tokens=k)
    longest = max(len(ids) for ids in prompts.values())
    runner = PagedRunner(model_dir, num_blocks=-(-(longest + n) // DEFAULT_BLOCK_SIZE) + 8)
    rows = []
    for name, ids in prompts.items():
        x, mask = torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)
        hf_cpu, hf_wall, pd_cpu, pd_wall, same = [], [], [], [], True
        for r in range(repeats):
            with torch.inference_mode():
                with _Clock() as one:
                    model.generate(x, attention_mask=mask, generation_config=configs[1])
                with _Clock() as all_:
                    hf_tokens = model.generate(x, attention_mask=mask, generation_config=configs[n])[0, len(ids):].tolist()
            hf_cpu.append(all_.cpu - one.cpu)
            hf_wall.append(all_.wall - one.wall)
            sid = ("bench", name, r)
            tokens = [int(runner.prefill(sid, ids, reuse_prefix=False).argmax())]
            with _Clock() as dec:
                for _ in range(n - 1):
                    (logits,) = runner.step([(sid, [tokens[-1]])])
                    tokens.append(int(logits[-1].argmax()))
            runner.free(sid)
            pd_cpu.append(dec.cpu)
            pd_wall.append(dec.wall)
            same = same and tokens == hf_tokens
            print(f"  {name} repeat {r + 1}/{repeats}: HF {(n - 1) / hf_cpu[-1]:.2f}, paged {(n - 1) / dec.cpu:.2f} "
                  f"decode tok/s (CPU time)", flush=True)
        rate = {key: (n - 1) / statistics.median(v)
                for key, v in (("hf_cpu", hf_cpu), ("hf_wall", hf_wall), ("pd_cpu", pd_cpu), ("pd_wall", pd_wall))}
        rows.append({"prompt": name, "prompt_tokens": len(ids), "decode_tok_s": rate,
                     "ratio_cpu": rate["pd_cpu"] / rate["hf_cpu"], "ratio_wall": rate["pd_wall"] / rate["hf_wall"],
                     "same_tokens": same})
    hdr = (f"{'prompt':<10}{'tokens':>7} | {'HF cpu':>7} {'paged':>7} {'ratio':>6} | {'HF wall':>7} {'paged':>7} "
           f"{'ratio':>6} | same tokens")
    print("batch-1 decode tok/s, in process (PagedRunner.step vs generate)\n" + hdr + "\n" + "-" * len(hdr))
    for row in rows:
        r = row["decode_tok_s"]
        print(f"{row['prompt']:<10}{row['prompt_tokens']:>7} | {r['hf_cpu']:>7.2f} {r['pd_cpu']:>7.2f} "
              f"{row['ratio_cpu']:>5.2f}x | {r['hf_wall']:>7.2f} {r['pd_wall']:>7.2f} {row['ratio_wall']:>5.2f}x | "
              f"{row['same_tokens']}")
    return rows


def main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.local import LocalCluster
    from pdserve.modelstore import resolve_model

    p = argparse.ArgumentParser(prog="pdserve bench")
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engine", default="auto", choices=["auto", "paged", "dense"], help="decode engine (pdserve decode --engine)")
    p.add_argument("--inprocess", action="store_true",
                   help="no cluster: batch-1 PagedRunner.step vs generate in this process (the engine's decode alone)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(tok)
    if a.inprocess:
        print(f"pdserve bench --inprocess: {model_dir.name}, {a.tokens} tokens/request, median of {a.repeats}, "
              f"torch threads 1", flush=True)
        rows = _inprocess(model_dir, prompts, a.tokens, a.repeats)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=2))
        return 0
    print(f"pdserve bench: {model_dir.name}, {a.tokens} tokens/request, median of {a.repeats}, torch threads 1, "
          f"decode engine {a.engine}",
          flush=True)
    variants = {k: _variants(ids, a.repeats, len(tok)) for k, ids in prompts.items()}
    with LocalCluster(str(model_dir), worker_args={"decode": ["--spec-method", "none", "--engine", a.engine],
                                                   "front": ["--no-preposition"]}) as cluster:
        ours = {k: _pdserve(cluster.url, model_dir.name, v, a.tokens) for k, v in variants.items()}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = {k: _hf(model, v, a.tokens) for k, v in variants.items()}
    hdr = (f"{'prompt':<10}{'tokens':>7} | {'TTFT HF':>8} {'TTFT pd':>8} {'ratio':>6} | {'tok/s HF':>8} "
           f"{'tok/s pd':>8} {'ratio':>6} | {'KV MiB':>7} {'handoff':>8} {'% TTFT':>7}")
    print(hdr + "\n" + "-" * len(hdr))
    rows = []
    for k, ids in prompts.items():
        o, b = ours[k], base[k]
        row = {"prompt": k, "prompt_tokens": len(ids), "hf": b, "pdserve": o,
               "ttft_ratio_pd_over_hf": o["ttft_s"] / b["ttft_s"],
               "decode_ratio_pd_over_hf": o["decode_tok_s"] / b["decode_tok_s"],
               "handoff_pct_of_ttft": 100 * o["handoff_stall_s"] / o["ttft_s"]}
        rows.append(row)
        print(f"{k:<10}{len(ids):>7} | {b['ttft_s']:>7.3f}s {o['ttft_s']:>7.3f}s {row['ttft_ratio_pd_over_hf']:>5.2f}x | "
              f"{b['decode_tok_s']:>8.2f} {o['decode_tok_s']:>8.2f} {row['decode_ratio_pd_over_hf']:>5.2f}x | "
              f"{o['kv_bytes'] / 2**20:>7.2f} {o['handoff_stall_s'] * 1e3:>6.1f}ms {row['handoff_pct_of_ttft']:>6.1f}%")
    print("TTFT pd: the first token, streamed by prefill while the KV travels. handoff: what the KV handoff added "
          "before the second token (gap between tokens 1 and 2 minus the median inter-token gap after it); "
          "'% TTFT': that, relative to TTFT.")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0
