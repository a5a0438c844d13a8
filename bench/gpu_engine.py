"""The paged engine on a GPU: greedy against transformers on the same device, same-answer paths, decode step time
against the HBM roofline. Part of the prepared device check (`bench/gpu_check.sh`).

    python -P bench/gpu_engine.py [--model DIR] [--dtype bfloat16] [--out gpu_engine.json]
    python -P bench/gpu_engine.py --device cpu   # the same on one CPU thread (the CPU's roofline: one core's stream)
    python -P bench/gpu_engine.py --smoke        # the CPU, a few tokens: keeps the script from rotting (tests)

1. Greedy: 4 prompts, 24 tokens each through `PagedRunner` (prefill, then one-row steps) against transformers'
   `generate` of the same checkpoint at the same dtype on the same device; token ids compared exactly, the first
   difference printed (at bfloat16 two near-tied logits can part: counted, not hidden).
2. Same answer: each prompt's greedy tokens along other engine paths — its prefix cached, its prompt in chunks of
   17, decoded inside a batch of 16, verified 5 rows at a time — against computing it alone; prints how many
   differ. On a GPU the projections are cuBLAS GEMMs, whose kernels change with the row count: this measures how
   far the CPU's invariance holds there, it does not assert it.
3. Decode step time at batch 1, 16 and 64 (CUDA events, median of 20 steps, 512 tokens of context each), next to
   the memory roofline: (the weight bytes a step reads + the batch's KV bytes) / the read bandwidth measured here
   (a sum over 1 GiB: HBM on a GPU, one core's stream on a CPU), and the ratio.
Decode steps are not captured in CUDA graphs: the engine launches each step's kernels from Python.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch's first allocation: on huge pages, as workers
import torch  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a village by the sea, there lived an old fisherman who",
           "List three prime numbers and explain why each one is prime:"]


def greedy(runner, sid, prompt: list[int], n: int, **prefill_kw) -> list[int]:
    out = [int(runner.prefill(sid, prompt, **prefill_kw).argmax())]
    while len(out) < n:
        (lg,) = runner.step([(sid, [out[-1]])])
        out.append(int(lg[-1].argmax()))
    runner.free(sid)
    return out


def paths(runner, prompt: list[int], n: int, ref: list[int]) -> dict[str, bool]:
    """Whether each other path gives `ref`'s tokens."""
    got = {"cached": greedy(runner, "cached", prompt, n),
           "chunk17": greedy(runner, "chunk17", prompt, n, chunk_size=17, reuse_prefix=False)}
    runner.prefill("base", prompt[:8], reuse_prefix=False)
    fillers = [("f", k) for k in range(15)]
    for f in fillers:
        runner.fork("base", f)
    out = [int(runner.prefill("batch", prompt, reuse_prefix=False).argmax())]
    while len(out) < n:
        logits = runner.step([("batch", [out[-1]])] + [(f, [7]) for f in fillers])
        out.append(int(logits[0][-1].argmax()))
    for f in [*fillers, "base", "batch"]:
        runner.free(f)
    got["batch16"] = out
    out = [int(runner.prefill("spec", prompt, reuse_prefix=False).argmax())]
    while len(out) < n:
        drafts = ref[len(out):len(out) + 4]
        (lg,) = runner.step([("spec", [out[-1]] + drafts)])
        for j, row in enumerate(lg):
            out.append(int(row.argmax()))
            if j >= len(drafts) or out[-1] != drafts[j]:
                break
        runner.rollback("spec", len(prompt) + len(out) - 1)
    runner.free("spec")
    got["spec4"] = out[:n]
    return {k: v == ref for k, v in got.items()}


def read_bandwidth(device: torch.device, small: bool) -> float:
    """Bytes per second of reading 1 GiB once on `device` (a sum; 8 MiB in the smoke run): what a decode step
    does with its weights."""
    n = (1 << 21) if small else (1 << 28)
    a = torch.ones(n, dtype=torch.float32, device=device)
    for _ in range(3):
        a.sum()
    times = [timed(device, a.sum) for _ in range(10)]
    return a.numel() * 4 / statistics.median(times)


def timed(device: torch.device, fn) -> float:
    """Seconds `fn` takes: CUDA events on a GPU, the wall clock on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="on the CPU, 2 prompts, 6 tokens, batch 1 and 4")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.runner import PagedRunner
    from pdserve.modelstore import resolve_model

    device = torch.device("cpu" if args.smoke else args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("no CUDA device here (--device cpu, or --smoke)")
        return 2
    dtype = getattr(torch, args.dtype)
    prompts, tokens = (PROMPTS[:2], 6) if args.smoke else (PROMPTS, args.tokens)
    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    runner = PagedRunner(model_dir, dtype=dtype, device=str(device), num_blocks=4096)  # 64 x 513 tokens and more
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu, one thread" + (" (smoke)" * args.smoke)
    print(f"{model_dir.name} at {args.dtype} on {name}")
    result: dict = {"device": name, "dtype": args.dtype, "greedy": [], "paths": [], "steps": []}

    print("\n1. greedy, PagedRunner against transformers' generate on the same device; 2. the same answer along other paths")
    with torch.inference_mode():
        for text in prompts:
            ids = tok.encode(text)
            ours = greedy(runner, "g", ids, tokens, reuse_prefix=False)
            theirs = hf.generate(torch.tensor([ids], device=device), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
            first = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            result["greedy"].append({"prompt": text, "equal": ours == theirs, "first_difference": first})
            print(f"  {'equal' if ours == theirs else f'differs at token {first}'}: {text[:40]!r}")
            same = paths(runner, ids, tokens, ours)
            result["paths"].append(same)
            print(f"     same answer along: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    del hf

    print("\n3. decode step time against the memory roofline")
    bandwidth = read_bandwidth(device, args.smoke)
    # what a step reads: every weight but the input embedding's table (a few rows of it), the head once
    embed, head = runner.model.hf.get_input_embeddings(), runner.model.hf.get_output_embeddings()
    weight_bytes = sum(t.numel() * t.element_size() for t in runner.model.hf.parameters() if t is not embed.weight)
    if getattr(head, "weight", None) is embed.weight:
        weight_bytes += embed.weight.numel() * embed.weight.element_size()
    layout = runner.layout
    context = 64 if args.smoke else 512
    print(f"  read bandwidth {bandwidth / 1e9:.0f} GB/s; weights {weight_bytes / 1e6:.0f} MB; context {context}")
    print(f"  {'batch':>5} {'step ms':>8} {'roofline ms':>12} {'ratio':>6}")
    with torch.inference_mode():
        for batch in ((1, 4) if args.smoke else (1, 16, 64)):
            for s in range(batch):
                runner.prefill(("ctx", s), [(97 * i + 13 * s) % 40000 + 100 for i in range(context)],
                               reuse_prefix=False)
            step = [(("ctx", s), [5]) for s in range(batch)]

            def one():
                runner.step(step)
                for s in range(batch):
                    runner.rollback(("ctx", s), context)

            one()
            ms = statistics.median(timed(device, one) for _ in range(3 if args.smoke else 20)) * 1e3
            kv_bytes = batch * (context + 1) * layout.num_layers * 2 * layout.kv_heads * layout.head_dim * \
                torch.tensor([], dtype=dtype).element_size()
            roof = (weight_bytes + kv_bytes) / bandwidth * 1e3
            result["steps"].append({"batch": batch, "step_ms": ms, "roofline_ms": roof})
            print(f"  {batch:>5} {ms:>8.2f} {roof:>12.2f} {ms / roof:>5.2f}x")
            for s in range(batch):
                runner.free(("ctx", s))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
