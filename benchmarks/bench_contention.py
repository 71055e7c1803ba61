"""Decode speed with and without a competing CPU-bound process: do the threads degrade gracefully?

On a machine where other processes compete for the cores, OpenMP threads that spin while
they wait (libgomp's default) burn the cores that the working threads need; threads that
sleep at once (``OMP_WAIT_POLICY=PASSIVE``) must be woken for every parallel region, which
costs a decode step of hundreds of small kernels dearly even on a quiet machine. lessmem
sets a short spin (``GOMP_SPINCOUNT``/``KMP_BLOCKTIME``, ``lessmem/__init__.py``) when it is
imported before torch; this benchmark measures it against both.

Each variant runs in its own worker process, since the OpenMP runtime reads its
environment once, when torch is imported:

- ``lessmem``: lessmem imported first, its own setting, torch's default threads;
- ``passive``: lessmem imported first with ``OMP_WAIT_POLICY=PASSIVE``, the same threads;
- ``spin``: torch imported first with nothing set (libgomp's default, what a script that
  imports torch before lessmem gets), the same threads;
- ``lessmem-1t`` (full run only): lessmem's setting and ``torch.set_num_threads(1)``;
- ``lessmem-auto`` (full run only): lessmem's setting, and before each run no more threads
  than ``lessmem.base.cpu.free_cores()`` finds idle (what ``lessmem eval``/``generate`` do).

A worker loads the model, prefills ``--context`` tokens into a lessmem ``int4`` cache
with the fused attention on (so torch's and lessmem's C++ kernels both run), and times
``--tokens`` greedy decode steps, once per request. The parent alternates requests
without and with one competing process (a Python busy loop, one core's worth) for
``--rounds`` rounds, and reports per variant the median tok/s alone and contended and
their ratio (1.0: unaffected; with two cores and one competitor ~0.5 is a fair share;
far below: a collapse). The worker also counts the OpenMP runtimes mapped in its
process (1: torch and the C++ kernels share one libgomp, so one setting covers both).

    python benchmarks/bench_contention.py            # built-in model (SmolLM2-135M)
    python benchmarks/bench_contention.py --quick    # tiny random model (CI)
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {  # name: (OMP_WAIT_POLICY, or "lessmem" for lessmem's own setting, or None for
    #                 libgomp's default; threads or None for torch's choice)
    "lessmem": ("lessmem", None),
    "passive": ("PASSIVE", None),
    "spin": (None, None),
    "lessmem-1t": ("lessmem", 1),
    # what `lessmem eval/generate` do without --threads: no more threads than idle cores,
    # sampled (lessmem.base.cpu.free_cores) when a run starts
    "lessmem-auto": ("lessmem", "auto"),
}
QUICK_VARIANTS = ("lessmem", "passive", "spin")
_OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # lessmem.OMP_WAIT_VARS; a worker
# must not import lessmem to read them: the import sets them, before torch starts


# ----------------------------------------------------------------------------- worker


def _worker(args) -> None:
    """One variant: import in the order the variant needs, then serve 'go' requests."""
    policy, threads = VARIANTS[args.worker]
    for name in _OMP_VARS:
        os.environ.pop(name, None)
    if policy is None:
        import torch  # first: the OpenMP runtime starts with its own default (spin a while)

        import lessmem  # noqa: F401  (its settings come too late to matter)
        at_start = "unset"
    else:
        if policy != "lessmem":
            os.environ["OMP_WAIT_POLICY"] = policy
        importlib.import_module("lessmem")  # before torch, as the `lessmem` command does
        at_start = " ".join(f"{n}={os.environ[n]}" for n in _OMP_VARS if n in os.environ)
        import torch
    default_threads = torch.get_num_threads()
    if isinstance(threads, int):
        torch.set_num_threads(threads)
    model, ids = _model_and_prompt(args)
    decode = _decoder(model, ids, args.tokens)
    decode()  # warm-up: kernels built/loaded, first allocations
    info = {"threads": torch.get_num_threads(), "omp_settings": at_start,
            "openmp_runtimes": _openmp_runtimes()}
    print(json.dumps({"ready": info}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        if threads == "auto":
            from lessmem.base.cpu import free_cores

            torch.set_num_threads(min(default_threads, free_cores()))
        print(json.dumps({**decode(), "threads": torch.get_num_threads()}), flush=True)


def _model_and_prompt(args):
    import torch

    from lessmem.models import tiny_random

    if args.quick:
        model = tiny_random("llama", hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=4)
    else:
        from lessmem.models import load

        model, _ = load("smollm2-135m")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    return model, torch.randint(1, vocab, (1, args.context), generator=g)


def _decoder(model, ids, steps: int):
    """A function: fresh int4 cache, prefill ``ids``, time ``steps`` greedy decode steps."""
    import torch

    from lessmem.kvcache import KVCache, enable
    from lessmem.kvcache.cache import cache_kwarg

    kw = cache_kwarg(model)

    @torch.inference_mode()
    def decode() -> dict:
        with enable(model):
            cache = KVCache(model.config, "int4")
            out = model(ids, **{kw: cache}, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                out = model(nxt, **{kw: cache}, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"tok_s": steps / wall, "wall_s": wall, "cpu_s": cpu}

    return decode


def _openmp_runtimes() -> int:
    """Distinct OpenMP runtime files mapped into this process (libgomp, libiomp, libomp)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return -1
    names = {line.split()[-1] for line in maps.splitlines()
             if any(k in line.rsplit("/", 1)[-1] for k in ("libgomp", "libiomp", "libomp"))}
    return len(names)


# ----------------------------------------------------------------------------- parent


class _Worker:
    def __init__(self, variant: str, args):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant,
               "--context", str(args.context), "--tokens", str(args.tokens)]
        if args.quick:
            cmd.append("--quick")
        env = {k: v for k, v in os.environ.items() if k not in (*_OMP_VARS, "OMP_NUM_THREADS")}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()["ready"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


class _Competitor:
    """One CPU-bound process (a Python busy loop) while the block runs."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True:\n    pass"])
        time.sleep(0.3)  # let it get onto a core
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def measure(args) -> dict:
    names = QUICK_VARIANTS if args.quick else tuple(VARIANTS)
    workers = {n: _Worker(n, args) for n in names}
    runs = {n: {"alone": [], "contended": []} for n in names}
    try:
        for _ in range(args.rounds):
            for n, w in workers.items():  # round-robin: drift on the machine hits all alike
                runs[n]["alone"].append(w.run())
                with _Competitor():
                    runs[n]["contended"].append(w.run())
    finally:
        for w in workers.values():
            w.close()
    out = {}
    for n in names:
        alone = statistics.median(r["tok_s"] for r in runs[n]["alone"])
        cont = statistics.median(r["tok_s"] for r in runs[n]["contended"])
        out[n] = {**workers[n].info, "alone_tok_s": alone,
                  "contended_tok_s": cont, "contended_vs_alone": cont / alone, "runs": runs[n]}
    return out


def main() -> None:
    sys.path.insert(0, str(HERE))
    from common import parser

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=None, help="prompt tokens (default 256; quick 64)")
    p.add_argument("--tokens", type=int, default=None, help="decode steps per run (default 32; quick 16)")
    p.add_argument("--rounds", type=int, default=None, help="alone/contended pairs (default 3; quick 1)")
    p.add_argument("--worker", choices=tuple(VARIANTS), default=None, help=argparse_suppress())
    args = p.parse_args()
    args.context = args.context or (64 if args.quick else 256)
    args.tokens = args.tokens or (16 if args.quick else 32)
    args.rounds = args.rounds or (1 if args.quick else 3)
    for name in ("context", "tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: allowed: an integer >= 1")
    if args.worker:
        return _worker(args)

    from common import header, write_result

    h = header(model="tiny-random-llama" if args.quick else "smollm2-135m", cache="int4",
               context=args.context, tokens=args.tokens, rounds=args.rounds,
               competitor="one Python busy loop")
    res = measure(args)
    print(f"{'variant':<12} {'OpenMP settings':<36} {'threads':>7} {'alone tok/s':>12} {'contended':>10} {'ratio':>6}")
    for n, r in res.items():
        threads = "/".join(str(t) for t in sorted({x.get("threads", r["threads"]) for x in
                                                   r["runs"]["alone"] + r["runs"]["contended"]}))
        print(f"{n:<12} {r['omp_settings']:<36} {threads:>7} "
              f"{r['alone_tok_s']:>12.1f} {r['contended_tok_s']:>10.1f} {r['contended_vs_alone']:>6.2f}")
    summary = {"contended_vs_alone": res["lessmem"]["contended_vs_alone"],
               "auto_threads_contended_vs_alone": (res["lessmem-auto"]["contended_vs_alone"]
                                                   if "lessmem-auto" in res else None),
               "lessmem_vs_passive_alone": res["lessmem"]["alone_tok_s"] / res["passive"]["alone_tok_s"],
               "lessmem_vs_spin_contended": res["lessmem"]["contended_tok_s"] / res["spin"]["contended_tok_s"],
               "passive_vs_spin_contended": res["passive"]["contended_tok_s"] / res["spin"]["contended_tok_s"],
               "openmp_runtimes": res["lessmem"]["openmp_runtimes"]}
    print("summary: " + json.dumps(summary))
    write_result("bench_contention", {"header": h, "variants": res, "summary": summary},
                 args.out, args.quick)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
