"""Fused GGUF dequant-matmul (``GGUFLinear``) vs fp32 ``nn.Linear`` at decode shapes (batch 1
unless ``--batch``).

For each shape (in_features K × out_features N) and each of the ten GGUF block types:
build the raw blocks (llama.cpp's quantizer on the first rows of a random weight, tiled
to N rows, so the bytes are real GGUF blocks while quantizing stays quick), check the
fused kernel against the dequantize-then-matmul reference first, then time batch-1
forwards round-robin with an fp32 ``nn.Linear`` of the same shape (interleaved medians,
so a noisy neighbour hits all alike) at 1 thread and at all threads. K-quants need
K % 256 == 0, so 576×1536 has only the legacy types (llama.cpp falls back the same way).

    python benchmarks/bench_gguf_linear.py            # 576x1536, 4096x4096, 4096x11008
    python benchmarks/bench_gguf_linear.py --quick    # one small shape, few repeats
    # the int8-activation kernel lessmem.load uses for Q4_0/Q4_1/Q8_0 files, at the built-in
    # model's shapes, one to sixteen decode rows (a serving batch)
    python benchmarks/bench_gguf_linear.py --int8-activations --batch 1,4,16
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
from lessmem.weights.gguf_linear import GGUFLinear, set_int8_activations  # noqa: E402

# the built-in model's (SmolLM2-135M) decode shapes: q/o, k/v, gate/up, down (K x N)
MODEL_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]

QUANT_ROWS = 256  # rows quantized for real, then tiled


def build(lin: torch.nn.Linear, t: str, int8_activations: bool = False) -> GGUFLinear:
    n = lin.out_features
    raw = quantize_gguf(lin.weight.detach()[:QUANT_ROWS], t)
    raw = np.tile(raw, (-(-n // raw.shape[0]), 1))[:n]
    q = GGUFLinear.from_raw(torch.from_numpy(np.ascontiguousarray(raw)), t, lin.in_features)
    set_int8_activations(q, int8_activations)
    return q


def check(q: GGUFLinear, rows: int = 1) -> float:
    x = torch.randn(rows, q.in_features)
    xr = gguf_linear_cpp.quantize_activations_q8(x) if q.int8_activations else x  # (as the kernel rounds it)
    ref = gguf_linear_ref(xr, q.qweight, q.gguf_type, q.out_features).double()
    err = ((q(x).double() - ref).abs().max() / ref.abs().max()).item()
    if err > 1e-5:
        raise SystemExit(f"reference check failed for {q.extra_repr()}: rel err {err:.3g}")
    return err


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--types", default=None,
                   help=f"comma-separated GGUF types (default: all; with --int8-activations {','.join(gguf_linear_cpp.Q8_TYPES)})")
    p.add_argument("--batch", default="1", help="comma-separated x rows a call (decode rows of a serving batch)")
    p.add_argument("--int8-activations", action="store_true",
                   help="the kernel lessmem.load uses for Q4_0/Q4_1/Q8_0 (x rounded to int8 per block of 32), "
                        "at the built-in model's shapes")
    args = p.parse_args()
    q8 = args.int8_activations
    types = [t.strip().lower() for t in (args.types or ",".join(gguf_linear_cpp.Q8_TYPES if q8 else GGUF_TYPES))
             .split(",") if t.strip()]
    bad = [t for t in types if t not in GGUF_TYPES or (q8 and t not in gguf_linear_cpp.Q8_TYPES)]
    batches = [int(b) for b in args.batch.split(",") if b.strip().isdigit() and int(b) > 0]
    if bad or not batches or len(batches) != len([b for b in args.batch.split(",") if b.strip()]):
        allowed = ", ".join(gguf_linear_cpp.Q8_TYPES if q8 else GGUF_TYPES)
        raise SystemExit(f"bench_gguf_linear: --types {args.types!r} / --batch {args.batch!r}: allowed types "
                         f"{allowed}; batch: positive integers")
    shapes = [(256, 512)] if args.quick else MODEL_SHAPES if q8 else [(576, 1536), (4096, 4096), (4096, 11008)]
    repeat = 5 if args.quick else args.repeat
    all_threads = torch.get_num_threads()
    h = header(shapes=shapes, batch=batches, int8_activations=q8, types=types, cpp_kernel=gguf_linear_cpp.available(),
               load_avg_start=os.getloadavg(), omp_settings={n: os.environ.get(n) for n in lessmem.OMP_WAIT_VARS})
    rows = []
    for k, n in shapes:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False)
        fp32_bytes = lin.weight.numel() * 4
        qs = {t: build(lin, t, q8) for t in types if k % GGUF_TYPES[t].block_size == 0}
        errs = {t: max(check(q, b) for b in batches) for t, q in qs.items()}
        for threads, b in [(th, b) for th in sorted({1, all_threads}) for b in batches]:
            x = torch.randn(b, k)
            torch.set_num_threads(threads)
            with torch.no_grad():
                times = interleaved({"fp32": lin, **qs}, x, repeat)
            t_fp32 = times["fp32"]
            row = {"in_features": k, "out_features": n, "threads": threads, "batch": b,
                   "fp32_ms": t_fp32 * 1e3, "fp32_GBps": fp32_bytes / t_fp32 / 1e9,
                   "skipped": [t for t in types if t not in qs]}
            for t, q in qs.items():
                row[f"{t}_ms"] = times[t] * 1e3
                row[f"{t}_speedup"] = t_fp32 / times[t]
                row[f"{t}_GBps"] = q.nbytes / times[t] / 1e9
                row[f"{t}_bytes"] = q.nbytes
                row[f"{t}_ref_rel_err"] = errs[t]
            rows.append(row)
            print(f"{k}x{n} batch={b} threads={threads}: fp32 {t_fp32 * 1e3:.3f} ms  " + "  ".join(
                f"{t} {row[f'{t}_speedup']:.2f}x" for t in qs))
        torch.set_num_threads(all_threads)
    h["load_avg_end"] = os.getloadavg()  # a shared machine: > cpus means the ratios are noisy
    write_result("bench_gguf_linear", {"header": h, "rows": rows}, args.out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
