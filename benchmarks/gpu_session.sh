#!/usr/bin/env bash
# One call on a borrowed GPU machine (the device tool's `run`, ~15 minutes of device time in
# all): the CUDA tests, the CPU kernel tests on that machine's CPU, then bench_gpu.py, every
# log and the JSON under $OUT. The machine's image already has torch, triton, transformers and
# pytest-xdist, and reaches no package index, so lessmem runs from the checkout (PYTHONPATH)
# without installing its dependencies; tests needing a package it lacks skip. Commit
# $OUT/gpu.json as benchmarks/results/gpu.json.
#
#   device run: bash benchmarks/gpu_session.sh        (timeout_s 600; the steps end by ~570 s)
#
# The tests run under xdist (-n): a test that kills its process (the first run, 2026-12-04,
# segfaulted in a C++ argument check) fails alone instead of ending the whole step.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lessmem_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, \
triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
  lscpu | grep -E "Model name|^Flags" | cut -c1-400; gcc --version | head -1; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
# the CUDA tests: kernels vs the CPU, the public API end to end (skips what the image lacks)
timeout 160 python3 -m pytest -q -n 8 -p no:cacheprovider tests/cuda tests/weights/test_fp8_cuda.py \
  -o addopts="" -rs --tb=short 2>&1 | tee "$OUT/tests_cuda.log" | tail -25
# the CPU kernels on this machine's CPU (AVX-512 VNNI/VBMI paths that CI's CPU never compiles)
timeout 130 python3 -m pytest -q -n 12 -p no:cacheprovider tests/kernels -m "not slow" -o addopts="" \
  --tb=short 2>&1 | tee "$OUT/tests_kernels_cpu.log" | tail -15
# the benchmark: GEMV, attention 4k-32k, decode on a Llama-3-8B-shaped model, offload
timeout 270 python3 benchmarks/bench_gpu.py --out "$OUT/gpu.json" 2>&1 | tee "$OUT/bench_gpu.log" | tail -30
ls -la "$OUT"
