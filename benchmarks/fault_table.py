"""Fault table: each class of storage fault, N trials, how many were detected, what was lost.

Every trial injects one fault into a real store (block files on disk, a real
redis-server, a writer process killed with SIGKILL) or into a tiered KV cache in the
middle of a run (tiny random llama, int4, 32-token blocks, 150-token prompt, then the
undisturbed run's tokens fed one at a time), and records:

- ``detected``: the fault was noticed where it matters: a damaged block was refused (a
  miss, counted as corrupt), the cache recomputed lost blocks (``recoveries``), refused
  or kept a block it could not place (``refused_blocks``/``demote_failures``), did not
  restore another model's state, or a store reopened after a kill showed no partial
  block;
- ``lost``: something acknowledged was lost or something wrong was returned: a damaged
  block's bytes returned as data, an acknowledged block missing or different after a
  kill, or a run whose logits, fed the undisturbed run's tokens (teacher forcing), are
  off by more than the int4 cache's own tolerance (``TOL``) on some step;
- ``token_flips``: runs whose own greedy pick differed from the undisturbed run's at some
  step (recomputed tokens are new K/V of the same tokens: a near tie can move);
- ``crashed``: the run raised instead of completing.

The faults: damaged block files of every kind (flipped byte at a random offset,
truncated, emptied, extended, another block's bytes, zeroed, deleted) read through
``get`` and ``get_many``; kill -9 of a disk writer (``tests/offload/_writer.py``); Redis
killed mid-decode (alone and behind a small host tier), down from the start, restarted
empty, evicting under ``maxmemory`` + ``allkeys-lru``, full under ``noeviction``; a disk
block deleted by a peer; block files corrupted after a restore; a failed demotion (a
full disk, a down Redis); a prefix restored into a different model (other weights,
quantized, bf16).

    python benchmarks/fault_table.py            # 20 trials per fault (200 for damaged files)
    python benchmarks/fault_table.py --quick    # 2 per fault (CI)
    python benchmarks/fault_table.py --trials 5
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "kvcache"))  # _gen: model, prompt, greedy decode
sys.path.insert(0, str(HERE.parent / "tests"))  # _redis: a private redis-server
sys.path.insert(0, str(HERE.parent / "tests" / "offload"))  # _kill: kill -9 a block writer

import torch  # noqa: E402
from common import header, parser, write_result  # noqa: E402

torch.set_num_threads(1)

import _gen  # noqa: E402
from _kill import kill_writer  # noqa: E402
from _redis import RedisProc  # noqa: E402

from lessmem.kvcache import KVCache  # noqa: E402
from lessmem.kvcache.cache import cache_kwargs  # noqa: E402
from lessmem.kvcache.tiered import TieredKVCache  # noqa: E402
from lessmem.offload import DiskTier, HostTier  # noqa: E402

STEPS = 16
TOL = 0.05  # the int4 cache vs. itself with tokens recomputed in chunks (measured: < 0.01)
DAMAGES = ("flip", "truncate", "empty", "extend", "swap", "zero", "missing")


# ---- a redis-server of our own (tests/_redis.py) -----------------------------------------

def fill(url: str, mb: int) -> None:
    """Another tenant writes ``mb`` MB of newer values (evicts under allkeys-lru)."""
    import redis

    client = redis.Redis.from_url(url)
    for size in (100_000, 10_000, 1_000, 100):  # under noeviction: pack it full to the last byte
        try:
            for i in range(mb * 1_000_000 // size):
                client.set(f"junk:{size}:{i}", b"x" * size)
        except redis.exceptions.ResponseError:
            continue  # full at this size: smaller values fill what is left
    client.close()


# ---- damaged block files and kill -9 (the disk tier itself) ----------------------------

def _block(i: int) -> dict:
    return {"x": torch.full((4096,), float(i)), "i": torch.tensor([i])}


def _damage(f: Path, how: str, other: Path, rng: random.Random) -> None:
    data = bytearray(f.read_bytes())
    if how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        data = data[:rng.randrange(len(data))]
    elif how == "empty":
        data = bytearray()
    elif how == "extend":
        data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif how == "swap":  # a valid block under the wrong name
        data = bytearray(other.read_bytes())
    elif how == "zero":
        a = rng.randrange(len(data))
        data[a:a + 512] = bytes(len(data[a:a + 512]))
    elif how == "missing":
        f.unlink()
        return
    f.write_bytes(data)


def trial_damaged(how: str, rng: random.Random, root: Path, via_many: bool) -> dict:
    t = DiskTier(root, fsync=False)
    t.put("a", _block(1))
    t.put("b", _block(2))
    _damage(root / "blocks" / "a.blk", how, root / "blocks" / "b.blk", rng)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = t.get_many(["a"])[0] if via_many else t.get("a")
    wrong = got is not None and not (torch.equal(got["x"], _block(1)["x"]) and got["i"].item() == 1)
    refused = got is None and (how == "missing" or t.stats.corrupt == 1)
    intact = t.get("b") is not None and t.get("b")["i"].item() == 2
    t.close()
    return {"detected": refused, "lost": wrong or not intact}


def trial_kill9(rng: random.Random, root: Path) -> dict:
    acked = kill_writer(root, after=rng.randrange(5, 40))
    t = DiskTier(root)  # reopening removes the dead writer's temp files
    lost = 0
    for key in acked:
        b = t.get(key)
        i = int(key[3:])
        lost += b is None or b["i"].item() != i or not torch.equal(b["x"], torch.full((20000,), float(i)))
    clean = t.stats.corrupt == 0 and not [f for f in os.listdir(root / "blocks") if f.startswith(".tmp")]
    t.close()
    return {"detected": clean, "lost": lost > 0}


# ---- faults in a tiered cache's run ------------------------------------------------------

class Run:
    """The model, its prompt, and an undisturbed run to compare with."""

    def __init__(self):
        self.model = _gen.model()
        self.ids = _gen.prompt()
        ref = KVCache(self.model.config, _gen.CFG)
        self.toks, self.logits = _gen.decode(self.model, ref, _gen.chunked_prefill(self.model, ref, self.ids),
                                             STEPS)

    def cache(self, tiers, **kw) -> TieredKVCache:
        return TieredKVCache(self.model.config, _gen.CFG, tiers=tiers, block_tokens=32, device_budget="16KiB",
                             model=self.model, **kw)

    def decode(self, cache, logits, fault=None, at: int = 0) -> tuple[list, list]:
        """Teacher-forced: feed the undisturbed run's tokens (``fault()`` after step ``at``),
        so every step's logits compare with that run's on the same input; returns this
        run's own greedy picks and its logits."""
        toks, all_logits = [], [logits]
        with torch.no_grad():
            for i, t in enumerate(self.toks):
                toks.append(int(logits.argmax(-1)[0]))
                out = self.model(torch.tensor([[t]]), **cache_kwargs(self.model, cache))
                logits = out.logits[:, -1].float()
                all_logits.append(logits)
                if i + 1 == at and fault is not None:
                    fault()
        return toks, all_logits

    def wrong(self, toks, logits) -> bool:
        """Logits off by more than the int4 cache's own tolerance on some step."""
        worst = max((a - b).abs().max().item() for a, b in zip(logits, self.logits, strict=True))
        return worst > TOL

    def flips(self, toks) -> bool:
        """A greedy pick differs from the undisturbed run's (a near tie moved by a
        recomputation's new K/V of the same tokens; counted, not a loss by itself)."""
        return toks != self.toks


def _cache_trial(run: Run, make, fault, detected, rng: random.Random) -> dict:
    """A run with ``fault()`` after a random step; ``detected(cache)`` says if it was noticed."""
    cache = make()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits = cache.prefill(run.model, run.ids, save=False)
            toks, all_logits = run.decode(cache, logits, fault, at=rng.randrange(1, STEPS))
        return {"detected": bool(detected(cache)), "lost": run.wrong(toks, all_logits),
                "token_flips": run.flips(toks)}
    except Exception as e:  # noqa: BLE001 - a crash is recorded, not hidden
        return {"detected": True, "lost": False, "crashed": f"{type(e).__name__}: {e}"[:300]}
    finally:
        cache.close()


def _recovered(cache) -> bool:
    return cache.offload_stats()["recoveries"] > 0


def _blocks(root: Path) -> list[Path]:
    return sorted(p for p in (root / "blocks").glob("*.blk") if not p.name.startswith(("state-", "sinks-")))


def redis_trials(run: Run, rng: random.Random, root: Path) -> dict:
    """Each Redis fault once, on a fresh server."""
    out = {}
    srv = RedisProc(root)
    try:
        out["redis killed mid-decode"] = _cache_trial(
            run, lambda: run.cache(srv.start().url), srv.kill, _recovered, rng)
        out["redis killed behind a host tier"] = _cache_trial(
            run, lambda: run.cache(f"host@4KiB,{srv.start().url}"), srv.kill, _recovered, rng)
        srv.kill()
        out["redis down from the start"] = _cache_trial(
            run, lambda: run.cache(srv.url), None, lambda c: c.offload_stats()["refused_blocks"] > 0, rng)
        out["redis restarted empty"] = _cache_trial(
            run, lambda: run.cache(srv.start().url), lambda: (srv.kill(), srv.start()), _recovered, rng)
        srv.kill()
        out["redis evicting (maxmemory, allkeys-lru)"] = _cache_trial(
            run, lambda: run.cache(srv.start("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru").url),
            lambda: fill(srv.url, 8), _recovered, rng)
        srv.kill()
        def full_server():  # another tenant filled it before the run: every write is refused (OOM)
            srv.start("--maxmemory", "2mb")
            fill(srv.url, 4)
            return run.cache(f"host@4KiB,{srv.url}")
        out["redis full (maxmemory, noeviction)"] = _cache_trial(
            run, full_server, None,
            lambda c: c.offload_stats()["remote"]["errors"] > 0 and c.offload_stats()["host"]["demote_failures"] > 0,
            rng)
        srv.kill()
        out["failed demotion: redis down"] = _cache_trial(
            run, lambda: run.cache(f"host@4KiB,{srv.url}"), None,
            lambda c: c.offload_stats()["host"]["demote_failures"] > 0, rng)
    finally:
        srv.kill()
    return out


def disk_trials(run: Run, rng: random.Random, root: Path) -> dict:
    out = {}
    d = root / "peer"

    def peer_evicts():
        files = _blocks(d)
        for p in rng.sample(files, max(1, len(files) // 2)):
            p.unlink()
    out["disk block deleted by a peer"] = _cache_trial(
        run, lambda: run.cache([DiskTier(d, fsync=False)], prefetch=rng.choice(["gather", False])),
        peer_evicts, _recovered, rng)
    full = root / "full"
    out["failed demotion: full disk"] = _cache_trial(
        run, lambda: run.cache([HostTier(capacity=4096), DiskTier(full, capacity=1024, fsync=False)]), None,
        lambda c: c.offload_stats()["host"]["demote_failures"] > 0, rng)
    out["corrupt block after a restore"] = _corrupt_after_restore(run, rng, root / "restore")
    return out


def _corrupt_after_restore(run: Run, rng: random.Random, d: Path) -> dict:
    a = run.cache(f"disk:{d}", prefetch=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = a.prefill(run.model, run.ids)
    a.close()
    b = run.cache(f"disk:{d}", prefetch=False)

    def corrupt():
        files = _blocks(d)
        for p in rng.sample(files, max(1, len(files) // 3)):
            _damage(p, "flip", p, rng)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restored = b.restore_prefix(run.ids[0])
            if restored is None:
                return {"detected": False, "lost": False, "crashed": "the saved prefix was not restored"}
            toks, logits = run.decode(b, saved, corrupt, at=rng.randrange(1, STEPS))
        return {"detected": _recovered(b), "lost": run.wrong(toks, logits), "token_flips": run.flips(toks)}
    except Exception as e:  # noqa: BLE001
        return {"detected": True, "lost": False, "crashed": f"{type(e).__name__}: {e}"[:300]}
    finally:
        b.close()


def trial_other_model(run: Run, which: str, root: Path) -> dict:
    from lessmem import RTNConfig, quantize_
    from lessmem.models import tiny_random

    ids = run.ids[:, :100]
    a = run.cache(f"disk:{root}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a.prefill(run.model, ids)
    a.close()
    if which == "other weights":
        other = tiny_random("llama", num_layers=4, seed=2)
    else:
        other = _gen.model()
        if which == "quantized":
            quantize_(other, RTNConfig(bits=4, group_size=32), progress=False)
        else:
            other = other.to(torch.bfloat16)
    c = TieredKVCache(other.config, _gen.CFG, tiers=f"disk:{root}", block_tokens=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = c.prefill(other, ids)
    reused = c.prefill_skipped + c.prefix_tokens_reused
    c.close()
    ref = KVCache(other.config, _gen.CFG)
    want = _gen.chunked_prefill(other, ref, ids)
    return {"detected": reused == 0, "lost": not torch.equal(got, want)}


# ---- the table ---------------------------------------------------------------------------

def add(table: dict, name: str, r: dict) -> None:
    row = table.setdefault(name, {"trials": 0, "detected": 0, "lost": 0, "token_flips": 0, "crashed": 0,
                                  "errors": []})
    row["trials"] += 1
    row["token_flips"] += bool(r.get("token_flips"))
    row["detected"] += bool(r["detected"])
    row["lost"] += bool(r["lost"])
    if r.get("crashed"):
        row["crashed"] += 1
        row["errors"] = (row["errors"] + [r["crashed"]])[:3]


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=None, help="trials per fault (default 20; --quick: 2)")
    args = p.parse_args()
    n = args.trials or (2 if args.quick else 20)
    if n < 1:
        p.error(f"--trials {n}: allowed: a positive integer")
    if shutil.which("redis-server") is None:
        p.error("needs redis-server on PATH (the Redis faults run against a real server)")
    rng = random.Random(0)
    table: dict = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lessmem-faults-") as tmp:
        tmp = Path(tmp)
        for i in range(10 * n):  # damaged block files: cheap, so ten times as many
            how = DAMAGES[i % len(DAMAGES)]
            add(table, f"damaged block file: {how}", trial_damaged(how, rng, tmp / f"dmg{i}", via_many=i % 2 == 1))
        for i in range(n):
            add(table, "kill -9 of a disk writer", trial_kill9(rng, tmp / f"kill{i}"))
        run = Run()
        for i in range(n):
            print(f"tiered-cache faults, trial {i + 1}/{n} ({time.perf_counter() - t0:.0f} s)", flush=True)
            for name, r in {**redis_trials(run, rng, tmp / f"redis{i}"),
                            **disk_trials(run, rng, tmp / f"disk{i}")}.items():
                add(table, name, r)
            which = ("other weights", "quantized", "bf16")[i % 3]
            add(table, "prefix restored into a different model", trial_other_model(run, which, tmp / f"id{i}"))
    for name, row in table.items():
        print(f"{name:45s} trials {row['trials']:4d}  detected {row['detected']:4d}  lost {row['lost']:3d}"
              f"  crashed {row['crashed']:3d}  token flips {row['token_flips']:3d}")
    total_lost = sum(r["lost"] for r in table.values())
    data = {"header": header(trials=n, steps=STEPS, tol=TOL, model="tiny random llama (4 layers), int4, "
                                                            "32-token blocks"),
            "faults": table, "lost": total_lost, "crashed": sum(r["crashed"] for r in table.values()),
            "seconds": time.perf_counter() - t0,
            "command": "python benchmarks/fault_table.py" + (" --quick" if args.quick else "")}
    write_result("fault_table", data, args.out, quick=args.quick)


if __name__ == "__main__":
    main()
