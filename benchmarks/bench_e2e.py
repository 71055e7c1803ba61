"""A whole decode step, lessmem against llama.cpp on the same GGUF file and the same token ids.

The built-in model's GGUF file is loaded by lessmem as it is stored (``lessmem.load``'s
default: blocks memory-mapped, fused dequant-matmuls) and by llama.cpp (the
``llama-cpp-python`` package; same threads, flash attention on). Both are given the same
token ids (the start of wikitext-2 test, tokenized once), prefill them, then decode
``--new-tokens`` greedy tokens. Every row runs in its own process, one at a time, rows
alternating within each repeat; the median over ``--repeats`` is reported.

Per row: decode tok/s (the first generated token comes from the prefill, so ``new - 1``
timed steps), prefill seconds, peak RSS (whole process, and while decoding: the peak is
reset after the prefill; lessmem loads no tokenizer, ``lessmem.load(..., tokenizer=False)``,
as llama.cpp is fed ids too: the RSS its HF tokenizer adds, measured after the run, is
reported beside it), the RSS of the bare imports measured by a process that only
imports (python + torch + transformers + lessmem, or python + llama_cpp), KV bytes, the
bytes a decode step reads (weights + KV) and the floor they imply at the memory bandwidth
measured here (a read loop over 512 MiB), how many greedy tokens match llama.cpp's
(f16 KV) row, and what the RSS at the end of the decode holds beyond the child's own
imports, by what backs it (``rss_growth_by_kind_mib``: the GGUF file's pages, shared
libraries' code pages the run touched, anonymous memory, other; from ``/proc/self/smaps``).

    python benchmarks/bench_e2e.py                      # 512, 4096, 8192, 16384-token prompts
    python benchmarks/bench_e2e.py --prompts 512,4096 --repeats 3
    python benchmarks/bench_e2e.py --quick              # CI: a tiny GGUF, lessmem rows only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LLAMA_KV = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids for llama.cpp's type_k / type_v
LLAMA_KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # bytes per stored value
ROWS = ("llama.cpp f16", "llama.cpp q8_0", "llama.cpp q4_0",
        "lessmem DynamicCache", "lessmem int8", "lessmem best-4", "lessmem best-2")
MiB = 2 ** 20


# ----------------------------------------------------------------------------- child side

def _status_mib(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rss_by_kind(gguf: str) -> dict[str, float] | None:
    """Resident MiB by what backs it (Linux ``/proc/self/smaps``): ``file`` (the GGUF file's
    mapped pages), ``code`` (shared libraries: torch's, the kernels', llama.cpp's), ``anon``
    (heap and anonymous memory: the KV, activations, the model's objects) and ``other``
    (other files, stacks). None where smaps cannot be read."""
    kinds = {"file": 0, "code": 0, "anon": 0, "other": 0}
    target = os.path.realpath(gguf)
    kind = "other"
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
                    name = head[5].strip() if len(head) > 5 else ""
                    kind = ("file" if name and os.path.realpath(name) == target
                            else "code" if ".so" in name.rsplit("/", 1)[-1]
                            else "anon" if not name or name == "[heap]" else "other")
                elif line.startswith("Rss:"):
                    kinds[kind] += int(line.split()[1])
    except OSError:
        return None
    return {k: v / 1024 for k, v in kinds.items()}


def _rss_growth(before: dict | None, gguf: str) -> dict[str, float] | None:
    """``_rss_by_kind`` now less ``before`` (the child's own, taken after its imports)."""
    now = _rss_by_kind(gguf)
    return None if before is None or now is None else {k: now[k] - before[k] for k in now}


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["engine"] == "imports-lessmem":
        import transformers.models.qwen2.modeling_qwen2  # noqa: F401

        _import_lessmem()
        return {"peak_rss_mib": _status_mib("VmHWM")}
    if spec["engine"] == "imports-llama.cpp":
        import llama_cpp  # noqa: F401

        return {"peak_rss_mib": _status_mib("VmHWM")}
    ids = json.loads(Path(spec["ids"]).read_text())
    if spec["engine"] == "llama.cpp":
        import llama_cpp  # noqa: F401  (its imports: not the model's share)

        spec = {**spec, "rss_start": _rss_by_kind(spec["gguf"])}
        return _child_llama(spec, ids)
    _import_lessmem()  # as the imports row has them
    spec = {**spec, "rss_start": _rss_by_kind(spec["gguf"])}
    return _child_lessmem(spec, ids)


def _import_lessmem() -> None:
    """What a lessmem child holds before the model: transformers' Llama, lessmem, its C++ kernels."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    import lessmem  # noqa: F401
    from lessmem.kernels import attention_cpp, gguf_linear_cpp

    gguf_linear_cpp.available(), attention_cpp.load()


def _child_llama(spec: dict, ids: list[int]) -> dict:
    from llama_cpp import Llama

    kv = spec["kv"]
    n_ctx = len(ids) + spec["new_tokens"] + 8
    llm = Llama(spec["gguf"], n_ctx=n_ctx, n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_batch=512, n_ubatch=512, flash_attn=True, type_k=LLAMA_KV[kv], type_v=LLAMA_KV[kv],
                logits_all=False, verbose=False, use_mmap=True)
    out, times = [], []
    t0 = time.perf_counter()
    gen = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    whole_peak = 0.0
    for tok in gen:
        times.append(time.perf_counter())
        if len(out) == 0:  # the prefill is done
            whole_peak = _status_mib("VmHWM")
            _reset_peak()
        out.append(int(tok))
        if len(out) == spec["new_tokens"]:
            break
    gen.close()
    decode_peak = _status_mib("VmHWM")
    growth = _rss_growth(spec["rss_start"], spec["gguf"])
    cfg = spec["config"]
    kv_bytes = (2 * cfg["layers"] * cfg["kv_heads"] * cfg["head_dim"] * (len(ids) + len(out))
                * LLAMA_KV_BYTES[kv])
    return {"tokens": out, "prefill_s": times[0] - t0, "decode_s": times[-1] - times[0],
            "peak_rss_mib": max(whole_peak, decode_peak), "decode_peak_rss_mib": decode_peak,
            "kv_bytes": int(kv_bytes), "weight_bytes_per_step": spec["file_tensor_bytes"], "rss_growth_mib": growth}


def _child_lessmem(spec: dict, ids_list: list[int]) -> dict:
    import torch
    from transformers import DynamicCache

    import lessmem
    from lessmem.kvcache import KVCache, enable
    from lessmem.kvcache.cache import cache_kwarg
    from lessmem.weights.gguf_linear import GGUFLinear

    if spec.get("no_tokenizer"):  # --quick's file holds no tokenizer, which lessmem.load also reads
        from lessmem.weights.gguf_load import load_gguf_blocks

        model = load_gguf_blocks(spec["gguf"])
        lessmem.lean_decode(model)  # what lessmem.load switches on
    else:  # token ids in, token ids out: no tokenizer (its RSS is measured after the run)
        model, _ = lessmem.load(spec["gguf"], tokenizer=False)
    cache = DynamicCache() if spec["kv"] == "DynamicCache" else KVCache(model.config, spec["kv"])
    kw = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    ids = torch.tensor([ids_list])
    chunk = spec["chunk"]
    out, times = [], []
    with torch.inference_mode(), enable(model):
        t0 = time.perf_counter()
        for s in range(0, ids.shape[1], chunk):
            logits = model(ids[:, s:s + chunk], **kw).logits
        nxt = logits[:, -1:].argmax(-1)
        times.append(time.perf_counter())
        out.append(int(nxt))
        whole_peak = _status_mib("VmHWM")
        _reset_peak()
        while len(out) < spec["new_tokens"]:
            nxt = model(nxt, **kw).logits[:, -1:].argmax(-1)
            times.append(time.perf_counter())
            out.append(int(nxt))
    decode_peak = _status_mib("VmHWM")
    growth = _rss_growth(spec["rss_start"], spec["gguf"])  # (before the tokenizer below)
    tokenizer_mib = None
    if not spec.get("no_tokenizer"):  # what lessmem.load(path) would add by building the tokenizer
        before = _status_mib("VmRSS")
        tok = lessmem.load_tokenizer(spec["gguf"])  # from the metadata the load kept
        tokenizer_mib = _status_mib("VmRSS") - before
        del tok
    if spec["kv"] == "DynamicCache":
        kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                       for t in (layer.keys, layer.values))
    else:
        kv_bytes = cache.memory()["total"]
    weights = sum(m.qweight.numel() for m in model.modules() if isinstance(m, GGUFLinear))
    return {"tokens": out, "prefill_s": times[0] - t0, "decode_s": times[-1] - times[0],
            "peak_rss_mib": max(whole_peak, decode_peak), "decode_peak_rss_mib": decode_peak,
            "tokenizer_rss_mib": tokenizer_mib, "rss_growth_mib": growth,
            "kv_bytes": int(kv_bytes), "weight_bytes_per_step": int(weights),
            "held": model._lessmem_gguf["bytes_mapped"] + model._lessmem_gguf["bytes_copied"]}


# ----------------------------------------------------------------------------- parent side

def run_child(spec: dict, timeout: float = 3600) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    raise RuntimeError(f"{spec['engine']} {spec.get('kv')} failed (rc {proc.returncode}): " + " | ".join(tail))


def bandwidth_gbs(threads: int) -> float:
    """Best of 5 read passes (``sum``) over 512 MiB of float32, in GB/s (10⁹ bytes)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(2 ** 27)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def prompt_ids(tok, n: int) -> list[int]:
    text = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
    raw = text.read_text()
    ids: list[int] = []
    while len(ids) < n:  # the test text is ~280k tokens; repeat it for longer prompts
        ids += tok(raw[: n * 6], add_special_tokens=False)["input_ids"]
    return ids[:n]


def main(argv=None) -> int:
    from common import header, parser, write_result

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompts", default="512,4096,8192,16384")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--chunk", type=int, default=512, help="lessmem prefill tokens per forward")
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise SystemExit(f"unknown rows {bad}; allowed: {', '.join(ROWS)}")
    prompts = [int(x) for x in args.prompts.split(",") if x.strip()]
    try:
        import llama_cpp  # noqa: F401
        have_llama = True
    except ImportError:
        have_llama = False
    tmp = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    if args.quick:
        gguf_path, tok = _quick_gguf(tmp)
        prompts, new_tokens, repeats = [48, 96], 6, 1
        rows = [r for r in rows if r.startswith("lessmem")]
    else:
        import lessmem
        from lessmem.models import builtin_gguf

        gguf_path = builtin_gguf()
        _, tok = lessmem.load("smollm2-135m")
        new_tokens, repeats = args.new_tokens, args.repeats
        if not have_llama:
            print("# llama-cpp-python is not installed: llama.cpp rows skipped "
                  "(pip install llama-cpp-python)", file=sys.stderr)
            rows = [r for r in rows if r.startswith("lessmem")]
    from lessmem.formats.gguf_file import read_gguf_header

    head = read_gguf_header(gguf_path)
    meta = head.metadata
    arch = meta["general.architecture"]
    n_heads = int(meta[f"{arch}.attention.head_count"])
    config = {"layers": int(meta[f"{arch}.block_count"]), "kv_heads": int(meta[f"{arch}.attention.head_count_kv"]),
              "head_dim": int(meta[f"{arch}.embedding_length"]) // n_heads}
    tensor_bytes = sum(t.nbytes for t in head.tensors)
    bw = bandwidth_gbs(args.threads)
    h = header(model="tiny (quick)" if args.quick else "smollm2-135m Q4_1 (built-in GGUF)",
               gguf_bytes=head.file_size, threads=args.threads, new_tokens=new_tokens, repeats=repeats,
               prompts=prompts, bandwidth_gbs=bw, llama_cpp=_llama_version() if have_llama else None,
               command="python benchmarks/bench_e2e.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    base = {"threads": args.threads, "gguf": str(gguf_path), "new_tokens": new_tokens, "config": config,
            "file_tensor_bytes": tensor_bytes, "chunk": args.chunk, "no_tokenizer": args.quick}
    imports = {"lessmem": run_child({**base, "engine": "imports-lessmem"})["peak_rss_mib"]}
    if any(r.startswith("llama.cpp") for r in rows):
        imports["llama.cpp"] = run_child({**base, "engine": "imports-llama.cpp"})["peak_rss_mib"]
    print(f"# bandwidth {bw:.1f} GB/s; bare imports RSS: " +
          ", ".join(f"{k} {v:.0f} MiB" for k, v in imports.items()), flush=True)
    results = []
    for n in prompts:
        ids_file = tmp / f"ids-{n}.json"
        ids_file.write_text(json.dumps(prompt_ids(tok, n)))
        runs: dict[str, list[dict]] = {r: [] for r in rows}
        for rep in range(repeats):
            for r in rows:  # alternating: each repeat runs every row once
                engine, kv = r.split(" ", 1)
                res = run_child({**base, "engine": engine, "kv": kv, "ids": str(ids_file)})
                runs[r].append(res)
                print(f"  prompt {n:>6}  {r:<22} repeat {rep + 1}: "
                      f"{(new_tokens - 1) / res['decode_s']:7.2f} tok/s  prefill {res['prefill_s']:6.1f} s  "
                      f"decode peak RSS {res['decode_peak_rss_mib']:6.0f} MiB", flush=True)
        results += _summarise(n, runs, imports, head.file_size, bw, new_tokens)
    data = {"header": h, "bare_imports_rss_mib": imports, "rows": results, "targets": _targets(results)}
    write_result("e2e", data, args.out, args.quick)
    return 0


def _llama_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


def _summarise(n: int, runs: dict, imports: dict, file_bytes: int, bw: float, new_tokens: int) -> list[dict]:
    ref = runs.get("llama.cpp f16")
    ref_tokens = ref[0]["tokens"] if ref else None
    out = []
    for name, rs in runs.items():
        engine = name.split(" ", 1)[0]
        tps = [(new_tokens - 1) / r["decode_s"] for r in rs]
        med = statistics.median(tps)
        step_bytes = rs[0]["weight_bytes_per_step"] + rs[0]["kv_bytes"]
        floor_s = step_bytes / (bw * 1e9)
        row = {"prompt_tokens": n, "row": name, "engine": engine, "tok_per_s": med, "tok_per_s_runs": tps,
               "prefill_s": statistics.median(r["prefill_s"] for r in rs),
               "decode_peak_rss_mib": statistics.median(r["decode_peak_rss_mib"] for r in rs),
               "kv_bytes": rs[0]["kv_bytes"], "bytes_per_step": step_bytes, "floor_step_s": floor_s,
               "step_s": 1 / med, "step_over_floor": (1 / med) / floor_s}
        base_rss = imports[engine]
        row["peak_rss_mib"] = statistics.median(r["peak_rss_mib"] for r in rs)
        row["rss_over_imports_mib"] = row["peak_rss_mib"] - base_rss  # the model's share
        row["decode_rss_over_imports_mib"] = row["decode_peak_rss_mib"] - base_rss
        row["rss_rule_ratio"] = row["rss_over_imports_mib"] * MiB / (file_bytes + row["kv_bytes"])
        if all(r.get("rss_growth_mib") for r in rs):  # the RSS at the end of the decode, by kind
            row["rss_growth_by_kind_mib"] = {k: statistics.median(r["rss_growth_mib"][k] for r in rs)
                                             for k in rs[0]["rss_growth_mib"]}
        if rs[0].get("tokenizer_rss_mib") is not None:  # not in the decode run: what it would add
            row["tokenizer_rss_mib"] = statistics.median(r["tokenizer_rss_mib"] for r in rs)
        if ref_tokens is not None:
            row["tokens_equal_llama_f16"] = sum(a == b for a, b in zip(rs[0]["tokens"], ref_tokens, strict=False))
        out.append(row)
    by = {r["row"]: r for r in out}
    lc = by.get("llama.cpp f16")
    dyn = by.get("lessmem DynamicCache")
    for r in out:
        if lc is not None:
            r["x_llama_f16"] = r["tok_per_s"] / lc["tok_per_s"]
        if dyn is not None and r["engine"] == "lessmem":
            r["x_dynamic"] = r["tok_per_s"] / dyn["tok_per_s"]
    return out


def _targets(rows: list[dict]) -> dict:
    """The issue's targets, each with the value it was judged on (None where not measured)."""
    def get(n, name):
        return next((r for r in rows if r["prompt_tokens"] == n and r["row"] == name), None)

    t = {}
    ns = sorted({r["prompt_tokens"] for r in rows})
    rss = [r["rss_rule_ratio"] for r in rows if r["engine"] == "lessmem"]
    t["rss_rule_max_ratio"] = max(rss) if rss else None
    t["rss_rule_met"] = bool(rss) and max(rss) <= 1.2
    small, big = (ns[0], ns[-1]) if ns else (None, None)
    b4s, lcs = get(small, "lessmem best-4"), get(small, "llama.cpp f16")
    t["best4_x_llama_at_shortest"] = b4s["tok_per_s"] / lcs["tok_per_s"] if b4s and lcs else None
    b4, lc, dyn = get(big, "lessmem best-4"), get(big, "llama.cpp f16"), get(big, "lessmem DynamicCache")
    t["best4_x_llama_at_longest"] = b4["tok_per_s"] / lc["tok_per_s"] if b4 and lc else None
    t["best4_x_dynamic_at_longest"] = b4["tok_per_s"] / dyn["tok_per_s"] if b4 and dyn else None
    t["lessmem_step_over_floor_at_longest"] = {r["row"]: r["step_over_floor"] for r in rows
                                               if r["prompt_tokens"] == big and r["engine"] == "lessmem"}
    return t


def _quick_gguf(tmp: Path):
    """A tiny llama-shaped GGUF (Q8_0 linears) and a byte tokenizer, written for --quick."""
    from lessmem.models import tiny_random, tiny_tokenizer
    from lessmem.weights.gguf_export import write_model_gguf

    model = tiny_random("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                        intermediate_size=512)
    path = tmp / "tiny.gguf"
    write_model_gguf(model, path, "q8_0")
    return path, tiny_tokenizer()


if __name__ == "__main__":
    raise SystemExit(main())
