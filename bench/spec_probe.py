"""Quick probe: plain greedy vs greedy speculative decoding (n-gram drafts, adaptive k) on the
real model, per workload — tokens/s, acceptance, ratio, and a token-for-token equality check.

Both loops are written here on purpose (model forward + DynamicCache, batch 1): the probe
measures the speculation policy, not a serving stack. Prefill is excluded from the timings
(it is the same work in both); one torch thread (on these 2-core machines two threads made
small matmuls slower under load).

    python bench/spec_probe.py                       # all workloads, all prompts
    python bench/spec_probe.py --workloads code_edit --limit 2 --json out.json
    python bench/spec_probe.py --ceiling             # + the best any prompt-lookup drafter could do
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent.parent))  # `bench` from a checkout

from bench.workloads import get_workloads  # noqa: E402
from pdserve.decode.drafters import Drafter, NgramDrafter, crop_cache  # noqa: E402
from pdserve.decode.speculation import SpanTracker, SpeculationController  # noqa: E402


@dataclass
class RunResult:
    tokens: list[int]
    decode_seconds: float  # CPU seconds of this thread after the prefill step (see _clock)
    wall_seconds: float = 0.0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    chosen_k: list[int] = field(default_factory=list)
    match_log: list[tuple[int, int, int]] = field(default_factory=list)  # (matched n, proposed, accepted)

    @property
    def decode_tokens(self) -> int:  # tokens produced after the prefill's first token
        return max(len(self.tokens) - 1, 0)

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def _clock() -> float:
    """This thread's CPU seconds: on a shared 2-core machine wall time mostly measures the
    neighbours; with one torch thread the CPU time is the work done (wall time is reported too)."""
    return time.thread_time()


def _truncate_at_eos(tokens: list[int], eos_ids: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens, False


@torch.inference_mode()
def plain_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int],
                 controller: SpeculationController | None = None) -> RunResult:
    """One token per target forward. Feeds k = 0 step costs to ``controller`` if given."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits
    out = [int(logits[0, -1].argmax())]
    t0, w0 = _clock(), time.perf_counter()
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        ts = _clock()
        logits = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits
        out.append(int(logits[0, -1].argmax()))
        if controller is not None:
            controller.observe_verify(1, 1, _clock() - ts)
    return RunResult(out, _clock() - t0, wall_seconds=time.perf_counter() - w0, steps=len(out) - 1)


@torch.inference_mode()
def speculative_greedy(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int],
                       drafter: Drafter, controller: SpeculationController, request_id: str,
                       max_k: int = 8) -> RunResult:
    """Greedy speculative decoding: draft k tokens, one target forward over k + 1, accept the
    longest prefix the target's argmax agrees with, plus the target's own next token; the
    target cache is cropped back over the rejected positions."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits
    out = [int(logits[0, -1].argmax())]
    span = SpanTracker().feed(tokenizer.decode(out))
    res = RunResult(out, 0.0)
    loop = asyncio.new_event_loop()
    t0, w0 = _clock(), time.perf_counter()
    try:
        while len(out) < max_new_tokens and out[-1] not in eos_ids:
            kind = span.kind
            limit = min(max_k, max_new_tokens - len(out) - 1)
            if hasattr(drafter, "confidence"):
                # model-free drafter: propose first (microseconds), then let the controller cut
                # the proposal by cost, using the drafter's confidence in this very proposal
                ts = _clock()
                draft = loop.run_until_complete(drafter.propose(request_id, prompt_ids + out, limit)) if limit > 0 else None
                td = _clock() - ts
                hint = drafter.confidence(request_id)
                k = controller.choose_k(request_id, kind, 1, len(draft), alpha_hint=hint) if draft and hint is not None else 0
                drafter.trim(request_id, k)
                if draft:
                    controller.observe_draft(len(draft), td)
            else:
                k = controller.choose_k(request_id, kind, 1, limit)
                ts = _clock()
                draft = loop.run_until_complete(drafter.propose(request_id, prompt_ids + out, k)) if k > 0 else None
                td = _clock() - ts
                if k > 0:
                    controller.observe_draft(k, td)
            proposal = draft.token_ids[:k] if draft is not None else []
            ts = _clock()
            base = cache.get_seq_length()
            logits = model(input_ids=torch.tensor([[out[-1]] + proposal]), past_key_values=cache,
                           use_cache=True).logits[0]
            preds = logits.argmax(dim=-1).tolist()  # preds[i]: the target's token after proposal[:i]
            accepted = 0
            while accepted < len(proposal) and proposal[accepted] == preds[accepted]:
                accepted += 1
            crop_cache(cache, base + 1 + accepted)
            controller.observe_verify(1, len(proposal) + 1, _clock() - ts)
            new = proposal[:accepted] + [preds[accepted]]
            new, _ = _truncate_at_eos(new[: max_new_tokens - len(out)], eos_ids)
            drafter.feedback(request_id, accepted, new)
            controller.observe_step(request_id, kind, len(proposal), accepted)
            out.extend(new)
            span.feed(tokenizer.decode(new))
            res.steps += 1
            res.drafted += len(proposal)
            res.accepted += accepted
            res.chosen_k.append(k)
            match_n = getattr(drafter, "last_match_n", {}).get(request_id, 0) if proposal else 0
            res.match_log.append((match_n, len(proposal), accepted))
    finally:
        loop.close()
        drafter.release(request_id)
        controller.release(request_id)
    res.tokens = out
    res.decode_seconds = _clock() - t0
    res.wall_seconds = time.perf_counter() - w0
    return res


def ngram_ceiling_steps(prompt_ids: list[int], output: list[int], min_n: int = 1, max_n: int = 16) -> list[int]:
    """What the best possible prompt-lookup drafter could do on one greedy output: steps of an
    oracle that, before each step, knows which earlier occurrence of a suffix (>= ``min_n``
    tokens) continues the furthest into the real output, and drafts exactly that far.

    Greedy speculation accepts a draft token iff it equals the plain greedy output, so this
    replay is exact. Returns the number of tokens drafted (= accepted) at each step after the
    first output token; every step also commits one target token.
    """
    steps, pos = [], 1
    while pos < len(output):
        seq = prompt_ids + output[:pos]
        length, future = len(seq), output[pos:-1]  # the last output token is always the target's own
        best = 0
        for s in range(1, length):
            n = 0  # how long a suffix of seq ends at s
            while n < max_n and n < s and seq[s - n - 1] == seq[length - n - 1] and s - n - 1 < length - n - 1:
                n += 1
            if n < min_n:
                continue
            a = 0
            while a < len(future):
                p = s + a
                if (seq[p] if p < length else future[p - length]) != future[a]:
                    break
                a += 1
            best = max(best, a)
        steps.append(best)
        pos += best + 1
    return steps


def ngram_cost_microseconds(context: int = 2048, steps: int = 2000, seed: int = 0) -> float:
    """Mean cost of one NgramDrafter.propose (incremental: 1–3 new tokens per call) on a
    ``context``-token sequence with a 500-token vocabulary, in microseconds of CPU time."""
    import random

    rng = random.Random(seed)
    toks = [rng.randrange(500) for _ in range(context)]
    d = NgramDrafter()
    d.propose_now("x", toks, 8)
    t0 = _clock()
    for _ in range(steps):
        toks.extend(rng.randrange(500) for _ in range(rng.randint(1, 3)))
        d.propose_now("x", toks, 8)
    return 1e6 * (_clock() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="checkpoint folder (default: the converted SmolLM2)")
    ap.add_argument("--workloads", nargs="*", default=None)
    ap.add_argument("--limit", type=int, default=0, help="prompts per workload (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="override each prompt's max_new_tokens")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--min-n", type=int, default=2)
    ap.add_argument("--max-n", type=int, default=8)
    ap.add_argument("--min-reach", type=float, default=0.25, help="n-gram confidence trimming (0 = off)")
    ap.add_argument("--ceiling", action="store_true",
                    help="also replay each plain output with an oracle prompt-lookup drafter (the best any "
                         "n-gram drafter could do under the fitted latency model)")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model_dir is None:
        from pdserve.modelstore import ensure_default_model

        args.model_dir = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    eos_ids = {tok.eos_token_id} | {tok.convert_tokens_to_ids("<|im_end|>")}
    eos_ids.discard(None)

    controller = SpeculationController(method="ngram")
    drafter = NgramDrafter(min_n=args.min_n, max_n=args.max_n, min_reach=args.min_reach)
    # calibrate the latency model a little so the first request does not run on priors alone
    warm = tok("Hello there, how are you today?")["input_ids"]
    plain_greedy(model, warm, 8, eos_ids, controller)

    print(f"n-gram drafting cost: {ngram_cost_microseconds():.1f} µs per propose on a 2048-token context")
    rows, all_ok = [], True
    match_stats: dict[int, list[int]] = {}  # matched n -> [steps, proposed, accepted]
    print(f"{'workload':<12} {'prompt':<8} {'new':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
          f"{'accept':>6} {'tok/step':>8} {'same':>5}", flush=True)
    for wl in get_workloads(args.workloads):
        prompts = wl.prompts[: args.limit] if args.limit else wl.prompts
        agg = {"plain_tokens": 0, "plain_s": 0.0, "spec_tokens": 0, "spec_s": 0.0, "drafted": 0,
               "accepted": 0, "steps": 0, "mismatches": 0,
               "plain_wall_s": 0.0, "spec_wall_s": 0.0}
        for pi, p in enumerate(prompts):
            ids = tok(p.render(tok), add_special_tokens=False)["input_ids"]
            max_new = args.max_new_tokens or p.max_new_tokens
            # alternate which runs first, so warm-up and neighbours' load do not favour one side
            def run_spec():
                return speculative_greedy(model, tok, ids, max_new, eos_ids, drafter, controller,
                                          f"{wl.name}/{p.name}", max_k=args.max_k)

            if pi % 2:
                spec = run_spec()
                plain = plain_greedy(model, ids, max_new, eos_ids, controller)
            else:
                plain = plain_greedy(model, ids, max_new, eos_ids, controller)
                spec = run_spec()
            same = spec.tokens == plain.tokens
            for n, proposed, acc_n in spec.match_log:
                st = match_stats.setdefault(n, [0, 0, 0])
                st[0] += 1; st[1] += proposed; st[2] += acc_n  # noqa: E702
            all_ok &= same
            if args.ceiling:
                agg.setdefault("ceiling", []).append((ids, plain.tokens))
            agg["plain_tokens"] += plain.decode_tokens
            agg["plain_s"] += plain.decode_seconds
            agg["spec_tokens"] += spec.decode_tokens
            agg["spec_s"] += spec.decode_seconds
            agg["plain_wall_s"] += plain.wall_seconds
            agg["spec_wall_s"] += spec.wall_seconds
            agg["drafted"] += spec.drafted
            agg["accepted"] += spec.accepted
            agg["steps"] += spec.steps
            agg["mismatches"] += int(not same)
            acc = spec.accepted / spec.drafted if spec.drafted else 0.0
            ratio = spec.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else 0.0
            tps = spec.decode_tokens / spec.steps if spec.steps else 0.0
            print(f"{wl.name:<12} {p.name:<8} {len(plain.tokens):>4} {plain.tokens_per_second:>11.1f} "
                  f"{spec.tokens_per_second:>10.1f} {ratio:>6.2f} {acc:>6.2f} {tps:>8.2f} {str(same):>5}", flush=True)
            if args.verbose:
                print("   k:", spec.chosen_k)
                print("   text:", repr(tok.decode(plain.tokens))[:300])
            rows.append({"workload": wl.name, "prompt": p.name, "prompt_tokens": len(ids),
                         "new_tokens": len(plain.tokens), "plain_tps": plain.tokens_per_second,
                         "spec_tps": spec.tokens_per_second, "ratio": ratio, "acceptance": acc,
                         "tokens_per_step": tps, "same": same, "chosen_k": spec.chosen_k})
        p_tps = agg["plain_tokens"] / agg["plain_s"] if agg["plain_s"] else 0.0
        s_tps = agg["spec_tokens"] / agg["spec_s"] if agg["spec_s"] else 0.0
        acc = agg["accepted"] / agg["drafted"] if agg["drafted"] else 0.0
        ratio = s_tps / p_tps if p_tps else 0.0
        tps = agg["spec_tokens"] / agg["steps"] if agg["steps"] else 0.0
        verdict = "ok" if ratio >= wl.target_speedup else "BELOW"
        wall_ratio = (agg["plain_wall_s"] / agg["spec_wall_s"] * agg["spec_tokens"] / max(agg["plain_tokens"], 1)
                      if agg["spec_wall_s"] else 0.0)
        print(f"{wl.name:<12} {'ALL':<8} {agg['plain_tokens']:>4} {p_tps:>11.1f} {s_tps:>10.1f} {ratio:>6.2f} "
              f"{acc:>6.2f} {tps:>8.2f} {str(agg['mismatches'] == 0):>5}   target {wl.target_speedup:.2f}x: {verdict}"
              f" (wall-clock ratio {wall_ratio:.2f})",
              flush=True)
        if args.ceiling:
            a, b = controller.latency.verify_coefficients()
            plain_cost = spec_cost = 0.0
            for ids, out in agg["ceiling"]:
                drafted = ngram_ceiling_steps(ids, out, min_n=args.min_n)
                plain_cost += (len(out) - 1) * (a + b)
                spec_cost += sum(a + b * (d + 1) for d in drafted)
            ceiling = plain_cost / spec_cost if spec_cost else 0.0
            print(f"{'':<12} n-gram ceiling (oracle occurrence and k, min_n {args.min_n}, verify "
                  f"{1000 * a:.0f} ms + {1000 * b:.1f} ms/token): {ceiling:.2f}x plain", flush=True)
            agg["ceiling"] = ceiling
        rows.append({"workload": wl.name, "prompt": "ALL", "plain_tps": p_tps, "spec_tps": s_tps, "ratio": ratio,
                     "acceptance": acc, "tokens_per_step": tps, "mismatches": agg["mismatches"], "wall_ratio": wall_ratio,
                     "target": wl.target_speedup, "ngram_ceiling": agg.get("ceiling")})
    for n in sorted(match_stats):
        st = match_stats[n]
        print(f"  matched n={n}: {st[0]} steps, {st[1]} proposed, acceptance {st[2] / max(st[1], 1):.2f}")
    a, b = controller.latency.verify_coefficients()
    print(f"latency fit: verify ≈ {1000 * a:.1f} ms + {1000 * b:.2f} ms/token; stats: {controller.stats.snapshot()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "stats": controller.stats.snapshot(),
                                               "verify_fit_seconds": [a, b]}, indent=2, default=str))
    if not all_ok:
        print("MISMATCH: speculative output differed from plain greedy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
