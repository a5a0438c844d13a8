"""The native bfloat16 decoder layer against transformers' forward, per decode batch size, on this CPU.

    python -P bench/native_decode.py [--model default] [--context 256] [--steps 20]

Two engines of the same model in bfloat16, one torch thread: the default (steps of up to 16 rows run
`kernels/cpu_decoder.c`) and one built without it, whose projections keep the fastest layout a
calibration finds (oneDNN's packed weights here). Each decodes batches of 1, 4, 8 and 16 sequences of
`--context` tokens; printed: ms per step (median of `--steps`) side by side and the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from pdserve.engine.calibrate import measure
    from pdserve.engine.runner import PagedRunner
    from pdserve.engine.native import NativeDecoder
    from pdserve.modelstore import resolve_model

    model_dir = resolve_model(args.model)
    native = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=1024, prefix_cache=False)
    if native.model.native is None:
        print("the native decoder does not run here (no AVX512-BF16, no C compiler, or another architecture)")
        return 1
    build = NativeDecoder.from_model
    NativeDecoder.from_model = classmethod(lambda cls, model: None)
    try:
        plain = PagedRunner(model_dir, dtype=torch.bfloat16, num_blocks=1024, prefix_cache=False)
    finally:
        NativeDecoder.from_model = build
    measure(plain, [1, 4, 8, 16], context_tokens=64, repeats=1)  # its fastest layouts (the worker's calibration)
    vocab = native.vocab_size
    sizes = (1, 4, 8, 16)
    print(f"{model_dir.name}, bfloat16, {args.context} tokens of context, one torch thread; plan {plain.model.step_plan[1:17:5]}")
    print(f"{'batch':>5} {'native ms':>10} {'transformers ms':>16} {'speed-up':>9}")
    with torch.inference_mode():
        for r in (native, plain):
            for s in range(max(sizes)):
                r.prefill(s, [(7919 * (i + 31 * s) + 13) % vocab for i in range(args.context)])
        for b in sizes:
            times = {}
            for name, r in (("native", native), ("plain", plain)):
                batch = [(s, [5]) for s in range(b)]
                r.step(batch)
                runs = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    r.step(batch)
                    runs.append(time.perf_counter() - t)
                for s in range(b):
                    r.rollback(s, args.context)
                times[name] = statistics.median(runs) * 1e3
            print(f"{b:>5} {times['native']:>10.1f} {times['plain']:>16.1f} {times['plain'] / times['native']:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
