"""Shared helpers for benchmarks (not packaged): header, timing, JSON results.

Every benchmark: checks correctness against the reference first, warms up, times,
prints a header (device, torch version, threads, shapes) and writes JSON under
``benchmarks/results/``. Speeds are reported as ratios against a baseline timed in
the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (CI)")
    p.add_argument("--out", type=Path, default=None, help="JSON result path")
    return p


def header(**shapes) -> dict:
    h = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or platform.machine(),
        "cuda": torch.cuda.is_available(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **shapes,
    }
    print("# " + "  ".join(f"{k}={v}" for k, v in h.items()))
    return h


def interleaved(fns: dict, x, repeat: int, warmup: int = 3) -> dict:
    """Median seconds of each callable ``f(x)``, timed round-robin so a noisy neighbour
    hits all alike."""
    for _ in range(warmup):
        for f in fns.values():
            f(x)
    ts = {name: [] for name in fns}
    for _ in range(repeat):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f(x)
            ts[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in ts.items()}


def write_result(name: str, data: dict, out: Path | None = None, quick: bool = False) -> Path:
    """Write JSON to ``out`` or ``benchmarks/results/{name}[.quick].json``."""
    path = out or RESULTS / f"{name}{'.quick' if quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    print(f"wrote {path}")
    return path
