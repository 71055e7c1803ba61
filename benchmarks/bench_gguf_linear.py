"""Fused GGUF dequant-matmul (``GGUFLinear``) vs fp32 ``nn.Linear`` at decode shapes, batch 1.

For each shape (in_features K × out_features N) and each of the ten GGUF block types:
build the raw blocks (llama.cpp's quantizer on the first rows of a random weight, tiled
to N rows, so the bytes are real GGUF blocks while quantizing stays quick), check the
fused kernel against the dequantize-then-matmul reference first, then time batch-1
forwards round-robin with an fp32 ``nn.Linear`` of the same shape (interleaved medians,
so a noisy neighbour hits all alike) at 1 thread and at all threads. K-quants need
K % 256 == 0, so 576×1536 has only the legacy types (llama.cpp falls back the same way).

    python benchmarks/bench_gguf_linear.py            # 576x1536, 4096x4096, 4096x11008
    python benchmarks/bench_gguf_linear.py --quick    # one small shape, few repeats
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, interleaved, parser, write_result  # noqa: E402

import lessmem  # noqa: E402
from lessmem.formats.gguf import GGUF_TYPES, quantize_gguf  # noqa: E402
from lessmem.kernels import gguf_linear_cpp  # noqa: E402
from lessmem.kernels.gguf_linear_reference import gguf_linear_ref  # noqa: E402
from lessmem.weights.gguf_linear import GGUFLinear  # noqa: E402

QUANT_ROWS = 256  # rows quantized for real, then tiled


def build(lin: torch.nn.Linear, t: str) -> GGUFLinear:
    n = lin.out_features
    raw = quantize_gguf(lin.weight.detach()[:QUANT_ROWS], t)
    raw = np.tile(raw, (-(-n // raw.shape[0]), 1))[:n]
    return GGUFLinear.from_raw(torch.from_numpy(np.ascontiguousarray(raw)), t, lin.in_features)


def check(q: GGUFLinear) -> float:
    x = torch.randn(1, q.in_features)
    ref = gguf_linear_ref(x, q.qweight, q.gguf_type, q.out_features).double()
    err = ((q(x).double() - ref).abs().max() / ref.abs().max()).item()
    if err > 1e-5:
        raise SystemExit(f"reference check failed for {q.extra_repr()}: rel err {err:.3g}")
    return err


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--types", default=",".join(GGUF_TYPES), help="comma-separated GGUF types")
    args = p.parse_args()
    shapes = [(256, 512)] if args.quick else [(576, 1536), (4096, 4096), (4096, 11008)]
    repeat = 5 if args.quick else args.repeat
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    all_threads = torch.get_num_threads()
    h = header(shapes=shapes, batch=1, types=types, cpp_kernel=gguf_linear_cpp.available(),
               load_avg_start=os.getloadavg(), omp_settings={n: os.environ.get(n) for n in lessmem.OMP_WAIT_VARS})
    rows = []
    for k, n in shapes:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False)
        fp32_bytes = lin.weight.numel() * 4
        qs = {t: build(lin, t) for t in types if k % GGUF_TYPES[t].block_size == 0}
        errs = {t: check(q) for t, q in qs.items()}
        x = torch.randn(1, k)
        for threads in sorted({1, all_threads}):
            torch.set_num_threads(threads)
            with torch.no_grad():
                times = interleaved({"fp32": lin, **qs}, x, repeat)
            t_fp32 = times["fp32"]
            row = {"in_features": k, "out_features": n, "threads": threads,
                   "fp32_ms": t_fp32 * 1e3, "fp32_GBps": fp32_bytes / t_fp32 / 1e9,
                   "skipped": [t for t in types if t not in qs]}
            for t, q in qs.items():
                row[f"{t}_ms"] = times[t] * 1e3
                row[f"{t}_speedup"] = t_fp32 / times[t]
                row[f"{t}_GBps"] = q.nbytes / times[t] / 1e9
                row[f"{t}_bytes"] = q.nbytes
                row[f"{t}_ref_rel_err"] = errs[t]
            rows.append(row)
            print(f"{k}x{n} threads={threads}: fp32 {t_fp32 * 1e3:.3f} ms  " + "  ".join(
                f"{t} {row[f'{t}_speedup']:.2f}x" for t in qs))
        torch.set_num_threads(all_threads)
    h["load_avg_end"] = os.getloadavg()  # a shared machine: > cpus means the ratios are noisy
    write_result("bench_gguf_linear", {"header": h, "rows": rows}, args.out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
