"""Input validation shared by the formats layer: clear ValueErrors, never asserts."""

from __future__ import annotations

import torch

ALLOWED_INT_BITS = (2, 3, 4, 5, 6, 8)
SCALE_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


def check_bits(bits, allowed=ALLOWED_INT_BITS) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {', '.join(map(str, allowed))}")
    return bits


def check_float_tensor(x, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(
            f"{name} has dtype {x.dtype}; quantization needs a floating tensor "
            "(float16, bfloat16, float32 or float64)"
        )
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}); nothing to quantize")
    if not torch.isfinite(x).all():
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(
            f"{name} holds non-finite values ({n_nan} NaN, {n_inf} inf); "
            "only finite values can be quantized"
        )
    return x


def check_scale_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={dtype!r}; allowed: {', '.join(SCALE_DTYPES)}")
        return SCALE_DTYPES[dtype]
    if dtype not in SCALE_DTYPES.values():
        raise ValueError(f"scale_dtype={dtype!r}; allowed: torch.float16, torch.float32, torch.bfloat16")
    return dtype


def check_clip_ratio(clip_ratio) -> float:
    if not isinstance(clip_ratio, (int, float)) or not (0.0 < float(clip_ratio) <= 1.0):
        raise ValueError(f"clip_ratio={clip_ratio!r} must be a number in (0, 1]")
    return float(clip_ratio)
