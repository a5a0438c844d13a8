"""The `pdserve` command line: one entry point, each subcommand owned by the part it runs."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> ("module:function", help). Each function takes argv (list[str]) and returns an exit code.
# Imported lazily so `pdserve --help` does not pay for torch.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdserve.local:main", "run NATS, prefill, decode and the HTTP front as local processes"),
    "front": ("pdserve.front.server:main", "run the OpenAI-compatible HTTP front"),
    "prefill": ("pdserve.prefill.worker:main", "run a prefill worker"),
    "decode": ("pdserve.decode.worker:main", "run a decode worker"),
    "draftpool": ("pdserve.draftpool.server:main", "run a draft pool: fleet-wide suffix drafts for decode workers"),
    "top": ("pdserve.top:main", "a terminal view of a running deployment: pools, workers, queues, rates, latency"),
    "model": ("pdserve.modelcli:main", "fetch/convert models into the local cache"),
    "bench": ("pdserve.bench:main", "benchmarks: serving path vs transformers generate"),
    "operator": ("pdserve.operator.main:main", "run the Kubernetes operator (kopf)"),
    "metrics-adapter": ("pdserve.autoscale.adapter:main", "serve custom.metrics.k8s.io from worker load reports"),
    "webhook-check": ("pdserve.operator.webhookcheck:main",
                      "wait until the API server reaches the admission webhook (the chart's install hook)"),
}

# The commands that hold a model's weights and KV cache in host memory. Their torch allocations of 2 MB and
# more go on transparent huge pages (`THP_MEM_ALLOC_ENABLE`, read once by torch's CPU allocator, so set
# before torch loads): a step reads every weight and every cached key and value once, scattered over
# hundreds of MB, and on 4 KB pages a good part of that time goes to TLB misses (docs/PERFORMANCE.md,
# "Huge pages"). Needs the kernel's THP `madvise` or `always` mode (the usual defaults); a user's
# `THP_MEM_ALLOC_ENABLE=0` keeps 4 KB pages.
HUGE_PAGE_COMMANDS = frozenset({"prefill", "decode", "bench"})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_text) in SUBCOMMANDS.items():
            sub.add_parser(name, help=help_text, add_help=False)
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}")
        parser.print_help()
        return 0 if argv else 2
    target, help_text = SUBCOMMANDS[argv[0]]
    if argv[0] in HUGE_PAGE_COMMANDS:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from pdserve.config import COMMANDS, load

    if argv[0] in COMMANDS:
        # Settings are checked (and --help printed) before the command's module imports torch,
        # so a typo is refused at once.
        load(COMMANDS[argv[0]], argv[1:], prog=f"pdserve {argv[0]}", description=help_text)
    module, func = target.split(":")
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
