"""Tune the best-4 / best-2 KV presets on WikiText-2 *train* text (never the test split).

Runs the evaluator's protocol (``lessmem.eval.evaluate``: windows of N tokens, first
quarter prefilled, the rest fed in chunks) over candidate KVConfigs, with lessmem's
fused attention switched on, and writes one row per candidate (Δppl %, KLD, bits,
compression at 4k tokens from the planner) to ``benchmarks/results/kv_tuning.json``.

    python benchmarks/tune_kv_presets.py --windows 4 --window-len 1024 --chunk 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lessmem.formats import PerGroup, PerToken
from lessmem.kvcache import PRESETS, KVConfig, KVTensorConfig, enable

ROOT = Path(__file__).resolve().parent
TRAIN = ROOT.parents[1] / "shared/data/wikitext-2-raw/wiki.train.head.raw"


def t(fmt, bits, gran=None):
    return KVTensorConfig(fmt, bits, gran if gran is not None else PerToken())


def ch(g):
    return PerGroup(g, axis=-2)


CANDIDATES_4 = {
    "k4ch64-v4tok": KVConfig(keys=t("uint", 4, ch(64)), values=t("uint", 4), block_size=64, window=96),
    "k4ch64rot-v4tok": KVConfig(keys=t("uint", 4, ch(64)), values=t("uint", 4), rotate_keys=True,
                                block_size=64, window=96),
    "k4ch64rot-v4tokrot": KVConfig(keys=t("uint", 4, ch(64)), values=t("uint", 4), rotate_keys=True,
                                   rotate_values=True, block_size=64, window=96),
    "k4g32rot-v4g32rot-int": KVConfig(keys=t("int", 4, PerGroup(32)), values=t("int", 4, PerGroup(32)),
                                      rotate_keys=True, rotate_values=True, block_size=64, window=96),
    "k4ch64rot-v4tok-nosinks": KVConfig(keys=t("uint", 4, ch(64)), values=t("uint", 4), rotate_keys=True,
                                        block_size=64, window=96, sinks=0),
}
CANDIDATES_2 = {
    "k3ch64rot-v2tokrot": KVConfig(keys=t("uint", 3, ch(64)), values=t("uint", 2), rotate_keys=True,
                                   rotate_values=True, block_size=64, window=96),
    "k3ch64-v2tok": KVConfig(keys=t("uint", 3, ch(64)), values=t("uint", 2), block_size=64, window=96),
    "k2ch32rot-v2tokrot": KVConfig(keys=t("uint", 2, ch(32)), values=t("uint", 2), rotate_keys=True,
                                   rotate_values=True, block_size=64, window=96),
    "k3lmch64rot-v2lmtokrot": KVConfig(keys=t("lm", 3, ch(64)), values=t("lm", 2), rotate_keys=True,
                                       rotate_values=True, block_size=64, window=96),
    "k3ch64rot-v2g32rot": KVConfig(keys=t("uint", 3, ch(64)), values=t("uint", 2, PerGroup(32)),
                                   rotate_keys=True, rotate_values=True, block_size=64, window=96),
    "k3ch64rot-v3lmtokrot": KVConfig(keys=t("uint", 3, ch(64)), values=t("lm", 3), rotate_keys=True,
                                     rotate_values=True, block_size=64, window=96),
}


# ~3.5 average bits at the model's context (8k) with windows and sinks counted: 3-bit sides
# with 128-token key groups, Lloyd-Max codebooks after rotation (TurboQuant-style), clipping
def _r(k, v, **kw):
    return KVConfig(keys=k, values=v, rotate_keys=True, rotate_values=True,
                    **{"block_size": 128, "window": 64, **kw})


CANDIDATES_35 = {
    "k3ch128rot-v3tokrot": _r(t("uint", 3, ch(128)), t("uint", 3)),
    "k3lmch128rot-v3lmtokrot": _r(t("lm", 3, ch(128)), t("lm", 3)),
    "k3ch128rot-v3lmtokrot": _r(t("uint", 3, ch(128)), t("lm", 3)),
    "k3ch128rot-v3tokrot-clip.9": _r(t("uint", 3, ch(128)), KVTensorConfig("uint", 3, PerToken(), 0.9)),
    "k4ch128rot-v3lmtokrot": _r(t("uint", 4, ch(128)), t("lm", 3)),
    "k3ch128rot-v4lmtokrot": _r(t("uint", 3, ch(128)), t("lm", 4)),
    "k3ch64rot-v3tokrot-b64": _r(t("uint", 3, ch(64)), t("uint", 3), block_size=64, window=96),
    # keys carry most of the error at 3 bits: spend the bits there, 2-bit values
    "k4ch128rot-v2lmtokrot": _r(t("uint", 4, ch(128)), t("lm", 2)),
    "k4ch128rot-v2tokrot": _r(t("uint", 4, ch(128)), t("uint", 2)),
    "k4ch256rot-v2lmtokrot": _r(t("uint", 4, ch(256)), t("lm", 2), block_size=256),
    "k4ch128rot-v3tokrot": _r(t("uint", 4, ch(128)), t("uint", 3)),
}
# ~2.5 average bits at 8k: 2-bit values, 2- or 3-bit keys
CANDIDATES_25 = {
    "k2ch128rot-v2lmtokrot": _r(t("uint", 2, ch(128)), t("lm", 2)),
    "k2lmch128rot-v2lmtokrot": _r(t("lm", 2, ch(128)), t("lm", 2)),
    "k3lmch128rot-v2lmtokrot": _r(t("lm", 3, ch(128)), t("lm", 2)),
    "k3ch128rot-v2tokrot": _r(t("uint", 3, ch(128)), t("uint", 2)),
    "k3ch128rot-v2lmtokrot": _r(t("uint", 3, ch(128)), t("lm", 2)),
    "k3ch256rot-v2lmtokrot": _r(t("uint", 3, ch(256)), t("lm", 2), block_size=256),
}


class _Dims:
    layers, kv_heads, head_dim = 30, 3, 64


SENSITIVITY = ROOT / "results" / "kv_layer_sensitivity.json"
KV_CONFIGS = ROOT / "results" / "kv_configs"
# mixed: per-layer bits from the measured sensitivity (lessmem.eval.allocate) on the
# best-3 layout, at all-in budgets (window and sinks counted at the model's 8k context)
MIXED_BUDGETS = (3.5, 3.0, 2.5)


def all_in_bits(cfg, context=8192) -> float:
    from lessmem.eval.allocate import all_in_bits as bits

    return bits(cfg, _Dims.layers, _Dims.kv_heads, _Dims.head_dim, context)


def load_sensitivity(path=SENSITIVITY):
    from lessmem.eval.allocate import Sensitivity

    return Sensitivity.from_dict(json.loads(Path(path).read_text())["sensitivity"])


def mixed_candidates(sens) -> dict:
    """One allocation per budget: the largest mean bits whose all-in bits at 8k fit it."""
    from lessmem.eval.allocate import allocate_all_in

    return {f"mixed-{b}": allocate_all_in(sens, b, kv_heads=_Dims.kv_heads, head_dim=_Dims.head_dim,
                                          context=8192) for b in MIXED_BUDGETS}


def measure(args) -> int:
    """Write the per-layer sensitivity of the best-3 layout (``--sensitivity``)."""
    import lessmem
    from lessmem.eval.allocate import measure_sensitivity

    model, tok = lessmem.load("smollm2-135m")
    t0 = time.time()
    sens = measure_sensitivity(model, tok, TRAIN.read_text(), PRESETS["best-3"], (2, 3, 4),
                               windows=args.windows, window_len=args.window_len, chunk=args.chunk)
    out = {"text": TRAIN.name, "model": "smollm2-135m", "seconds": time.time() - t0,
           "sensitivity": sens.to_dict()}
    SENSITIVITY.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {SENSITIVITY} in {out['seconds']:.0f} s")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--which", default="4,2,presets",
                   help="candidate groups, comma-separated: 4, 2, 35, 25, mixed, presets")
    p.add_argument("--sensitivity", action="store_true",
                   help=f"measure each layer's cost per side and bits into {SENSITIVITY.name} "
                        "(the input of --which mixed) and stop")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "kv_tuning.json")
    args = p.parse_args(argv)
    bad = [g for g in args.which.split(",") if g not in ("4", "2", "35", "25", "mixed", "presets")]
    if bad:
        p.error(f"--which {','.join(bad)}; allowed: 4, 2, 35, 25, mixed, presets (comma-separated)")
    if args.sensitivity:
        return measure(args)
    import lessmem
    from lessmem.eval.caches import CacheSpec
    from lessmem.eval.perplexity import evaluate
    from lessmem.kvcache import KVCache

    model, tok = lessmem.load("smollm2-135m")
    text = TRAIN.read_text()
    sens = load_sensitivity() if "mixed" in args.which.split(",") else None
    groups = {"4": CANDIDATES_4, "2": CANDIDATES_2, "35": CANDIDATES_35, "25": CANDIDATES_25,
              "mixed": mixed_candidates(sens) if sens is not None else {},
              "presets": {f"preset:{n}": PRESETS[n] for n in ("int8", "fp8", "kivi-4", "kivi-2", "best-4",
                                                              "best-2")}}
    cands = {}
    for g in args.which.split(","):
        cands.update(groups[g])
    if groups["mixed"]:  # the allocations as files: --kv results/kv_configs/X.json
        KV_CONFIGS.mkdir(parents=True, exist_ok=True)
    for name, cfg in groups["mixed"].items():
        (KV_CONFIGS / f"{name}.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    def factory(kv):
        return lambda model_config: KVCache(model_config, kv)

    specs = [CacheSpec(n, factory(c), "lessmem", c.to_dict()) for n, c in cands.items()]
    t0 = time.time()
    with enable(model):
        rows = evaluate(model, tok, specs, text, args.windows, args.window_len, args.chunk,
                        model_name="smollm2-135m", text_name="wiki.train.head.raw")
    out = []
    for r in rows:
        cfg = cands.get(r["config"])
        row = {k: r.get(k) for k in ("config", "ppl", "delta_ppl_pct", "kld", "top1", "k_bits", "v_bits")}
        if cfg is not None:
            kb, vb = cfg.effective_bits(64, num_layers=_Dims.layers)
            bits_4k = all_in_bits(cfg, 4096)
            row.update(bits_avg=(kb + vb) / 2, compression_4k=16 / bits_4k, bits_4k=bits_4k,
                       bits_8k=all_in_bits(cfg, 8192), kv=cfg.to_dict())
            if r["config"] in groups["mixed"]:  # what the table predicts, costs summed over layers
                row["predicted_kld"] = sens.cost(cfg)
        out.append(row)
        print(f"{row['config']:<28} dppl {row['delta_ppl_pct']:+7.3f}%  kld {row['kld']:.4f}  "
              f"bits {row.get('bits_avg', 16):.3f} (8k all-in {row.get('bits_8k', 16):.3f})  "
              f"x{row.get('compression_4k', 1):.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"protocol": {k: rows[0][k] for k in ("model", "text", "windows",
                                    "window_len", "chunk", "prefill")}, "seconds": time.time() - t0,
                                    "rows": out}, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
