"""What tracing costs a serving process per request, in CPU: the spans one process records for a request, made
and exported over OTLP/HTTP (to a receiver in another process), against the same loop with tracing off.

    python bench/trace_overhead.py [--requests 2000] [--steps 64]

Each request records what decode records for it (`decode.request` with `handoff.import`, `decode.admission`,
`decode.queue` and one `decode.steps` span per 32 steps; the front and prefill record about as many), then the
provider is shut down so every span is exported before the clock stops. Off, the same loop runs its None tests
only. Prints CPU microseconds per request each way. bench/peer.py's trace-* builds measure the same end to end.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SINK = """
import sys
sys.path.append(sys.argv[1])
from bench.otlp_sink import OtlpReceiver
r = OtlpReceiver()
print(r.port, flush=True)
sys.stdin.read()  # until the parent closes it
print(len(r.spans()), flush=True)
"""


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_request(tracing, i: int, steps: int) -> None:
    s = tracing.start_request("decode.request", None, **{"pdserve.request_id": f"cmpl-{i}"})
    if s is None:  # off: what the workers do per instrumentation point
        for _ in range(3 + steps):
            pass
        return
    for name in ("handoff.import", "decode.admission", "decode.queue"):
        s.child(name, tracing.now_ns(), **{"pdserve.kv.bytes": 1 << 20, "pdserve.kv.transport": "shm"})
    group = tracing.StepGroup(s)
    for k in range(steps):
        now = tracing.now_ns()
        group.add(k, now, now, 1, 4, 2, 8)
    group.flush()
    s.end(**{"pdserve.tokens": steps})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--steps", type=int, default=64, help="decode steps per request")
    args = p.parse_args(argv)
    from pdserve import tracing

    c0 = cpu_s()
    for i in range(args.requests):
        one_request(tracing, i, args.steps)
    off = (cpu_s() - c0) / args.requests

    sink = subprocess.Popen([sys.executable, "-P", "-c", SINK, str(REPO)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    port = int(sink.stdout.readline())
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                       "OTEL_BSP_MAX_QUEUE_SIZE": str(16 * args.requests)})  # a burst this fast: keep every span
    if not tracing.configure("decode"):
        print("the otel extra is not installed", file=sys.stderr)
        return 2
    c0, t0 = cpu_s(), time.perf_counter()
    for i in range(args.requests):
        one_request(tracing, i, args.steps)
    tracing.shutdown(60)
    on, wall = (cpu_s() - c0) / args.requests, time.perf_counter() - t0
    sink.stdin.close()
    received = int(sink.stdout.readline())
    sink.wait(30)
    per = 4 + -(-args.steps // tracing.STEP_GROUP)
    print(f"{args.requests} requests of {args.steps} decode steps ({per} spans each; {received} received)")
    print(f"tracing off: {off * 1e6:8.1f} us CPU per request")
    print(f"tracing on:  {on * 1e6:8.1f} us CPU per request, export included ({wall:.1f} s wall)")
    return 0


if __name__ == "__main__":
    sys.path.append(str(REPO))
    sys.exit(main())
