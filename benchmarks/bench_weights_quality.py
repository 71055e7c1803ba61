"""Weight-quantization quality table: bits, size on disk, Δppl, KLD and decode speed vs fp32.

Rows per model: fp32 reference; RTN, GPTQ, AWQ at 4-bit and 3-bit (g128); SmoothQuant
W8A8; GGUF Q8_0, Q6_K, Q4_K_M, Q4_0 (llama.cpp mix rules); HQQ 4-bit g128.

Protocol (the KV evaluator's, ``lessmem.eval.perplexity``): WikiText-2 raw **test**
split, tokenized without special tokens, cut by ``make_windows`` into the first
``--windows`` consecutive windows of ``--window-len`` tokens (16 x 1024 by default);
each window runs in one forward pass and the tokens after its first quarter
(``P = window_len // 4``, the KV evaluator's prefill) are scored, so the fp32 row's ppl
is the KV table's ``dynamic`` ppl. Per row, over exactly those tokens::

    ppl = exp(mean -log q(x_t));  kld = mean KL(p_fp32 || q)  (float64, nats);  top1 agreement

The fp32 logits of every window are written once to a temporary directory and read back
per row (16 x 768 x 49152 floats do not belong in RAM next to the models).

Columns: ``bpw_all_linears`` = 8 x bytes / weights over every linear incl. ``lm_head``
(``bpw_block_linears``: the decoder blocks' linears only), bytes as held in memory:
QuantLinear / GGUFLinear buffers (codes, scales, zero points), float linears at 4 bytes
(a tied lm_head once, float in every row); ``bpw_all_linears_file`` counts a GGUF row's
float-held tensors at their GGUF block size (``base.gguf_rules.type_bytes``); ``disk_bytes``: the file(s)
written (``save_pretrained`` for fp32, ``save_quantized`` for lessmem rows, a GGUF file
for GGUF rows: ``export_gguf`` of the built-in file, or a tensors-only GGUF written here
for a model without a source .gguf); decode: greedy batch-1 decoding of
``--decode-tokens`` tokens after a 32-token prompt, quantized and fp32 model timed
alternately, ratio of medians. Calibration: the first ``n_samples`` windows of
``--calib-len`` tokens of ``wiki.train.head.raw`` (never the test split).

Models:
- ``smollm2-135m`` (built-in): its file is already Q4_1-quantized, so its "fp32"
  weights sit on a 4-bit grid (groups of 32) and 4-bit methods look easy; 576-wide
  inputs take groups of 64 where 128 does not divide them (``group_fallback``).
- ``wiki-byte-llama``: a byte-level Llama trained here by ``train_small_llama.py`` on
  ``wiki.train.head.raw`` (full-precision weights; the hard case), on windows of its
  training context (256 tokens, ``--byte-window-len``).

    python benchmarks/bench_weights_quality.py --models wiki-byte-llama,smollm2-135m
    python benchmarks/bench_weights_quality.py --quick
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, header, parser, write_result  # noqa: E402

import lessmem  # noqa: E402
from lessmem.base.corpus import pydoc_corpus  # noqa: E402
from lessmem.base.gguf_rules import type_bytes  # noqa: E402
from lessmem.base.paths import cache_dir, repo_data_file  # noqa: E402
from lessmem.eval.perplexity import make_windows  # noqa: E402
from lessmem.weights.gguf_mix import gguf_name  # noqa: E402

BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Q41_NOTE = ("built-in file is Q4_1-quantized (4-bit, groups of 32): its float weights already "
            "sit on a 4-bit grid, which flatters 4-bit methods; 576-wide inputs use groups of 64 "
            "where 128 does not divide them (group_fallback)")


def rows_spec(calib: dict) -> list[tuple[str, object]]:
    c = dict(group_fallback=True, **calib)
    return [
        ("RTN 4-bit g128", lessmem.RTNConfig(bits=4, group_size=128, group_fallback=True)),
        ("GPTQ 4-bit g128", lessmem.GPTQConfig(bits=4, group_size=128, **c)),
        ("AWQ 4-bit g128", lessmem.AWQConfig(bits=4, group_size=128, search_samples=4, **c)),
        ("HQQ 4-bit g128", lessmem.HQQConfig(bits=4, group_size=128, group_fallback=True)),
        ("RTN 3-bit g128", lessmem.RTNConfig(bits=3, group_size=128, group_fallback=True)),
        ("GPTQ 3-bit g128", lessmem.GPTQConfig(bits=3, group_size=128, **c)),
        ("AWQ 3-bit g128", lessmem.AWQConfig(bits=3, group_size=128, search_samples=4, **c)),
        ("SmoothQuant W8A8", lessmem.SmoothQuantConfig(alpha=0.5, **calib)),
        ("GGUF Q8_0", lessmem.GGUFConfig("Q8_0")),
        ("GGUF Q6_K", lessmem.GGUFConfig("Q6_K")),
        ("GGUF Q4_K_M", lessmem.GGUFConfig("Q4_K_M")),
        ("GGUF Q4_0", lessmem.GGUFConfig("Q4_0")),
    ]


def load_model(name: str, quick: bool):
    from lessmem.models import load, tiny_random, tiny_tokenizer

    if quick:
        return tiny_random("llama", hidden_size=128, intermediate_size=256, num_heads=2,
                           num_kv_heads=2, vocab_size=259), tiny_tokenizer()
    if name == "wiki-byte-llama":
        d = cache_dir("models", "wiki-byte-llama")
        if not (d / "model.safetensors").exists():
            raise SystemExit("run benchmarks/train_small_llama.py first")
        return load(str(d))
    return load(name)


@torch.inference_mode()
def scored_logits(model, w: torch.Tensor, prefill: int) -> torch.Tensor:
    """[N - P, V] float32 logits predicting tokens P..N-1 of window ``w`` (one forward)."""
    n = w.numel()
    return model(input_ids=w[None], use_cache=False, logits_to_keep=n - prefill + 1).logits[0, :-1].float()


class Reference:
    """fp32 logits of every window, kept on disk (one file per window)."""

    def __init__(self, model, windows: torch.Tensor, prefill: int, tmp: Path, paths=None):
        self.paths = paths if paths is not None else []
        for i, w in enumerate(windows if paths is None else []):
            p = tmp / f"ref{i}.pt"
            torch.save(scored_logits(model, w, prefill), p)
            self.paths.append(p)

    def first(self, k: int) -> Reference:
        return Reference(None, None, 0, None, self.paths[:k])

    def __iter__(self):
        for p in self.paths:
            yield torch.load(p)


@torch.inference_mode()
def score(model, windows: torch.Tensor, ref: Reference, prefill: int, rows: int = 128) -> dict:
    nll = kld = 0.0
    top1 = n = 0
    for w, ref_logits in zip(windows, ref, strict=True):
        q_logits = scored_logits(model, w, prefill)
        tgt = w[prefill:]
        for a in range(0, tgt.numel(), rows):  # [rows, V] float64 at a time
            lq = torch.log_softmax(q_logits[a:a + rows].double(), -1)
            lp = torch.log_softmax(ref_logits[a:a + rows].double(), -1)
            nll -= float(lq.gather(1, tgt[a:a + rows, None]).sum())
            kld += float((lp.exp() * (lp - lq)).sum(-1).clamp_min(0).sum())
            top1 += int((lq.argmax(-1) == lp.argmax(-1)).sum())
        n += tgt.numel()
    return {"ppl": math.exp(nll / n), "kld": kld / n, "top1": top1 / n, "tokens_scored": n}


def kv_evaluator_check(model, tok, windows: torch.Tensor, ref: Reference, prefill: int) -> dict:
    """Reference check first: window 0 scored here (one forward) and by the KV evaluator
    (``lessmem.eval.perplexity.evaluate``: prefill, then chunks of 16 through a cache)."""
    from lessmem.eval.perplexity import evaluate

    here = score(model, windows[:1], ref.first(1), prefill)["ppl"]
    kv = evaluate(model, tok, [], windows[0], windows=1, window_len=windows.shape[1], chunk=16)[0]
    assert kv["prefill"] == prefill, (kv["prefill"], prefill)
    rel = abs(here / kv["ppl"] - 1)
    if rel > 1e-3:
        raise SystemExit(f"window 0: ppl {here:.4f} here vs {kv['ppl']:.4f} in the KV evaluator")
    return {"window0_ppl": here, "window0_ppl_kv_evaluator": kv["ppl"], "rel_diff": rel}


@torch.inference_mode()
def decode_ratio(model, base, prompt, new_tokens: int, reps: int = 3) -> dict:
    def run(m):
        t0 = time.perf_counter()
        m.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
        return new_tokens / (time.perf_counter() - t0)

    run(model), run(base)  # warm-up (builds kernels, caches)
    q, f = [], []
    for _ in range(reps):  # interleaved, so load changes hit both alike
        q.append(run(model))
        f.append(run(base))
    return {"decode_tok_s": statistics.median(q), "fp32_decode_tok_s": statistics.median(f),
            "decode_ratio": statistics.median(q) / statistics.median(f)}


def linear_bits(model, report: dict) -> dict:
    """Effective bits per weight from bytes: over the blocks' linears and over all linears.

    ``bpw_*``: the bytes held in memory (QuantLinear / GGUFLinear buffers: codes, scales,
    zero points; float linears at their dtype; a tied lm_head counts once, and a GGUF row's
    tied lm_head stays float in memory); ``bpw_all_linears_file``: what the file stores, a
    GGUF-encoded float layer at its GGUF block size (``base.gguf_rules.type_bytes``)."""
    gguf_types = report.get("types", {})
    blk_b = blk_n = all_b = all_n = file_b = 0
    seen, classes = set(), Counter()
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Linear):
            if id(w) in seen:
                continue
            seen.add(id(w))
            n = b = w.numel()
            b *= w.element_size()
            fb = type_bytes(gguf_types[name], *w.shape) if name in gguf_types else b
        elif hasattr(m, "nbytes") and hasattr(m, "in_features"):  # QuantLinear, GGUFLinear
            n = m.in_features * m.out_features
            bias = getattr(m, "bias", None)
            b = fb = m.nbytes - (bias.numel() * bias.element_size() if bias is not None else 0)
        else:
            continue
        classes[type(m).__name__] += 1
        all_b += b
        file_b += fb
        all_n += n
        if name.endswith(BLOCK_LINEARS):
            blk_b += b
            blk_n += n
    return {"bpw_block_linears": 8 * blk_b / blk_n, "bpw_all_linears": 8 * all_b / all_n,
            "bpw_all_linears_file": 8 * file_b / all_n, "linear_bytes_held": all_b,
            "layer_classes": dict(classes)}


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())


def gguf_tensors_file(model, mix: str, path: Path) -> dict:
    """A GGUF file holding every weight of ``model`` in llama.cpp's ``mix`` (no tokenizer)."""
    import gguf

    from lessmem.weights.gguf_export import add_tensors

    cfg = model.config
    n_layers = cfg.num_hidden_layers
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    n_gqa = heads // int(getattr(cfg, "num_key_value_heads", None) or heads)  # as apply_gguf
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))

    def tensors():
        for key, t in model.state_dict().items():
            if tied and key == "lm_head.weight":
                continue
            g = names.get(key) or gguf_name(key.removesuffix(".weight"))
            if g is None:
                g = (key.replace("model.layers.", "blk.").replace("input_layernorm", "attn_norm")
                     .replace("post_attention_layernorm", "ffn_norm"))
            yield g, t.detach().float().numpy()

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    types, _ = add_tensors(w, tensors(), mix, n_layers, has_output=not tied, n_gqa=n_gqa)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def disk_bytes(model, report: dict, name: str, tmp: Path, float_model=None) -> tuple[int, str]:
    """(bytes, what was written) for one row; GGUF rows encode ``float_model`` (as export does)."""
    d = Path(tempfile.mkdtemp(dir=tmp))
    try:
        if report.get("method") == "gguf":
            mix = report["config"]["type"]
            src = cache_dir("models") / "SmolLM2-135M-Instruct.Q4_1.gguf"
            if name == "smollm2-135m" and src.is_file():
                from lessmem.weights.gguf_export import export_gguf

                export_gguf(src, d / "m.gguf", mix, progress=False)
                return (d / "m.gguf").stat().st_size, "export_gguf of the built-in file (tokenizer included)"
            gguf_tensors_file(float_model if float_model is not None else model, mix, d / "m.gguf")
            return (d / "m.gguf").stat().st_size, "tensors-only GGUF (no tokenizer) written by the benchmark"
        if report.get("method") == "fp32":
            model.save_pretrained(d, safe_serialization=True)
            return _dir_bytes(d), "save_pretrained (safetensors, fp32)"
        lessmem.save_quantized(model, d)
        return _dir_bytes(d), "lessmem.save_quantized (safetensors + config)"
    finally:
        shutil.rmtree(d)


def bench_model(name: str, args, test_text: str, calib_text: str, save=None) -> dict:
    base, tok = load_model(name, args.quick)
    base.eval()
    wlen = args.byte_window_len if name == "wiki-byte-llama" else args.window_len
    windows = make_windows(tok, test_text, args.windows, wlen)
    prefill = wlen // 4
    calib = dict(n_samples=args.n_samples, seq_len=args.calib_len)
    tmp = Path(tempfile.mkdtemp(prefix="bench_wq_"))
    try:
        t0 = time.perf_counter()
        ref = Reference(base, windows, prefill, tmp)
        ref_score = score(base, windows, ref, prefill)
        ref_secs = time.perf_counter() - t0
        check = kv_evaluator_check(base, tok, windows, ref, prefill)
        prompt = windows[0, :32][None]
        fp_disk, fp_how = disk_bytes(base, {"method": "fp32"}, name, tmp)
        rows = [{"row": "fp32 reference", **ref_score, "delta_ppl_pct": 0.0,
                 **linear_bits(base, {}), "disk_bytes": fp_disk, "disk_file": fp_how,
                 "decode_ratio": 1.0, "eval_seconds": ref_secs}]
        print(f"[{name}] fp32: ppl {ref_score['ppl']:.3f} ({ref_score['tokens_scored']} tokens, "
              f"{ref_secs:.0f} s)", flush=True)
        specs = rows_spec(calib)
        if args.only:
            specs = [s for s in specs if any(o.lower() in s[0].lower() for o in args.only.split(","))]
        for label, cfg in specs:
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            rep = lessmem.quantize_(model, cfg, calibration=calib_text, tokenizer=tok, progress=False)
            qsecs = time.perf_counter() - t0
            t0 = time.perf_counter()
            s = score(model, windows, ref, prefill)
            esecs = time.perf_counter() - t0
            disk, how = disk_bytes(model, rep, name, tmp, float_model=base)
            row = {"row": label, **s, "delta_ppl_pct": 100 * (s["ppl"] / ref_score["ppl"] - 1),
                   **linear_bits(model, rep), "disk_bytes": disk, "disk_file": how,
                   "quantize_seconds": qsecs, "eval_seconds": esecs,
                   "calibration": rep.get("calibration")}
            if rep.get("method") == "gguf":
                row["gguf_types"] = dict(Counter(rep["types"].values()))
            row.update(decode_ratio(model, base, prompt, args.decode_tokens))
            rows.append(row)
            if save is not None:  # partial results survive an interrupted run
                save({"model": name, "rows": rows, "partial": True})
            print(f"[{name}] {label}: ppl {row['ppl']:.3f} ({row['delta_ppl_pct']:+.2f}%) kld "
                  f"{row['kld']:.4f} bpw {row['bpw_all_linears']:.3f} disk {disk / 1e6:.1f} MB decode "
                  f"x{row['decode_ratio']:.2f} {row['layer_classes']} (q {qsecs:.0f} s, eval {esecs:.0f} s)",
                  flush=True)
            del model
    finally:
        shutil.rmtree(tmp)
    return {"model": name,
            "protocol": {"windows": args.windows, "window_len": wlen, "prefill": prefill,
                         "scored_per_window": wlen - prefill, "window_fn": "lessmem.eval.perplexity.make_windows",
                         "calibration": calib, "decode_tokens": args.decode_tokens, "batch": 1,
                         "kv_evaluator_check": check},
            "weights_note": Q41_NOTE if name == "smollm2-135m" else
            ("full-precision weights trained here (train_small_llama.py, 256-token training "
             "context, so windows of 256 tokens)" if name == "wiki-byte-llama" else "tiny random (quick)"),
            "rows": rows}


def markdown_table(res: dict) -> str:
    """One model's rows as the README's markdown table."""
    lines = [f"{res['model']}: {res['protocol']['windows']} windows x {res['protocol']['window_len']} "
             f"tokens, {res['protocol']['scored_per_window']} scored per window. {res['weights_note']}",
             "", "| row | bpw (block linears) | bpw (all linears: RAM / file) | size on disk | ppl | Δppl % "
             "| KLD | decode vs fp32 | linear layers |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['row']} | {r['bpw_block_linears']:.2f} | {r['bpw_all_linears']:.2f} / "
                     f"{r.get('bpw_all_linears_file', r['bpw_all_linears']):.2f} | "
                     f"{r['disk_bytes'] / 1e6:.1f} MB | {r['ppl']:.3f} | {r['delta_ppl_pct']:+.2f} | "
                     f"{r['kld']:.3g} | {r['decode_ratio']:.2f}x | "
                     + ", ".join(f"{k} {v}" for k, v in r["layer_classes"].items()) + " |")
    return "\n".join(lines)


def merge_rows(path: Path, new: list[dict], h: dict) -> dict:
    """The file ``path`` with ``new``'s rows merged in by label (a rerun of some rows)."""
    if not path.is_file():
        return {"header": h, "results": new}
    data = json.loads(path.read_text())
    data.setdefault("updates", []).append(h)
    old = data["results"]
    for res in new:
        prev = next((r for r in old if r["model"] == res["model"]), None)
        if prev is None or prev["protocol"] != res["protocol"]:
            raise SystemExit(f"{path}: no {res['model']} result with the same protocol to merge into")
        labels = [r["row"] for r in prev["rows"]]
        for row in res["rows"][1:]:
            row["rerun"] = h["time"]
            if row["row"] in labels:
                prev["rows"][labels.index(row["row"])] = row
            else:
                prev["rows"].append(row)
    return data


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--models", default="wiki-byte-llama,smollm2-135m")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window-len", type=int, default=1024)
    p.add_argument("--byte-window-len", type=int, default=256, help="wiki-byte-llama's windows")
    p.add_argument("--n-samples", type=int, default=8, help="calibration windows")
    p.add_argument("--calib-len", type=int, default=512, help="calibration window length")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--only", default=None, help="comma list of row-label substrings")
    p.add_argument("--table", type=Path, default=None,
                   help="print the markdown table of an existing result JSON and exit")
    p.add_argument("--update", action="store_true",
                   help="merge the rows run into the existing result file (same label: replaced)")
    args = p.parse_args()
    if args.table is not None:
        for res in json.loads(args.table.read_text())["results"]:
            print(markdown_table(res) + "\n")
        return 0
    test = repo_data_file("wikitext-2-raw", "wiki.test.raw")
    train = repo_data_file("wikitext-2-raw", "wiki.train.head.raw")
    if args.quick or test is None or train is None:
        corpus = pydoc_corpus()
        test_text, calib_text = corpus[: len(corpus) // 2], corpus[len(corpus) // 2:]
        source = "pydoc (quick)" if args.quick else "pydoc_data.topics halves (wikitext not found)"
    else:
        test_text, calib_text = test.read_text(encoding="utf-8"), train.read_text(encoding="utf-8")
        source = "wikitext-2-raw/wiki.test.raw (eval), wiki.train.head.raw (calibration)"
    if args.quick:
        args.models, args.windows, args.window_len, args.n_samples = "tiny-random", 2, 64, 4
        args.calib_len, args.decode_tokens = 64, 4
        args.only = args.only or "RTN 4,GPTQ 4,Q4_K_M"
    # windows, window length and calibration are per model, in each result's "protocol"
    h = header(models=args.models, text=source)
    results = []
    stem = "bench_weights_quality" if args.quick or "," in args.models else f"bench_weights_quality_{args.models}"

    def save_partial(part):
        if args.update:
            return
        write_result(stem, {"header": h, "results": results + [part]}, args.out, args.quick)

    for m in args.models.split(","):
        results.append(bench_model(m, args, test_text, calib_text, save_partial))
    data = {"header": h, "results": results}
    if args.update and not args.quick:
        data = merge_rows(args.out or RESULTS / f"{stem}.json", results, h)
    path = write_result(stem, data, args.out, args.quick)
    for res in json.loads(path.read_text())["results"]:
        print(markdown_table(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
