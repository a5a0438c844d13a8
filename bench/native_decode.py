"""The native decoder layers (bfloat16 and float32) against transformers' forward, per decode batch and prompt size.

    python -P bench/native_decode.py [--model default] [--context 256] [--steps 20] [--threads 1]

Two engines of the same model in bfloat16, on `--threads` threads (one: a worker on its own core; two: a
step on a lent core, pdserve.cpulease): the default (steps of up to
`cpu_decoder.max_rows()` rows run `kernels/cpu_decoder.c`: 1024) and one built
without it, whose projections keep the fastest layout a calibration finds (oneDNN's packed weights here).
Each decodes batches of 1 to 64 sequences of `--context` tokens, then prefills prompts of 16 to 256 tokens
(the last row's logits, as prefill does); printed: ms per step (median of `--steps`; of 5 for prompts) side
by side and the ratio, and the same for the model in float32 (what `dtype: auto` serves on a CPU without
AVX512-BF16, and what `--dtype float32` serves anywhere): the native float32 layer against transformers' float32
forward. Where the CPU has AMX, the native engine's AVX512-BF16 path (`PDSERVE_NATIVE_AMX=0`)
gets a column of its own. Torch's OpenMP threads spin for at most 1000 rounds after a parallel region, as
`pdserve up`'s workers' do (`GOMP_SPINCOUNT`): with libgomp's default they spin on, on the core the native
layer's second thread needs (two threads: a 16-row step 32 ms against 23, a 256-token prompt 188 against 154).
Torch's large allocations go on transparent huge pages, as the workers' do (`pdserve.cli`,
`THP_MEM_ALLOC_ENABLE`; `THP_MEM_ALLOC_ENABLE=0` measures 4 KB pages).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # before torch loads libgomp
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch's first allocation
import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pdserve.engine.calibrate import measure
    from pdserve.engine.runner import PagedRunner
    from pdserve.modelstore import resolve_model

    model_dir = resolve_model(args.model)
    blocks = 64 * (args.context // 16 + 2) + 32  # the largest batch's contexts, a prompt and a step each
    native = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=blocks, prefix_cache=False)
    if native.model.native is None:
        print("the native decoder does not run here (no AVX512-BF16 or AVX2 + FMA, no C compiler, or another architecture)")
        return 1
    def transformers_only(dtype):
        r = PagedRunner(model_dir, dtype=dtype, num_blocks=blocks, prefix_cache=False, native_layers=False)
        measure(r, [1, 4, 8, 16], context_tokens=64, repeats=1)  # its fastest layouts (the worker's calibration)
        return r

    plain = transformers_only(torch.bfloat16)
    native32 = PagedRunner(model_dir, dtype=torch.float32, num_blocks=blocks, prefix_cache=False)
    wide = transformers_only(torch.float32)
    from pdserve.kernels import cpu_decoder

    amx = cpu_decoder.use_amx(True)
    top = cpu_decoder.max_rows()
    vocab = native.vocab_size
    sizes = [b for b in (1, 4, 8, 16, 24, 32, 64) if b <= top]
    paths = [("native", native, True), ("plain", plain, amx), ("native32", native32, amx), ("float32", wide, amx)]
    paths += [("avx512", native, False)] if amx else []
    print(f"{model_dir.name}, bfloat16, {args.context} tokens of context, {args.threads} thread(s), native projections on "
          f"{cpu_decoder.isa()}; plan {plain.model.step_plan[1:17:5]}")
    head = (f"{'native ms':>10} {'transformers ms':>16} {'speed-up':>9} {'f32 native':>11} {'f32 transformers':>17} "
            f"{'speed-up':>9}"
            + (f" {'AVX512 ms':>10}" if amx else ""))

    def timed(r, batch, n, undo, last_only=False):
        r.step(batch, last_only=last_only)
        undo()
        runs = []
        for _ in range(n):
            t = time.perf_counter()
            r.step(batch, last_only=last_only)
            runs.append(time.perf_counter() - t)
            undo()
        return statistics.median(runs) * 1e3

    def row(label, times):
        line = f"{label:>12} {times['native']:>10.1f} {times['plain']:>16.1f} {times['plain'] / times['native']:>8.2f}x"
        line += (f" {times['native32']:>11.1f} {times['float32']:>17.1f}"
                 f" {times['float32'] / times['native32']:>8.2f}x")
        if amx:
            line += f" {times['avx512']:>10.1f}" if "avx512" in times else f" {'-':>10}"
        print(line)

    print(f"{'decode batch':>12} {head}")
    with torch.inference_mode():
        for r in (native, plain, native32, wide):
            for s in range(max(sizes)):
                r.prefill(s, [(7919 * (i + 31 * s) + 13) % vocab for i in range(args.context)])
        for b in sizes:
            times = {}
            for name, r, on in paths:
                if name == "avx512" and b > cpu_decoder.MAX_ROWS:
                    continue
                cpu_decoder.use_amx(on)
                batch = [(s, [5]) for s in range(b)]
                times[name] = timed(r, batch, args.steps, lambda: [r.rollback(s, args.context) for s in range(b)])
            cpu_decoder.use_amx(amx)
            row(str(b), times)
        print(f"{'prompt':>12} {head}")
        for n in (16, 64, 128, 256):
            if n > top:
                break
            ids = [(7919 * i + 11) % vocab for i in range(n)]
            times = {}
            for name, r, on in paths:
                if name == "avx512" and n > cpu_decoder.MAX_ROWS:
                    continue
                cpu_decoder.use_amx(on)
                r.start("p", ids, reuse_prefix=False)
                times[name] = timed(r, [("p", ids)], 5, lambda: r.rollback("p", 0), last_only=True)
                r.free("p")
            cpu_decoder.use_amx(amx)
            row(str(n), times)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
