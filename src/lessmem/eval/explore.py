"""The quantization error explorer: where the error goes, bits × group size, on any matrix.

An interactive quantization-error simulator's views, as functions over ``lessmem.formats``:

- ``error_table``: effective bits/weight (scales and zero points counted, from the
  QTensor's own bytes), SNR = 10·log10(Σw² / Σ(w − ŵ)²) in dB, max |w − ŵ|, and
  compression vs fp16 (16 / effective bits), for every bits × granularity × scheme;
- ``outlier_experiment``: per-tensor scales with outlier channels collapse (the scale
  stretches to the outliers, ordinary weights fall onto a handful of levels); groups
  recover, and the damage stays in the outlier's own group;
- ``traffic_table``: bytes one decode matmul y = W·x moves: fp16 reads W once; fused
  int4 reads codes + scales once; unfused dequantize-then-matmul reads the codes,
  writes an fp16 W and reads it back — more than fp16.

Example:
    >>> from lessmem.eval.explore import synthetic_weights, error_table
    >>> w, cols = synthetic_weights(16, 128, seed=11, outliers=0)
    >>> row = error_table(w, bits=[4], groups=["32"], schemes=["sym"])[0]
    >>> row["bits_per_weight"], round(row["compression"], 2)
    (4.5, 3.56)
"""

from __future__ import annotations

import functools
import re

import torch

from ..formats import QUANTIZERS, PerChannel, PerGroup, PerTensor, quantize, snr_db

DEFAULT_GROUPS = ("8", "16", "32", "64", "128", "channel", "tensor")
# names other helpers add to lessmem.formats; rows appear for those that exist
EXTRA_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                 "lm2", "lm3", "lm4", "fp8-e4m3", "fp8-e5m2")


def synthetic_weights(rows: int = 256, cols: int = 1024, seed: int = 11, outliers: int = 0,
                      outlier_scale: float = 100.0) -> tuple[torch.Tensor, list[int]]:
    """A seeded N(0, 1) weight matrix [rows, cols] with ``outliers`` input channels × scale.

    Outlier columns are drawn among the first min(128, cols) so the 128-weight picture
    of row 0 shows them. Returns (weights fp32, outlier column indices).
    """
    for k, v in (("rows", rows), ("cols", cols)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k}={v!r} must be a positive integer")
    if isinstance(outliers, bool) or not isinstance(outliers, int) or not 0 <= outliers <= min(128, cols):
        raise ValueError(f"outliers={outliers!r}; allowed: 0 to {min(128, cols)} channels")
    if not outlier_scale > 0:
        raise ValueError(f"outlier_scale={outlier_scale!r} must be positive")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    cols_out = sorted(torch.randperm(min(128, cols), generator=g)[:outliers].tolist())
    if cols_out:
        w[:, cols_out] *= outlier_scale
    return w, cols_out


def granularity(label: str, cols: int):
    """``"32"`` -> PerGroup(32) along the input axis, ``"channel"`` -> one scale per output row
    (PerChannel(0)), ``"tensor"`` -> PerTensor()."""
    s = str(label).strip().lower().removeprefix("g")
    if s in ("channel", "per-channel", "row"):
        return PerChannel(0)
    if s in ("tensor", "per-tensor"):
        return PerTensor()
    if not s.isdigit() or int(s) < 1:
        raise ValueError(f"group {label!r}; allowed: a positive group size (8, 16, 32, 64, 128, ...), "
                         "'channel' or 'tensor'")
    if cols % int(s):
        raise ValueError(f"group {s} does not divide the {cols} columns of the matrix")
    return PerGroup(int(s))


def _label(g) -> str:
    return "per-tensor" if isinstance(g, PerTensor) else "per-channel" if isinstance(g, PerChannel) \
        else f"g{g.size}"


def _measure(w: torch.Tensor, qt) -> dict:
    w_hat = qt.dequantize(torch.float32)
    err = (w - w_hat).abs()
    return {"bits_per_weight": qt.bits_per_element, "snr_db": snr_db(w, w_hat),
            "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()),
            "compression": 16.0 / qt.bits_per_element, "nbytes": qt.nbytes}


def error_table(w: torch.Tensor, bits=(2, 3, 4, 8), groups=DEFAULT_GROUPS, schemes=("sym", "asym"),
                skipped: list | None = None) -> list[dict]:
    """One row per bits × group × scheme (sym = int, zero point 0; asym = uint + zero point).

    Groups that do not divide the columns are left out (and named in ``skipped``).
    """
    for s in schemes:
        if s not in ("sym", "asym"):
            raise ValueError(f"scheme {s!r}; allowed: sym, asym")
    for b in bits:
        if isinstance(b, bool) or b not in range(2, 9):
            raise ValueError(f"bits={b!r}; allowed: 2, 3, 4, 5, 6, 7, 8")
    rows = []
    grans = []
    for label in groups:
        try:
            grans.append(granularity(label, w.shape[-1]))
        except ValueError as exc:
            if skipped is None or "does not divide" not in str(exc):
                raise
            skipped.append(str(exc))
    for b in bits:
        for g in grans:
            for s in schemes:
                qt = quantize(w, f"{'int' if s == 'sym' else 'uint'}{b}", granularity=g)
                rows.append({"bits": b, "group": _label(g), "scheme": s, **_measure(w, qt)})
    return rows


def available_formats(names=EXTRA_FORMATS) -> list[str]:
    """The names of ``names`` that ``lessmem.formats.quantize`` accepts today."""
    return [n for n in names if any(re.fullmatch(p, n) for p in QUANTIZERS)]


def formats_table(w: torch.Tensor, names=None, skipped: list | None = None) -> list[dict]:
    """GGUF block types, codebooks and fp8 on the same matrix (each with its own scales)."""
    rows = []
    for n in available_formats(EXTRA_FORMATS if names is None else names):
        try:
            qt = quantize(w, n)
        except ValueError as exc:  # e.g. a K-quant on rows that are not a multiple of 256
            if skipped is None:
                raise
            skipped.append(f"{n}: {exc}")
            continue
        rows.append({"format": n, **_measure(w, qt)})
    return rows


def _group_errors(x: torch.Tensor, x_hat: torch.Tensor, group: int, outlier_cols: list[int]) -> list[dict]:
    out = []
    for i in range(0, x.numel(), group):
        e = (x[i:i + group] - x_hat[i:i + group]).abs()
        has = [c for c in outlier_cols if i <= c < i + group]
        ordinary = [j for j in range(e.numel()) if i + j not in has]
        out.append({"start": i, "stop": i + e.numel(), "outliers": has, "max_abs_err": float(e.max()),
                    "ordinary_max_abs_err": float(e[ordinary].max()) if ordinary else 0.0})
    return out


def outlier_experiment(w: torch.Tensor, outlier_cols: list[int], bits: int = 4, group: int = 32,
                       scheme: str = "sym", show: int = 128) -> dict:
    """Per-tensor vs groups of ``group`` on a matrix with outlier channels.

    Returns SNR of each (all weights and ordinary weights only), the dB recovered, the
    mean error of ordinary weights that share a group with an outlier vs those that
    don't, and per-group errors on the first ``show`` weights of row 0 (the picture).

    Example:
        >>> w, cols = synthetic_weights(32, 1024, seed=11, outliers=2)
        >>> r = outlier_experiment(w, cols, bits=4, group=32)
        >>> r["recovered_db"] > 10, r["per_tensor"]["snr_db_ordinary"] < 1
        (True, True)
    """
    fmt = f"{'int' if scheme == 'sym' else 'uint'}{bits}"
    gran = granularity(str(group), w.shape[-1])
    res = {}
    mask = torch.ones(w.shape[-1], dtype=torch.bool)
    mask[outlier_cols] = False
    in_outlier_group = torch.zeros(w.shape[-1], dtype=torch.bool)
    for c in outlier_cols:
        in_outlier_group[(c // group) * group:(c // group + 1) * group] = True
    near = in_outlier_group & mask
    far = ~in_outlier_group
    n = min(show, w.shape[-1])
    for name, g in (("per_tensor", PerTensor()), (f"g{group}", gran)):
        qt = quantize(w, fmt, granularity=g)
        w_hat = qt.dequantize(torch.float32)
        err = (w - w_hat).abs()
        res[name] = {
            "granularity": _label(g), "bits_per_weight": qt.bits_per_element, "snr_db": snr_db(w, w_hat),
            "snr_db_ordinary": snr_db(w[:, mask], w_hat[:, mask]),
            "max_abs_err": float(err.max()),
            "mean_abs_err_ordinary_in_outlier_groups": float(err[:, near].mean()) if near.any() else 0.0,
            "mean_abs_err_elsewhere": float(err[:, far].mean()) if far.any() else 0.0,
            "groups_row0": _group_errors(w[0, :n], w_hat[0, :n], group, [c for c in outlier_cols if c < n]),
            "row0": w_hat[0, :n].tolist(),
        }
    res["row0_original"] = w[0, :n].tolist()
    res["outlier_cols"] = list(outlier_cols)
    res["bits"], res["group"], res["scheme"] = bits, group, scheme
    res["recovered_db"] = res[f"g{group}"]["snr_db"] - res["per_tensor"]["snr_db"]
    res["recovered_db_ordinary"] = res[f"g{group}"]["snr_db_ordinary"] - res["per_tensor"]["snr_db_ordinary"]
    return res


def traffic_table(w: torch.Tensor, formats=(("int4", "32"),), batch: int = 1,
                  bandwidth: float | None = None) -> list[dict]:
    """Bytes moved by one decode matmul y[B, out] = x[B, in] · Wᵀ for W = ``w``.

    fp16: read W (2 bytes/weight) + x + y. Fused: read the QTensor's bytes (codes + scales)
    once. Unfused: read codes + scales, write W in fp16, read it back: ≥ 4 bytes/weight.

    Example:
        >>> w, _ = synthetic_weights(64, 256)
        >>> [(r["path"], r["bytes_per_weight"]) for r in traffic_table(w, [("int4", "32")])]
        [('fp16', 2.0), ('fused', 0.5625), ('unfused', 4.5625)]
    """
    out_f, in_f = w.shape
    act = 2 * batch * (in_f + out_f)  # x read, y written, fp16
    fp16 = 2 * out_f * in_f
    rows = [{"path": "fp16", "format": "fp16", "weight_read": fp16, "weight_written": 0, "total": fp16 + act}]
    for fmt, grp in formats:
        if re.fullmatch(r"u?int[2-8]", fmt):
            g = granularity(grp, in_f)
            qt, label = quantize(w, fmt, granularity=g), f"{fmt} {_label(g)}"
        else:
            qt, label = quantize(w, fmt), fmt
        rows.append({"path": "fused", "format": label, "weight_read": qt.nbytes, "weight_written": 0,
                     "total": qt.nbytes + act})
        rows.append({"path": "unfused", "format": label, "weight_read": qt.nbytes + fp16,
                     "weight_written": fp16, "total": qt.nbytes + 2 * fp16 + act})
    for r in rows:
        r["vs_fp16"] = r["total"] / rows[0]["total"]
        r["bytes_per_weight"] = (r["weight_read"] + r["weight_written"]) / (out_f * in_f)
        if bandwidth:
            r["seconds_at_bandwidth"] = r["total"] / bandwidth
    return rows


def snr_curves(table: list[dict], scheme: str = "sym") -> dict[str, list[tuple[int, float]]]:
    """{group label: [(bits, SNR dB), ...]} from an error table, for the plot."""
    curves: dict[str, list] = {}
    for r in table:
        if r["scheme"] == scheme:
            curves.setdefault(r["group"], []).append((r["bits"], r["snr_db"]))
    return curves


# ---------------------------------------------------------------- real tensors

def model_gguf_path(model: str):
    """The GGUF file of a built-in alias (through ``lessmem.models``) or a ``.gguf`` path."""
    from pathlib import Path

    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"model file {model!r} does not exist")
        return p
    from .. import models

    if model not in models.BUILTIN:
        raise ValueError(f"--model {model!r}: give a built-in alias ({', '.join(models.BUILTIN)}) "
                         "or a path to a .gguf file")
    return models.builtin_gguf(model)


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    from ..formats.gguf_file import open_gguf_reader

    # header checked first (a damaged file: "not a valid GGUF file: ..."), then memory-mapped
    return open_gguf_reader(path)


def list_tensors(model: str) -> list[dict]:
    """Name, GGUF type and shape ([rows, cols], torch order) of every tensor in the model file."""
    reader = _reader(str(model_gguf_path(model)))
    return [{"name": t.name, "type": t.tensor_type.name, "shape": [int(s) for s in reversed(t.shape)]}
            for t in reader.tensors]


def load_tensor(model: str, name: str) -> tuple[torch.Tensor, dict]:
    """One tensor of the model file as fp32 [rows, cols] (dequantized with the gguf package).

    Reading the GGUF file directly is much cheaper than loading the model. 1-D tensors
    come back as [1, n]. Names may omit the ``.weight`` suffix.
    """
    import gguf

    reader = _reader(str(model_gguf_path(model)))
    by_name = {t.name: t for t in reader.tensors}
    t = by_name.get(name) or by_name.get(f"{name}.weight")
    if t is None:
        close = [n for n in by_name if name.split(".")[-1] in n][:5]
        raise ValueError(f"no tensor {name!r} in {model}; e.g. {', '.join(close or list(by_name)[:5])} "
                         "(see --list-tensors)")
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = [int(s) for s in reversed(t.shape)]
    x = torch.from_numpy(arr.reshape(shape).copy()).float()
    if x.ndim == 1:
        x = x.unsqueeze(0)
    elif x.ndim > 2:
        x = x.reshape(-1, x.shape[-1])
    return x, {"name": t.name, "stored_as": t.tensor_type.name, "shape": list(x.shape)}


def what_it_buys(bits: int = 4, group: int | str = 32, model: str = "llama-3.1-8b", hardware: str = "h100",
                 fits_in: int = 24 * 2**30) -> list[dict]:
    """The simulator's "what it buys" panel through ``lessmem.plan``: decode floor, weight bytes,
    scale overhead, unquantized KV at the model's full context, and whether it all fits."""
    from ..plan import plan

    fmt = f"int{bits}-{'channel' if str(group) == 'channel' else f'g{group}'}"
    p = plan(model, weights=["fp16", fmt], kv="fp16", hardware=hardware, context=None, batch=1)
    kv = p["kv"][0]["total"]
    rows = []
    for w, d in zip(p["weights"], p["decode"][:2], strict=True):
        rows.append({"model": p["model"]["name"], "hardware": p["hardware"]["name"], "weights": w["format"],
                     "bits_per_weight": w["format_bpw"], "scale_share": w["scale_share"],
                     "weight_bytes": w["bytes"], "seconds_per_token": d["seconds_per_token"],
                     "tok_s": d["tok_s"], "kv_fp16_bytes": kv, "context": p["inputs"]["context"],
                     "fits_in": fits_in, "fits": w["bytes"] + kv <= fits_in})
    return rows
