"""One engine for every family: batch-16 over batch-1 decode rates per family, next to transformers itself; SmolLM2 likewise.

Part 1 (`--families`): the same-size random-weight checkpoint of each family (tests/tinymodels.py at
`--hidden` x `--layers`) on `PagedRunner`: aggregate decode tokens/s of `step` at batch 1 and at
batch 16, and their ratio (what 16 concurrent sequences gain over one), next to the Llama checkpoint's
ratio: each family's ratio over Llama's is the scaling it keeps (acceptance: within 10%); and each step's CPU time
per parameter it reads, over Llama's (the native families: within 1.2x).

Next to each paged rate, the same checkpoint in transformers itself (its own model with a `DynamicCache`,
the loop `generate` runs, 16 prompts left-padded): decode tokens/s at batch 1 and 16, and the paged
engine's rate over it.

Part 2 (`--smollm2`): SmolLM2-135M-Instruct, the paged engine against transformers itself: decode
tokens/s at batch 1 and 16 and prefill tokens/s (one 300-token prompt); ratio = paged / transformers.

Both run their variants in interleaved rounds (A, B, B, A, ...) and report medians of per-round rates
and of per-round ratios: on a shared machine a neighbour's burst then costs both sides alike. Rates are
tokens per second of this thread's CPU time (what the work cost; wall time mostly measures the
neighbours) and of wall time. One torch thread.

    python bench/engine_families.py                               # both parts
    python bench/engine_families.py --families llama qwen3 --no-smollm2 --rounds 3 --out fam.json
    python bench/engine_families.py --dtypes float32 bfloat16 --no-families   # what bf16 costs on this CPU
    python bench/engine_families.py --no-smollm2 --family-dtype bfloat16 --hidden 512 --rounds 3  # native families
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # `bench` from a checkout; appended: its kernels/ and operator/ must not shadow packages
sys.path.append(str(ROOT / "tests"))  # the family checkpoints the tests use

from bench.engine_throughput import Timer  # noqa: E402
from pdserve.engine.runner import PagedRunner  # noqa: E402
from pdserve.modelstore import ensure_default_model  # noqa: E402
from tinymodels import FAMILIES, make_tiny  # noqa: E402

LONG_PROMPT = (ROOT / "tests" / "data" / "long_prompt.txt").read_text()


class Decoder:
    """`batch` sequences in one engine, prefilled once; `rates(steps)` decodes them together."""

    def __init__(self, runner: PagedRunner, prompts: list[list[int]], tag: str):
        self.runner = runner
        self.seqs = [(tag, i) for i in range(len(prompts))]
        self.last = [int(runner.prefill(s, p, reuse_prefix=False).argmax()) for s, p in zip(self.seqs, prompts)]

    @torch.inference_mode()
    def rates(self, steps: int, batch: int) -> tuple[float, float]:
        """(tokens/s CPU, tokens/s wall) of `steps` decode steps of the first `batch` sequences."""
        seqs = self.seqs[:batch]
        with Timer() as t:
            for _ in range(steps):
                logits = self.runner.step([(s, [tok]) for s, tok in zip(seqs, self.last)])
                self.last[:batch] = [int(lg[-1].argmax()) for lg in logits]
        return steps * batch / t.cpu, steps * batch / t.wall


class HFDecoder:
    """The same prompts in transformers' own model: one `DynamicCache` for batch 1 (the first prompt) and one
    for batch 16 (left-padded), prefilled once; `rates(steps, batch)` runs the decode loop `generate` runs."""

    def __init__(self, path: Path, prompts: list[list[int]], pad: int, dtype=torch.float32):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        # transformers 5.24 calls the cache `cache` (and warns on the old name); 5.17 has only `past_key_values`
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.state = {1: self._prefill(prompts[:1], pad), 16: self._prefill(prompts, pad)}

    @torch.inference_mode()
    def _prefill(self, prompts: list[list[int]], pad: int) -> list:
        from transformers import DynamicCache

        n = max(map(len, prompts))
        ids = torch.tensor([[pad] * (n - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self.cache_kw: cache})
        return [out.logits[:, -1].argmax(-1, keepdim=True), mask, pos[:, -1:], cache]

    def prefill_rate(self, ids: list[int]) -> tuple[float, float]:
        from transformers import DynamicCache

        with torch.inference_mode(), Timer() as t:
            self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1,
                       **{self.cache_kw: DynamicCache(config=self.model.config)})
        return len(ids) / t.cpu, len(ids) / t.wall

    @torch.inference_mode()
    def rates(self, steps: int, batch: int) -> tuple[float, float]:
        st = self.state[batch]
        with Timer() as t:
            for _ in range(steps):
                last, mask, pos, cache = st
                mask = torch.cat((mask, mask.new_ones(batch, 1)), dim=1)
                pos = pos + 1
                out = self.model(input_ids=last, attention_mask=mask, position_ids=pos, use_cache=True,
                                 logits_to_keep=1, **{self.cache_kw: cache})
                st[:] = [out.logits[:, -1].argmax(-1, keepdim=True), mask, pos, cache]
        return steps * batch / t.cpu, steps * batch / t.wall


def prefill_rates(runner: PagedRunner, ids: list[int]) -> tuple[float, float]:
    with Timer() as t:
        runner.prefill("prefill-bench", ids, reuse_prefix=False)
    runner.free("prefill-bench")
    return len(ids) / t.cpu, len(ids) / t.wall


def seq_tokens(args, prompts: list[list[int]]) -> int:
    """The most tokens a decoded sequence reaches (the first one steps at batch 1 and at batch 16)."""
    return max(map(len, prompts)) + 4 + 2 * args.steps * args.rounds


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion briefly.",
             "List three primary colours.", "Who wrote Hamlet?", "How do bees make honey?",
             "Translate 'good morning' into Spanish.", "What is 17 times 23?"]
    out = []
    for i in range(n):
        msg = [{"role": "user", "content": f"{texts[i % len(texts)]} (question {i})"}]
        out.append(tokenizer.encode(tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=False),
                                    add_special_tokens=False))
    return out


def bench_families(args, tokdir: Path) -> list[dict]:
    from transformers import AutoTokenizer

    root = Path(args.checkpoints or tempfile.mkdtemp(prefix="pdserve-families-"))
    tok = AutoTokenizer.from_pretrained(tokdir)
    prompts = chat_prompts(tok, 16)
    rows = []
    for fam in args.families:
        path = make_tiny(fam, root, tokdir, hidden=args.hidden, layers=args.layers)
        runner = PagedRunner(path, num_blocks=16 * -(-seq_tokens(args, prompts) // 16) + 8,
                             dtype=getattr(torch, args.family_dtype))
        dec = Decoder(runner, prompts, fam)
        hf = HFDecoder(path, prompts, tok.pad_token_id or 0, getattr(torch, args.family_dtype))
        dec.rates(2, 16)  # warm
        hf.rates(1, 16)
        r1, r16, h1, h16 = [], [], [], []
        for r in range(args.rounds):
            order = [(dec, 1, r1), (dec, 16, r16), (hf, 1, h1), (hf, 16, h16)]
            for d, batch, acc in (order if r % 2 == 0 else order[::-1]):
                acc.append(d.rates(args.steps, batch))
        # the parameters a decode step reads: all but the input embedding's table (a few rows of it)
        embed = runner.model.hf.get_input_embeddings().weight
        read = sum(p.numel() for p in runner.model.parameters() if p is not embed)
        row = {"family": fam, "params": sum(p.numel() for p in runner.model.parameters()), "params_read": read,
               "native": runner.model.native is not None,
               "windows": list(runner.layout.layer_windows),
               "batch1_tok_s_cpu": med([x[0] for x in r1]), "batch16_tok_s_cpu": med([x[0] for x in r16]),
               "batch1_tok_s_wall": med([x[1] for x in r1]), "batch16_tok_s_wall": med([x[1] for x in r16]),
               "scaling_cpu": med([b[0] / a[0] for a, b in zip(r1, r16)]),
               "scaling_wall": med([b[1] / a[1] for a, b in zip(r1, r16)]),
               "hf_batch1_tok_s_cpu": med([x[0] for x in h1]), "hf_batch16_tok_s_cpu": med([x[0] for x in h16]),
               "paged_vs_hf_batch1": med([a[0] / b[0] for a, b in zip(r1, h1)]),
               "paged_vs_hf_batch16": med([a[0] / b[0] for a, b in zip(r16, h16)])}
        rows.append(row)
        print(f"  {fam:10s} batch 1 {row['batch1_tok_s_cpu']:8.1f} tok/s, batch 16 {row['batch16_tok_s_cpu']:8.1f} "
              f"tok/s (CPU time): {row['scaling_cpu']:.2f}x", flush=True)
        del runner, dec, hf
    base = next((r for r in rows if r["family"] == "llama"), None)
    for r in rows:
        r["scaling_vs_llama"] = r["scaling_cpu"] / base["scaling_cpu"] if base else None
        # a step's CPU time per parameter it reads, over Llama's: 1.0 = as cheap per weight as Llama
        for b in (1, 16):
            per = 1 / r[f"batch{b}_tok_s_cpu"] / r["params_read"]
            r[f"step_per_param_b{b}_vs_llama"] = per / (1 / base[f"batch{b}_tok_s_cpu"] / base["params_read"]) \
                if base else None
    return rows


def bench_smollm2(args, model_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tok, 16)
    long_ids = tok.encode(LONG_PROMPT, add_special_tokens=False)[:300]
    blocks = 16 * -(-seq_tokens(args, prompts) // 16) + -(-len(long_ids) // 16) + 8
    dtype = getattr(torch, args.dtype)
    runner = PagedRunner(model_dir, num_blocks=blocks, dtype=dtype)
    impls = {"paged": (Decoder(runner, prompts, "paged"), lambda: prefill_rates(runner, long_ids)),
             "transformers": (hf := HFDecoder(model_dir, prompts, tok.pad_token_id or 0, dtype),
                              lambda: hf.prefill_rate(long_ids))}
    for dec, _ in impls.values():
        dec.rates(1, 16)  # warm
    res = {n: {"decode1": [], "decode16": [], "prefill": []} for n in impls}
    names = list(impls)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            dec, prefill = impls[name]
            res[name]["prefill"].append(prefill())
            res[name]["decode1"].append(dec.rates(args.steps, 1))
            res[name]["decode16"].append(dec.rates(args.steps, 16))
        print(f"  round {r + 1}/{args.rounds}", flush=True)
    out = {"dtype": args.dtype, "prefill_tokens": len(long_ids), "rows": []}
    for what in ("decode1", "decode16", "prefill"):
        a, b = res["paged"][what], res["transformers"][what]
        out["rows"].append({
            "what": {"decode1": "decode, batch 1", "decode16": "decode, batch 16", "prefill": "prefill"}[what],
            "paged_tok_s_cpu": med([x[0] for x in a]), "transformers_tok_s_cpu": med([x[0] for x in b]),
            "ratio_cpu": med([x[0] / y[0] for x, y in zip(a, b)]),
            "ratio_wall": med([x[1] / y[1] for x, y in zip(a, b)])})
    return out


def bench_dtypes(args, model_dir: Path) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tok, 16)
    decs = {}
    for name in args.dtypes:
        runner = PagedRunner(model_dir, num_blocks=16 * -(-seq_tokens(args, prompts) // 16) + 8,
                             dtype=getattr(torch, name))
        decs[name] = Decoder(runner, prompts, name)
    res = {n: {1: [], 16: []} for n in decs}
    for r in range(args.rounds):
        for name in (list(decs) if r % 2 == 0 else list(decs)[::-1]):
            for b in (1, 16):
                res[name][b].append(decs[name].rates(args.steps, b))
    base = args.dtypes[0]
    return [{"dtype": n, **{f"batch{b}_tok_s_cpu": med([x[0] for x in res[n][b]]) for b in (1, 16)},
             **{f"batch{b}_vs_{base}": med([x[0] / y[0] for x, y in zip(res[n][b], res[base][b])]) for b in (1, 16)}}
            for n in decs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--no-families", dest="families", action="store_const", const=[])
    ap.add_argument("--hidden", type=int, default=256, help="family checkpoints' width (heads of 16 dims)")
    ap.add_argument("--layers", type=int, default=4, help="family checkpoints' layer count")
    ap.add_argument("--checkpoints", default=None, help="folder for the family checkpoints (default: a temp dir)")
    ap.add_argument("--family-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the families' dtype (both run the native layers where a family has them)")
    ap.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=True,
                    help="SmolLM2: the paged engine against transformers itself")
    ap.add_argument("--dtype", default="float32", help="SmolLM2 comparison's dtype")
    ap.add_argument("--dtypes", nargs="*", default=[], help="also SmolLM2's decode rates in these dtypes (first = base)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = ensure_default_model()
    result = {"rounds": args.rounds, "steps": args.steps, "cpu": torch.backends.cpu.get_cpu_capability(),
              "torch_threads": 1}
    if args.families:
        print(f"families at hidden {args.hidden} x {args.layers} layers, {args.rounds} rounds ...", flush=True)
        result["families"] = bench_families(args, model_dir)
    if args.smollm2:
        print("SmolLM2-135M-Instruct: the paged engine vs transformers ...", flush=True)
        result["smollm2"] = bench_smollm2(args, model_dir)
    if args.dtypes:
        print(f"SmolLM2 decode by dtype: {' '.join(args.dtypes)} ...", flush=True)
        result["dtypes"] = bench_dtypes(args, model_dir)

    print()
    if args.families:
        print(f"families in {args.family_dtype}; 'per param' = a step's CPU time per parameter it reads, over Llama's")
        print(f"{'family':10} | {'native':>6} | {'params':>9} | {'b1 tok/s':>9} | {'b16 tok/s':>9} | {'b16/b1':>7} | "
              f"{'vs llama':>8} | {'b1 per param':>12} | {'b16 per param':>13} | {'hf b1':>7} | {'hf b16':>7} | "
              f"{'b1/hf':>6} | {'b16/hf':>6} | windows")
        for r in result["families"]:
            vs = f"{r['scaling_vs_llama']:.2f}x" if r["scaling_vs_llama"] is not None else "-"
            per = [f"{r[f'step_per_param_b{b}_vs_llama']:.2f}x" if r["scaling_vs_llama"] is not None else "-"
                   for b in (1, 16)]
            print(f"{r['family']:10} | {'yes' if r['native'] else 'no':>6} | {r['params']:>9} | "
                  f"{r['batch1_tok_s_cpu']:>9.1f} | {r['batch16_tok_s_cpu']:>9.1f} | {r['scaling_cpu']:>6.2f}x | "
                  f"{vs:>8} | {per[0]:>12} | {per[1]:>13} | {r['hf_batch1_tok_s_cpu']:>7.1f} | "
                  f"{r['hf_batch16_tok_s_cpu']:>7.1f} | {r['paged_vs_hf_batch1']:>5.2f}x | "
                  f"{r['paged_vs_hf_batch16']:>5.2f}x | {r['windows'] or 'all full'}")
    if args.smollm2:
        s = result["smollm2"]
        print(f"\nSmolLM2 ({s['dtype']}), tokens/s of CPU time; ratio = paged / transformers (median of rounds)")
        print(f"{'':18} | {'paged':>12} | {'transformers':>12} | {'ratio cpu':>9} | {'ratio wall':>10}")
        for r in s["rows"]:
            print(f"{r['what']:18} | {r['paged_tok_s_cpu']:>12.1f} | {r['transformers_tok_s_cpu']:>12.1f} | "
                  f"{r['ratio_cpu']:>8.3f}x | {r['ratio_wall']:>9.3f}x")
    if args.dtypes:
        print("\nSmolLM2 decode by dtype, tokens/s of CPU time")
        for r in result["dtypes"]:
            print("  " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
