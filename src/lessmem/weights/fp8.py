"""``FP8Linear``: a linear layer with FP8 (e4m3) weights, W8A8-FP8 or weight-only.

Stored (``N = out_features``, ``K = in_features``), nothing else:

- ``qweight``: ``torch.float8_e4m3fn [N, K]`` (1 sign, 4 exponent, 3 mantissa bits; finite
  values up to ±448, no infinities);
- ``scale``: float32 ``[N, 1]``, one per output channel: ``max|W[n, :]| / 448`` (an all-zero
  row gets 1), so each row's largest weight lands on ±448;
- ``bias``: float32 ``[N]`` when the layer has one.

``.half()`` / ``.to(torch.bfloat16)`` keep these dtypes (they are the format); ``.to(device)``
moves them.

``qweight = fp8(clamp(W / scale, -448, 448))`` (round to nearest even; the clamp keeps a
value that rounds past 448 from turning into NaN) and ``W_hat = qweight · scale``. That is
8 + 32/K bits per weight (``bits_per_weight``; bias excluded): 8.03 at K = 1024. No
calibration: the scales are the weights' own row maxima.

Forward, ``act="fp8"`` (W8A8): each input row (token) gets its own scale
``s_x = max|x_row| / 448`` (at least 1e-12), ``x_q = fp8(clamp(x / s_x, -448, 448))``, and
``torch._scaled_mm(x_q, qweight.T, scale_a=s_x [M, 1], scale_b=scale.T [1, N])`` computes
``(x_q · qweight.T) · s_x · scale.T`` with float32 accumulation, then the bias is added and
the result cast to the input's dtype. On Hopper (and Ada, compute capability 8.9) GPUs
``_scaled_mm`` runs on the FP8 tensor cores (cuBLASLt / CUTLASS row-wise kernels); on CPU
it is torch's reference kernel (exact float math on the FP8 values, up to about twice the time of
a float32 matmul: the CPU has no FP8 units, so the W8A8 path there is for checking, not
speed). On CUDA ``_scaled_mm`` needs compute capability >= 8.9 and ``K`` and ``N`` divisible
by 16; row-wise scales with a float32 output need compute capability 9.0 and a recent
cuBLAS, elsewhere the output is bfloat16 (tried once, then remembered). Where
``_scaled_mm`` cannot run (an older GPU, odd shapes, or it raises), the layer warns once,
remembers why (``fallback_reason``) and takes the weight-only path from then on;
``.to(device)`` clears what it remembered.

Forward, ``act=None`` (weight-only, W8A16): ``F.linear(x, W_hat in x's dtype, bias)``, the
weight dequantized on each call (``qweight`` in float32 times ``scale``, rounded once to
x's dtype); any device, any dtype.

Reference: P. Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433, 2022
(the E4M3 / E5M2 formats; E4M3 for weights and activations).

Example:
    >>> import torch
    >>> from lessmem.weights.fp8 import FP8Linear
    >>> _ = torch.manual_seed(0)
    >>> lin = torch.nn.Linear(256, 64)
    >>> q = FP8Linear.from_linear(lin, act="fp8")
    >>> q.qweight.dtype, q.scale.shape, q.bits_per_weight, q.nbytes
    (torch.float8_e4m3fn, torch.Size([64, 1]), 8.125, 16896)
    >>> x = torch.randn(3, 256)
    >>> err = (q(x) - lin(x)).pow(2).mean().sqrt() / lin(x).pow(2).mean().sqrt()
    >>> bool(err < 0.05)
    True
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .qlinear import held_nbytes
from .rtn import check_size

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
ACT_SCALE_MIN = 1e-12  # an all-zero input row: any scale gives zeros
ACTS = ("fp8", None)


def fp8_quantize(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight float8_e4m3fn [N, K], scale float32 [N, 1])`` for a 2-D floating weight
    ``w``; ``scale`` None: ``max|w_row| / 448`` (1 for an all-zero row). A given ``scale``
    (anything of ``N`` elements) is used as it is; weights beyond ``448 · scale`` saturate
    at ±448."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        got = f"{w.dtype} {list(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"the weight must be a 2-D floating tensor [out, in], got {got}")
    wf = w.detach().float()
    if scale is None:
        amax = wf.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    else:
        scale = torch.as_tensor(scale, device=wf.device).detach().float()
        if scale.numel() != wf.shape[0] or not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"scale must hold {wf.shape[0]} finite positive values (one per output "
                             f"channel), got shape {list(scale.shape)}")
        scale = scale.reshape(-1, 1)
    q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def quantize_activations(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (token) dynamic FP8 quantization of ``x2 [M, K]``: ``(x_q e4m3 [M, K],
    s_x float32 [M, 1])`` with ``x ≈ x_q · s_x``."""
    xf = x2.float()
    sx = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=ACT_SCALE_MIN)
    return (xf / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), sx


def _check_act(act) -> None:
    if not (act is None or (isinstance(act, str) and act in ACTS)):
        raise ValueError(f"FP8Linear act={act!r}; allowed: 'fp8' (W8A8) or None (weight-only)")


class FP8Linear(nn.Module):
    """A linear layer with float8_e4m3fn weights and per-output-channel float32 scales; see
    the module doc."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, act: str | None = "fp8",
                 fmt: str = "e4m3"):
        super().__init__()
        check_size("in_features", in_features)
        check_size("out_features", out_features)
        if not isinstance(bias, bool):
            raise ValueError(f"FP8Linear bias={bias!r} must be True or False")
        _check_act(act)
        if fmt != "e4m3":
            raise ValueError(f"FP8Linear fmt={fmt!r}; allowed: 'e4m3'")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.act, self.fmt = act, fmt
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("scale", torch.ones(out_features, 1, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self._reset_route()

    def _reset_route(self) -> None:
        self.fallback_reason: str | None = None  # why _scaled_mm is not used (warned once)
        self._mm_out = torch.float32  # _scaled_mm's output dtype (bfloat16 where f32 is refused)
        self._checked_on: torch.device | None = None  # the device _unusable last passed

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                       act: str | None = "fp8") -> FP8Linear:
        """Wrap ``qweight`` (float8_e4m3fn ``[N, K]``) and ``scale`` (``N`` floats) as they are."""
        if not isinstance(qweight, torch.Tensor) or qweight.dtype != FP8_DTYPE or qweight.dim() != 2:
            got = f"{qweight.dtype} {list(qweight.shape)}" if isinstance(qweight, torch.Tensor) \
                else type(qweight).__name__
            raise ValueError(f"qweight must be a 2-D torch.float8_e4m3fn tensor [out, in], got {got}")
        n, k = qweight.shape
        if not isinstance(scale, torch.Tensor) or scale.numel() != n or not scale.is_floating_point():
            got = f"{scale.dtype} {list(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
            raise ValueError(f"scale must be a floating tensor of {n} values (one per output channel), got {got}")
        m = cls(k, n, bias is not None, act)
        m.qweight = qweight.detach().contiguous()
        m.scale = scale.detach().float().reshape(n, 1).contiguous()
        if bias is not None:
            if bias.numel() != n:
                raise ValueError(f"bias has {bias.numel()} values; the layer has {n} outputs")
            m.bias.data = bias.detach().float().reshape(n).clone()
        return m.to(qweight.device)

    @classmethod
    def from_linear(cls, lin: nn.Linear, act: str | None = "fp8") -> FP8Linear:
        """Quantize an ``nn.Linear``'s weight (per-output-channel scales, see the module doc)."""
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"FP8Linear.from_linear needs a torch.nn.Linear, got {type(lin).__name__}")
        _check_act(act)
        q, s = fp8_quantize(lin.weight)
        return cls.from_quantized(q, s, lin.bias, act)

    # ---- inspection ---------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the layer holds (FP8 weight, scales, bias)."""
        return held_nbytes(self)

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight: 8 for the FP8 code + 32/K for the row's float32 scale."""
        return 8 + 32 / self.in_features

    def dequantized_weight(self) -> torch.Tensor:
        """float32 ``W_hat = qweight · scale`` ``[N, K]`` (a new tensor)."""
        return self.qweight.float() * self.scale

    # ---- compute ------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features; this layer takes {self.in_features}")
        if self.act == "fp8" and self.fallback_reason is None:
            y = self._forward_w8a8(x)
            if y is not None:
                return y
        return self._forward_weight_only(x)

    def _forward_weight_only(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight.float().mul_(self.scale).to(x.dtype)  # one rounding to x's dtype
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w, bias)

    def _unusable(self, x: torch.Tensor) -> str | None:
        """Why ``_scaled_mm`` cannot take this layer on ``x``'s device (None: try it)."""
        if x.device.type != "cuda":
            return None
        cap = torch.cuda.get_device_capability(x.device)
        if cap < (8, 9):
            return (f"torch._scaled_mm needs an FP8 GPU (compute capability >= 8.9); this one is "
                    f"{cap[0]}.{cap[1]}")
        if self.in_features % 16 or self.out_features % 16:
            return (f"torch._scaled_mm on CUDA needs in_features and out_features divisible by 16; "
                    f"this layer is {self.out_features} x {self.in_features}")
        return None

    def _fall_back(self, why: str) -> None:
        self.fallback_reason = why
        warnings.warn(f"FP8Linear ({self.out_features} x {self.in_features}): {why}; this layer "
                      "uses the weight-only FP8 path (dequantize + matmul) from now on", stacklevel=4)

    def _forward_w8a8(self, x: torch.Tensor) -> torch.Tensor | None:
        """W8A8 through ``torch._scaled_mm``; None once it has fallen back (see the module doc)."""
        if x.device != self._checked_on:  # once per device, not per call
            why = self._unusable(x)
            if why is not None:
                self._fall_back(why)
                return None
            self._checked_on = x.device
        xq, sx = quantize_activations(x.reshape(-1, self.in_features))
        sw = self.scale.reshape(1, -1)
        try:
            y = torch._scaled_mm(xq, self.qweight.t(), scale_a=sx, scale_b=sw, out_dtype=self._mm_out)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            if x.device.type == "cuda" and self._mm_out == torch.float32:
                # row-wise scales with a float32 output need SM 9.0 and cuBLAS >= 12.9; the
                # CUTLASS row-wise kernels write bfloat16
                try:
                    y = torch._scaled_mm(xq, self.qweight.t(), scale_a=sx, scale_b=sw,
                                         out_dtype=torch.bfloat16)
                    self._mm_out = torch.bfloat16
                except (RuntimeError, ValueError, NotImplementedError):
                    self._fall_back(f"torch._scaled_mm raised {type(e).__name__}: {first}")
                    return None
            else:
                self._fall_back(f"torch._scaled_mm raised {type(e).__name__}: {first}")
                return None
        y = y.float()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` moves the tensors; ``.to(dtype)``/``.half()`` leave the stored
        formats alone (float8_e4m3fn codes, float32 scales and bias): they are the quantized
        format, not the model's compute dtype (the forward casts to the input's dtype). A
        move forgets a fallback decided on the old device."""

        def keep_dtype(t):
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)

        super()._apply(keep_dtype, recurse)
        self._reset_route()
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"act={self.act}, bias={self.bias is not None}")
