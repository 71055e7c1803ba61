"""Which GGUF block type each tensor gets: llama.cpp's mix rules, as a small table.

Follows ``llama_tensor_get_type`` (llama.cpp ``src/llama-quant.cpp``) for the types we
encode. For a file type (``Q4_K_M`` …) every 2-D weight gets the base type, except:

- ``output.weight`` (or ``token_embd.weight`` when the output is tied to it): Q6_K
  (Q8_0 stays Q8_0; Q8_0 when the row length is not a multiple of the base block)
- ``attn_v.weight`` in Q4_K_M/Q5_K_M: Q6_K for layers where ``use_more_bits`` holds
  (the first and last eighth, and every third layer between); Q4_K_S: Q5_K in layers < 4
- ``ffn_down.weight`` in Q4_K_M/Q5_K_M: Q6_K where ``use_more_bits(layer, n_layers)``;
  Q4_K_S: Q5_K in the first eighth of the layers
- a row length that is not a multiple of 256 cannot hold K-quant super-blocks:
  Q4_K→Q5_0, Q5_K→Q5_1, Q6_K→Q8_0 (llama.cpp's fallback); 1-D tensors stay F32.

Example:
    >>> from lessmem.weights.gguf_mix import tensor_type
    >>> [tensor_type("Q4_K_M", f"blk.{i}.ffn_down.weight", 1536, 30) for i in (0, 4, 5, 29)]
    ['q6_k', 'q4_k', 'q6_k', 'q6_k']
    >>> tensor_type("Q4_K_M", "blk.6.ffn_down.weight", 1536, 30)
    'q4_k'
    >>> tensor_type("Q4_K_M", "blk.6.attn_q.weight", 576, 30)   # 576 % 256 != 0
    'q5_0'
"""

from __future__ import annotations

import re

# file type -> base block type
MIXES = {
    "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
    "Q4_K_S": "q4_k", "Q4_K_M": "q4_k", "Q5_K_S": "q5_k", "Q5_K_M": "q5_k", "Q6_K": "q6_k",
}
# llama_ftype ids written to general.file_type
FILE_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_S": 14, "Q4_K_M": 15,
                 "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18}
_BLOCK = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "q4_k": 256, "q5_k": 256,
          "q6_k": 256}
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def check_mix(mix: str) -> str:
    m = mix.upper() if isinstance(mix, str) else mix
    if m not in MIXES:
        raise ValueError(f"GGUF type {mix!r} is not supported; allowed: {', '.join(MIXES)}")
    return m


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mix: str, name: str, n_cols: int, n_layers: int, has_output: bool = True,
                ndim: int = 2) -> str:
    """GGUF type name (lower case, or "f32") for tensor ``name`` with rows of ``n_cols``."""
    mix = check_mix(mix)
    base = MIXES[mix]
    if ndim < 2:
        return "f32"
    t = base
    m = re.match(r"blk\.(\d+)\.", name)
    layer = int(m.group(1)) if m else -1
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        if n_cols % _BLOCK[base]:
            t = "q8_0"
        elif base != "q8_0":
            t = "q6_k"
    elif name.endswith("attn_v.weight"):
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, n_layers):
            t = "q6_k"
        elif mix == "Q4_K_S" and layer < 4:
            t = "q5_k"
    elif name.endswith("ffn_down.weight"):
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, n_layers):
            t = "q6_k"
        elif mix == "Q4_K_S" and layer < n_layers // 8:
            t = "q5_k"
    if n_cols % _BLOCK[t]:
        t = _FALLBACK.get(t, t)
        if n_cols % _BLOCK[t]:
            raise ValueError(f"{name}: row length {n_cols} is not a multiple of 32; "
                             "no GGUF block type fits")
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
