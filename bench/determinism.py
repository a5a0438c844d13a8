"""Same request, same answer? Greedy tokens of one prompt computed along different paths of the engine.

    python -P bench/determinism.py [--model default] [--dtype auto] [--prompts 100] [--tokens 16] [--json F]

For each of `--prompts` prompts (seeded token ids, 40 to 300 tokens, so prompts cross block and chunk
boundaries), the reference is the prompt computed in one step with no prefix reuse, then `--tokens` greedy
tokens decoded one row per step, alone. Each other path computes the same request another way and its
greedy tokens are compared with the reference's, token id for token id:

  cached    the prompt again, its leading whole blocks found in the prefix cache (the tail computed)
  chunk64   the prompt in chunks of 64 tokens          chunk17   in chunks of 17 (crossing every block)
  batch3    decoded inside a batch of 3 sequences      batch16   inside a batch of 16
  mixed     the prompt computed in the same step as another sequence's decode row (a chunk riding in
            decode's step, as conditional disaggregation does)
  spec4     decoded by verification steps of 5 rows (the reference's next 4 tokens as drafts, as a
            speculative step that accepts them)
  recompute half the tokens decoded, then the sequence dropped and its prompt and those tokens computed again
            as one prompt (preemption's recomputation, or a conversation's next turn), then decoded on

Printed: per path, how many prompts' tokens differ from the reference and the mean first position of a
difference. The engine is `PagedRunner` on one thread; which kernels serve depends on the CPU (the native
bfloat16 decoder needs AVX512-BF16): printed first. This measures, it does not assert: the tests hold the
properties that are guaranteed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

PATHS = ("cached", "chunk64", "chunk17", "batch3", "batch16", "mixed", "spec4", "recompute")


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits).item())


def decode_alone(r, sid, first: int, n: int) -> list[int]:
    out = [first]
    while len(out) < n:
        (lg,) = r.step([(sid, [out[-1]])])
        out.append(greedy(lg[-1]))
    return out


def run(r, prompts: list[list[int]], tokens: int) -> dict:
    base_prompt = list(range(1000, 1100))  # the fillers' shared prompt: forked per prompt, freed after
    r.prefill("filler", base_prompt, reuse_prefix=False)
    (lg,) = r.step([("filler", [500])])
    filler_next = greedy(lg[-1])
    diffs: dict[str, list[int]] = {p: [] for p in PATHS}  # first differing index per differing prompt
    for i, prompt in enumerate(prompts):
        ref = decode_alone(r, ("ref", i), greedy(r.prefill(("ref", i), prompt, reuse_prefix=False)), tokens)
        got: dict[str, list[int]] = {}
        got["cached"] = decode_alone(r, ("cached", i), greedy(r.prefill(("cached", i), prompt)), tokens)
        for size in (64, 17):
            sid = (f"chunk{size}", i)
            got[f"chunk{size}"] = decode_alone(
                r, sid, greedy(r.prefill(sid, prompt, chunk_size=size, reuse_prefix=False)), tokens)
        for width in (3, 16):
            sid = (f"batch{width}", i)
            out = [greedy(r.prefill(sid, prompt, reuse_prefix=False))]
            fillers = [("f", i, width, k) for k in range(width - 1)]
            for f in fillers:
                r.fork("filler", f)
            nxt = {f: filler_next for f in fillers}
            while len(out) < tokens:
                logits = r.step([(sid, [out[-1]])] + [(f, [nxt[f]]) for f in fillers])
                out.append(greedy(logits[0][-1]))
                nxt = {f: greedy(lg[-1]) for f, lg in zip(fillers, logits[1:])}
            for f in fillers:
                r.free(f)
            got[f"batch{width}"] = out
        sid, other = ("mixed", i), ("mixed-other", i)
        r.fork("filler", other)
        r.start(sid, prompt, reuse_prefix=False)
        logits = r.step([(other, [filler_next]), (sid, prompt)], last_only=True)
        got["mixed"] = decode_alone(r, sid, greedy(logits[1][-1]), tokens)
        r.free(other)
        sid = ("spec4", i)
        out = [greedy(r.prefill(sid, prompt, reuse_prefix=False))]
        while len(out) < tokens:
            drafts = ref[len(out):len(out) + 4]
            (lg,) = r.step([(sid, [out[-1]] + drafts)])
            accepted = 0
            for j, row in enumerate(lg):  # a speculative step: keep tokens while the drafts match
                tok = greedy(row)
                out.append(tok)
                if j >= len(drafts) or tok != drafts[j]:
                    break
                accepted += 1
            r.rollback(sid, len(prompt) + len(out) - 1)
        got["spec4"] = out[:tokens]
        sid = ("recompute", i)
        half = decode_alone(r, sid, greedy(r.prefill(sid, prompt, reuse_prefix=False)), tokens // 2)
        r.free(sid)
        again = greedy(r.prefill(sid, prompt + half[:-1], reuse_prefix=False))
        got["recompute"] = half[:-1] + decode_alone(r, sid, again, tokens - len(half) + 1)
        for name, toks in got.items():
            if toks != ref:
                diffs[name].append(next(j for j, (a, b) in enumerate(zip(toks, ref)) if a != b))
        for sid in [("ref", i), *((name, i) for name in PATHS)]:
            if sid in r:
                r.free(sid)
        print(f"  prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens): "
              + (", ".join(f"{n} differs at {diffs[n][-1]}" for n in PATHS if got[n] != ref) or "all equal"),
              file=sys.stderr, flush=True)
    r.free("filler")
    return diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto", help="auto (what `pdserve up` resolves here), float32 or bfloat16")
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from pdserve.checkpoint import resolve_dtype
    from pdserve.engine.runner import PagedRunner
    from pdserve.modelstore import resolve_model

    dtype = resolve_dtype(args.dtype)
    r = PagedRunner(resolve_model(args.model), dtype=dtype, num_blocks=1024)
    native = r.native_rows()
    print(f"dtype {str(dtype).removeprefix('torch.')}; steps of up to {native} rows on the native decoder"
          if native else f"dtype {str(dtype).removeprefix('torch.')}; transformers' forward (no native decoder here)")
    g = torch.Generator().manual_seed(args.seed)
    vocab = min(r.vocab_size, 49152)
    prompts = [torch.randint(100, vocab, (int(torch.randint(40, 301, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    diffs = run(r, prompts, args.tokens)
    print(f"\n{'path':<10} {'prompts differing':>18} {'mean first difference':>22}")
    for name in PATHS:
        d = diffs[name]
        mean = f"{statistics.mean(d):.1f}" if d else "-"
        print(f"{name:<10} {len(d):>12} / {len(prompts):<5} {mean:>22}")
    total = sum(len(d) for d in diffs.values())
    print(f"\n{total} differences over {len(prompts)} prompts x {len(PATHS)} paths ({args.tokens} tokens each)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(dtype=str(dtype), native_rows=native, prompts=len(prompts), tokens=args.tokens,
                           differing={k: v for k, v in diffs.items()}), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
