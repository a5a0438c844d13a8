"""Layer streaming through the real workers: a 2,000-token prompt, KV sent layer by layer during the
prompt's last forward vs sent after prefill, side by side in one run (issue #5).

Two local clusters on one embedded NATS (one prefill, one decode worker each, one torch thread),
the same greedy request to both, repeated: time to the first token (prefill streams it straight to
the front, so the KV move is never on it), time to the second token (decode's first step, which
needs the KV in place) and the gap between them, which is where the handoff shows.

    python bench/layer_streaming.py [--tokens 2000] [--repeats 5] [--json out.json]
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

from bench.sse import sse_events  # noqa: E402

LONG = (Path(__file__).resolve().parent.parent / "tests" / "data" / "long_prompt.txt").read_text()


def first_two_tokens(url: str, model: str, ids: list[int]) -> tuple[float, float]:
    body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps = []
    for ev in sse_events(url, "/v1/completions", body, timeout=600):
        for ch in ev.get("choices", []):
            # a token event; the second token arrives with its finish reason
            if ch.get("finish_reason") is None or len(stamps) == 1:
                stamps.append(time.perf_counter() - t0)
    return stamps[0], stamps[1]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from pdserve.local import LocalCluster
    from pdserve.modelstore import resolve_model
    from pdserve.natsserver import EmbeddedNats

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model_dir = resolve_model("default")
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = tok.encode(LONG, add_special_tokens=False)
    nats = EmbeddedNats().start()
    out = {}
    try:
        for name, flag in (("send_after_prefill", "--no-kv-stream-layers"), ("layer_streamed", "--kv-stream-layers")):
            # every prompt distinct from the first token on: no prefix cache hits between repeats
            prompts = [[(7 * r + 1) % 1000 + 1000] + (base * 2)[r : r + args.tokens - 1] for r in range(args.repeats + 1)]
            with LocalCluster(str(model_dir), 1, 1, nats=nats.creds, worker_args={"prefill": [flag]}) as c:
                first_two_tokens(c.url, model_dir.name, prompts[0])  # warm-up
                rows = [first_two_tokens(c.url, model_dir.name, ids) for ids in prompts[1:]]
            out[name] = {"ttft_s": statistics.median(r[0] for r in rows),
                         "second_token_s": statistics.median(r[1] for r in rows),
                         "gap_s": statistics.median(r[1] - r[0] for r in rows)}
    finally:
        nats.close()
    a, b = out["send_after_prefill"], out["layer_streamed"]
    print(f"{args.tokens}-token prompt, median of {args.repeats}")
    print(f"{'':22}{'TTFT s':>10}{'2nd token s':>13}{'gap s':>9}")
    for name, r in out.items():
        print(f"{name:22}{r['ttft_s']:>10.3f}{r['second_token_s']:>13.3f}{r['gap_s']:>9.3f}")
    print(f"layer streaming: second token {a['second_token_s'] / b['second_token_s']:.2f}x sooner, "
          f"gap {a['gap_s'] / max(b['gap_s'], 1e-9):.2f}x shorter")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
