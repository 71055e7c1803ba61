"""Bits per key channel for the built-in model, calibrated on WikiText-2 *train* text.

Takes each per-layer allocation in ``benchmarks/results/kv_configs/mixed-*.json`` (the
layer's key and value bits from ``lessmem kv-allocate``) and spends each layer's key bits
per channel instead of uniformly (``lessmem.eval.channels.calibrate_channels``: E[q²] and
the key quantization error of every channel, measured on 8 windows of 1024 train tokens).
Writes ``kv_configs/chan-<budget>.json``; ``bench_kv_quality.py`` measures them on the
test split.

    python benchmarks/calibrate_kv_channels.py            # ~1 minute on two cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lessmem.eval.channels import calibrate_channels
from lessmem.eval.perplexity import make_windows
from lessmem.kvcache.config import KVConfig
from lessmem.models import load

ROOT = Path(__file__).resolve().parent
TRAIN = ROOT.parents[1] / "shared/data/wikitext-2-raw/wiki.train.head.raw"
CONFIGS = ROOT / "results" / "kv_configs"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="2.5,3.0,3.5", help="mixed-<budget>.json files to start from")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m", weights="float")
    ids = make_windows(tok, TRAIN.read_text(), args.windows, args.window_len)
    for budget in args.budgets.split(","):
        t0 = time.perf_counter()
        template = KVConfig.from_dict(json.loads((CONFIGS / f"mixed-{budget}.json").read_text()))
        cfg = calibrate_channels(model, ids, None, template)
        out = CONFIGS / f"chan-{budget}.json"
        out.write_text(json.dumps(cfg.to_dict()) + "\n")
        kb, vb = cfg.effective_bits(model.config.head_dim, model.config.num_hidden_layers)
        print(f"{out.name}: keys {kb:.2f} / values {vb:.2f} bits ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
