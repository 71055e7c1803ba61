"""Tiered KV offload: decode speed and memory with 75% of the quantized cache on disk.

Batch 1, the built-in model (SmolLM2-135M, fused quantized attention), contexts of 4k and
8k tokens of WikiText-2 prefilled once into an in-memory :class:`KVCache` (preset
``int4``); the same state is then copied into :class:`TieredKVCache` variants whose
device budget leaves ``--disk-share`` (75%) of the quantized blocks on a disk tier
(fsync'd, CRC-checked files). The variants decode greedily side by side, one step each
in turn, each one first in turn (so machine noise and cache effects hit all alike):

- ``memory``: the in-memory quantized cache (baseline);
- ``tiered+prefetch``: disk tier with the prefetcher on (``prefetch=True``: "gather" — layer
  i+1 gathered by a background thread while layer i computes — when a core is free for
  it, else "hint" — the step's block files advised into the page cache, read and checked
  by the decoding thread on all cores; the mode used is in the JSON);
- ``tiered``: the same without prefetch (what the prefetch hides).

Correctness first: every step's logits of each tiered variant must equal the baseline's
bit for bit. Reported per context: tok/s and the ratio to the baseline, bytes on the
device (peak, from the tensors held) against the budget, achieved disk read GB/s,
prefetch lateness. Then the peak process RSS (sampled every 2 ms) of two fresh
subprocesses that restore the saved state from the disk store and decode: all blocks
in RAM vs the tiered cache under the budget.

    python benchmarks/bench_offload.py                      # built-in model, 4k and 8k
    python benchmarks/bench_offload.py --block-tokens 1024  # same, written to offload_b1024.json
    python benchmarks/bench_offload.py --quick              # CI: tiny random model
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, parser, write_result  # noqa: E402

from lessmem.kvcache import KVCache, enable  # noqa: E402
from lessmem.kvcache.presets import PRESETS  # noqa: E402
from lessmem.kvcache.tiered import TieredKVCache, cache_kwargs  # noqa: E402
from lessmem.offload import DiskTier  # noqa: E402


def load_model(quick: bool):
    if quick:
        from lessmem.models import tiny_random

        m = tiny_random("llama", num_layers=24, hidden_size=32, num_heads=2, num_kv_heads=1,
                        intermediate_size=64, seed=2)
        return m, None, PRESETS["int4"].replace(window=8, block_size=8), 16
    from lessmem.models import load

    m, tok = load("smollm2-135m")
    return m, tok, PRESETS["int4"], 256


def context_ids(tok, n: int, vocab: int) -> torch.Tensor:
    from lessmem.base.paths import repo_data_file

    path = repo_data_file("wikitext-2-raw", "wiki.test.raw")
    if tok is not None and path is not None:
        text = path.read_text()
        ids = tok(text[: n * 6], return_tensors="pt").input_ids
        while ids.shape[1] < n:
            ids = torch.cat([ids, ids], dim=1)
        return ids[:, :n]
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab - 16, (1, n), generator=g)


def prefill(model, cache, ids, chunk: int) -> torch.Tensor:
    with torch.no_grad():
        for a in range(0, ids.shape[1], chunk):
            out = model(ids[:, a:a + chunk], **cache_kwargs(model, cache))
    return out.logits[:, -1].float()


def budget_for(cache: TieredKVCache, disk_share: float) -> int:
    """Device bytes that leave ``disk_share`` of the sealed blocks below the device."""
    blocks = sum(sum(la.block_bytes) for la in cache.tiered)
    growth = sum(la.token_bytes() for la in cache.tiered)
    return int(cache.fp_bytes() + growth + cache.account.reserve() + (1 - disk_share) * blocks)


def disk_share_of(cache: TieredKVCache) -> float:
    total = on_dev = 0
    for la in cache.tiered:
        for k, b in zip(la.block_keys, la.block_bytes, strict=True):
            total += b
            on_dev += b if cache.device_tier.contains(k) else 0
    return 1 - on_dev / total if total else 0.0


def run_context(model, tok, cfg, block_tokens, n_ctx, steps, disk_share, root: Path,
                save: bool) -> dict:
    vocab = model.config.vocab_size
    ids = context_ids(tok, n_ctx, vocab)
    src = KVCache(model.config, cfg)
    t0 = time.perf_counter()
    logits0 = prefill(model, src, ids, chunk=512 if n_ctx > 1024 else 64)
    t_prefill = time.perf_counter() - t0
    if save:  # the state after the prompt, for the peak-RSS subprocesses
        torch.save(ids, root / "ids.pt")
        saver = TieredKVCache.from_cache(src, tiers=[DiskTier(root / "rss-store")],
                                         block_tokens=block_tokens, model=model)
        saver.save_prefix(ids[0], logits0)
        saver.close(keep_session=True)
    caches = {"memory": src}
    for name, pf in (("tiered+prefetch", True), ("tiered", False)):
        c = TieredKVCache.from_cache(src, tiers=[DiskTier(root / f"{n_ctx}-{name}")],
                                     block_tokens=block_tokens, prefetch=pf, model=model)
        c.set_device_budget(budget_for(c, disk_share))
        caches[name] = c
    nxt = {n: logits0.argmax(-1) for n in caches}
    times = {n: [] for n in caches}
    exact = True
    with torch.no_grad():
        order = list(caches)
        for step in range(steps):
            step_logits = {}
            k = step % len(order)
            for name in order[k:] + order[:k]:  # each variant first in turn
                c = caches[name]
                t0 = time.perf_counter()
                out = model(nxt[name][:, None], **cache_kwargs(model, c))
                times[name].append(time.perf_counter() - t0)
                step_logits[name] = out.logits[:, -1].float()
                nxt[name] = step_logits[name].argmax(-1)
            exact &= all(torch.equal(step_logits["memory"], v) for v in step_logits.values())
    base = statistics.median(times["memory"][1:])
    res = {"context": n_ctx, "prefill_s": t_prefill, "decode_steps": steps, "bit_exact": bool(exact),
           "cache_bytes": src.memory()["total"], "variants": {}}
    for name, c in caches.items():
        med = statistics.median(times[name][1:])
        row = {"ms_per_token": 1e3 * med, "tok_s": 1 / med, "ratio_vs_memory": base / med}
        if isinstance(c, TieredKVCache):
            st = c.offload_stats()
            row.update(prefetch_mode=c.prefetch, device_budget=c.device_budget, device_peak=c.device_peak,
                       within_budget=c.device_peak <= c.device_budget, disk_share=disk_share_of(c),
                       disk_bytes=c.stack.placement()[c.lower[0].name],
                       disk_read_gbps=st[c.lower[0].name]["read_gbps"],
                       disk_bytes_read=st[c.lower[0].name]["bytes_read"], prefetch=st["prefetch"])
            c.close()
        res["variants"][name] = row
    return res


CHILD = r"""
import gc, json, sys, threading, time, torch
sys.path.insert(0, sys.argv[1])
import bench_offload as b
from lessmem.kvcache import enable
from lessmem.kvcache.tiered import TieredKVCache, cache_kwargs
from lessmem.offload import DiskTier
quick, store, mode, steps, ids = sys.argv[2] == "1", sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
model, tok, cfg, bt = b.load_model(quick)
bt = int(sys.argv[8])
enable(model)
ids = torch.load(ids)
gc.collect()
base = b.rss_bytes()
peak = [base]
stop = threading.Event()
def sample():  # current RSS every 2 ms: the peak while the cache is restored and used
    while not stop.is_set():
        peak[0] = max(peak[0], b.rss_bytes())
        time.sleep(0.002)
th = threading.Thread(target=sample, daemon=True)
th.start()
c = TieredKVCache(model.config, cfg, tiers=[DiskTier(store)], block_tokens=bt, model=model)  # same weights: same keys
if mode == "tiered":
    c.set_device_budget(1)  # restore with everything below the device, then set the real budget
logits = c.restore_prefix(ids[0])
assert logits is not None and logits.numel(), "saved prefix not found"
if mode == "memory":
    cache = c.to_kvcache()
    c.close(keep_session=True)
else:
    cache = c
    c.set_device_budget(b.budget_for(c, float(sys.argv[7])))
nxt = logits.argmax(-1)
with torch.no_grad():
    for _ in range(steps):
        nxt = model(nxt[:, None], **cache_kwargs(model, cache)).logits[:, -1].argmax(-1)
stop.set()
th.join()
print(json.dumps({"rss_before_cache": base, "peak_rss_during_decode": peak[0],
                  "kv_bytes_on_device": getattr(cache, "device_peak", None) or cache.memory()["total"]}))
"""


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def rss_phase(quick, steps, disk_share, root: Path, block_tokens: int) -> dict:
    """Peak RSS of fresh processes decoding from the saved state: all-in-RAM vs tiered."""
    out = {}
    for mode in ("memory", "tiered"):
        cmd = [sys.executable, "-c", CHILD, str(Path(__file__).resolve().parent), "1" if quick else "0",
               str(root / "rss-store"), mode, str(steps), str(root / "ids.pt"), str(disk_share), str(block_tokens)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if p.returncode:
            raise RuntimeError(p.stderr[-2000:])
        out[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    out["kv_rss_mib"] = {k: (v["peak_rss_during_decode"] - v["rss_before_cache"]) / 2**20
                         for k, v in out.items()}
    out["peak_rss_drop_mib"] = (out["memory"]["peak_rss_during_decode"]
                                - out["tiered"]["peak_rss_during_decode"]) / 2**20
    return out


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--contexts", default=None, help="comma-separated context lengths (default 4096,8192)")
    p.add_argument("--steps", type=int, default=None, help="decode steps per variant (default 24)")
    p.add_argument("--disk-share", type=float, default=0.75, help="share of the blocks on disk")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="tokens per stored block (default 256, the cache's default; 16 with --quick)")
    p.add_argument("--no-rss", action="store_true", help="skip the subprocess peak-RSS phase "
                   "(always skipped with --quick)")
    args = p.parse_args()
    args.no_rss = args.no_rss or args.quick
    if args.quick:
        torch.set_num_threads(1)  # tiny shapes: threads only add contention on a shared machine
    if not 0 <= args.disk_share <= 1:
        raise SystemExit(f"--disk-share={args.disk_share}; allowed: 0..1")
    contexts = [int(x) for x in (args.contexts or ("320" if args.quick else "4096,8192")).split(",")]
    steps = args.steps or (4 if args.quick else 24)
    model, tok, cfg, default_block_tokens = load_model(args.quick)
    block_tokens = args.block_tokens or default_block_tokens
    enable(model)
    h = header(model="tiny-random-24L" if args.quick else "smollm2-135m", kv_preset="int4",
               window=cfg.window, block_tokens=block_tokens, contexts=contexts, steps=steps,
               disk_share=args.disk_share, batch=1)
    results = {"header": h, "contexts": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("LESSMEM_BENCH_DIR")) as tmp:
        root = Path(tmp)
        for n in contexts:
            rss = not args.no_rss and n == contexts[-1]
            res = run_context(model, tok, cfg, block_tokens, n, steps, args.disk_share, root, rss)
            v = res["variants"]
            print(f"ctx {n}: bit_exact={res['bit_exact']}  memory {v['memory']['tok_s']:.2f} tok/s  "
                  f"tiered+prefetch {v['tiered+prefetch']['tok_s']:.2f} "
                  f"({v['tiered+prefetch']['ratio_vs_memory']:.2f}x, disk {v['tiered+prefetch']['disk_share']:.0%}, "
                  f"{v['tiered+prefetch']['prefetch_mode']})  "
                  f"tiered {v['tiered']['tok_s']:.2f} ({v['tiered']['ratio_vs_memory']:.2f}x)")
            if not res["bit_exact"]:
                raise SystemExit("tiered logits differ from the in-memory cache")
            if rss:
                res["rss"] = rss_phase(args.quick, 8, args.disk_share, root, block_tokens)
                print(f"peak RSS of the KV part (MiB): {res['rss']['kv_rss_mib']}, "
                      f"process peak drop {res['rss']['peak_rss_drop_mib']:.1f} MiB")
            results["contexts"].append(res)
    results["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # a non-default block size gets its own file (offload_b1024.json) instead of overwriting offload.json
    stem = "offload" if args.quick or block_tokens == default_block_tokens else f"offload_b{block_tokens}"
    write_result(stem, results, args.out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
