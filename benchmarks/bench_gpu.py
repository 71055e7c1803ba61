"""lessmem on a GPU: quantized GEMV, quantized-KV decode attention, end-to-end decode, offload.

Runs on CUDA when a device is present (bf16 activations, the Triton kernels behind
``torch.ops.lessmem.*``) and falls back to the CPU otherwise (fp32, the C++ kernels), so it
never rots on machines without a GPU (CI runs ``--quick``). Every number is a ratio against
a baseline timed in the same run, and bandwidth is reported against the device's own
measured copy bandwidth (``peak_gbs``: a device-to-device copy on CUDA, a read loop on CPU):

- ``gemv``: batch-1 ``QuantLinear`` int4 (group 128) and ``GGUFLinear`` Q4_K / Q4_0 / Q8_0
  at 4096x4096, 14336x4096 and 4096x14336 (out x in) against a dense ``F.linear`` in the
  compute dtype: ms, speed-up, GB/s of the bytes held, fraction of peak; relative error
  against the layer's own dequantized weight (the kernel, not the format, is checked);
- ``attention``: one decode step of the op ``quantized_attention`` over a best-4 history
  (Llama-3-8B heads: 32 query / 8 KV heads of 128) at 4k-32k tokens against SDPA over the
  same history in the compute dtype: GB/s of the quantized bytes read, fraction of peak;
- ``decode``: greedy decode steps after a prompt of 4k-32k tokens on a Llama-3-8B-shaped
  model with random weights (speed does not depend on the values) for ``DynamicCache``,
  lessmem ``best-4`` (under ``kvcache.enable``) and transformers' quanto ``QuantizedCache``
  (when installed): ms per step and ratio to DynamicCache;
- ``offload``: the best-4 cache as a ``TieredKVCache`` with 75% of its sealed blocks in a
  host tier (pinned memory on CUDA) against all on the device, with the host-to-device
  time of the offloaded bytes per step (measured copy bandwidth) beside the step time: the
  offload can only keep up when the transfer is below the compute.

A row that fails records its error instead of stopping the run (one run on a borrowed GPU
should return everything it can).

    python benchmarks/bench_gpu.py                 # GPU: the shapes above (about 5 min on an H200)
    python benchmarks/bench_gpu.py --quick         # CI / CPU: tiny shapes
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, parser, write_result  # noqa: E402

import lessmem  # noqa: E402,F401  (sets OpenMP's wait policy before torch starts OpenMP)
from lessmem.kernels.attention import QuantKV, QuantSide, quantized_attention  # noqa: E402
from lessmem.kvcache import KVCache, enable  # noqa: E402
from lessmem.kvcache.cache import cache_kwarg  # noqa: E402
from lessmem.kvcache.codec import encode, kv_layout  # noqa: E402
from lessmem.kvcache.presets import resolve  # noqa: E402
from lessmem.weights.gguf_linear import GGUFLinear  # noqa: E402
from lessmem.weights.qlinear import QuantLinear  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, repeat: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` (synchronized on CUDA)."""
    for _ in range(warmup):
        fn()
    _sync()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def peak_gbs(quick: bool) -> dict:
    """The device's measured bandwidth: a copy (read + write) on CUDA, a read loop on CPU;
    and, on CUDA, pinned host-to-device copies (what an offloaded block costs)."""
    n = (1 << 24) if quick else (1 << 28)
    x = torch.ones(n, device=DEV)
    out = {}
    if CUDA:
        y = torch.empty_like(x)
        s = timed(lambda: y.copy_(x), 10)
        out["peak_gbs"] = 2 * x.numel() * 4 / s / 1e9
        h = torch.ones(n // 4).pin_memory()
        d = torch.empty(n // 4, device=DEV)
        s = timed(lambda: d.copy_(h, non_blocking=True), 10)
        out["h2d_gbs"] = h.numel() * 4 / s / 1e9
    else:
        s = timed(lambda: x.sum(), 5)
        out["peak_gbs"] = x.numel() * 4 / s / 1e9
        out["h2d_gbs"] = out["peak_gbs"]  # host and device are the same memory
    return out


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def bench_gemv(shapes, peak: float, repeat: int) -> list[dict]:
    rows = []
    for n, k in shapes:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False)
        x = torch.randn(1, k, device=DEV, dtype=DTYPE)
        dense_w = lin.weight.detach().to(DEV, DTYPE)
        dense_s = timed(lambda x=x, w=dense_w: torch.nn.functional.linear(x, w), repeat)
        row = {"out_features": n, "in_features": k, "dense_dtype": str(DTYPE).replace("torch.", ""),
               "dense_ms": dense_s * 1e3, "dense_bytes": dense_w.numel() * dense_w.element_size()}
        makers = {"int4_g128": lambda lin: QuantLinear.from_linear(lin, bits=4, group_size=128),
                  "q4_k": lambda lin: GGUFLinear.from_linear(lin, "Q4_K"),
                  "q4_0": lambda lin: GGUFLinear.from_linear(lin, "Q4_0"),
                  "q8_0": lambda lin: GGUFLinear.from_linear(lin, "Q8_0")}
        for name, make in makers.items():
            try:
                layer = make(lin).to(DEV)
                s = timed(lambda layer=layer, x=x: layer(x), repeat)
                ref = x.float() @ layer.dequantized_weight().to(DEV).float().T
                row[name] = {"ms": s * 1e3, "speedup": dense_s / s, "bytes": layer.nbytes,
                             "gbs": layer.nbytes / s / 1e9, "of_peak": layer.nbytes / s / 1e9 / peak,
                             "rel_err": _rel(layer(x), ref), "layout": getattr(layer, "layout", "gguf")}
            except Exception as exc:  # recorded, the run goes on
                row[name] = {"error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
        rows.append(row)
        print(f"gemv {n}x{k}: dense {dense_s * 1e3:.3f} ms; " + "; ".join(
            f"{m} {r['ms']:.3f} ms {r['speedup']:.2f}x {r['of_peak']:.0%} of peak" if "ms" in r else f"{m} ERROR"
            for m, r in row.items() if isinstance(r, dict)), flush=True)
    return rows


def _history(preset: str, hkv: int, t: int, d: int, seed: int = 0) -> QuantKV:
    cfg = resolve(preset)
    g = torch.Generator(device=DEV).manual_seed(seed)
    sides = []
    for spec in (cfg.keys, cfg.values):
        enc = encode(torch.randn(1, hkv, t, d, device=DEV, generator=g), spec)
        sides.append(QuantSide(enc.codes, enc.scale, enc.zero_point, kv_layout(spec, d)))
    return QuantKV(*sides)


def _kv_nbytes(kv: QuantKV) -> int:
    return sum(t.numel() * t.element_size() for s in (kv.keys, kv.values)
               for t in (s.codes, s.scale, s.zero_point) if t is not None)


def bench_attention(contexts, heads, peak: float, repeat: int) -> list[dict]:
    hq, hkv, d = heads
    rows = []
    for t in contexts:
        row = {"context": t, "q_heads": hq, "kv_heads": hkv, "head_dim": d}
        try:
            kv = _history("best-4", hkv, t, d)
            q = torch.randn(1, hq, 1, d, device=DEV) * d ** -0.5
            s = timed(lambda kv=kv, q=q: quantized_attention(q, kv), repeat)
            k = torch.randn(1, hkv, t, d, device=DEV, dtype=DTYPE)
            v = torch.randn(1, hkv, t, d, device=DEV, dtype=DTYPE)
            qd = q.to(DTYPE)
            sdpa = timed(lambda q=qd, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                         repeat)
            nbytes = _kv_nbytes(kv)
            row.update(best4_ms=s * 1e3, sdpa_ms=sdpa * 1e3, speedup_vs_sdpa=sdpa / s, best4_bytes=nbytes,
                       sdpa_bytes=2 * k.numel() * k.element_size(), gbs=nbytes / s / 1e9,
                       of_peak=nbytes / s / 1e9 / peak)
            if t == contexts[0]:  # the kernel against the float64 oracle once
                from lessmem.kernels.attention_reference import attention_reference

                def cpu(side):
                    return QuantSide(side.codes.cpu(), side.scale.cpu(),
                                     None if side.zero_point is None else side.zero_point.cpu(), side.layout)
                ref, _ = attention_reference(q.cpu(), QuantKV(cpu(kv.keys), cpu(kv.values)))
                row["rel_err"] = _rel(quantized_attention(q, kv)[0].cpu(), ref)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        rows.append(row)
        print(f"attention T={t}: " + (f"best-4 {row['best4_ms']:.3f} ms ({row['of_peak']:.0%} of peak), "
                                      f"SDPA {row['sdpa_ms']:.3f} ms" if "best4_ms" in row else row["error"]),
              flush=True)
    return rows


def _model(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if quick:
        from lessmem.models import tiny_random

        return tiny_random("llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                           intermediate_size=256, max_position_embeddings=8192).to(DEV).eval(), "tiny llama"
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=65536,
                      rope_theta=500000.0, torch_dtype="bfloat16")
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg).to(DTYPE).eval()
    return model, "Llama-3-8B-shaped, random weights"


def _quanto(model):
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=64, residual_length=128)
    except Exception as exc:
        return exc


def _prefill(model, cache, ids, chunk: int):
    with torch.no_grad():
        for a in range(0, ids.shape[1], chunk):
            out = model(input_ids=ids[:, a:a + chunk], **{cache_kwarg(model): cache}, use_cache=True)
    return out.logits[:, -1:].argmax(-1)


def _steps(model, cache, nxt, steps: int) -> float:
    ts = []
    with torch.no_grad():
        for _ in range(steps):
            _sync()
            t0 = time.perf_counter()
            out = model(input_ids=nxt, **{cache_kwarg(model): cache}, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            _sync()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:] or ts)


def bench_decode(model, contexts, steps: int, chunk: int) -> list[dict]:
    from transformers import DynamicCache

    rows = []
    for t in contexts:
        ids = torch.randint(3, model.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(t)).to(DEV)
        row = {"context": t, "steps": steps}
        for name in ("DynamicCache", "best-4", "quanto-4"):
            try:
                if name == "DynamicCache":
                    cache, ctx = DynamicCache(), None
                elif name == "quanto-4":
                    cache, ctx = _quanto(model), None
                    if isinstance(cache, Exception):
                        row[name] = {"skipped": f"{type(cache).__name__}: {cache}"}
                        continue
                else:
                    cache, ctx = KVCache(model.config, name), enable(model)
                try:
                    nxt = _prefill(model, cache, ids, chunk)
                    s = _steps(model, cache, nxt, steps)
                finally:
                    if ctx is not None:
                        ctx.disable()
                row[name] = {"ms_per_step": s * 1e3, "tok_s": 1 / s}
                if isinstance(cache, KVCache):
                    row[name]["kv_bytes"] = int(cache.memory()["total"])
                del cache
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            if CUDA:
                torch.cuda.empty_cache()
        base = row.get("DynamicCache", {}).get("ms_per_step")
        for name in ("best-4", "quanto-4"):
            if base and "ms_per_step" in row.get(name, {}):
                row[name]["ratio_vs_dynamic"] = base / row[name]["ms_per_step"]
        rows.append(row)
        print(f"decode T={t}: " + "; ".join(
            f"{n} {r['ms_per_step']:.2f} ms" if "ms_per_step" in r else f"{n} {next(iter(r.values()))}"
            for n, r in row.items() if isinstance(r, dict)), flush=True)
    return rows


def bench_offload(model, context: int, steps: int, chunk: int, h2d_gbs: float, block_tokens: int) -> dict:
    from lessmem.kvcache.tiered import TieredKVCache
    from lessmem.offload import HostTier

    row = {"context": context, "host_share_target": 0.75, "block_tokens": block_tokens}
    try:
        ids = torch.randint(3, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(1)).to(DEV)
        with enable(model):
            src = KVCache(model.config, "best-4")
            nxt = _prefill(model, src, ids, chunk)
            tiered = TieredKVCache.from_cache(src, tiers=[HostTier(None)], block_tokens=block_tokens, prefetch=True,
                                              model=model)
            blocks = sum(sum(la.block_bytes) for la in tiered.tiered)
            growth = sum(la.token_bytes() for la in tiered.tiered)
            tiered.set_device_budget(int(tiered.fp_bytes() + growth + tiered.account.reserve() + 0.25 * blocks))
            on_dev = sum(b for la in tiered.tiered for k, b in zip(la.block_keys, la.block_bytes, strict=True)
                         if tiered.device_tier.contains(k))
            s_dev = _steps(model, src, nxt, steps)
            s_off = _steps(model, tiered, nxt, steps)
        host_bytes = blocks - on_dev
        row.update(all_device_ms=s_dev * 1e3, offload_ms=s_off * 1e3, ratio_vs_all_device=s_dev / s_off,
                   host_share=host_bytes / blocks if blocks else 0.0, host_bytes=host_bytes,
                   h2d_ms_per_step=host_bytes / (h2d_gbs * 1e9) * 1e3,
                   prefetch=tiered.offload_stats().get("prefetch") if hasattr(tiered, "offload_stats") else None)
        row["transfer_below_compute"] = row["h2d_ms_per_step"] < row["all_device_ms"]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    print(f"offload T={context}: " + (f"all on device {row['all_device_ms']:.2f} ms, 75% host "
                                      f"{row['offload_ms']:.2f} ms ({row['ratio_vs_all_device']:.2f}x), "
                                      f"H2D {row['h2d_ms_per_step']:.2f} ms/step" if "offload_ms" in row
                                      else row["error"]), flush=True)
    return row


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sections", default="gemv,attention,decode,offload")
    p.add_argument("--contexts", default=None, help="decode contexts, e.g. 4096,16384,32768")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    unknown = sections - {"gemv", "attention", "decode", "offload"}
    if unknown:
        p.error(f"--sections {','.join(sorted(unknown))}; allowed: gemv, attention, decode, offload")
    quick = args.quick
    if quick:
        shapes, att_ctx, heads, dec_ctx, steps, repeat = [(256, 512)], [256, 1024], (8, 2, 64), [256], 4, 5
    else:
        shapes = [(4096, 4096), (14336, 4096), (4096, 14336)]
        att_ctx, heads, dec_ctx, steps, repeat = [4096, 8192, 16384, 32768], (32, 8, 128), [4096, 16384, 32768], 16, 50
        if not CUDA:  # a full run on a CPU: the shapes, fewer repeats and shorter contexts
            att_ctx, dec_ctx, steps, repeat = [4096, 16384], [1024], 4, 10
    if args.contexts:
        dec_ctx = [int(c) for c in args.contexts.split(",")]
    bw = peak_gbs(quick)
    h = header(sections=sorted(sections), dtype=str(DTYPE).replace("torch.", ""), **bw)
    h["triton"] = _triton_version()
    out = {"header": h, "quick": quick}
    if "gemv" in sections:
        out["gemv"] = bench_gemv(shapes, bw["peak_gbs"], repeat)
    if "attention" in sections:
        out["attention"] = bench_attention(att_ctx, heads, bw["peak_gbs"], repeat)
    if sections & {"decode", "offload"}:
        model, desc = _model(quick or not CUDA)
        out["model"] = desc
        chunk = 256 if quick else 4096
        if "decode" in sections:
            out["decode"] = bench_decode(model, dec_ctx, steps, chunk)
        if "offload" in sections:
            out["offload"] = bench_offload(model, dec_ctx[-1], steps, chunk, bw["h2d_gbs"], 64 if quick else 256)
    write_result("gpu" if CUDA else "gpu_cpu_fallback", out, args.out, quick)
    return 0


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
