"""GGUF files rated by llama.cpp itself: lessmem's encodings against llama.cpp's quantizer.

From one float model (default: ``wiki-byte-llama-m``, the 19M-parameter byte-level Llama
``train_small_llama.py --size medium`` trains on wiki.train: full-precision weights,
every linear a multiple of 256 wide) an F32 GGUF is written (``write_model_gguf``, no
vocabulary: token ids in), and for each llama.cpp file type five files of the same
tensor types and size:

- ``llama.cpp``: ``llama_model_quantize`` (llama-cpp-python), what ``llama-quantize`` writes;
- ``llama.cpp+imatrix``: the same with an importance matrix passed through its C API
  (``llama_model_imatrix_data``); the matrix is lessmem's ``collect_imatrix`` over the
  calibration windows (llama-imatrix's statistic: mean squared input per column; the
  Python package ships no imatrix tool);
- ``lessmem``: ``export_gguf`` (llama.cpp's quantizer re-implemented; ``bytes_equal_llama_cpp``
  records whether every tensor equals llama.cpp's file byte for byte);
- ``lessmem imatrix``: ``export_gguf_imatrix`` with the same matrix (``bytes_equal_llama_cpp``
  against the llama.cpp+imatrix file);
- ``lessmem gptq``: ``GGUFConfig(type, gptq=True)`` (GPTQ inside the blocks,
  ``weights.gguf_gptq``) over the same calibration windows, ``export_gguf_encoded``;
- ``lessmem awq``: ``GGUFConfig(type, awq=True)``: AWQ's per-channel scales searched with
  the linears' own block types as the quantizer and folded into the norms, then each
  linear encoded by llama.cpp's weighted quantizer with the importance measured after the
  fold; ``lessmem awq+gptq``: the same scales, then GPTQ inside the blocks.

Every file, the F32 one included, is then evaluated **by llama.cpp** (``Llama.eval``, all
logits): WikiText-2 **test** windows of ``--window-len`` tokens, the tokens after the
first quarter scored (the KV evaluator's protocol), ``ppl``, ``kld`` (mean KL(p_F32 || q),
nats) and ``top1`` agreement against the F32 file's own logits, ``delta_ppl_pct`` against
its ppl. Calibration: windows of ``wiki.train.head.raw`` (never the test split).
IQ4_XS is written by both sides too (lessmem's GPTQ picks among its 16 non-uniform levels).

Without llama-cpp-python (``--quick`` in CI) the llama.cpp rows are skipped and lessmem's
files are evaluated by lessmem's own GGUF loader (``load_gguf_blocks``); ``evaluator``
says which ran.

    python benchmarks/train_small_llama.py --size medium --steps 360
    python benchmarks/bench_gguf_llamacpp.py
    python benchmarks/bench_gguf_llamacpp.py --quick
"""

from __future__ import annotations

import copy
import ctypes
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, parser, write_result  # noqa: E402

import lessmem  # noqa: E402
from lessmem.base.paths import cache_dir, repo_data_file  # noqa: E402
from lessmem.eval.perplexity import make_windows  # noqa: E402
from lessmem.weights.gguf_export import Source, export_gguf_encoded, write_model_gguf  # noqa: E402
from lessmem.weights.imatrix import collect_imatrix, export_gguf_imatrix  # noqa: E402

TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_XS")
VARIANTS = ("llama.cpp", "llama.cpp+imatrix", "lessmem", "lessmem imatrix", "lessmem gptq", "lessmem awq",
            "lessmem awq+gptq")
OURS = VARIANTS[2:]


def have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load_model(name: str, quick: bool):
    from lessmem.models import load, tiny_random, tiny_tokenizer

    if quick:
        return tiny_random("llama", num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                           num_kv_heads=2, vocab_size=259), tiny_tokenizer()
    if name.startswith("wiki-byte-llama"):
        d = cache_dir("models", name)
        if not (d / "model.safetensors").exists():
            raise SystemExit(f"run benchmarks/train_small_llama.py first ({name} not found in {d})")
        return load(str(d), weights="float")
    return load(name, weights="float")


def text_ids(tok, split: str, quick: bool) -> torch.Tensor:
    path = repo_data_file("wikitext-2-raw", split)
    if path is None:
        if not quick:
            raise SystemExit(f"needs ../shared/data/wikitext-2-raw/{split}")
        from lessmem.base.corpus import pydoc_corpus

        text = pydoc_corpus()[: 200_000] if "test" in split else pydoc_corpus()[200_000:400_000]
    else:
        text = path.read_text(encoding="utf-8")
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


# ----------------------------------------------------------------------------- llama.cpp


class _IMatrixArg:
    """An IMatrix as the C array ``llama_model_imatrix_data[]`` (NULL-name terminated)."""

    def __init__(self, im):
        import llama_cpp

        self.keep = []
        entries = sorted(im.entries.items())
        self.array = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for i, (name, _) in enumerate(entries):
            vals = np.ascontiguousarray(im.importance(name), dtype=np.float32)
            self.keep.append(vals)
            self.array[i].name = name.encode()
            self.array[i].data = vals.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            self.array[i].size = vals.size
        self.array[len(entries)].name = None


def llama_quantize(src: Path, out: Path, ftype: str, threads: int, im=None) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    arg = None
    if im is not None:
        arg = _IMatrixArg(im)
        params.imatrix = ctypes.cast(arg.array, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {ftype} returned {rc}")
    del arg


def llama_logits(path: Path, n_ctx: int, threads: int):
    """window ids -> [n, V] float32 logits, computed by llama.cpp."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def run(w: torch.Tensor) -> np.ndarray:
        llm.reset()
        llm.eval(w.tolist())
        return np.array(llm.scores[: w.numel()], dtype=np.float32)

    return run, llm


def lessmem_logits(path: Path, config):
    from lessmem.weights.gguf_load import load_gguf_blocks

    model = load_gguf_blocks(str(path), config=config, int8_activations=False).eval()

    @torch.inference_mode()
    def run(w: torch.Tensor) -> np.ndarray:
        return model(input_ids=w[None], use_cache=False).logits[0].float().numpy()

    return run, model


# ----------------------------------------------------------------------------- scoring


def log_softmax(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    m = a.max(-1, keepdims=True)
    return a - m - np.log(np.exp(a - m).sum(-1, keepdims=True))


def score(run, windows: torch.Tensor, prefill: int, ref: list | None) -> tuple[dict, list]:
    nll = kld = 0.0
    top1 = n = 0
    logps = []
    for i, w in enumerate(windows):
        lq = log_softmax(run(w)[prefill - 1:-1])
        tgt = w[prefill:].numpy()
        nll -= float(lq[np.arange(tgt.size), tgt].sum())
        if ref is not None:
            lp = ref[i]
            kld += float((np.exp(lp) * (lp - lq)).sum())
            top1 += int((lp.argmax(-1) == lq.argmax(-1)).sum())
        else:
            logps.append(lq)
        n += tgt.size
    row = {"ppl": math.exp(nll / n), "tokens_scored": n}
    if ref is not None:
        row.update(kld=kld / n, top1=top1 / n)
    return row, logps


def file_bytes_equal(a: Path, b: Path) -> bool:
    import gguf

    ta = {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(a)).tensors}
    tb = {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(b)).tensors}
    return ta == tb


def build(ftype: str, f32: Path, tmp: Path, im, model, calib, args, llama: bool):
    """The files of one type: {variant: path} and {variant: seconds to encode}."""
    files: dict[str, Path] = {}
    seconds: dict[str, float] = {}

    def make(variant, fn):
        if variant not in args.variants:
            return
        out = tmp / f"{ftype}.{variant.replace(' ', '_').replace('+', '_')}.gguf"
        t = time.perf_counter()
        fn(out)
        seconds[variant] = round(time.perf_counter() - t, 2)
        files[variant] = out

    def calibrated(gptq: bool, awq: bool):
        def run(out):
            m = copy.deepcopy(model)
            cfg = lessmem.GGUFConfig(ftype, gptq=gptq, awq=awq, n_samples=args.calib_samples,
                                     seq_len=args.calib_len, n_grid=args.n_grid)
            lessmem.quantize_(m, cfg, calibration=calib, progress=False)
            export_gguf_encoded(f32, out, ftype, m, progress=False)
        return run

    if llama:
        make("llama.cpp", lambda o: llama_quantize(f32, o, ftype, args.threads))
        make("llama.cpp+imatrix", lambda o: llama_quantize(f32, o, ftype, args.threads, im))
    make("lessmem", lambda o: Source(f32, ftype).write(o, progress=False))
    make("lessmem imatrix", lambda o: export_gguf_imatrix(f32, o, ftype, im, progress=False))
    make("lessmem gptq", calibrated(gptq=True, awq=False))
    make("lessmem awq", calibrated(gptq=False, awq=True))
    make("lessmem awq+gptq", calibrated(gptq=True, awq=True))
    return files, seconds


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="wiki-byte-llama-m")
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-grid", type=int, default=10,
                   help="AWQ's scale exponents searched (GGUFConfig's default 20; 10 halves the search)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"some of: {', '.join(VARIANTS)}")
    args = p.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(args.variants) - set(VARIANTS):
        p.error(f"--variants: {sorted(set(args.variants) - set(VARIANTS))} unknown; allowed: {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    if args.quick:
        types = ["Q4_K_M", "Q3_K_M"]
        args.windows, args.window_len, args.calib_samples, args.calib_len, args.n_grid = 2, 64, 4, 64, 4
    llama = have_llama_cpp() and not args.quick
    model, tok = load_model(args.model, args.quick)
    model.eval()
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    h = header(model=args.model if not args.quick else "tiny random (quick)", parameters=n_params,
               windows=args.windows, window_len=args.window_len, calib=f"{args.calib_samples} x {args.calib_len}",
               awq_n_grid=args.n_grid,
               evaluator="llama.cpp" if llama else "lessmem load_gguf_blocks",
               llama_cpp=__import__("llama_cpp").__version__ if llama else None)
    test = make_windows(tok, text_ids(tok, "wiki.test.raw", args.quick), args.windows, args.window_len)
    calib = make_windows(tok, text_ids(tok, "wiki.train.head.raw", args.quick), args.calib_samples,
                         args.calib_len)
    prefill = args.window_len // 4
    tmp = Path(tempfile.mkdtemp(prefix="bench_gguf_llamacpp."))
    rows = []
    try:
        f32 = write_model_gguf(model, tmp / "f32.gguf", "f32", tokenizer_model="none")

        def evaluate(path: Path, ref):
            if llama:
                run, keep = llama_logits(path, args.window_len, args.threads)
            else:
                run, keep = lessmem_logits(path, cfg)
            t0 = time.perf_counter()
            row, logps = score(run, test, prefill, ref)
            row["eval_s"] = round(time.perf_counter() - t0, 2)
            del keep
            return row, logps

        base, ref = evaluate(f32, None)
        with torch.inference_mode():  # the same windows through transformers: the conversion is faithful
            nll = n = 0.0
            for w in test:
                lq = torch.log_softmax(model(w[None]).logits[0, prefill - 1:-1].double(), -1)
                nll -= float(lq[torch.arange(w.numel() - prefill), w[prefill:]].sum())
                n += w.numel() - prefill
        base.update(variant="F32", type="F32", file_bytes=f32.stat().st_size, transformers_ppl=math.exp(nll / n))
        print(f"F32: ppl {base['ppl']:.4f} (transformers {base['transformers_ppl']:.4f})", flush=True)
        t0 = time.perf_counter()
        im = collect_imatrix(model, calib, n_samples=args.calib_samples, seq_len=args.calib_len)
        imatrix_s = time.perf_counter() - t0
        for ftype in types:
            files, seconds = build(ftype, f32, tmp, im, model, calib, args, llama)
            for variant, path in files.items():
                row, _ = evaluate(path, ref)
                row.update(variant=variant, type=ftype, file_bytes=path.stat().st_size,
                           delta_ppl_pct=100 * (row["ppl"] / base["ppl"] - 1), encode_s=seconds[variant])
                theirs = {"lessmem": "llama.cpp", "lessmem imatrix": "llama.cpp+imatrix"}.get(variant)
                if llama and theirs in files:
                    row["bytes_equal_llama_cpp"] = file_bytes_equal(path, files[theirs])
                rows.append(row)
                print(f"{ftype:7s} {variant:18s} ppl {row['ppl']:.4f} ({row['delta_ppl_pct']:+.2f}%) "
                      f"kld {row['kld']:.5f} top1 {row['top1']:.3f} {row['file_bytes'] / 2**20:.2f} MiB", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    targets = []
    for ftype in types:
        by = {r["variant"]: r for r in rows if r["type"] == ftype}
        ours = [by[v] for v in OURS if v in by]
        if "llama.cpp+imatrix" not in by or not ours:
            continue
        best = min(ours, key=lambda r: r["ppl"])
        theirs = by["llama.cpp+imatrix"]
        t = {"type": ftype, "best_lessmem": best["variant"], "ppl": best["ppl"], "llama_cpp_imatrix_ppl": theirs["ppl"],
             "same_size": abs(best["file_bytes"] / theirs["file_bytes"] - 1) <= 0.01,
             "pass": best["ppl"] <= theirs["ppl"]}
        if ftype in ("Q3_K_M", "Q2_K"):
            ratio = best["delta_ppl_pct"] / theirs["delta_ppl_pct"] if theirs["delta_ppl_pct"] > 0 else float("inf")
            t.update(delta_ratio=ratio, pass_10pct=ratio <= 0.9)
        targets.append(t)
    data = {"header": h, "base": base, "rows": rows, "targets": targets, "imatrix_s": round(imatrix_s, 2),
            "protocol": f"{args.windows} windows x {args.window_len} tokens of wiki.test.raw, tokens after "
                        f"the first {prefill} scored; calibration {args.calib_samples} x {args.calib_len} "
                        "tokens of wiki.train.head.raw"}
    name = "bench_gguf_llamacpp" + ("" if args.model == "wiki-byte-llama-m" else f"_{args.model}")
    write_result(name, data, args.out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
