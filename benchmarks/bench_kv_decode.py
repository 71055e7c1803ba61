"""Decode speed at long context: lessmem quantized caches vs DynamicCache vs quanto.

Batch 1, the built-in model, a context of ``--context`` tokens (default 4096) prefilled
once per cache, then ``--tokens`` greedy decode steps timed one by one (median step).
Reported: tok/s per cache and the ratio to DynamicCache measured in the same run, KV
bytes, and a correctness check first (the fused attention's logits vs the reference
path's on the same cache contents). ``--quick``: a tiny random model, short context.

    python benchmarks/bench_kv_decode.py            # built-in model, 4k context
    python benchmarks/bench_kv_decode.py --quick    # CI
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, parser, write_result  # noqa: E402

import lessmem  # noqa: E402
from lessmem.kvcache import KVCache, enable  # noqa: E402
from lessmem.kvcache.cache import cache_kwarg  # noqa: E402


def _context_ids(tok, n: int, vocab: int) -> torch.Tensor:
    text_path = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
    if tok is not None and text_path.exists():
        ids = tok(text_path.read_text()[: n * 8], return_tensors="pt").input_ids[:, :n]
        if ids.shape[1] == n:
            return ids
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab, (1, n), generator=g)


def _decode(model, cache, ids, steps: int):
    """Prefill ``ids`` then greedy-decode ``steps`` tokens; ((median wall s, median CPU s)
    per step, logits list). CPU time (all threads) is robust to other processes on a
    shared machine; wall time is what a user sees."""
    with torch.no_grad():
        out = model(ids, **{cache_kwarg(model): cache}, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times, cpu, logits = [], [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(nxt, **{cache_kwarg(model): cache}, use_cache=True)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            logits.append(out.logits[:, -1])
            nxt = out.logits[:, -1:].argmax(-1)
    return (statistics.median(times[1:] or times), statistics.median(cpu[1:] or cpu)), logits


def _quanto_cache(model, bits):
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=bits,
                              q_group_size=64, residual_length=128)
    except Exception as exc:  # not installed or API changed: skip the peer
        print(f"# quanto QuantizedCache unavailable: {type(exc).__name__}: {exc}")
        return None


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--presets", default="best-4,int4,kivi-2")
    p.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        from lessmem.models import tiny_random

        model, tok = tiny_random("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2), None
        context, steps = args.context or 512, args.tokens or 6
    else:
        model, tok = lessmem.load("smollm2-135m")
        context, steps = args.context or 4096, args.tokens or 24
    model.eval()
    ids = _context_ids(tok, context, model.config.vocab_size)
    h = header(model="tiny-random" if args.quick else "smollm2-135m", context=context,
               decode_steps=steps, batch=1)
    presets = [s for s in args.presets.split(",") if s]

    # correctness first: fused vs reference path on the same prompt (short, cheap)
    short = ids[:, : min(context, 400)]
    # with float activations: a GGUF model's decode rows take int8 activations (llama.cpp's
    # q8_1, rounded per block of 32), where a 1e-6 difference between the two attention paths
    # can flip a rounding and move a logit by ~0.3 (measured: int8 KV, 0.32)
    q8 = [m for m in model.modules() if getattr(m, "int8_activations", False)]
    for m in q8:
        m.int8_activations = False
    ref_cache = KVCache(model.config, presets[0], attention="reference")
    _, ref_logits = _decode(model, ref_cache, short, 3)
    with enable(model):
        fused_cache = KVCache(model.config, presets[0])
        _, fused_logits = _decode(model, fused_cache, short, 3)
    for m in q8:
        m.int8_activations = True
    err = max((a - b).abs().max().item() for a, b in zip(ref_logits, fused_logits, strict=True))
    print(f"fused vs reference logits (max abs diff, {presets[0]}): {err:.2e}")
    if err > 1e-2:
        raise SystemExit(f"fused attention disagrees with the reference path: {err}")

    from transformers import DynamicCache

    rows = []
    (t_dyn, c_dyn), _ = _decode(model, DynamicCache(), ids, steps)

    def row(name, t, c, **extra):
        return {"cache": name, "step_s": t, "tok_per_s": 1 / t, "ratio": t_dyn / t,
                "cpu_step_s": c, "cpu_ratio": c_dyn / c, **extra}

    rows.append(row("DynamicCache", t_dyn, c_dyn))
    with enable(model):
        for name in presets:
            cache = KVCache(model.config, name)
            (t, c), _ = _decode(model, cache, ids, steps)
            mem = cache.memory()
            rows.append(row(f"lessmem {name} (fused)", t, c, kv_bytes=mem["total"],
                            compression=mem["compression"], k_bits=mem["k_bits"], v_bits=mem["v_bits"]))
    if not args.quick:
        cache = KVCache(model.config, presets[0], attention="reference")
        (t, c), _ = _decode(model, cache, ids, max(4, steps // 4))
        rows.append(row(f"lessmem {presets[0]} (reference, dequantize all)", t, c))
    qc = _quanto_cache(model, 4)
    if qc is not None:
        (t, c), _ = _decode(model, qc, ids, max(4, steps // 2))
        rows.append(row("transformers QuantizedCache quanto int4", t, c))
    for r in rows:
        print(f"{r['cache']:<50} {r['tok_per_s']:8.2f} tok/s  x{r['ratio']:.2f} wall  "
              f"x{r['cpu_ratio']:.2f} CPU time  vs DynamicCache")
    write_result("kv_decode", {"header": h, "fused_vs_reference_max_abs": err, "rows": rows},
                 args.out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
