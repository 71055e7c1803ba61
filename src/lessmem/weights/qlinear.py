"""``QuantLinear``: an ``nn.Linear`` whose weight lives as codes and is expanded only
inside the matmul (fused kernels in ``lessmem.kernels``).

Layouts held (``N = out_features``, ``K = in_features``, ``G = K / group_size``):

- 4-bit, shapes torch's CPU op takes: ``int4pack`` (the op's packed layout) and its
  ``[G, N, 2]`` bf16 scale-and-zero tensor → ``_weight_int4pack_mm_for_cpu`` (bf16 activations)
- 2/3/4-bit otherwise: ``qweight`` codes packed by ``formats.packing.pack_bits`` row-major,
  fp16 ``scale [N, G]``, uint8 ``zero_point [N, G]`` → the C++ ``lowbit_linear`` kernel for
  up to 16 rows (it reads these tensors as held; activations are rounded to 16-bit fixed
  point per group, relative error ≤ 1.6e-5, see ``kernels.linear_cpp``); larger batches
  (prefill), and group sizes that are not a multiple of 32, dequantize and use BLAS
- 8-bit, symmetric with one scale per row: int8 ``qweight [N, K]`` and fp16 ``scale [N, 1]``
  → the C++ ``int8_linear`` kernel; with ``act_bits=8`` (SmoothQuant W8A8, which needs this
  form) activations are quantized per token on the fly (x_q = round(x / s_x),
  s_x = max|x_token| / 127) and the int8·int8 kernel sums in int32. 8-bit codes with groups
  or zero points are held ``packed`` (one byte per code) and dequantized for BLAS.

The kernels are torch ops (``torch.ops.lessmem.lowbit_linear`` / ``int8_linear`` /
``w8a8_linear``, ``kernels.linear_ops``): on CPU tensors the C++ kernels above, on CUDA the
Triton kernels (``kernels.linear_triton``: float activations, no 16-bit rounding), elsewhere
(or without a compiler / triton) the torch fallbacks (``kernels.linear_torch``: the same math
on the tensors' own device) after one warning. ``int4pack`` is a CPU op's packing: moving
the layer off the CPU (``.to("cuda")``) re-holds its codes in the ``packed`` layout with
the same bf16 scales, and quantizing a layer whose weight is already off the CPU never
picks it.

``nbytes`` counts every tensor held (codes, scales, zero points, bias): the kernels read the
held tensors directly, so there are no derived copies to go stale after ``load_state_dict``.

Example:
    >>> import torch
    >>> from lessmem.weights.qlinear import QuantLinear
    >>> _ = torch.manual_seed(0)
    >>> lin = torch.nn.Linear(128, 64)
    >>> q = QuantLinear.from_linear(lin, bits=4, group_size=32, symmetric=False)
    >>> x = torch.randn(2, 128)
    >>> err = (q(x) - lin(x)).abs().max().item()
    >>> err < 0.1, q.nbytes < lin.weight.numel() * 4 / 5
    (True, True)
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.packing import pack_bits, unpack_bits
from ..kernels import int4_linear as i4
from ..kernels import (
    linear_cpp,
    linear_ops,  # noqa: F401  (registers torch.ops.lessmem.*_linear)
)
from .rtn import QuantizedWeight, check_group_size, check_size, rtn_quantize

FUSED_MAX_ROWS = 16  # above this many rows, dequantize once and use BLAS (compute-bound)
# the ops (kernels.linear_ops) by their overloads: the dispatcher picks CPU C++ or CUDA Triton
_LOWBIT = torch.ops.lessmem.lowbit_linear.default
_INT8 = torch.ops.lessmem.int8_linear.default
_W8A8 = torch.ops.lessmem.w8a8_linear.default


def held_nbytes(module: nn.Module) -> int:
    """Bytes of every tensor ``module`` holds (buffers and parameters, submodules included)."""
    return sum(t.numel() * t.element_size()
               for t in itertools.chain(module.buffers(), module.parameters()))


class QuantLinear(nn.Module):
    """A linear layer with ``bits``-bit group-wise weights; see the module doc."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int,
                 symmetric: bool, bias: bool = True, act_bits: int | None = None):
        super().__init__()
        if isinstance(bits, bool) or bits not in (2, 3, 4, 8):
            raise ValueError(f"QuantLinear bits={bits!r}; allowed: 2, 3, 4, 8")
        check_size("in_features", in_features)
        check_size("out_features", out_features)
        check_group_size(group_size, in_features)
        if group_size is None:
            raise ValueError(f"QuantLinear group_size=None; pass in_features={in_features} for one "
                             "group per row")
        for name, flag in (("symmetric", symmetric), ("bias", bias)):
            if not isinstance(flag, bool):
                raise ValueError(f"QuantLinear {name}={flag!r} must be True or False")
        if isinstance(act_bits, bool) or act_bits not in (None, 8) or (act_bits == 8 and bits != 8):
            raise ValueError(f"act_bits={act_bits!r}; allowed: None, or 8 with bits=8 (W8A8)")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.symmetric, self.act_bits = bits, group_size, symmetric, act_bits
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.layout = "unset"
        # lowbit_linear takes groups of whole 32-code blocks; others dequantize + BLAS
        self._fused = linear_cpp.lowbit_supported(in_features, group_size)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                       act_bits: int | None = None) -> QuantLinear:
        """Wrap codes/scales produced by RTN, GPTQ or AWQ."""
        n, k = qw.codes.shape
        m = cls(k, n, qw.bits, qw.group_size, qw.symmetric, bias is not None, act_bits)
        if bias is not None:
            m.bias.data = bias.detach().float().clone()
        m._set_codes(qw.codes, qw.scale, qw.zero)
        return m

    @classmethod
    def from_linear(cls, lin: nn.Linear, bits: int = 4, group_size: int | None = 128,
                    symmetric: bool = False, act_bits: int | None = None) -> QuantLinear:
        """Round-to-nearest quantization of an ``nn.Linear``."""
        qw = rtn_quantize(lin.weight, bits, group_size, symmetric)
        return cls.from_quantized(qw, lin.bias, act_bits)

    def _set_codes(self, u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, portable: bool = False):
        """Hold codes ``u [N, K]`` in the runtime layout; ``portable`` (or codes off the CPU)
        never picks ``int4pack``, whose packing only torch's CPU op reads."""
        n, k = self.out_features, self.in_features
        for name in ("qweight", "int4pack", "scale", "zero_point", "int4_sz"):
            if hasattr(self, name):
                delattr(self, name)
        scale = scale.to(torch.float16).reshape(n, -1).contiguous()
        zero = zero.to(torch.uint8).reshape(n, -1).contiguous()
        per_row_symmetric = scale.shape[1] == 1 and bool((zero == 128).all())
        if self.act_bits == 8 and not (self.bits == 8 and per_row_symmetric):
            raise ValueError(f"act_bits=8 (W8A8) needs 8-bit codes symmetric with one scale per row "
                             f"(group_size={k}, symmetric=True); got group_size={self.group_size}, "
                             f"symmetric={self.symmetric}")
        if self.bits == 8 and per_row_symmetric:
            self.layout = "int8"
            self.register_buffer("qweight", (u.to(torch.int16) - 128).to(torch.int8).contiguous())
            self.register_buffer("scale", scale)
        elif self.bits == 4 and not portable and u.device.type == "cpu" and i4.supported(n, k, self.group_size):
            self.layout = "int4pack"
            # only the op's tensors are held; scale and zero point are derived back on export.
            # Both are copied once the op's workspace is freed: the op's own outputs sit between
            # freed blocks the heap cannot give back, which over a model's layers held ~5x the
            # codes' size (SmolLM2-135M int4 checkpoint: 257 MiB of heap growth, 92 with copies)
            packed, sz = i4.pack_int4(u), i4.scales_and_zeros(scale, zero)
            self.register_buffer("int4pack", packed.clone())
            self.register_buffer("int4_sz", sz.clone())
        else:  # 2/3/4-bit packed; 8-bit with groups or zero points too (a byte per code, BLAS only)
            self.layout = "packed"
            self._fused = self._fused and self.bits <= 4
            self.register_buffer("qweight", pack_bits(u, self.bits))
            self.register_buffer("scale", scale)
            self.register_buffer("zero_point", zero)

    # ---- export -------------------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """Plain unsigned codes u [N, K] (uint8), whatever the runtime layout."""
        n, k = self.out_features, self.in_features
        if self.layout == "int8":
            return (self.qweight.to(torch.int16) + 128).to(torch.uint8)
        if self.layout == "int4pack":
            return i4.unpack_int4(self.int4pack, n, k)
        return unpack_bits(self.qweight, self.bits, n * k).view(n, k)

    def scales(self) -> torch.Tensor:
        """fp16 scale [N, G] (int4pack: the bf16 scale the op uses, exactly)."""
        if self.layout == "int4pack":
            return self.int4_sz[..., 0].T.to(torch.float16).contiguous()
        return self.scale

    def zero(self) -> torch.Tensor:
        """uint8 zero point [N, G] in code units (int4pack: from z = s·(8 − zp))."""
        if self.layout == "int8":
            return torch.full_like(self.scale, 128, dtype=torch.uint8)
        if self.layout == "int4pack":
            sz = self.int4_sz.float()
            zp = 8.0 - sz[..., 1] / torch.where(sz[..., 0] == 0, 1.0, sz[..., 0])
            return torch.round(zp).clamp(0, 15).T.to(torch.uint8).contiguous()
        return self.zero_point

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.codes(), self.scales(), self.zero(), self.bits, self.group_size,
                               self.symmetric)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 W_hat [N, K] as the kernels see it (int4pack: bf16 scale and zero)."""
        if self.layout == "int4pack":
            sz = self.int4_sz.float()  # [G, N, 2]
            s = sz[..., 0].T.repeat_interleave(self.group_size, 1)
            z = sz[..., 1].T.repeat_interleave(self.group_size, 1)
            return s * (self.codes().float() - 8) + z
        return self.quantized_weight().dequantize()

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the layer holds at run time (codes, scales, zeros, bias)."""
        return held_nbytes(self)

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight: codes + scales + zero points (bias excluded), portable layout."""
        g = self.in_features // self.group_size
        meta = 16 + (0 if self.layout == "int8" or self.symmetric else 8)
        return self.bits + meta * g / self.in_features

    # ---- compute ------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # the kernels read rows of in_features unchecked
            raise ValueError(f"input has {x.shape[-1]} features; this layer takes {self.in_features}")
        dtype = x.dtype
        rows = x.numel() // self.in_features
        if self.layout == "packed" and rows <= FUSED_MAX_ROWS and self._fused:
            # the op adds the bias; CPU: C++, CUDA: Triton (kernels.linear_ops)
            y = _LOWBIT(x, self.qweight, self.bits, self.scale, self.zero_point, self.group_size,
                                   self.bias)
            return y if dtype == torch.float32 else y.to(dtype)
        if self.act_bits == 8:
            y = self._forward_w8a8(x)
        elif self.layout == "int4pack":
            y = i4.int4_linear(x, self.int4pack, self.group_size, self.int4_sz)
        elif rows > FUSED_MAX_ROWS or self.layout == "packed":
            y = F.linear(x.float(), self.dequantized_weight())
        else:
            y = _INT8(x, self.qweight, self.scale.view(-1))
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype)

    def _forward_w8a8(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        sx = (x2.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # per-token dynamic scale
        xq = torch.round(x2 / sx[:, None]).clamp(-127, 127).to(torch.int8)
        if x2.shape[0] > FUSED_MAX_ROWS:  # same integer sums through BLAS (exact up to 2^24)
            sw = self.scale.float().view(-1)
            y = (xq.float() @ self.qweight.float().T) * sx[:, None] * sw[None, :]
        else:
            y = _W8A8(xq, sx, self.qweight, self.scale.view(-1))
        return y.view(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` moves the codes and scales; ``.to(dtype)``/``.half()`` leave the
        stored formats alone (fp16 scales, bf16 int4pack scales): they are part of the
        quantized format, not of the model's compute dtype."""
        if self.layout == "int4pack" and fn(torch.empty(0)).device.type != "cpu":
            # the op's packing is CPU-only: off the CPU the codes are held packed row-major,
            # with the bf16 scales the op used (exact in fp16) and their zero points
            self._set_codes(self.codes(), self.scales(), self.zero(), portable=True)
        held = {n: b.dtype for n, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for n, dt in held.items():
            b = self._buffers.get(n)
            if b is not None and b.dtype != dt:
                self._buffers[n] = b.to(dt)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, layout={self.layout}"
                + (f", act_bits={self.act_bits}" if self.act_bits else ""))
