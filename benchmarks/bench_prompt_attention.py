"""A prompt chunk's attention in bfloat16: lessmem's kernel (``kernels.prompt_attention``,
CPUs with AVX512-BF16) against torch's SDPA on the same bf16 tensors.

The shapes are the built-in model's (9 query heads over 3 KV heads of 64): a chunk of Tq
queries that are the last Tq of N keys, causal (what a prompt chunk attends to) or not (a
slice of history before the chunk). First each kernel output is checked against the float64
formula over the same bf16-rounded q, k and v (``prompt_attention.reference_attention``);
then both are timed round-robin (interleaved medians, so a noisy neighbour hits both alike).
SDPA gets the causal mask as a bool [Tq, N] mask, as ``kvcache.view`` gave it before the
kernel (``enable_gqa``: the KV heads read in place). GFLOP/s count every score of the dense
Tq × N product (4·Hq·Tq·N·D), masked or not, the same count for both.

    python benchmarks/bench_prompt_attention.py            # Tq 512, N 512 / 1024 / 4096 causal, 2048 not
    python benchmarks/bench_prompt_attention.py --quick    # one small shape, few repeats
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, interleaved, parser, write_result  # noqa: E402

from lessmem.kernels import prompt_attention  # noqa: E402

HQ, HKV, D = 9, 3, 64  # the built-in model (SmolLM2-135M)
FULL = [(512, 512, True), (512, 1024, True), (512, 4096, True), (512, 2048, False)]  # Tq, N, causal
QUICK = [(64, 160, True)]


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    shapes = QUICK if args.quick else FULL
    repeat = 3 if args.quick else args.repeat
    kernel = prompt_attention.available()
    h = header(heads=HQ, kv_heads=HKV, head_dim=D, shapes=shapes, kernel_available=kernel,
               load_avg_start=os.getloadavg())
    if not kernel:
        print("# the kernel does not run here (no AVX512-BF16, or no compiler): SDPA rows only")
    scale = D ** -0.5
    rows = []
    for Tq, N, causal in shapes:
        g = torch.Generator().manual_seed(N)
        q = torch.randn(1, HQ, Tq, D, generator=g).to(torch.bfloat16)
        k = torch.randn(1, HKV, N, D, generator=g).to(torch.bfloat16)
        v = torch.randn(1, HKV, N, D, generator=g).to(torch.bfloat16)
        mask = (torch.arange(N)[None, :] <= torch.arange(Tq)[:, None] + (N - Tq)) if causal else None
        x = (q, k, v)
        fns = {"sdpa": lambda t, m=mask: F.scaled_dot_product_attention(*t, attn_mask=m, scale=scale, enable_gqa=True)}
        row = {"queries": Tq, "keys": N, "causal": causal}
        ref, ref_lse = prompt_attention.reference_attention(q, k, v, scale, causal)
        row["sdpa_max_abs_err"] = (fns["sdpa"](x).double() - ref).abs().max().item()
        if kernel:
            fns["kernel"] = lambda t, c=causal: prompt_attention.bf16_attention(*t, scale, c)
            out, lse = fns["kernel"](x)
            row["kernel_max_abs_err"] = (out.double() - ref).abs().max().item()
            row["kernel_lse_max_abs_err"] = (lse.double() - ref_lse).abs().max().item()
        with torch.no_grad():
            times = interleaved(fns, x, repeat)
        flops = 4 * HQ * Tq * N * D
        for name, t in times.items():
            row[f"{name}_ms"] = t * 1e3
            row[f"{name}_gflops"] = flops / t / 1e9
        if kernel:
            row["kernel_speedup"] = times["sdpa"] / times["kernel"]
        rows.append(row)
        print(f"Tq {Tq} N {N} {'causal' if causal else 'full'}: sdpa {row['sdpa_ms']:.2f} ms "
              f"({row['sdpa_gflops']:.0f} GFLOP/s)" + (f", kernel {row['kernel_ms']:.2f} ms "
              f"({row['kernel_gflops']:.0f} GFLOP/s, {row['kernel_speedup']:.2f}x), max err "
              f"{row['kernel_max_abs_err']:.1e}" if kernel else ""))
    h["load_avg_end"] = os.getloadavg()  # a shared machine: > cpus means the ratios are noisy
    write_result("bench_prompt_attention", {"header": h, "rows": rows}, args.out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
