"""Which GGUF block type each tensor gets, for GGUFConfig and the GGUF exporter.

The rules themselves live in one torch-free place, ``lessmem.base.gguf_rules`` (the
planner sizes files with the same function); this module keeps the exporter's API:
``tensor_type`` (that rule, restricted to the types ``lessmem.formats.gguf`` can
encode), ``check_mix``, ``MIXES``/``FILE_TYPE_IDS`` and the HF→GGUF tensor names.

Example:
    >>> from lessmem.weights.gguf_mix import tensor_type
    >>> [tensor_type("Q4_K_M", f"blk.{i}.ffn_down.weight", 1536, 30) for i in (0, 4, 5, 29)]
    ['q6_k', 'q4_k', 'q6_k', 'q6_k']
    >>> tensor_type("Q4_K_M", "blk.6.attn_q.weight", 576, 30)   # 576 % 256 != 0
    'q5_0'
"""

from __future__ import annotations

import re

from ..base import gguf_rules
from ..base.gguf_rules import use_more_bits  # noqa: F401  (re-export)
from ..formats.gguf import GGUF_IQ_TYPES, GGUF_TYPES

# file type -> base block type; llama_ftype ids written to general.file_type
MIXES = {f: base for f, (base, _) in gguf_rules.FILE_TYPES.items()}
FILE_TYPE_IDS = {f: i for f, (_, i) in gguf_rules.FILE_TYPES.items()}
ENCODABLE = (*GGUF_TYPES, *GGUF_IQ_TYPES)  # the block types lessmem.formats.gguf encodes


def check_mix(mix: str) -> str:
    """Upper-case file type (``Q4_K_M``); ValueError naming the allowed ones."""
    return gguf_rules.check_file_type(mix)


def tensor_type(mix: str, name: str, n_cols: int, n_layers: int, has_output: bool = True,
                ndim: int = 2, n_gqa: int = 1, n_expert: int = 1, has_imatrix: bool = False) -> str:
    """GGUF type name (lower case, or "f32") for tensor ``name`` with rows of ``n_cols``.

    ValueError when llama.cpp's choice is a type lessmem cannot encode (F16, for rows that
    are not a multiple of 32).
    """
    t = gguf_rules.tensor_type(mix, name, n_cols, n_layers, has_output, ndim, n_gqa, n_expert,
                               has_imatrix)
    if t == "f16":
        raise ValueError(f"{name}: row length {n_cols} is not a multiple of 32; no GGUF block type "
                         "fits (llama.cpp would store it as F16, which lessmem does not encode)")
    if t != "f32" and t not in ENCODABLE:
        raise ValueError(f"{name}: llama.cpp stores it as {t} in {check_mix(mix)} (row length "
                         f"{n_cols}), which lessmem cannot encode; encodable: {', '.join(ENCODABLE)}")
    return t


# HF Llama linear names -> GGUF tensor names
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str | None:
    """``model.layers.3.mlp.down_proj`` -> ``blk.3.ffn_down.weight``; ``lm_head`` -> ``output.weight``."""
    if hf_name == "lm_head":
        return "output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m and m.group(2) in HF_TO_GGUF:
        return f"blk.{m.group(1)}.{HF_TO_GGUF[m.group(2)]}.weight"
    return None
