"""`pdserve model fetch|path|fingerprint`: manage the local model cache."""
from __future__ import annotations

import argparse

from pdserve.modelstore import ensure_default_model, model_fingerprint, resolve_model


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve model")
    p.add_argument("action", choices=["fetch", "path", "fingerprint"])
    p.add_argument("--model", default="default", help="a checkpoint folder, or 'default'")
    a = p.parse_args(argv)
    if a.action == "fetch":
        print(ensure_default_model())
    elif a.action == "path":
        print(resolve_model(a.model))
    else:
        print(model_fingerprint(resolve_model(a.model)))
    return 0
