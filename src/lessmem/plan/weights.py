"""Weight footprints on paper: float, integer with group scales, GGUF types and mixes.

Effective bits count the metadata: b-bit codes with one s-bit scale (and a z-bit zero
point) per group of G weights cost b + (s + z)/G bits, so int4 with an fp16 scale per 32
weights is 4 + 16/32 = 4.5 bits. Two overhead figures, since the literature uses both:

- ``scale_share``: metadata / total bits — 0.5/4.5 = 11.1% at group 32 (as
  "scale overhead"),
- ``scale_tax``: metadata / code bits — 2/4 = 50% at group 8 (the "50% tax").

GGUF types are counted from their block layout (bytes per block / weights per block).
Files are sized with llama.cpp's per-tensor rules (``base.gguf_rules``, the same function
the GGUF exporter uses): mixes such as Q4_K_M give more bits to attn_v and ffn_down of
some layers; every file type, Q4_0 and Q8_0 included, stores the output matrix in Q6_K
(Q8_0 stays Q8_0); rows that are not a multiple of a block fall back; 1-D tensors are
F32. GGUF types that are no llama.cpp file type (q3_k, q4_k, q5_k, iq4_*) are sized as
that type everywhere.

Example:
    >>> from lessmem.plan.weights import get_weight_format
    >>> f = get_weight_format("int4-g32")
    >>> f.bits_per_weight, round(100 * f.scale_share, 1)
    (4.5, 11.1)
    >>> get_weight_format("q6_k").bits_per_weight
    6.5625
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from ..base.gguf_rules import FALLBACK, FILE_TYPES, GGUF_TYPES, row_fallback, type_bytes  # noqa: F401  (re-export)
from ..base.gguf_rules import tensor_type as _file_tensor_type

# llama.cpp file types that are mixes (the rest share their name with a GGUF type)
MIXES = tuple(f.lower() for f in FILE_TYPES if f.lower() not in GGUF_TYPES)


@dataclass(frozen=True)
class WeightFormat:
    """How a 2-D weight is stored: ``kind`` float | int | gguf | mix."""

    name: str
    kind: str
    bits: int  # code bits
    group: int | None = None  # weights per scale (None: none; 0: one per output row)
    scale_bits: int = 16
    zero_point_bits: int = 0
    gguf_type: str | None = None

    def __post_init__(self):
        kinds = ("float", "int", "gguf", "mix")
        if self.kind not in kinds:
            raise ValueError(f"weight format {self.name!r}: kind={self.kind!r}; allowed: {', '.join(kinds)}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 32:
            raise ValueError(f"weight format {self.name!r}: bits={self.bits!r}; allowed: 1 to 32")
        if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, int)
                                       or self.group < 0):
            raise ValueError(f"weight format {self.name!r}: group={self.group!r}; allowed: None, 0 "
                             "(one scale per row) or a positive group size")
        if self.kind in ("gguf", "mix") and self.gguf_type not in (*GGUF_TYPES, *MIXES):
            raise ValueError(f"weight format {self.name!r}: gguf_type={self.gguf_type!r}; allowed: "
                             + ", ".join((*GGUF_TYPES, *MIXES)))

    @property
    def bits_per_weight(self) -> float:
        """Effective bits of one quantized weight (for per-row scales: see ``tensor_bytes``)."""
        if self.kind == "gguf":
            n, nbytes, _ = GGUF_TYPES[self.gguf_type]
            return 8 * nbytes / n
        if self.kind == "int" and self.group:
            return self.bits + (self.scale_bits + self.zero_point_bits) / self.group
        return float(self.bits)

    @property
    def meta_bits(self) -> float:
        return self.bits_per_weight - self.bits

    @property
    def scale_share(self) -> float:
        """Metadata as a fraction of all bits (11.1% for int4 g32)."""
        return self.meta_bits / self.bits_per_weight

    @property
    def scale_tax(self) -> float:
        """Metadata relative to the code bits (50% for int4 g8)."""
        return self.meta_bits / self.bits

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(bits_per_weight=self.bits_per_weight, scale_share=self.scale_share,
                 scale_tax=self.scale_tax)
        return d


def weight_choices() -> str:
    return ("fp32, fp16, bf16, int8 (per-channel), intN-gG / uintN-gG (N 2..8, G weights per fp16 "
            "scale; uint adds a zero point), GGUF types " + ", ".join(t for t in GGUF_TYPES if t[0] in "qi")
            + ", mixes " + ", ".join(MIXES))


def get_weight_format(spec: str | WeightFormat) -> WeightFormat:
    """``fp16``, ``int8``, ``int4-g32``, ``uint4-g128``, ``q4_0``, ``Q4_K_M``, ..."""
    if isinstance(spec, WeightFormat):
        return spec
    s = str(spec).strip().lower().replace("-", "_") if str(spec).lower().startswith(("q", "iq")) \
        else str(spec).strip().lower()
    if s in ("fp32", "f32"):
        return WeightFormat("fp32", "float", 32)
    if s in ("fp16", "f16", "bf16"):
        return WeightFormat(s.replace("f16", "fp16").replace("bfp16", "bf16"), "float", 16)
    if s in GGUF_TYPES:
        return WeightFormat(s.upper(), "gguf", GGUF_TYPES[s][2], gguf_type=s)
    if s in MIXES:
        return WeightFormat(s.upper(), "mix", int(s[1]), gguf_type=s)
    m = re.fullmatch(r"(u?)int([2-8])(?:[-_:]?g(?:roup)?=?(\d+|channel))?", s)
    if m:
        asym, bits, g = m.group(1) == "u", int(m.group(2)), m.group(3)
        if g is None:
            g = "channel" if bits == 8 else "32"
        group = 0 if g == "channel" else int(g)
        if g != "channel" and group < 1:
            raise ValueError(f"weight format {spec!r}: group size must be >= 1")
        name = f"{'u' if asym else ''}int{bits}-{'channel' if group == 0 else f'g{group}'}"
        return WeightFormat(name, "int", bits, group, 16, 16 if asym else 0)
    raise ValueError(f"unknown weight format {spec!r}; choose one of: {weight_choices()}")


def mix_type(mix: str, t, n_layers: int, tied: bool = False, n_gqa: int = 1) -> str:
    """The GGUF type llama.cpp gives tensor ``t`` (a Tensor2D) in file type ``mix``.

    Example:
        >>> from lessmem.plan.models import Tensor2D
        >>> mix_type("q4_k_m", Tensor2D("attn_v", 1024, 8192, 10), 80, n_gqa=8)  # 70B rule
        'q5_k'
    """
    if t.rows == 1:
        return "f32"
    name = f"blk.{t.layer}.{t.name}.weight" if t.layer is not None else f"{t.name}.weight"
    return _file_tensor_type(mix, name, t.cols, n_layers, has_output=not tied, n_gqa=n_gqa)


def tensor_bytes(fmt: WeightFormat, t, n_layers: int, keep_embeddings: bool = False,
                 tied: bool = False, n_gqa: int = 1) -> tuple[float, str]:
    """(bytes, storage type) of one tensor in format ``fmt``."""
    if t.rows == 1:  # norms and biases stay in float
        return (t.numel * 4, "f32") if fmt.kind in ("gguf", "mix") else (t.numel * 2, "fp16")
    if keep_embeddings and t.name in ("token_embd", "output"):
        return t.numel * 2, "fp16"
    if fmt.kind == "float":
        return t.numel * fmt.bits / 8, fmt.name
    if fmt.kind == "int":
        g = t.cols if fmt.group == 0 else fmt.group
        groups = t.rows * math.ceil(t.cols / g)
        return t.numel * fmt.bits / 8 + groups * (fmt.scale_bits + fmt.zero_point_bits) / 8, fmt.name
    if fmt.gguf_type.upper() in FILE_TYPES:  # a llama.cpp file type: its per-tensor rules
        typ = mix_type(fmt.gguf_type, t, n_layers, tied, n_gqa)
    else:  # a bare GGUF type everywhere, with llama.cpp's row-length fallback
        typ = row_fallback(fmt.gguf_type, t.cols)
    return type_bytes(typ, t.rows, t.cols), typ


def weight_footprint(model, fmt: WeightFormat | str, keep_embeddings: bool = False) -> dict:
    """Bytes of all weights of ``model`` in ``fmt``, effective bits over the model, types used.

    When the model states ``params`` that differ from its shapes (e.g. a round
    8B), the bytes are scaled to that count at the same effective bits.

    Example:
        >>> from lessmem.plan.models import get_model
        >>> w = weight_footprint(get_model("llama-2-7b"), "q4_k_m")
        >>> round(w["model_bpw"], 2), round(w["bytes"] / 2**30, 2)
        (4.84, 3.8)
    """
    fmt = get_weight_format(fmt)
    total, by_type, numel = 0.0, {}, 0
    tied = getattr(model, "tied_embeddings", False)
    n_gqa = max(1, model.heads // max(1, model.kv_heads))
    for t in model.tensors():
        b, typ = tensor_bytes(fmt, t, model.layers, keep_embeddings, tied, n_gqa)
        total += b
        numel += t.numel
        e = by_type.setdefault(typ, {"params": 0, "bytes": 0.0})
        e["params"] += t.numel
        e["bytes"] += b
    bpw = 8 * total / numel
    n = model.n_params
    return {
        "format": fmt.name, "params": n, "bytes": int(round(n * bpw / 8)), "model_bpw": bpw,
        "format_bpw": fmt.bits_per_weight if fmt.kind != "mix" else bpw,
        "scale_share": fmt.scale_share if fmt.kind != "mix" else None,
        "scale_tax": fmt.scale_tax if fmt.kind != "mix" else None,
        "fp16_bytes": int(round(n * 2)), "by_type": by_type,
    }
