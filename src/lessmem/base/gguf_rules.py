"""llama.cpp's GGUF type rules, torch-free: which block type each tensor of a file type gets.

One copy of the rules for the planner (``plan.weights``), ``GGUFConfig`` and the GGUF
exporter (``weights.gguf_mix`` wraps :func:`tensor_type`). It follows
``llama_tensor_get_type`` (llama.cpp ``src/llama-quant.cpp``) for the classic and K-quant
file types and IQ4_NL / IQ4_XS, Llama-style tensor names, no ``--pure``/
``--output-tensor-type`` overrides; ``has_imatrix`` (an importance matrix is given) changes
one choice, IQ4's ffn_down:

- every 2-D tensor gets the file type's base type; 1-D tensors (norms, biases) stay F32;
- ``output.weight`` (``token_embd.weight`` when the output is tied to it): Q6_K, or
  Q8_0 when the base is Q8_0 or the row length is not a multiple of the base block;
- ``attn_v``: Q2_K→Q3_K (Q4_K with ≥ 4 query heads per KV head); Q3_K_M→Q5_K in
  layers 0-1, else Q4_K; Q3_K_L→Q5_K; Q4_K_M/Q5_K_M→Q6_K where ``use_more_bits``;
  Q4_K_S→Q5_K in layers 0-3; IQ4_NL/IQ4_XS→Q5_K with ≥ 4 query heads per KV head;
  then on a 70B (llama.cpp's model type: 80 layers with grouped KV heads, 8 query heads
  per KV head) Q3_K/Q4_K→Q5_K, since its attn_v is 8x smaller than attn_q; with 8
  experts Q8_0 (and attn_k Q8_0);
- ``ffn_down``: Q2_K→Q3_K; Q3_K_M→Q5_K in the first sixteenth, else Q4_K; Q3_K_L→Q5_K;
  Q4_K_M/Q5_K_M→Q6_K where ``use_more_bits``; Q4_K_S→Q5_K in the first eighth;
  IQ4_NL/IQ4_XS→Q5_K in the first eighth, without an importance matrix only;
- ``attn_output``: Q2_K→Q3_K, Q3_K_M→Q4_K, Q3_K_L→Q5_K (with 8 experts: Q5_K for
  Q2_K, Q3_K_S/M, Q4_K_S/M, IQ4_NL/XS); fused ``attn_qkv``: Q3_K_M/L→Q4_K, Q4_K_M→Q5_K, Q5_K_M→Q6_K;
- a row length (``n_cols``, ggml's ``ne[0]``) that is not a multiple of the type's block
  falls back (``tensor_type_fallback``): Q2_K/Q3_K→Q4_0, IQ4_XS→IQ4_NL, Q4_K→Q5_0,
  Q5_K→Q5_1, Q6_K→Q8_0, then F16 (checked tensor by tensor against llama.cpp's own
  quantizer in ``tests/formats/test_gguf_rules_vs_llama_cpp.py``).

``use_more_bits(i, n)``: the first and last eighth of the layers, and every third layer
in between (``(i - n//8) % 3 == 2``): 14 of 30 layers, 40 of 80.

Example:
    >>> from lessmem.base.gguf_rules import tensor_type
    >>> [tensor_type("Q4_K_M", f"blk.{i}.ffn_down.weight", 1536, 30) for i in (0, 4, 5, 6, 29)]
    ['q6_k', 'q4_k', 'q6_k', 'q4_k', 'q6_k']
    >>> tensor_type("Q4_K_M", "blk.10.attn_v.weight", 8192, 80, n_gqa=8)   # 70B: Q4_K -> Q5_K
    'q5_k'
    >>> tensor_type("Q3_K_M", "blk.6.attn_q.weight", 576, 30)   # 576 % 256 != 0
    'q4_0'
"""

from __future__ import annotations

import math
import re

# GGUF type -> (weights per block, bytes per block, code bits); checked against gguf.GGML_QUANT_SIZES
GGUF_TYPES: dict[str, tuple[int, int, int]] = {
    "f32": (1, 4, 32), "f16": (1, 2, 16), "bf16": (1, 2, 16),
    "q4_0": (32, 18, 4), "q4_1": (32, 20, 4), "q5_0": (32, 22, 5), "q5_1": (32, 24, 5),
    "q8_0": (32, 34, 8), "q2_k": (256, 84, 2), "q3_k": (256, 110, 3), "q4_k": (256, 144, 4),
    "q5_k": (256, 176, 5), "q6_k": (256, 210, 6), "q8_k": (256, 292, 8),
    "iq4_nl": (32, 18, 4), "iq4_xs": (256, 136, 4),
}
# a row length the block does not divide: llama.cpp's replacement (then F16)
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
            "iq4_xs": "iq4_nl"}
# llama.cpp file type (llama_ftype) -> (base GGUF type, id written to general.file_type)
FILE_TYPES: dict[str, tuple[str, int]] = {
    "Q4_0": ("q4_0", 2), "Q4_1": ("q4_1", 3), "Q8_0": ("q8_0", 7), "Q5_0": ("q5_0", 8),
    "Q5_1": ("q5_1", 9), "Q2_K": ("q2_k", 10), "Q3_K_S": ("q3_k", 11), "Q3_K_M": ("q3_k", 12),
    "Q3_K_L": ("q3_k", 13), "Q4_K_S": ("q4_k", 14), "Q4_K_M": ("q4_k", 15),
    "Q5_K_S": ("q5_k", 16), "Q5_K_M": ("q5_k", 17), "Q6_K": ("q6_k", 18),
    "IQ4_NL": ("iq4_nl", 25), "IQ4_XS": ("iq4_xs", 30),
}
_IQ4 = ("IQ4_NL", "IQ4_XS")


def check_file_type(ftype: str) -> str:
    """Upper-case file type name; ValueError naming the allowed ones."""
    f = ftype.upper().replace("-", "_") if isinstance(ftype, str) else ftype
    if f not in FILE_TYPES:
        raise ValueError(f"GGUF type {ftype!r} is not supported; allowed: {', '.join(FILE_TYPES)}")
    return f


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp: the first and last eighth of ``n`` layers, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def is_70b(n_layers: int, n_gqa: int) -> bool:
    """llama.cpp's LLM_TYPE_70B for Llama: 80 layers with grouped KV heads (65B has none)."""
    return n_layers == 80 and n_gqa > 1


def _by_role(f: str, name: str, i: int, n: int, n_gqa: int, n_expert: int, typ: str,
             has_imatrix: bool = False) -> str:
    """The type before the row-length fallback, for a tensor that is not the output."""
    if "attn_v.weight" in name:
        if f == "Q2_K":
            typ = "q4_k" if n_gqa >= 4 else "q3_k"
        elif f == "Q3_K_M":
            typ = "q5_k" if i < 2 else "q4_k"
        elif f == "Q3_K_L":
            typ = "q5_k"
        elif f in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            typ = "q6_k"
        elif f == "Q4_K_S" and i < 4:
            typ = "q5_k"
        elif f in _IQ4 and n_gqa >= 4:
            typ = "q5_k"
        if is_70b(n, n_gqa) and typ in ("q3_k", "q4_k"):
            typ = "q5_k"
        if n_expert == 8:
            typ = "q8_0"
    elif "attn_k.weight" in name:
        if n_expert == 8:
            typ = "q8_0"
    elif "ffn_down" in name:
        if f == "Q2_K":
            typ = "q3_k"
        elif f == "Q3_K_M":
            typ = "q5_k" if i < n // 16 else "q4_k"
        elif f == "Q3_K_L":
            typ = "q5_k"
        elif f in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            typ = "q6_k"
        elif f == "Q4_K_S" and i < n // 8:
            typ = "q5_k"
        elif f in _IQ4 and i < n // 8 and not has_imatrix:
            typ = "q5_k"
    elif "attn_output.weight" in name:
        if n_expert == 8:
            if f in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", *_IQ4):
                typ = "q5_k"
        else:
            typ = {"Q2_K": "q3_k", "Q3_K_M": "q4_k", "Q3_K_L": "q5_k"}.get(f, typ)
    elif "attn_qkv.weight" in name:
        typ = {"Q3_K_M": "q4_k", "Q3_K_L": "q4_k", "Q4_K_M": "q5_k", "Q5_K_M": "q6_k"}.get(f, typ)
    return typ


def tensor_type(ftype: str, name: str, n_cols: int, n_layers: int, has_output: bool = True,
                ndim: int = 2, n_gqa: int = 1, n_expert: int = 1, has_imatrix: bool = False) -> str:
    """GGUF type (lower case; "f32"/"f16" for float) that llama-quantize gives tensor ``name``.

    ``name`` is the GGUF tensor name (``blk.3.attn_v.weight``, ``output.weight``);
    ``n_cols`` the row length; ``n_gqa`` query heads per KV head; ``n_expert`` experts;
    ``has_imatrix``: encoded with an importance matrix (``llama-quantize --imatrix``).
    """
    f = check_file_type(ftype)
    if ndim < 2:
        return "f32"
    base = FILE_TYPES[f][0]
    m = re.match(r"blk\.(\d+)\.", name)
    i = int(m.group(1)) if m else -1
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        if n_cols % GGUF_TYPES[base][0]:
            typ = "q8_0"
        else:
            typ = base if base == "q8_0" else "q6_k"
    elif name == "token_embd.weight":
        typ = base
    else:
        typ = _by_role(f, name, i, n_layers, n_gqa, n_expert, base, has_imatrix)
    return row_fallback(typ, n_cols)


def row_fallback(typ: str, n_cols: int) -> str:
    """``typ``, or llama.cpp's replacement (then F16) when its block does not divide ``n_cols``.

    Example:
        >>> row_fallback("q4_k", 576), row_fallback("q4_k", 512), row_fallback("q8_0", 50)
        ('q5_0', 'q4_k', 'f16')
    """
    if n_cols % GGUF_TYPES[typ][0]:
        typ = FALLBACK.get(typ, "f16")
        if n_cols % GGUF_TYPES[typ][0]:
            typ = "f16"
    return typ


def type_bytes(typ: str, rows: int, cols: int) -> int:
    """Bytes of a ``rows x cols`` tensor stored as GGUF type ``typ`` (whole blocks per row).

    Example:
        >>> type_bytes("q4_k", 2, 512), type_bytes("f32", 3, 5)
        (576, 60)
    """
    if typ not in GGUF_TYPES:
        raise ValueError(f"GGUF type {typ!r}; allowed: {', '.join(GGUF_TYPES)}")
    n, nbytes, _ = GGUF_TYPES[typ]
    return rows * math.ceil(cols / n) * nbytes
