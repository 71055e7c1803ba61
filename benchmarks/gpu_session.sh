#!/usr/bin/env bash
# One call on a borrowed GPU machine (the device tool's `run`, ~15 minutes of device time in
# all): the CUDA tests, then bench_gpu.py, every log and the JSON under $OUT. The machine's
# image already has torch, triton and transformers, and reaches no package index, so
# lessmem runs from the checkout (PYTHONPATH) without installing its dependencies; tests
# needing a package it lacks skip. Commit $OUT/gpu.json as benchmarks/results/gpu.json.
#
#   device run: bash benchmarks/gpu_session.sh        (timeout_s 560 leaves time to rerun)
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lessmem_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, \
triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
# the CUDA tests: kernels vs the CPU, the public API end to end (skips what the image lacks)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/cuda tests/weights/test_fp8_cuda.py \
  -o addopts="" -rs 2>&1 | tee "$OUT/tests_cuda.log" | tail -25
# the benchmark: GEMV, attention 4k-32k, decode on a Llama-3-8B-shaped model, offload
timeout 280 python3 benchmarks/bench_gpu.py --out "$OUT/gpu.json" 2>&1 | tee "$OUT/bench_gpu.log" | tail -30
ls -la "$OUT"
