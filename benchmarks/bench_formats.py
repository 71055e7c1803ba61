"""Quantize / dequantize throughput of every format on one fp32 matrix.

For each format: first a correctness check against the reference twin on a small slice
(integer codes, fp8 values and codebook indices bit-exact; GGUF blocks against the
``gguf`` package where it can decode/quantize them), then SNR and bits per element on the
full matrix, then the median time of ``quantize`` and ``dequantize``. Throughput is GB/s
of fp32 elements (4 bytes each, in for quantize, out for dequantize), and the ratio is
against a plain fp32 -> fp16 -> fp32 cast timed in the same run (the memory-bound floor
of "any 16-bit format"). Times are the minimum over the repeats: these machines are
shared, and the least-disturbed run is the best estimate of what the code costs.

    python benchmarks/bench_formats.py            # 4096 x 4096, writes results/bench_formats.json
    python benchmarks/bench_formats.py --quick    # 512 x 512, seconds
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, parser, write_result  # noqa: E402

from lessmem.formats import PerChannel, PerGroup, PerTensor, PerToken, quantize, snr_db  # noqa: E402
from lessmem.formats import _reference as ref  # noqa: E402
from lessmem.formats.codebook import codebook_indices  # noqa: E402
from lessmem.formats.integer import _effective_qparams, grouped_codes  # noqa: E402

try:  # GGUF block formats are written by another module; bench them when present
    from lessmem.formats.gguf import GGUF_TYPES
except ImportError:  # pragma: no cover
    GGUF_TYPES = {}

# (label, format name, options)
FORMATS = [
    *[(f"int{b} g32", f"int{b}", {"granularity": PerGroup(32)}) for b in (8, 4, 3, 2)],
    *[(f"int{b} per-channel", f"int{b}", {"granularity": PerChannel(0)}) for b in (8, 4, 3, 2)],
    ("uint4 g32", "uint4", {"granularity": PerGroup(32)}),
    ("fp8-e4m3 per-tensor", "fp8-e4m3", {"granularity": PerTensor()}),
    ("fp8-e4m3 per-token", "fp8-e4m3", {"granularity": PerToken()}),
    ("fp8-e4m3fnuz per-tensor", "fp8-e4m3fnuz", {"granularity": PerTensor()}),
    ("fp8-e5m2 per-tensor", "fp8-e5m2", {"granularity": PerTensor()}),
    ("fp8-e4m3 g32 fp16", "fp8-e4m3", {"granularity": PerGroup(32), "scale_dtype": torch.float16}),
    ("lm4 g64", "lm4", {"granularity": PerGroup(64)}),
    ("lm4 g64 data-fit", "lm4", {"granularity": PerGroup(64), "fit": "data"}),
    ("lm3 g64", "lm3", {"granularity": PerGroup(64)}),
    ("lm2 g64", "lm2", {"granularity": PerGroup(64)}),
    *[(t, t, {}) for t in GGUF_TYPES],
]


def check_against_reference(name: str, opts: dict, x: torch.Tensor) -> str:
    """Bit-exact check of the fast path on ``x`` (small); returns what was checked."""
    qt = quantize(x, name, **opts)
    kind = qt.fmt.kind
    gran = qt.fmt.granularity
    if kind == "int":
        xg, _ = gran.group(x)
        codes, scales, zps = ref.quantize_int_reference(xg, qt.fmt.bits, qt.fmt.symmetric,
                                                        scale_dtype=opts.get("scale_dtype", torch.float16))
        scale, zp = _effective_qparams(qt)
        ok = torch.equal(grouped_codes(qt).long(), codes) and torch.equal(scale.float(), scales)
        ok = ok and (qt.fmt.symmetric or torch.equal(zp.long(), zps))
        what = "codes+scales == quantize_int_reference"
    elif kind == "fp8":
        xg, _ = gran.group(x)
        codes, scales = ref.quantize_fp8_reference(xg, qt.fmt.variant, qt.scale.dtype)
        ok = torch.equal(qt.codes.float(), codes) and torch.equal(qt.scale.float(), scales)
        what = "fp8 values+scales == quantize_fp8_reference"
    elif kind == "codebook":
        xg, _ = gran.group(x)
        xn = xg.float() / torch.where(qt.scale == 0, 1.0, qt.scale.float()).unsqueeze(1)
        ok = torch.equal(codebook_indices(qt).long(),
                         ref.codebook_assign_reference(xn, qt.extra["codebook"]))
        what = "indices == codebook_assign_reference"
    elif kind == "gguf":
        return _check_gguf(name, qt, x)
    else:  # pragma: no cover
        raise ValueError(f"no reference check for kind {kind!r}")
    if not ok:
        raise SystemExit(f"{name}: fast path disagrees with the reference")
    return what


def _check_gguf(name: str, qt, x: torch.Tensor) -> str:
    try:
        import gguf
        from gguf import quants
    except ImportError:
        return "skipped (gguf package not installed)"
    gtype = getattr(gguf.GGMLQuantizationType, name.upper())
    raw = qt.codes.numpy()
    theirs = torch.from_numpy(quants.dequantize(raw, gtype).reshape(x.shape).copy())
    if not torch.equal(theirs, qt.dequantize(torch.float32)):
        raise SystemExit(f"{name}: our dequantize differs from gguf's on our blocks")
    what = "dequantize == gguf.quants.dequantize"
    try:
        theirs_raw = quants.quantize(x.numpy(), gtype)
    except NotImplementedError:  # the gguf package has no K-quant quantizers
        return what
    if not (theirs_raw == raw).all():
        raise SystemExit(f"{name}: our blocks differ from gguf.quants.quantize")
    return what + " and blocks == gguf.quants.quantize"


def best_time(fn, repeat: int, warmup: int = 1) -> float:
    """Minimum seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared, oversubscribed machine more "
                        "threads make OpenMP barriers stall and the timings meaningless)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = 512 if args.quick else 4096
    repeat, warmup = (5, 1) if args.quick else (3, 1)
    load = [round(v, 1) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None
    info = header(shape=[n, n], dtype="float32", repeat=repeat, timing="min", loadavg=load)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=g)
    small = torch.randn(16, 256, generator=g) * torch.logspace(-2, 1, 256)
    gbytes = x.numel() * 4 / 1e9

    base_t = best_time(lambda: x.half().float(), repeat=3 * repeat, warmup=warmup)
    base = gbytes / base_t
    print(f"baseline fp32->fp16->fp32 cast: {base:.2f} GB/s")
    print(f"{'format':26s} {'bits':>7s} {'SNR dB':>8s} {'quant GB/s':>11s} {'dequant GB/s':>13s}"
          f" {'q/cast':>7s} {'dq/cast':>8s}  check")
    rows = []
    for label, name, opts in FORMATS:
        checked = check_against_reference(name, opts, small)
        qt = quantize(x, name, **opts)
        snr = snr_db(x, qt.dequantize())
        tq = best_time(lambda name=name, opts=opts: quantize(x, name, **opts), repeat=repeat, warmup=warmup)
        td = best_time(qt.dequantize, repeat=repeat, warmup=warmup)
        row = {"format": label, "name": name, "granularity": repr(qt.fmt.granularity),
               "bits_per_element": qt.bits_per_element, "nbytes": qt.nbytes, "snr_db": snr,
               "quant_gbps": gbytes / tq, "dequant_gbps": gbytes / td,
               "quant_vs_cast": (gbytes / tq) / base, "dequant_vs_cast": (gbytes / td) / base,
               "quant_s": tq, "dequant_s": td, "check": checked}
        rows.append(row)
        print(f"{label:26s} {row['bits_per_element']:7.4f} {snr:8.2f} {row['quant_gbps']:11.3f} "
              f"{row['dequant_gbps']:13.3f} {row['quant_vs_cast']:7.3f} {row['dequant_vs_cast']:8.3f}"
              f"  {checked}")
    write_result("bench_formats", {"header": info, "baseline_cast_gbps": base, "results": rows},
                 args.out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
