"""Weight quantization: which weights get quantized and how the codes are chosen.

RTN, HQQ (calibration-free), GPTQ, AWQ and SmoothQuant (W8A8) behind one call, ``quantize_``,
which replaces ``nn.Linear`` modules by ``QuantLinear`` (fused dequant-matmul kernels), FP8
(``FP8Config``: float8_e4m3fn weights in ``FP8Linear``, W8A8 through ``torch._scaled_mm`` or
weight-only) and GGUF types (``GGUFConfig``: ``GGUFLinear``); checkpoints
(``save_quantized`` / ``checkpoint.load_quantized``), GGUF export, and llama.cpp importance
matrices (``weights.imatrix``: ``collect_imatrix``, ``read_imatrix``, ``write_imatrix``; the
``imatrix`` of ``GGUFConfig``).

Example:
    >>> import lessmem
    >>> from lessmem.models import tiny_random
    >>> model = tiny_random("llama")
    >>> _ = lessmem.quantize_(model, lessmem.RTNConfig(bits=4, group_size=64), progress=False)
    >>> model.model.layers[0].self_attn.q_proj.bits
    4
"""

from .apply import quantize_
from .checkpoint import load_quantized, save_quantized
from .config import (
    AWQConfig,
    FP8Config,
    GGUFConfig,
    GPTQConfig,
    HQQConfig,
    RTNConfig,
    SmoothQuantConfig,
    WeightConfig,
)
from .fp8 import FP8Linear
from .imatrix import IMatrix, collect_imatrix, read_imatrix, write_imatrix
from .qlinear import QuantLinear

__all__ = ["quantize_", "QuantLinear", "FP8Linear", "WeightConfig", "RTNConfig", "HQQConfig", "GPTQConfig",
           "AWQConfig", "SmoothQuantConfig", "GGUFConfig", "FP8Config", "save_quantized", "load_quantized",
           "IMatrix", "collect_imatrix", "read_imatrix", "write_imatrix"]
