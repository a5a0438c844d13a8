"""Paged engine throughput: aggregate decode tokens/s of `PagedRunner.step` at batch 1, 4, 16 vs sequential HF `generate`.

Same prompts (the free_chat and code_edit workloads, chat-templated), greedy, N new tokens each,
stop tokens ignored on both sides so both do the same work. One torch thread (on these 2-core
machines two threads made small matmuls slower under load).

* HF: `generate` on each prompt in turn (what serving one request at a time gives); its rate is
  all new tokens / all time, prefill included (prefill is reported separately so the decode-only
  rate can be read off: generate with 1 new token is timed too).
* Paged: the first B prompts are prefilled (timed apart), then N-1 `step`s of the B sequences
  together; decode rate = B*(N-1) / step time.

Both CPU time of this thread (what the work cost; on a shared machine wall time mostly measures
the neighbours) and wall time are reported; ratios are paged decode rate / HF decode rate. The
paged tokens are checked against HF's, token for token.

    python bench/engine_throughput.py                      # batches 1 4 16, 16 new tokens
    python bench/engine_throughput.py --batches 1 16 --new-tokens 8 --out engine.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent.parent))  # `bench` from a checkout

from bench.workloads import get_workloads  # noqa: E402
from pdserve.engine.runner import PagedRunner  # noqa: E402
from pdserve.modelstore import ensure_default_model  # noqa: E402
from pdserve.runtime import ModelRunner  # noqa: E402


class Timer:
    def __enter__(self):
        self.cpu0, self.wall0 = time.thread_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.cpu = time.thread_time() - self.cpu0
        self.wall = time.perf_counter() - self.wall0


def load_prompts(hf: ModelRunner, count: int) -> list[list[int]]:
    prompts = [p for w in get_workloads(["free_chat", "code_edit"]) for p in w.prompts]
    if count > len(prompts):
        raise SystemExit(f"--prompts {count}: only {len(prompts)} prompts in the workloads")
    return [hf.encode_chat(p.messages) for p in prompts[:count]]


def hf_generate(hf: ModelRunner, prompts: list[list[int]], new_tokens: int) -> dict:
    configs = {}
    for n in (1, new_tokens):
        configs[n] = copy.deepcopy(hf.model.generation_config)
        # no stop token: exactly n new tokens each, the same work the paged loop does
        configs[n].update(eos_token_id=[], do_sample=False, pad_token_id=0, max_new_tokens=n)
    outs, gen, pre = [], Timer(), Timer()
    with torch.inference_mode():
        def run(ids, n):
            return hf.model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), generation_config=configs[n]
            )[0, len(ids):].tolist()
        with pre:
            for ids in prompts:
                run(ids, 1)
        with gen:
            for ids in prompts:
                outs.append(run(ids, new_tokens))
    n = len(prompts)
    decode_cpu, decode_wall = max(gen.cpu - pre.cpu, 1e-9), max(gen.wall - pre.wall, 1e-9)
    return {
        "tokens": outs,
        "tok_s_cpu": n * new_tokens / gen.cpu,
        "tok_s_wall": n * new_tokens / gen.wall,
        "decode_tok_s_cpu": n * (new_tokens - 1) / decode_cpu,
        "decode_tok_s_wall": n * (new_tokens - 1) / decode_wall,
    }


def paged_batch(runner: PagedRunner, prompts: list[list[int]], new_tokens: int) -> dict:
    ids = [("bench", len(prompts), i) for i in range(len(prompts))]
    pre, dec = Timer(), Timer()
    with torch.inference_mode():
        with pre:
            outs = [[int(runner.prefill(sid, p, reuse_prefix=False).argmax())] for sid, p in zip(ids, prompts)]
        with dec:
            for _ in range(new_tokens - 1):
                logits = runner.step([(sid, [o[-1]]) for sid, o in zip(ids, outs)])
                for o, l in zip(outs, logits):
                    o.append(int(l[-1].argmax()))
    for sid in ids:
        runner.free(sid)
    steps = len(prompts) * (new_tokens - 1)
    return {
        "tokens": outs,
        "decode_tok_s_cpu": steps / dec.cpu,
        "decode_tok_s_wall": steps / dec.wall,
        "tok_s_cpu": len(prompts) * new_tokens / (pre.cpu + dec.cpu),
        "tok_s_wall": len(prompts) * new_tokens / (pre.wall + dec.wall),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="checkpoint folder (default: the converted default model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    model_dir = args.model_dir or ensure_default_model()
    hf = ModelRunner(model_dir)
    prompts = load_prompts(hf, max(args.batches))
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts of {min(lengths)}..{max(lengths)} tokens, {args.new_tokens} new tokens each, 1 torch thread",
          flush=True)
    print("HF generate, one prompt after another ...", flush=True)
    base = hf_generate(hf, prompts, args.new_tokens)
    runner = PagedRunner(model_dir, num_blocks=sum(hf.layout.num_blocks(n + args.new_tokens) for n in lengths) + 8)

    rows = []
    for b in args.batches:
        print(f"paged, batch {b} ...", flush=True)
        r = paged_batch(runner, prompts[:b], args.new_tokens)
        r["batch"] = b
        r["tokens_equal_hf"] = sum(r["tokens"][i] == base["tokens"][i] for i in range(b))
        r["ratio_cpu"] = r["decode_tok_s_cpu"] / base["decode_tok_s_cpu"]
        r["ratio_wall"] = r["decode_tok_s_wall"] / base["decode_tok_s_wall"]
        rows.append(r)

    print()
    print(f"HF generate (sequential): {base['decode_tok_s_cpu']:.2f} decode tok/s CPU-time, "
          f"{base['decode_tok_s_wall']:.2f} wall; with prefill {base['tok_s_cpu']:.2f} CPU / {base['tok_s_wall']:.2f} wall")
    print(f"{'batch':>5} | {'decode tok/s cpu':>16} | {'ratio cpu':>9} | {'decode tok/s wall':>17} | {'ratio wall':>10} | "
          f"{'e2e tok/s cpu':>13} | {'same tokens':>11}")
    for r in rows:
        print(f"{r['batch']:>5} | {r['decode_tok_s_cpu']:>16.2f} | {r['ratio_cpu']:>8.2f}x | {r['decode_tok_s_wall']:>17.2f} | "
              f"{r['ratio_wall']:>9.2f}x | {r['tok_s_cpu']:>13.2f} | {r['tokens_equal_hf']:>5}/{r['batch']:<5}")
    if args.out:
        for r in rows:
            del r["tokens"]
        del base["tokens"]
        Path(args.out).write_text(json.dumps({"new_tokens": args.new_tokens, "prompt_tokens": lengths,
                                              "hf_generate": base, "paged": rows}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
