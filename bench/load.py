"""Serving under load (issue #6's acceptance table): pdserve vs sequential `transformers` generate, one run.

Starts a local cluster (embedded NATS, one prefill and one decode worker, the front; one torch
thread each) on the default model and prints, side by side:

1. Closed loop at concurrency 1, 4 and 16 over one mixed request set (prompts 32-512 tokens,
   outputs 16-128 tokens, greedy, fixed lengths), and sequential in-process `generate` over the
   same set: aggregate output tokens/s, TTFT and inter-token latency percentiles, and the ratio
   of tokens/s to `generate`'s.
2. Open loop: Poisson arrivals at several rates over the same kind of mix: the same columns.
3. Shared system prompt: a ~1,000-token system prompt, TTFT on a miss (a system prompt nobody
   sent before) vs on a hit (one that the prefix cache holds): the ratio.
4. Multi-turn chat: turn 2 of conversations whose turn 1 was answered, after a short think time,
   through the pre-positioning front vs a second front on the same workers that sends no hints
   (so both have the prefix cache, only one pre-positioning): TTFT of turn 2, the ratio, and how
   often pre-positioning hit.

    python bench/load.py [--quick] [--json out.json]

Token/s of `generate` counts output tokens over its wall time (prefill included), the same
accounting as pdserve's aggregate.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.append(str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.sse import delta_text, sse_events  # noqa: E402

LONG = (Path(__file__).resolve().parent.parent / "tests" / "data" / "long_prompt.txt").read_text()


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[i]


def request_set(tok, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """`n` (prompt ids, output tokens) pairs: mixed lengths cut from different places of a long text."""
    rng = random.Random(seed)
    base = tok.encode(LONG, add_special_tokens=False)
    out = []
    for _ in range(n):
        plen = rng.choice([32, 64, 128, 256, 512])
        start = rng.randrange(0, len(base) - plen)
        out.append((base[start : start + plen], rng.choice([16, 32, 64, 128])))
    return out


# -- pdserve client --------------------------------------------------------------------------


def stream(url: str, model: str, body: dict) -> dict:
    """One streamed request; token arrival times relative to the send."""
    body = {"model": model, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **body}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    t0 = time.perf_counter()
    stamps, usage, text = [], {}, []
    for ev in sse_events(url, path, body):
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            piece = delta_text(ch)
            if piece:
                stamps.append(time.perf_counter() - t0)
                text.append(piece)
    return {"stamps": stamps, "usage": usage, "text": "".join(text), "sent": t0}


def summarise(results: list[dict], wall: float) -> dict:
    ttft = [r["stamps"][0] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p90": percentile(itl, 90), "itl_p99": percentile(itl, 99)}


def closed_loop(url: str, model: str, reqs, concurrency: int) -> dict:
    todo = list(enumerate(reqs))
    lock = threading.Lock()
    results: list[dict] = []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                _, (ids, n) = todo.pop(0)
            r = stream(url, model, {"prompt": ids, "max_tokens": n})
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarise(results, time.perf_counter() - t0)


def open_loop(url: str, model: str, reqs, rate: float, seed: int = 1) -> dict:
    rng = random.Random(seed)
    results: list[dict] = []
    lock = threading.Lock()

    def one(ids, n):
        r = stream(url, model, {"prompt": ids, "max_tokens": n})
        with lock:
            results.append(r)

    threads = []
    t0 = time.perf_counter()
    for ids, n in reqs:
        t = threading.Thread(target=one, args=(ids, n))
        t.start()
        threads.append(t)
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join()
    return summarise(results, time.perf_counter() - t0)


# -- the baseline ----------------------------------------------------------------------------


class _Stamps:
    """A `generate` streamer that stamps every new token (the first `put` is the prompt)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.stamps: list[float] = []
        self._prompt = True

    def put(self, value):
        if self._prompt:
            self._prompt = False
            return
        self.stamps.append(time.perf_counter() - self.t0)

    def end(self):
        pass


def sequential_generate(model, reqs) -> dict:
    results = []
    t0 = time.perf_counter()
    for ids, n in reqs:
        s = _Stamps()
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, streamer=s)
        results.append({"stamps": s.stamps, "usage": {"completion_tokens": len(s.stamps)}})
    return summarise(results, time.perf_counter() - t0)


# -- prefix and pre-positioning --------------------------------------------------------------


def system_prompt_ttft(url: str, model: str, tok, repeats: int) -> dict:
    base = tok.encode(LONG, add_special_tokens=False)
    system = tok.decode(base[:1000])
    questions = ["Who is the text about?", "Name one place in the text.", "What year is mentioned?",
                 "Summarise the first paragraph.", "What happens at the end?"]
    stream(url, model, {"messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": "Warm up."}], "max_tokens": 1})
    miss, hit, cached = [], [], 0
    for i in range(repeats):
        q = questions[i % len(questions)]
        fresh = f"[session {random.getrandbits(48):x}] " + system  # differs from the first token: nothing cached
        m = stream(url, model, {"messages": [{"role": "system", "content": fresh}, {"role": "user", "content": q}],
                                "max_tokens": 2})
        h = stream(url, model, {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                                "max_tokens": 2})
        miss.append(m["stamps"][0])
        hit.append(h["stamps"][0])
        cached = h["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    prompt_tokens = h["usage"].get("prompt_tokens", 0)
    return {"prompt_tokens": prompt_tokens, "cached_tokens_on_hit": cached, "ttft_miss_s": statistics.median(miss),
            "ttft_hit_s": statistics.median(hit), "ratio": statistics.median(miss) / statistics.median(hit)}


def multi_turn(url: str, control_url: str, model: str, conversations: int, think_s: float) -> dict:
    """Turn 2 TTFT with pre-positioning (url) vs without (control_url: a front that sends no hints)."""
    base = LONG.split(". ")
    out = {}
    for name, u in (("preposition", url), ("prefix_cache_only", control_url)):
        ttft, hits = [], 0
        for c in range(conversations):
            # the same topics in both arms, so turn 2 differs only in what was cached (the label at the start of
            # the user message keeps the arms' prompts apart from the first block on: no KV is shared between them)
            topic = ". ".join(base[(c * 7) % len(base):][:3])
            turn1 = [{"role": "user", "content": f"Conversation {name} {c}. Read this and retell it at length: {topic}"}]
            a1 = stream(u, model, {"messages": turn1, "max_tokens": 160})
            time.sleep(think_s)  # the user reads and types; the worker is idle
            turn2 = turn1 + [{"role": "assistant", "content": a1["text"]},
                             {"role": "user", "content": "Thanks. And in one word?"}]
            a2 = stream(u, model, {"messages": turn2, "max_tokens": 2})
            ttft.append(a2["stamps"][0])
            hits += bool(a2["usage"].get("prompt_tokens_details", {}).get("prepositioned"))
        out[name] = {"ttft_turn2_s": statistics.median(ttft), "hits": hits, "conversations": conversations}
    out["ratio"] = out["prefix_cache_only"]["ttft_turn2_s"] / out["preposition"]["ttft_turn2_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.local import LocalCluster
    from pdserve.modelstore import resolve_model
    from pdserve.natsserver import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--requests", type=int, default=32, help="requests in the closed-loop set")
    p.add_argument("--rates", default="0.5,1,2", help="Poisson arrival rates (requests/s)")
    p.add_argument("--quick", action="store_true", help="a smaller run (16 requests, one rate, fewer repeats)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    n_req = 16 if args.quick else args.requests
    rates = [1.0] if args.quick else [float(r) for r in args.rates.split(",")]
    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs = request_set(tok, n_req)
    report: dict = {"requests": n_req, "closed_loop": {}, "open_loop": {}}

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sequential_generate(hf, reqs[:2])  # warm-up
    report["generate"] = base = sequential_generate(hf, reqs)
    del hf

    cluster = LocalCluster(str(model_dir), 1, 1)
    cluster.start()
    try:
        name = model_dir.name
        control_port = free_port()
        cluster.spawn("front-nohints", "front", "--model", str(model_dir), "--port", str(control_port),
                      "--no-preposition")
        control_url = f"http://127.0.0.1:{control_port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(control_url + "/ready", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        closed_loop(cluster.url, name, reqs[:4], 4)  # warm-up
        for c in (1, 4, 16):
            report["closed_loop"][c] = closed_loop(cluster.url, name, reqs, c)
        for rate in rates:
            report["open_loop"][rate] = open_loop(cluster.url, name, request_set(tok, n_req, seed=2), rate)
        report["system_prompt"] = system_prompt_ttft(cluster.url, name, tok, 3 if args.quick else 5)
        report["multi_turn"] = multi_turn(cluster.url, control_url, name, 2 if args.quick else 4, think_s=3.0)
    finally:
        cluster.stop()

    cols = ("tok/s", "x generate", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99")
    print(f"\n{n_req} requests, prompts 32-512 tokens, outputs 16-128 tokens, greedy; one torch thread per process")
    print(f"{'':28}" + "".join(f"{c:>11}" for c in cols))

    def row(label, s):
        vals = (s["tok_s"], s["tok_s"] / base["tok_s"], s["ttft_p50"], s["ttft_p90"], s["ttft_p99"],
                s["itl_p50"] * 1e3, s["itl_p90"] * 1e3, s["itl_p99"] * 1e3)
        print(f"{label:28}" + "".join(f"{v:>11.2f}" for v in vals))

    row("generate, sequential", base)
    for c, s in report["closed_loop"].items():
        row(f"pdserve, concurrency {c}", s)
    for rate, s in report["open_loop"].items():
        row(f"pdserve, Poisson {rate}/s", s)
    print("(TTFT in s, ITL in ms)")
    sp = report["system_prompt"]
    print(f"\nshared system prompt ({sp['prompt_tokens']} tokens, {sp['cached_tokens_on_hit']} cached on a hit): "
          f"TTFT miss {sp['ttft_miss_s']:.3f} s, hit {sp['ttft_hit_s']:.3f} s -> {sp['ratio']:.1f}x")
    mt = report["multi_turn"]
    print(f"multi-turn, turn 2 TTFT: pre-positioning {mt['preposition']['ttft_turn2_s']:.3f} s "
          f"(hits {mt['preposition']['hits']}/{mt['preposition']['conversations']}), prefix cache only "
          f"{mt['prefix_cache_only']['ttft_turn2_s']:.3f} s -> {mt['ratio']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
