"""Fused QuantLinear (int4, int8, 3-bit, 2-bit) vs fp32 nn.Linear at decode shapes.

For each (in_features, out_features): check every QuantLinear against its
dequantize-then-matmul reference first, then time forwards and report the speed ratio vs
an fp32 ``nn.Linear`` timed in the same run (interleaved round-robin, medians), at 1
thread and at all threads (this machine is shared, so both are given), plus achieved GB/s
of weight bytes. ``int4_g128_lowbit`` is 4-bit through the ``lowbit_linear`` kernel (the
path for shapes torch's int4pack op does not take), timed as the same kind of callable.
Batch 1 at every shape; batches 4 and 16 (the fused kernel's row tiles) at two shapes.

    python benchmarks/bench_linear.py            # 5 decode shapes of a 4096/11008 and a 576/1536 model
    python benchmarks/bench_linear.py --quick    # one small shape, few repeats
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, interleaved, parser, write_result  # noqa: E402

from lessmem.formats.packing import pack_bits  # noqa: E402
from lessmem.kernels import linear_cpp  # noqa: E402
from lessmem.weights.qlinear import QuantLinear  # noqa: E402

VARIANTS = {  # name -> (bits, group_size, symmetric)
    "int4_g128": (4, 128, False),
    "int8": (8, None, True),
    "int3_g128": (3, 128, False),
    "int2_g128": (2, 128, False),
}
SHAPES = [(576, 1536), (1536, 576), (4096, 4096), (4096, 11008), (11008, 4096)]
BATCH_SHAPES = [(576, 1536), (4096, 4096)]  # timed at every batch of BATCHES; other shapes at 1
BATCHES = [1, 4, 16]  # 4 and 16: the fused kernel's row tiles


class LowbitInt4(torch.nn.Module):
    """4-bit codes of a QuantLinear run through ``lowbit_linear`` instead of int4pack."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        self._qw = q.quantized_weight()  # plain codes u [N, K], fp16 scale and uint8 zero [N, G]
        self.codes = pack_bits(self._qw.codes, 4)
        self.scale, self.zero, self.bias = self._qw.scale.contiguous(), self._qw.zero.contiguous(), q.bias
        self.gs, self.layout = q.group_size, "lowbit"
        self.nbytes = sum(t.numel() * t.element_size()
                          for t in (self.codes, self.scale, self.zero, self.bias))

    def forward(self, x):
        return linear_cpp.lowbit_linear_unchecked(x, self.codes, 4, self.scale, self.zero,
                                                  self.gs, self.bias)

    def dequantized_weight(self):
        return self._qw.dequantize()


def check(q, lin: torch.nn.Linear) -> float:
    x = torch.randn(1, lin.in_features)
    ref = x.double() @ q.dequantized_weight().double().T + lin.bias.double()
    err = ((q(x).double() - ref).abs().max() / ref.abs().max()).item()
    # int4pack: bf16 activations; lowbit: 16-bit fixed-point activations (≤ 1.6e-5 of a group max)
    tol = 2e-2 if q.layout == "int4pack" else 1e-4
    if err > tol:
        raise SystemExit(f"reference check failed for {q}: rel err {err:.3g}")
    return err


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--repeat", type=int, default=50)
    args = p.parse_args()
    shapes = [(256, 512)] if args.quick else SHAPES
    batch_shapes = [(256, 512)] if args.quick else BATCH_SHAPES
    repeat = 5 if args.quick else args.repeat
    all_threads = torch.get_num_threads()
    h = header(shapes=shapes, batch_shapes=batch_shapes, batches=BATCHES,
               variants=[*VARIANTS, "int4_g128_lowbit"],
               lowbit_simd=linear_cpp._mod().simd_build() if linear_cpp.available() else None)
    rows = []
    for k, n in shapes:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n)
        fp32_bytes = lin.weight.numel() * 4
        qs = {}
        for name, (bits, gs, sym) in VARIANTS.items():
            g = gs if gs is None or k % gs == 0 else 64  # 576 columns: groups of 64
            qs[name] = QuantLinear.from_linear(lin, bits, g, sym)
        qs["int4_g128_lowbit"] = LowbitInt4(qs["int4_g128"])
        errs = {name: check(q, lin) for name, q in qs.items()}
        batches = BATCHES if (k, n) in batch_shapes else [1]
        for batch in batches:
            x = torch.randn(batch, k)
            for threads in sorted({1, all_threads}):
                torch.set_num_threads(threads)
                with torch.no_grad():
                    times = interleaved({"fp32": lin, **qs}, x, repeat)
                t_fp32 = times["fp32"]
                row = {"in_features": k, "out_features": n, "batch": batch, "threads": threads,
                       "fp32_ms": t_fp32 * 1e3, "fp32_GBps": fp32_bytes / t_fp32 / 1e9}
                for name, q in qs.items():
                    t = times[name]
                    row[f"{name}_ms"] = t * 1e3
                    row[f"{name}_speedup"] = t_fp32 / t
                    row[f"{name}_GBps"] = q.nbytes / t / 1e9
                    row[f"{name}_layout"] = q.layout
                    row[f"{name}_ref_rel_err"] = errs[name]
                rows.append(row)
                print(f"{k}x{n} batch={batch} threads={threads}: fp32 {t_fp32 * 1e3:.3f} ms  "
                      + "  ".join(f"{name} {row[f'{name}_speedup']:.2f}x" for name in qs))
            torch.set_num_threads(all_threads)
    write_result("bench_linear", {"header": h, "rows": rows}, args.out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
