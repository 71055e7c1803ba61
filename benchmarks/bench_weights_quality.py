"""Weight-quantization quality table: Δppl, KLD, bits, size and decode speed vs fp32.

Rows per model: fp32 reference; RTN, GPTQ, AWQ at 4-bit and 3-bit (g128); SmoothQuant
W8A8; GGUF Q8_0, Q6_K, Q4_K_M, Q4_0 (llama.cpp mix rules, encoded and decoded in
memory). Protocol: WikiText-2 raw **test** split, tokenized without special tokens, the
first ``--windows`` consecutive windows of 512 tokens (``lessmem.eval.perplexity.
make_windows``, the KV evaluator's windows), every token after the first of each window
scored, KL(p_fp32 || q) averaged over the same tokens. Calibration: the first
``n_samples`` windows of ``wiki.train.head.raw`` (never the test split).

Models:
- ``smollm2-135m`` (built-in): its file is already Q4_1-quantized, so its "fp32"
  weights sit on a 4-bit grid and 4-bit methods look easy; 576-wide inputs take groups
  of 64 where 128 does not divide them (``group_fallback``).
- ``wiki-byte-llama``: a byte-level Llama trained here by ``train_small_llama.py`` on
  ``wiki.train.head.raw`` (full-precision weights; the hard case).

Decode speed: greedy decoding of ``--decode-tokens`` tokens after a 32-token prompt,
quantized model and fp32 model timed alternately, ratio of medians.

    python benchmarks/bench_weights_quality.py --models wiki-byte-llama,smollm2-135m
    python benchmarks/bench_weights_quality.py --quick
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, parser, write_result  # noqa: E402

import lessmem  # noqa: E402
from lessmem._paths import cache_dir, repo_data_file  # noqa: E402
from lessmem.eval.perplexity import make_windows  # noqa: E402
from lessmem.weights.qlinear import QuantLinear  # noqa: E402

BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rows_spec(calib: dict) -> list[tuple[str, object]]:
    c = dict(group_fallback=True, **calib)
    return [
        ("RTN 4-bit g128", lessmem.RTNConfig(bits=4, group_size=128, group_fallback=True)),
        ("GPTQ 4-bit g128", lessmem.GPTQConfig(bits=4, group_size=128, **c)),
        ("AWQ 4-bit g128", lessmem.AWQConfig(bits=4, group_size=128, search_samples=4, **c)),
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


@torch.no_grad()
def window_logprobs(model, windows: torch.Tensor) -> list[torch.Tensor]:
    return [torch.log_softmax(model(input_ids=w[None]).logits[0, :-1].float(), -1) for w in windows]


@torch.no_grad()
def score(model, windows, ref_lp) -> dict:
    nll, kld, n = 0.0, 0.0, 0
    for w, lp_ref in zip(windows, ref_lp, strict=True):
        lq = torch.log_softmax(model(input_ids=w[None]).logits[0, :-1].float(), -1)
        tgt = w[1:]
        nll += -lq.gather(1, tgt[:, None]).sum().item()
        kld += (lp_ref.exp() * (lp_ref - lq)).sum().item()
        n += tgt.numel()
    return {"ppl": math.exp(nll / n), "kld": kld / n, "tokens": n}


@torch.no_grad()
def decode_ratio(model, base, prompt, new_tokens: int, reps: int = 3) -> dict:
    def run(m):
        t0 = time.perf_counter()
        m.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
        return new_tokens / (time.perf_counter() - t0)

    run(model), run(base)  # warm-up (builds kernels, caches)
    q, f = [], []
    for _ in range(reps):
        q.append(run(model))
        f.append(run(base))
    return {"decode_tok_s": statistics.median(q), "fp32_decode_tok_s": statistics.median(f),
            "decode_ratio": statistics.median(q) / statistics.median(f)}


@torch.no_grad()
def decode_breakdown(model, prompt, new_tokens: int) -> dict:
    """Where decode time goes: seconds inside linear layers (hooks) vs the whole step."""
    spent = {"linear": 0.0}
    t_in = {}

    def pre(mod, inp):
        t_in[id(mod)] = time.perf_counter()

    def post(mod, inp, out):
        spent["linear"] += time.perf_counter() - t_in.pop(id(mod))

    hs = []
    for m in model.modules():
        if isinstance(m, (QuantLinear, nn.Linear)):
            hs += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    t0 = time.perf_counter()
    model.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    total = time.perf_counter() - t0
    for h in hs:
        h.remove()
    return {"decode_seconds": total, "linear_seconds": spent["linear"],
            "linear_share": spent["linear"] / total}


def linear_bits(model, report: dict) -> dict:
    """Effective bits per weight over the decoder blocks' linears, and over all linears."""
    blk_bits = blk_n = all_bits = all_n = 0.0
    gguf_types = report.get("types", {})
    bpw_gguf = {"q8_0": 8.5, "q6_k": 6.5625, "q5_k": 5.5, "q4_k": 4.5, "q5_0": 5.5, "q5_1": 6.0,
                "q4_0": 4.5, "q4_1": 5.0}
    seen = set()
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            b, n = m.bits_per_weight, m.in_features * m.out_features
        elif type(m) is nn.Linear:
            if id(m.weight) in seen:
                continue
            seen.add(id(m.weight))
            b = bpw_gguf[gguf_types[name]] if name in gguf_types else 32.0
            n = m.weight.numel()
        else:
            continue
        all_bits += b * n
        all_n += n
        if name.endswith(BLOCK_LINEARS):
            blk_bits += b * n
            blk_n += n
    return {"bpw_block_linears": blk_bits / blk_n, "bpw_all_linears": all_bits / all_n}


def disk_bytes(model, report: dict, fp32_bytes: int) -> int:
    """lessmem rows: the saved checkpoint; GGUF rows: fp32 size minus the linears' savings."""
    if report.get("method") == "gguf":
        saved = sum(m.weight.numel() * 4 for n, m in model.named_modules() if n in report["types"])
        return fp32_bytes - saved + report["bytes"]
    with tempfile.TemporaryDirectory() as d:
        lessmem.save_quantized(model, d)
        return sum(f.stat().st_size for f in Path(d).iterdir())


def fp32_disk_bytes(model) -> int:
    seen, n = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def bench_model(name: str, args, test_text: str, calib_text: str, save=None) -> dict:
    base, tok = load_model(name, args.quick)
    base.eval()
    windows = make_windows(tok, test_text, args.windows, args.window_len)
    calib = dict(n_samples=args.n_samples, seq_len=args.window_len)
    ref_lp = window_logprobs(base, windows)
    ref = score(base, windows, ref_lp)
    fp32_bytes = fp32_disk_bytes(base)
    prompt = windows[0, :32][None]
    rows = [{"row": "fp32 reference", **ref, "delta_ppl_pct": 0.0, "bpw_block_linears": 32.0,
             "bpw_all_linears": 32.0, "disk_bytes": fp32_bytes, "decode_ratio": 1.0}]
    rows[0]["time_breakdown"] = decode_breakdown(base, prompt, args.decode_tokens)
    print(f"[{name}] fp32: ppl {ref['ppl']:.3f} ({ref['tokens']} tokens)", flush=True)
    specs = rows_spec(calib)
    if args.only:
        specs = [s for s in specs if any(o.lower() in s[0].lower() for o in args.only.split(","))]
    for label, cfg in specs:
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        rep = lessmem.quantize_(model, cfg, calibration=calib_text, tokenizer=tok, progress=False)
        secs = time.perf_counter() - t0
        s = score(model, windows, ref_lp)
        row = {"row": label, **s, "delta_ppl_pct": 100 * (s["ppl"] / ref["ppl"] - 1),
               **linear_bits(model, rep), "disk_bytes": disk_bytes(model, rep, fp32_bytes),
               "quantize_seconds": secs, "calibration": rep.get("calibration")}
        if rep.get("method") == "gguf":
            row["decode_ratio"] = None  # decoded to float in memory: runs at fp32 speed
        else:
            row.update(decode_ratio(model, base, prompt, args.decode_tokens))
            row["time_breakdown"] = decode_breakdown(model, prompt, args.decode_tokens)
        rows.append(row)
        if save is not None:  # partial results survive an interrupted run
            save({"model": name, "rows": rows, "partial": True})
        print(f"[{name}] {label}: ppl {row['ppl']:.3f} ({row['delta_ppl_pct']:+.2f}%) kld "
              f"{row['kld']:.4f} bpw {row['bpw_block_linears']:.3f} decode x"
              f"{row['decode_ratio'] if row['decode_ratio'] is None else round(row['decode_ratio'], 2)}"
              f" ({secs:.0f} s)", flush=True)
        del model
    return {"model": name, "windows": args.windows, "window_len": args.window_len,
            "weights_note": ("built-in file is Q4_1-quantized: its float weights already sit on a "
                             "4-bit grid, which flatters 4-bit methods; 576-wide inputs use groups "
                             "of 64 (group_fallback)") if name == "smollm2-135m" else
            "full-precision weights trained here (train_small_llama.py)",
            "rows": rows}


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--models", default="wiki-byte-llama,smollm2-135m")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=512)
    p.add_argument("--n-samples", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--only", default=None, help="comma list of row-label substrings")
    args = p.parse_args()
    test = repo_data_file("wikitext-2-raw", "wiki.test.raw")
    train = repo_data_file("wikitext-2-raw", "wiki.train.head.raw")
    if args.quick or test is None or train is None:
        from lessmem.weights.calibrate import builtin_corpus

        corpus = builtin_corpus()
        test_text, calib_text = corpus[: len(corpus) // 2], corpus[len(corpus) // 2:]
        source = "pydoc_data.topics (wikitext not found)" if not args.quick else "pydoc (quick)"
    else:
        test_text, calib_text = test.read_text(), train.read_text()
        source = "wikitext-2-raw test (eval), wiki.train.head.raw (calibration)"
    if args.quick:
        args.models, args.windows, args.window_len, args.n_samples = "tiny-random", 2, 64, 4
        args.decode_tokens = 4
        args.only = args.only or "RTN 4,GPTQ 4,Q4_K_M"
    h = header(models=args.models, windows=args.windows, window_len=args.window_len,
               n_samples=args.n_samples, text=source)
    results = []

    def save_partial(part):
        write_result("bench_weights_quality", {"header": h, "results": results + [part]}, args.out,
                     args.quick)

    for m in args.models.split(","):
        results.append(bench_model(m, args, test_text, calib_text, save_partial))
    write_result("bench_weights_quality", {"header": h, "results": results}, args.out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
