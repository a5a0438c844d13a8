"""Draft pool benchmark: an agent workload whose conversations share structure across requests.

Agent traffic repeats itself across requests: many sessions run the same agent (the same system
prompt and tool schemas), make the same tool calls with the same argument shapes, and edit the same
code. Per-request prompt lookup sees only its own request; the draft pool's fleet suffix index sees
every earlier request's prompt and output. The workload (`shared_agent`): for each base conversation
(the agent traces and code edits of bench/workloads.py), a first session runs it once (its text joins
the index, nothing is measured), then `--variants` later sessions send the same conversation with
their own session line in the last user turn (so no prompt is repeated verbatim) and are measured.
`free_chat` (questions sharing nothing) checks that the pool costs nothing where it cannot help.
`pool_killed` (unless `--no-kill`): more later sessions of the same conversations; the pool process is
SIGKILLed while the first of them decodes on P, which must still finish with the same tokens, and the
rest run on P (pool gone: prompt lookup after failed asks) and on L (local), whose rates are compared.

Two clusters on one NATS server, one torch thread each: P decodes with prompt lookup and the pool
(`--draft-pool`, plus a `pdserve draftpool` process), L with prompt lookup alone. Each measured
prompt runs three ways in rotating order: plain (L, speculation off), local (L, prompt lookup),
pool (P). Greedy throughout, so all three must produce the same tokens (checked). Decode tokens/s
counts tokens after the first over the time after it. From P's decode worker's /metrics: draft and
accepted tokens by drafter (local prompt lookup vs pool), and the pool's round trip as a share of
the decode step time.

    python bench/draft_pool.py [--limit 3] [--variants 2] [--no-kill] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.append(str(Path(__file__).resolve().parent.parent))

from bench.spec_decode import rate, stream_request  # noqa: E402
from bench.workloads import AGENT_TRACE, CODE_EDIT, FREE_CHAT, WorkloadPrompt  # noqa: E402


def session_variant(wp: WorkloadPrompt, session: int) -> WorkloadPrompt:
    """The conversation as another session sends it: its last user turn starts with that session's line."""
    messages = [dict(m) for m in wp.messages]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last]["content"] = f"(session {session}) " + messages[last]["content"]
    return replace(wp, name=f"{wp.name}/s{session}", messages=messages)


def scrape(port: int) -> dict[str, float]:
    """The decode worker's counters this benchmark reads, by sample name with labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("pdserve_spec_drafter_", "pdserve_spec_pool_rtt_seconds", "pdserve_decode_step_seconds_sum",
                            "pdserve_spec_pool_asks")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def summarize(name: str, rows: list[dict], before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def tok_s(key):  # total tokens over total decode time: long answers weigh more, as in serving
        return sum(r[key]["tokens"] - 1 for r in rows) / sum(r[key]["decode_s"] for r in rows)

    def acceptance(source):
        drafted = d.get(f'pdserve_spec_drafter_draft_tokens_total{{drafter="{source}"}}', 0.0)
        return d.get(f'pdserve_spec_drafter_accepted_tokens_total{{drafter="{source}"}}', 0.0) / drafted \
            if drafted else float("nan")

    plain, local, pool = tok_s("plain"), tok_s("local"), tok_s("pool")
    step_s = d.get("pdserve_decode_step_seconds_sum", 0.0)
    return {"workload": name, "prompts": len(rows), "tokens": sum(r["pool"]["tokens"] for r in rows),
            "plain_tok_s": plain, "local_tok_s": local, "pool_tok_s": pool,
            "pool_over_local": pool / local, "pool_over_plain": pool / plain,
            "acceptance_local_drafter": acceptance("local"), "acceptance_pool_drafter": acceptance("pool"),
            "pool_draft_tokens": d.get('pdserve_spec_drafter_draft_tokens_total{drafter="pool"}', 0.0),
            "local_draft_tokens": d.get('pdserve_spec_drafter_draft_tokens_total{drafter="local"}', 0.0),
            "pool_asks_answered": d.get('pdserve_spec_pool_asks_total{outcome="answered"}', 0.0),
            "pool_rtt_share_of_step": d.get("pdserve_spec_pool_rtt_seconds_sum", 0.0) / step_s if step_s else 0.0,
            "same_tokens": all(r["pool"]["text"] == r["local"]["text"] == r["plain"]["text"] for r in rows)}


def summarize_kill(first: dict, rows: list[dict], before: dict, after: dict, killed_at: float,
                   pool_down_s: float) -> dict:
    """The pool killed mid-run: the request decoding at the kill, then the later ones on P (pool gone) vs L."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def tok_s(key):
        return sum(r[key]["tokens"] - 1 for r in rows) / sum(r[key]["decode_s"] for r in rows)

    failed = {o: d.get(f'pdserve_spec_pool_asks_total{{outcome="{o}"}}', 0.0) for o in ("timeout", "unavailable", "error")}
    return {"workload": "pool_killed", "prompts": len(rows), "tokens": sum(r["pool"]["tokens"] for r in rows),
            "killed_after_s": killed_at, "pool_gone_s": pool_down_s,
            "in_flight_same_tokens": first["pool"]["text"] == first["local"]["text"],
            "in_flight_tokens": first["pool"]["tokens"], "in_flight_pool_tok_s": rate(first["pool"]),
            "in_flight_local_tok_s": rate(first["local"]),
            "local_tok_s": tok_s("local"), "pool_dead_tok_s": tok_s("pool"),
            "pool_dead_over_local": tok_s("pool") / tok_s("local"),
            "failed_asks": failed, "skipped_asks": d.get('pdserve_spec_pool_asks_total{outcome="skipped"}', 0.0),
            "answered_asks": d.get('pdserve_spec_pool_asks_total{outcome="answered"}', 0.0),
            "same_tokens": all(r["pool"]["text"] == r["local"]["text"] for r in [first, *rows])}


def main() -> int:
    from pdserve.local import LocalCluster
    from pdserve.modelstore import resolve_model
    from pdserve.natsserver import EmbeddedNats, free_port

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--limit", type=int, default=3, help="base conversations per source (agent traces, code edits)")
    p.add_argument("--variants", type=int, default=2, help="measured later sessions per base conversation")
    p.add_argument("--free-chat", type=int, default=3, help="free chat prompts")
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--no-kill", action="store_true", help="skip the pool-killed phase")
    p.add_argument("--kill-after", type=float, default=1.5,
                   help="seconds into the first pool_killed request (on P) at which the pool is SIGKILLed")
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default=None, help="keep the clusters' logs here")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both clusters' (the workers' own default, auto, is bfloat16 on a CPU with native bf16, "
                        "where a k-row step rounds unlike a 1-row one and greedy outputs may part at near ties)")
    a = p.parse_args()
    model_dir = resolve_model(a.model)
    name = model_dir.name
    bases = AGENT_TRACE.prompts[: a.limit] + CODE_EDIT.prompts[: a.limit]
    spec = ["--spec-method", "ngram", "--spec-max-k", str(a.max_k)]
    metrics = free_port()
    # a shared machine may be slow to take a request: waiting longer is not decode speed
    front = ["--dispatch-timeout", "120"]
    if a.log_dir:
        for side in ("pool", "local"):
            Path(a.log_dir, side).mkdir(parents=True, exist_ok=True)
    nats = EmbeddedNats().start()
    try:
        env = {"PDSERVE_DTYPE": a.dtype}
        with LocalCluster(str(model_dir), nats=nats.creds, log_dir=a.log_dir and f"{a.log_dir}/pool", env=env,
                          worker_args={"decode": [*spec, "--draft-pool", "--metrics-port", str(metrics)],
                                       "front": front}) as P, \
                LocalCluster(str(model_dir), nats=nats.creds, log_dir=a.log_dir and f"{a.log_dir}/local", env=env,
                             worker_args={"decode": spec, "front": front}) as L:
            P.spawn("draftpool", "draftpool", "--model", str(model_dir))

            def run(key, wp):
                url = P.url if key == "pool" else L.url
                return stream_request(url, name, wp.messages, wp.max_new_tokens, spec=key != "plain")

            order = ["plain", "local", "pool"]
            for key in order:  # first-request costs (connections, allocator) are not decode speed
                run(key, replace(FREE_CHAT.prompts[-1], max_new_tokens=4))
            for wp in bases:  # the first session of each conversation: its text joins the pool's index
                run("pool", wp)
            results, i = [], 0
            measured = {"shared_agent": [session_variant(wp, s) for s in range(1, a.variants + 1) for wp in bases],
                        "free_chat": FREE_CHAT.prompts[: a.free_chat]}
            summary = []
            for workload, prompts in measured.items():
                before, rows = scrape(metrics), []
                for wp in prompts:
                    row = {"workload": workload, "prompt": wp.name}
                    for key in order[i % 3:] + order[: i % 3]:  # rotate which runs first
                        row[key] = run(key, wp)
                    i += 1
                    rows.append(row)
                    print(f"  {workload}/{wp.name}: plain {rate(row['plain']):.2f}, local {rate(row['local']):.2f}, "
                          f"pool {rate(row['pool']):.2f} tok/s", flush=True)
                summary.append(summarize(workload, rows, before, scrape(metrics)))
                results += rows
            if not a.no_kill:
                killed = [session_variant(wp, a.variants + 1) for wp in bases]
                before = scrape(metrics)
                first = {"workload": "pool_killed", "prompt": killed[0].name, "local": run("local", killed[0])}
                out: dict = {}
                t = threading.Thread(target=lambda: out.update(pool=run("pool", killed[0])))
                t0 = time.perf_counter()
                t.start()
                time.sleep(a.kill_after)
                P.kill("draftpool")
                killed_at, gone = time.perf_counter() - t0, time.perf_counter()
                t.join()
                first["pool"] = out["pool"]  # raises KeyError if that request failed: the bench's claim is it does not
                print(f"  pool killed {killed_at:.2f} s into {killed[0].name}: it finished with "
                      f"{first['pool']['tokens']} tokens, {'the same' if first['pool']['text'] == first['local']['text'] else 'OTHER'} "
                      f"tokens as local", flush=True)
                rows = []
                for j, wp in enumerate(killed[1:]):
                    row = {"workload": "pool_killed", "prompt": wp.name}
                    for key in (("local", "pool") if j % 2 else ("pool", "local")):
                        row[key] = run(key, wp)
                    rows.append(row)
                    print(f"  pool_killed/{wp.name}: local {rate(row['local']):.2f}, pool gone {rate(row['pool']):.2f} tok/s",
                          flush=True)
                kill_summary = summarize_kill(first, rows, before, scrape(metrics), killed_at, time.perf_counter() - gone)
                results += [first, *rows]
    finally:
        nats.close()

    print(f"\ndraft pool, {name}, greedy, decode tokens/s (after the first token), one torch thread, wall clock; "
          f"max k {a.max_k}; local = per-request prompt lookup, pool = prompt lookup + fleet suffix drafts")
    hdr = (f"{'workload':<13} {'prompts':>7} {'tokens':>6} | {'plain':>6} {'local':>6} {'pool':>6} | "
           f"{'pool/local':>10} {'pool/plain':>10} | {'acc local':>9} {'acc pool':>8} {'rtt/step':>8} {'same':>5}")
    print(hdr + "\n" + "-" * len(hdr))
    for s in summary:
        print(f"{s['workload']:<13} {s['prompts']:>7} {s['tokens']:>6} | {s['plain_tok_s']:>6.2f} "
              f"{s['local_tok_s']:>6.2f} {s['pool_tok_s']:>6.2f} | {s['pool_over_local']:>9.2f}x "
              f"{s['pool_over_plain']:>9.2f}x | {s['acceptance_local_drafter']:>9.2f} "
              f"{s['acceptance_pool_drafter']:>8.2f} {s['pool_rtt_share_of_step']:>8.3f} {str(s['same_tokens']):>5}")
    if not a.no_kill:
        k = kill_summary
        f = k["failed_asks"]
        print(f"\npool killed {k['killed_after_s']:.2f} s into a request: it finished ({k['in_flight_tokens']} tokens, "
              f"same tokens as local: {k['in_flight_same_tokens']}; {k['in_flight_pool_tok_s']:.2f} vs local "
              f"{k['in_flight_local_tok_s']:.2f} tok/s). Then {k['prompts']} requests over {k['pool_gone_s']:.0f} s with the "
              f"pool gone: {k['pool_dead_tok_s']:.2f} tok/s vs local {k['local_tok_s']:.2f} "
              f"({k['pool_dead_over_local']:.3f}x); failed asks {f['unavailable']:.0f} no responders, {f['timeout']:.0f} "
              f"timed out, {f['error']:.0f} errors; {k['skipped_asks']:.0f} skipped in back-off; same tokens: {k['same_tokens']}")
        summary.append(kill_summary)
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
