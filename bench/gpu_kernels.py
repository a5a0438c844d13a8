"""GPU check and benchmark of the Triton kernels against their torch references, side by side in one run.

On CUDA:
  1. correctness — fused spec verification vs the torch reference on random ragged batches (greedy and
     sampled rows, top-k / top-p, with and without draft probabilities, one noise row per request and
     per-position noise: the coupled mode), KV pack/unpack vs the reference (int8 payload bytes, fp8
     payload bytes, dequantised values), paged attention vs the reference on ragged decode / spec /
     prefill batches with shuffled block tables (float32: 1e-4, bf16: 2e-2);
  2. speed — fused verify vs the unfused torch reference (CUDA events, median of N) for batch 1..256,
     k 1..8, vocab 49,152 and 128,256, for greedy / sampled / sampled+top-p batches, and the coupled
     mode; KV pack and unpack throughput in GB/s (bytes read + bytes written) next to the torch
     reference; paged attention (bf16, block size 16) for decode and spec (k+1 = 5 queries) at batch
     1..256, context 512..8192, head_dim 64 (SmolLM2: 9 q / 3 kv heads) and 128 (Llama-3-8B: 32 / 8),
     kernel vs the torch reference, with the KV bytes read per second.
Prints tables, writes JSON to --out, exits 1 if a correctness check fails.

    python bench/gpu_kernels.py --out gpu_kernels.json
    python bench/gpu_kernels.py --smoke --out /tmp/smoke.json   # CPU, Triton interpreter, tiny sizes
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU through Triton's interpreter")
    ap.add_argument("--iters", type=int, default=None, help="timed repetitions per point (median reported)")
    ap.add_argument("--batches", default=None, help="comma list, default 1,4,16,64,256")
    ap.add_argument("--ks", default=None, help="comma list, default 1,2,4,8")
    ap.add_argument("--vocabs", default=None, help="comma list, default 49152,128256")
    ap.add_argument("--contexts", default=None, help="paged attention contexts, comma list, default 512,2048,8192")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: verify,kv,attention")
    return ap.parse_args()


ARGS = _parse()
if ARGS.smoke:
    # must be set before the kernel modules import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from pdserve.kernels import kv_quant, paged_attention, spec_verify  # noqa: E402

if ARGS.smoke:
    torch.set_num_threads(1)
DEVICE = "cuda" if (torch.cuda.is_available() and not ARGS.smoke) else "cpu"
if DEVICE == "cpu" and not ARGS.smoke:
    sys.exit("no CUDA device: run with --smoke for the CPU/interpreter check")

MODES = {
    # name: (temperature, top_k, top_p) for every row of the batch; "mixed" alternates greedy/sampled
    "greedy": (0.0, 0, 1.0),
    "sampled": (0.8, 0, 1.0),
    "sampled+top-p": (0.8, 0, 0.95),
    "mixed": None,
}


def _ints(text: str | None, default: list[int]) -> list[int]:
    return [int(x) for x in text.split(",")] if text else default


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# inputs


def verify_inputs(batch: int, k: int, vocab: int, mode: str, with_q: bool, seed: int = 0, ragged: bool = True,
                  per_position: bool = False):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=g, device=DEVICE) * 3.0
    if ragged:
        num_draft = torch.randint(0, k + 1, (batch,), generator=g, device=DEVICE, dtype=torch.int32)
    else:
        num_draft = torch.full((batch,), k, dtype=torch.int32, device=DEVICE)
    if MODES[mode] is None:
        temperature = torch.where(torch.arange(batch, device=DEVICE) % 2 == 0, 0.0, 0.9).float()
        top_k = torch.where(torch.arange(batch, device=DEVICE) % 3 == 0, 50, 0).to(torch.int32)
        top_p = torch.where(torch.arange(batch, device=DEVICE) % 4 == 1, 0.9, 1.0).float()
    else:
        t, tk, tp = MODES[mode]
        temperature = torch.full((batch,), t, device=DEVICE)
        top_k = torch.full((batch,), tk, dtype=torch.int32, device=DEVICE)
        top_p = torch.full((batch,), tp, device=DEVICE)
    draft_probs = None
    if with_q and k > 0:
        noisy = target[:, :k] + torch.randn(batch, k, vocab, generator=g, device=DEVICE)
        draft_probs = torch.softmax(noisy, dim=-1)
        drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).view(batch, k)
    else:
        agree = torch.rand(batch, k, generator=g, device=DEVICE) < 0.7
        drafts = torch.where(agree, target[:, :k].argmax(-1), torch.randint(0, vocab, (batch, k), generator=g, device=DEVICE))
    uniform, noise = spec_verify.draw_randomness(batch, k, vocab, generator=g, device=DEVICE)
    if per_position:  # [B, K+1, V]: the coupled mode for point-mass drafts of sampled rows
        noise = spec_verify.draw_randomness(batch * (k + 1), 0, vocab, generator=g, device=DEVICE)[1].view(batch, k + 1, vocab)
    return (target, drafts, num_draft, draft_probs, temperature, top_k, top_p, uniform, noise)


def attention_inputs(seqs: list[tuple[int, int]], q_heads: int, kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype, seed: int = 0):
    """A ragged batch over a pool with shuffled blocks. seqs: (tokens in cache, queries this step) per sequence."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks = [-(-length // block_size) for length, _ in seqs]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=g, device=DEVICE).to(torch.int32)
    table = torch.zeros(len(seqs), max(blocks), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    kv_pool = torch.randn(num_blocks, 2, kv_heads, block_size, head_dim, generator=g, device=DEVICE).to(dtype)
    nqs = [n for _, n in seqs]
    q = torch.randn(sum(nqs), q_heads, head_dim, generator=g, device=DEVICE).to(dtype)
    seq_lens = torch.tensor([length for length, _ in seqs], dtype=torch.int32, device=DEVICE)
    query_start = torch.tensor([0] + nqs, device=DEVICE).cumsum(0).to(torch.int32)
    return q, kv_pool, table, seq_lens, query_start, head_dim ** -0.5


# --------------------------------------------------------------------------------------------------
# timing


def time_ms(fn, iters: int) -> float:
    fn()  # warm-up (and compile)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------------
# correctness


def check_verify(sizes) -> list[dict]:
    rows = []
    for batch, k, vocab in sizes:
        for mode in MODES:
            for with_q in (False, True):
                for per_position in (False, True):
                    case = verify_inputs(batch, k, vocab, mode, with_q, seed=batch * 1000 + k * 10 + vocab % 7 + per_position,
                                         per_position=per_position)
                    # min-p (off, 0.05, 0.3 by row) rides on the per-position cases, so the case count stays
                    min_p = (torch.tensor([0.0, 0.05, 0.3], device=DEVICE).repeat(batch)[:batch]
                             if per_position else None)
                    ref_out, ref_acc = spec_verify.verify_reference(*case, min_p=min_p)
                    tri_out, tri_acc = spec_verify.verify_triton(*case, min_p=min_p)
                    bad = int(((ref_out != tri_out).any(dim=1) | (ref_acc != tri_acc)).sum())
                    rows.append({"check": "spec_verify", "batch": batch, "k": k, "vocab": vocab, "mode": mode,
                                 "draft_probs": with_q, "per_position_noise": per_position,
                                 "min_p": per_position, "requests_differing": bad,
                                 "requests": batch, "mean_accepted": float(ref_acc.float().mean())})
    return rows


def check_kv(shapes) -> list[dict]:
    rows = []
    for blocks, heads, block_size, head_dim in shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            g = torch.Generator(device=DEVICE).manual_seed(blocks)
            kv = (torch.randn(blocks, 2, heads, block_size, head_dim, generator=g, device=DEVICE) * 4).to(dtype)
            kv[0] = 0  # a zero block: scale 0, no NaN
            ids = torch.randperm(blocks, generator=g, device=DEVICE)[: max(1, blocks // 2)]
            for fmt in kv_quant.FORMATS:
                p_ref, s_ref = kv_quant.pack_reference(kv, ids, fmt)
                p_tri, s_tri = kv_quant.pack_triton(kv, ids, fmt)
                out_ref, out_tri = torch.zeros_like(kv), torch.zeros_like(kv)
                kv_quant.unpack_reference(p_ref, s_ref, out_ref, ids, fmt)
                kv_quant.unpack_triton(p_ref, s_ref, out_tri, ids, fmt)
                rows.append({"check": "kv_quant", "shape": [blocks, 2, heads, block_size, head_dim], "dtype": str(dtype),
                             "fmt": fmt, "payload_bytes_differing": int((p_ref != p_tri).sum()),
                             "scales_differing": int((s_ref != s_tri).sum()),
                             "values_differing": int((out_ref != out_tri).sum()), "nan": bool(out_tri.isnan().any())})
    return rows


def check_attention(configs, max_len: int, seqs_per_kind: int) -> list[dict]:
    rows = []
    for q_heads, kv_heads, head_dim, block_size, dtype in configs:
        g = torch.Generator().manual_seed(q_heads * 100 + head_dim)
        seqs = []
        for kind, most in (("decode", 1), ("spec", 5), ("prefill", max_len)):
            for _ in range(seqs_per_kind):
                length = int(torch.randint(1, max_len + 1, (1,), generator=g))
                seqs.append((length, min(length, most if kind != "prefill" else int(torch.randint(1, length + 1, (1,), generator=g)))))
        case = attention_inputs(seqs, q_heads, kv_heads, head_dim, block_size, dtype, seed=len(rows))
        ref = paged_attention.paged_attention_reference(*case)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for splits in (None, 4):  # None: as chosen for this batch; 4: split-KV forced
            tri = paged_attention.paged_attention_triton(*case, num_splits=splits)
            err = float((ref.float() - tri.float()).abs().max())
            rows.append({"check": "paged_attention", "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
                         "block_size": block_size, "dtype": str(dtype), "splits": splits or "auto", "sequences": len(seqs),
                         "queries": int(case[0].shape[0]), "max_abs_error": err, "tolerance": tol,
                         "ok": err <= tol and not bool(tri.isnan().any())})
    return rows


# --------------------------------------------------------------------------------------------------
# speed


def bench_verify(batches, ks, vocabs, modes, iters) -> list[dict]:
    rows = []
    total = len(batches) * len(ks) * len(vocabs) * len(modes)
    done = 0
    for vocab in vocabs:
        for k in ks:
            for batch in batches:
                for mode in modes:
                    done += 1
                    progress(f"[verify {done}/{total}] vocab={vocab} k={k} batch={batch} mode={mode}")
                    if mode == "coupled":  # point-mass drafts of sampled rows, per-position noise
                        case = verify_inputs(batch, k, vocab, "sampled", with_q=False, seed=done, ragged=False, per_position=True)
                    else:
                        case = verify_inputs(batch, k, vocab, mode, with_q=True, seed=done, ragged=False)
                    try:
                        ref_ms = time_ms(lambda: spec_verify.verify_reference(*case), iters)
                    except torch.OutOfMemoryError:
                        ref_ms = float("nan")
                        torch.cuda.empty_cache()
                    fused_ms = time_ms(lambda: spec_verify.verify_triton(*case), iters)
                    rows.append({"bench": "spec_verify", "vocab": vocab, "k": k, "batch": batch, "mode": mode,
                                 "reference_ms": ref_ms, "fused_ms": fused_ms, "speedup": ref_ms / fused_ms})
                    del case
    return rows


def bench_attention(shapes, batches, contexts, iters, block_size: int = 16, dtype=torch.bfloat16) -> list[dict]:
    rows = []
    kinds = (("decode", 1), ("spec", 5))
    total = len(shapes) * len(batches) * len(contexts) * len(kinds)
    done = 0
    for q_heads, kv_heads, head_dim in shapes:
        for context in contexts:
            for batch in batches:
                for kind, queries in kinds:
                    done += 1
                    progress(f"[attention {done}/{total}] head_dim={head_dim} context={context} batch={batch} {kind}")
                    case = attention_inputs([(context, queries)] * batch, q_heads, kv_heads, head_dim, block_size, dtype, seed=done)
                    kv_bytes = batch * context * 2 * kv_heads * head_dim * case[1].element_size()
                    try:
                        ref_ms = time_ms(lambda: paged_attention.paged_attention_reference(*case), max(1, min(iters, 3)))
                    except torch.OutOfMemoryError:
                        ref_ms = float("nan")
                        torch.cuda.empty_cache()
                    kernel_ms = time_ms(lambda: paged_attention.paged_attention_triton(*case), iters)
                    rows.append({"bench": "paged_attention", "kind": kind, "q_heads": q_heads, "kv_heads": kv_heads,
                                 "head_dim": head_dim, "context": context, "batch": batch, "dtype": str(dtype),
                                 "reference_ms": ref_ms, "kernel_ms": kernel_ms, "speedup": ref_ms / kernel_ms,
                                 "kv_GBps": kv_bytes / (kernel_ms * 1e-3) / 1e9})
                    del case
                    if DEVICE == "cuda":
                        torch.cuda.empty_cache()
    return rows


def bench_kv(shapes, iters) -> list[dict]:
    rows = []
    for blocks, moved, heads, block_size, head_dim in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            kv = torch.randn(blocks, 2, heads, block_size, head_dim, device=DEVICE).to(dtype)
            ids = torch.randperm(blocks, device=DEVICE)[:moved]
            out = torch.empty_like(kv)
            for fmt in kv_quant.FORMATS:
                progress(f"[kv] blocks={moved} heads={heads} bs={block_size} d={head_dim} {dtype} {fmt}")
                payload, scales = kv_quant.pack_triton(kv, ids, fmt)
                raw_bytes = moved * 2 * heads * block_size * head_dim * kv.element_size()
                wire_bytes = payload.numel() + scales.numel() * 4
                moved_bytes = raw_bytes + wire_bytes  # each direction reads one and writes the other
                res = {"bench": "kv_quant", "dtype": str(dtype), "fmt": fmt, "blocks": moved,
                       "block_shape": [2, heads, block_size, head_dim], "raw_bytes": raw_bytes, "wire_bytes": wire_bytes,
                       "compression": raw_bytes / wire_bytes}
                for name, fn in {
                    "pack_triton": lambda: kv_quant.pack_triton(kv, ids, fmt),
                    "pack_reference": lambda: kv_quant.pack_reference(kv, ids, fmt),
                    "unpack_triton": lambda: kv_quant.unpack_triton(payload, scales, out, ids, fmt),
                    "unpack_reference": lambda: kv_quant.unpack_reference(payload, scales, out, ids, fmt),
                }.items():
                    ms = time_ms(fn, iters)
                    res[f"{name}_ms"] = ms
                    res[f"{name}_GBps"] = moved_bytes / (ms * 1e-3) / 1e9
                rows.append(res)
    return rows


# --------------------------------------------------------------------------------------------------


def print_table(rows: list[dict], cols: list[str]) -> None:
    if not rows:
        return
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))
    print()


def main() -> int:
    if ARGS.smoke:
        check_sizes = [(3, 2, 100)]
        kv_check_shapes = [(4, 2, 4, 16)]
        batches, ks, vocabs = _ints(ARGS.batches, [2]), _ints(ARGS.ks, [2]), _ints(ARGS.vocabs, [64])
        modes = ["greedy", "sampled+top-p", "coupled"]
        kv_shapes = [(8, 4, 2, 4, 16)]
        iters = ARGS.iters or 1
        attention_check = ([(4, 2, 16, 4, torch.float32), (6, 2, 16, 8, torch.bfloat16)], 24, 1)
        attention_shapes, contexts = [(4, 2, 16)], _ints(ARGS.contexts, [32])
    else:
        check_sizes = [(1, 1, 49_152), (8, 4, 49_152), (64, 8, 49_152), (7, 3, 128_256), (256, 2, 128_256)]
        kv_check_shapes = [(64, 3, 16, 64), (128, 8, 16, 128)]
        batches, ks = _ints(ARGS.batches, [1, 4, 16, 64, 256]), _ints(ARGS.ks, [1, 2, 4, 8])
        vocabs = _ints(ARGS.vocabs, [49_152, 128_256])
        modes = [*MODES, "coupled"]
        kv_shapes = [(4096, 1024, 3, 16, 64), (4096, 1024, 8, 16, 128)]  # SmolLM2-135M, Llama-3-8B layouts
        iters = ARGS.iters or 10
        attention_check = ([(9, 3, 64, 16, torch.float32), (9, 3, 64, 16, torch.bfloat16), (32, 8, 128, 16, torch.float32),
                            (32, 8, 128, 16, torch.bfloat16), (32, 8, 128, 32, torch.float16), (12, 2, 80, 16, torch.bfloat16)],
                           3000, 6)
        attention_shapes, contexts = [(9, 3, 64), (32, 8, 128)], _ints(ARGS.contexts, [512, 2048, 8192])

    info = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": __import__("triton").__version__, "smoke": ARGS.smoke,
            "interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1"}
    progress(f"device: {info['device']}  torch {info['torch']}  triton {info['triton']}")

    skip = set(filter(None, ARGS.skip.split(",")))
    verify_checks = kv_checks = attention_checks = verify_rows = kv_rows = attention_rows = []
    if "verify" not in skip:
        progress("correctness: spec_verify")
        verify_checks = check_verify(check_sizes)
    if "kv" not in skip:
        progress("correctness: kv_quant")
        kv_checks = check_kv(kv_check_shapes)
    if "attention" not in skip:
        progress("correctness: paged_attention")
        attention_checks = check_attention(*attention_check)
    print("== correctness: fused verify vs reference (requests whose tokens differ) ==")
    print_table(verify_checks, ["batch", "k", "vocab", "mode", "draft_probs", "per_position_noise", "requests_differing",
                                "mean_accepted"])
    print("== correctness: KV pack/unpack vs reference ==")
    print_table(kv_checks, ["shape", "dtype", "fmt", "payload_bytes_differing", "scales_differing", "values_differing", "nan"])
    print("== correctness: paged attention kernel vs reference ==")
    print_table(attention_checks, ["q_heads", "kv_heads", "head_dim", "block_size", "dtype", "splits", "sequences", "queries",
                                   "max_abs_error", "tolerance", "ok"])

    if "verify" not in skip:
        verify_rows = bench_verify(batches, ks, vocabs, modes, iters)
    if "kv" not in skip:
        kv_rows = bench_kv(kv_shapes, iters)
    if "attention" not in skip:
        attention_rows = bench_attention(attention_shapes, batches, contexts, iters)
    print("== speed: fused verify vs unfused torch reference (ms, median) ==")
    print_table(verify_rows, ["vocab", "k", "batch", "mode", "reference_ms", "fused_ms", "speedup"])
    print("== speed: KV pack/unpack (GB/s = raw + wire bytes per ms) ==")
    print_table(kv_rows, ["dtype", "fmt", "blocks", "block_shape", "compression", "pack_triton_GBps", "pack_reference_GBps",
                          "unpack_triton_GBps", "unpack_reference_GBps"])
    print("== speed: paged attention kernel vs torch reference (ms, median; KV GB/s read by the kernel) ==")
    print_table(attention_rows, ["kind", "head_dim", "context", "batch", "reference_ms", "kernel_ms", "speedup", "kv_GBps"])

    # exact for KV; for verify a differing request needs a decision within an ulp of its boundary (the
    # GPU's exp is not torch's), so allow at most 1 in 1,000 requests
    total_requests = sum(r["requests"] for r in verify_checks)
    differing = sum(r["requests_differing"] for r in verify_checks)
    kv_bad = [r for r in kv_checks if r["payload_bytes_differing"] or r["scales_differing"] or r["values_differing"] or r["nan"]]
    attention_bad = [r for r in attention_checks if not r["ok"]]
    ok = differing <= total_requests // 1000 and not kv_bad and not attention_bad
    result = {"info": info, "ok": ok, "verify_checks": verify_checks, "kv_checks": kv_checks,
              "attention_checks": attention_checks, "verify_bench": verify_rows, "kv_bench": kv_rows,
              "attention_bench": attention_rows}
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump(result, f, indent=1)
        progress(f"wrote {ARGS.out}")
    print(f"correctness: {'OK' if ok else 'FAILED'} ({differing}/{total_requests} verify requests differ, "
          f"{len(kv_bad)} KV checks differ, {len(attention_bad)} paged attention checks out of tolerance)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
