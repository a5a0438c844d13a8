#!/usr/bin/env bash
# The prepared device check (one H100/H200, under 8 minutes): what a task that draws a GPU runs, in one call.
#   bash bench/gpu_check.sh            # results as JSON under $OUT (the device tool's folder) or /tmp/gpu-check
# 1. the Triton kernels against their torch references, then timed (bench/gpu_kernels.py, trimmed sizes);
# 2. the paged engine on the GPU at bfloat16 and float32: greedy against transformers on the same device, the same
#    answer along cached / chunked / batched / speculative paths, decode step time against the HBM roofline
#    (bench/gpu_engine.py).
# It builds nothing: the GPU machine's image has torch, triton and transformers; pdserve's own pure-Python
# dependencies it lacks (pydantic, pydantic-settings, nats-py, ...) travel as wheels in .whl (the device tool's
# README), installed first when the folder is there. Decode steps are not captured in CUDA graphs (the engine
# launches a step's kernels from Python): there is nothing of that to check yet.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# the checkout as the pdserve namespace: an editable install needs no download (setuptools is in the image)
python3 -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu_check: pdserve did not install"; exit 1; }
status=0
echo "== 1. Triton kernels (bench/gpu_kernels.py)"
timeout 240 python3 -P bench/gpu_kernels.py --batches 1,16,64 --ks 1,4 --vocabs 49152 --contexts 512,4096 \
  --out "$out/gpu_kernels.json" || status=1
for dtype in bfloat16 float32; do
  echo "== 2. the paged engine at $dtype (bench/gpu_engine.py)"
  timeout 150 python3 -P bench/gpu_engine.py --dtype "$dtype" --out "$out/gpu_engine_$dtype.json" || status=1
done
exit $status
