"""lessmem's dequant-matmuls as torch ops, one op with a backend per device.

Ops (``torch.ops.lessmem.<name>``; schema below each), the ones ``QuantLinear`` and
``GGUFLinear`` call on every device:

- ``lowbit_linear(x, codes, bits, scale, zero, group_size, bias?)`` → float32 ``[..., N]``:
  2/3/4-bit codes packed row-major by ``formats.packing.pack_bits``, fp16 ``scale [N, G]``,
  uint8 ``zero [N, G]``
- ``int8_linear(x, w, scale)`` → float32 ``[..., N]``: int8 ``w [N, K]``, fp16 ``scale [N]`` (W8A16)
- ``w8a8_linear(xq, sx, w, scale)`` → float32 ``[M, N]``: int8 activations with a per-row scale
- ``gguf_linear(x, raw, qtype, out_features, bias?, int8_activations)`` → x's dtype ``[..., N]``:
  raw GGUF rows (``qtype`` is the ggml type id, ``formats.gguf.gguf_type(name).ggml_id``);
  ``int8_activations`` rounds x per block of 32 as llama.cpp does (Q4_0/Q4_1/Q8_0 only)
- ``gguf_dequantize(raw, qtype, out_features, in_features)`` → float32 ``[N, K]``

Backends, picked by the dispatcher from the tensors' device (no caller branches on it):

- CPU: the C++ kernels (``csrc/linear.cpp``, ``csrc/gguf_linear.cpp``), registered from C++
  when their module loads (at the first CPU call), so a CPU call never enters Python: the
  dispatcher calls the C++ wrapper, which checks the arguments and runs the kernel; without
  a compiler, the torch fallbacks of ``linear_cpp`` / ``gguf_linear_cpp``;
- CUDA: the Triton kernels (``linear_triton``, ``gguf_linear_triton``), imported at the
  first CUDA call; a GGUF type the Triton kernel does not take, or CUDA without triton,
  runs the torch fallback after one warning naming the slow path;
- any other device: the torch fallback (``linear_torch``, ``gguf_linear_torch``: the same
  math with torch ops on the tensors' own device), after one warning.

Each op has a fake kernel (output shape and dtype only), so ``torch.compile`` traces a
model through it, and every backend checks its arguments before any work: a wrong
``in_features``, a short code buffer or a wrong dtype is a ``ValueError`` naming the value
and what is allowed (the kernels themselves read their buffers unchecked).

Example:
    >>> import torch
    >>> import lessmem.kernels.linear_ops  # registers the ops
    >>> w = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    >>> s = (torch.rand(16) / 100).half()
    >>> x = torch.randn(2, 64)
    >>> y = torch.ops.lessmem.int8_linear(x, w, s)
    >>> bool(torch.allclose(y, x @ (w.float() * s.float()[:, None]).T, atol=1e-4))
    True
    >>> torch.ops.lessmem.int8_linear(torch.randn(2, 60), w, s)
    Traceback (most recent call last):
    ...
    ValueError: int8_linear: x has 60 input features; allowed: 64 (w is [16, 64])
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from ..formats.gguf import gguf_type
from . import gguf_linear_cpp, gguf_linear_torch, linear_cpp, linear_torch
from .ops import LIB

LIB.define("lowbit_linear(Tensor x, Tensor codes, int bits, Tensor scale, Tensor zero, int group_size, "
           "Tensor? bias) -> Tensor")
LIB.define("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor")
LIB.define("w8a8_linear(Tensor xq, Tensor sx, Tensor w, Tensor scale) -> Tensor")
LIB.define("gguf_linear(Tensor x, Tensor raw, int qtype, int out_features, Tensor? bias, "
           "bool int8_activations) -> Tensor")
LIB.define("gguf_dequantize(Tensor raw, int qtype, int out_features, int in_features) -> Tensor")

HAS_TRITON = importlib.util.find_spec("triton") is not None
_GGML_TYPES: dict[int, object] = {}


def ggml_type(qtype: int):
    """The ``GGUFType`` of ggml type id ``qtype`` (ValueError naming the types allowed)."""
    t = _GGML_TYPES.get(qtype)
    if t is None:
        t = gguf_type(int(qtype))
        if t.name not in gguf_linear_cpp.KERNEL_TYPES:  # encodable but not multiplied by any kernel
            raise ValueError(f"GGUF type {t.name.upper()} (ggml id {qtype}) has no dequant-matmul kernel; "
                             f"allowed: {', '.join(n.upper() for n in gguf_linear_cpp.KERNEL_TYPES)}")
        _GGML_TYPES[qtype] = t
    return t


# ---- argument checks (every backend runs them before any work) --------------------------
def _dtype(op: str, name: str, t: torch.Tensor, want: torch.dtype) -> None:
    if t.dtype != want:
        raise ValueError(f"{op}: {name} dtype {t.dtype}; allowed: {want}")


def _float(op: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{op}: x dtype {x.dtype}; allowed: a float dtype")


def _bias(op: str, bias, n: int) -> None:
    if bias is not None and bias.numel() != n:
        raise ValueError(f"{op}: bias has {bias.numel()} values; allowed: None or out_features = {n}")


def check_lowbit(x, codes, bits, scale, zero, group_size, bias) -> None:
    op = "lowbit_linear"
    if bits not in (2, 3, 4):
        raise ValueError(f"{op}: bits={bits!r}; allowed: 2, 3, 4")
    _float(op, x)
    _dtype(op, "scale", scale, torch.float16)
    _dtype(op, "zero", zero, torch.uint8)
    _dtype(op, "codes", codes, torch.uint8)
    if scale.dim() != 2 or zero.shape != scale.shape:
        raise ValueError(f"{op}: scale {tuple(scale.shape)} / zero {tuple(zero.shape)}; allowed: both [N, G]")
    n, k = scale.shape[0], scale.shape[1] * group_size
    if x.shape[-1] != k or not linear_cpp.lowbit_supported(k, group_size):
        raise ValueError(f"{op}: x has {x.shape[-1]} input features with group_size={group_size} and "
                         f"{scale.shape[1]} groups per row; allowed: in_features = groups x group_size = {k}, "
                         "group_size a multiple of 32, at most 32768")
    if codes.numel() != n * k * bits // 8:
        raise ValueError(f"{op}: codes hold {codes.numel()} bytes; allowed: N x K x bits / 8 = {n * k * bits // 8}")
    _bias(op, bias, n)


def check_int8(x, w, scale) -> None:
    op = "int8_linear"
    _float(op, x)
    _dtype(op, "w", w, torch.int8)
    _dtype(op, "scale", scale, torch.float16)
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"{op}: x has {x.shape[-1]} input features; allowed: {w.shape[-1]} "
                         f"(w is [{', '.join(map(str, w.shape))}])")
    if scale.numel() != w.shape[0]:
        raise ValueError(f"{op}: scale has {scale.numel()} values; allowed: one per output row ({w.shape[0]})")


def check_w8a8(xq, sx, w, scale) -> None:
    op = "w8a8_linear"
    _dtype(op, "xq", xq, torch.int8)
    _dtype(op, "w", w, torch.int8)
    _dtype(op, "scale", scale, torch.float16)
    if xq.dim() != 2 or w.dim() != 2 or xq.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: xq {tuple(xq.shape)} and w {tuple(w.shape)}; allowed: [M, K] and [N, K]")
    if sx.numel() != xq.shape[0] or scale.numel() != w.shape[0]:
        raise ValueError(f"{op}: sx has {sx.numel()} and scale {scale.numel()} values; allowed: "
                         f"{xq.shape[0]} (one per row of xq) and {w.shape[0]} (one per row of w)")


def check_gguf(x, raw, qtype, out_features, bias):
    """The GGUFType; raises ValueError unless raw holds [out_features, x.shape[-1]] in it."""
    t = ggml_type(qtype)
    op = "gguf_linear"
    _float(op, x)
    _dtype(op, "raw", raw, torch.uint8)
    k = x.shape[-1]
    if k % t.block_size or raw.numel() != out_features * (k // t.block_size) * t.type_size:
        raise ValueError(f"{op}: raw holds {raw.numel()} bytes for x with {k} input features; allowed: "
                         f"in_features a multiple of {t.block_size} and [{out_features}, {k}] in "
                         f"{t.name.upper()} = {out_features * (k // t.block_size) * t.type_size} bytes")
    _bias(op, bias, out_features)
    return t


# ---- fake kernels (torch.compile, meta tensors) -----------------------------------------
@torch.library.register_fake("lessmem::lowbit_linear", lib=LIB)
def _lowbit_fake(x, codes, bits, scale, zero, group_size, bias):
    return x.new_empty((*x.shape[:-1], scale.shape[0]), dtype=torch.float32)


@torch.library.register_fake("lessmem::int8_linear", lib=LIB)
def _int8_fake(x, w, scale):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)


@torch.library.register_fake("lessmem::w8a8_linear", lib=LIB)
def _w8a8_fake(xq, sx, w, scale):
    return xq.new_empty((xq.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.register_fake("lessmem::gguf_linear", lib=LIB)
def _gguf_fake(x, raw, qtype, out_features, bias, int8_activations):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("lessmem::gguf_dequantize", lib=LIB)
def _gguf_dequantize_fake(raw, qtype, out_features, in_features):
    return raw.new_empty((out_features, in_features), dtype=torch.float32)


# ---- CPU: the C++ kernels ---------------------------------------------------------------
def _lowbit_cpu(x, codes, bits, scale, zero, group_size, bias):
    check_lowbit(x, codes, bits, scale, zero, group_size, bias)
    return linear_cpp.lowbit_linear_unchecked(x, codes, bits, scale, zero, group_size, bias)


def _int8_cpu(x, w, scale):
    check_int8(x, w, scale)
    return linear_cpp.int8_linear(x, w, scale.reshape(-1))


def _w8a8_cpu(xq, sx, w, scale):
    check_w8a8(xq, sx, w, scale)
    return linear_cpp.w8a8_linear(xq, sx, w, scale.reshape(-1))


def _gguf_cpu(x, raw, qtype, out_features, bias, int8_activations):
    t = check_gguf(x, raw, qtype, out_features, bias)
    if int8_activations and t.name in gguf_linear_cpp.Q8_TYPES:
        return gguf_linear_cpp.gguf_linear_q8_prechecked(x, raw, t, out_features, bias)
    return gguf_linear_cpp.gguf_linear_prechecked(x, raw, t, out_features, bias)


def _gguf_dequantize_any(raw, qtype, out_features, in_features):
    return gguf_linear_cpp.gguf_dequantize(raw, ggml_type(qtype), out_features, in_features)


# ---- other devices: the torch fallbacks, after one warning --------------------------------
_warned: set = set()


def warn_slow(what: str, device: torch.device, hint: str = "") -> None:
    """One warning per (kernel, device type) that the torch fallback runs."""
    key = (what, device.type)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"lessmem: no {what} kernel for {device.type} tensors{hint}; using the torch "
                      "fallback (the same math with torch ops on the device, the slow path)",
                      RuntimeWarning, stacklevel=3)


def _triton_hint(device) -> str:
    return " (pip install 'lessmem[gpu]' for the Triton kernel)" if device.type == "cuda" else ""


def _lowbit_fallback(x, codes, bits, scale, zero, group_size, bias):
    check_lowbit(x, codes, bits, scale, zero, group_size, bias)
    warn_slow("lowbit_linear", x.device, _triton_hint(x.device))
    x2 = x.reshape(-1, x.shape[-1]).float()
    y = linear_torch.lowbit_linear_torch(x2, codes, bits, scale, zero, group_size, bias)
    return y.view(*x.shape[:-1], scale.shape[0])


def _int8_fallback(x, w, scale):
    check_int8(x, w, scale)
    warn_slow("int8_linear", x.device, _triton_hint(x.device))
    y = linear_torch.int8_linear_torch(x.reshape(-1, x.shape[-1]), w, scale)
    return y.view(*x.shape[:-1], w.shape[0])


def _w8a8_fallback(xq, sx, w, scale):
    check_w8a8(xq, sx, w, scale)
    warn_slow("w8a8_linear", xq.device, _triton_hint(xq.device))
    return linear_torch.w8a8_linear_torch(xq, sx, w, scale)


def _gguf_fallback(x, raw, qtype, out_features, bias, int8_activations, hint=None):
    t = check_gguf(x, raw, qtype, out_features, bias)
    warn_slow(f"{t.name} gguf_linear", x.device, _triton_hint(x.device) if hint is None else hint)
    if int8_activations and t.name in gguf_linear_cpp.Q8_TYPES:
        x = gguf_linear_cpp.quantize_activations_q8(x).to(x.dtype)
    return gguf_linear_torch.gguf_linear_torch(x, raw, t, out_features, bias)


# ---- CUDA: the Triton kernels -------------------------------------------------------------
def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _lowbit_cuda(x, codes, bits, scale, zero, group_size, bias):
    check_lowbit(x, codes, bits, scale, zero, group_size, bias)
    from . import linear_triton  # imported at the first CUDA call: triton is slow to import

    y = linear_triton.lowbit_linear(_rows(x), codes, bits, scale, zero, group_size, bias)
    return y.view(*x.shape[:-1], scale.shape[0])


def _int8_cuda(x, w, scale):
    check_int8(x, w, scale)
    from . import linear_triton

    return linear_triton.int8_linear(_rows(x), w, scale.reshape(-1)).view(*x.shape[:-1], w.shape[0])


def _w8a8_cuda(xq, sx, w, scale):
    check_w8a8(xq, sx, w, scale)
    from . import linear_triton

    return linear_triton.w8a8_linear(xq, sx.float(), w, scale.reshape(-1))


def _gguf_cuda(x, raw, qtype, out_features, bias, int8_activations):
    t = check_gguf(x, raw, qtype, out_features, bias)
    from . import gguf_linear_triton

    if t.name not in gguf_linear_triton.SUPPORTED:
        return _gguf_fallback(x, raw, qtype, out_features, bias, int8_activations,
                              hint=f" (the Triton kernel takes {', '.join(gguf_linear_triton.SUPPORTED)})")
    xin = gguf_linear_cpp.quantize_activations_q8(x) if int8_activations and t.name in gguf_linear_cpp.Q8_TYPES else x
    y = gguf_linear_triton.gguf_linear(_rows(xin), raw.reshape(out_features, -1), t.name, out_features, bias)
    return y.view(*x.shape[:-1], out_features).to(x.dtype)


def _gguf_dequantize_cuda(raw, qtype, out_features, in_features):
    t = ggml_type(qtype)
    gguf_linear_cpp.check_shape(t, out_features, in_features)
    from . import gguf_linear_triton

    if t.name in gguf_linear_triton.SUPPORTED and hasattr(gguf_linear_triton, "gguf_dequantize"):
        return gguf_linear_triton.gguf_dequantize(raw, t.name, out_features, in_features)
    return gguf_linear_cpp.gguf_dequantize(raw, t, out_features, in_features)  # torch ops on the device


def _on_cpu(*tensors) -> bool:
    return all(t is None or not isinstance(t, torch.Tensor) or t.is_cpu for t in tensors)


def _composite(cpu, fallback, load):
    """The ``CompositeExplicitAutograd`` kernel: CPU tensors before the C++ module is loaded
    (loading it registers its ``CPU`` kernels, which the dispatcher prefers from then on:
    later calls never enter Python), and every device without a kernel of its own."""
    def kernel(*args):
        if _on_cpu(*args):
            load()  # builds on first use; None (one warning) without a compiler
            return cpu(*args)  # the C++ kernel through its Python wrapper, or its torch fallback
        return fallback(*args)
    kernel.__name__ = f"{cpu.__name__}_composite"
    return kernel


_BACKENDS = {
    "lowbit_linear": (_lowbit_cpu, _lowbit_cuda, _lowbit_fallback, linear_cpp._mod),
    "int8_linear": (_int8_cpu, _int8_cuda, _int8_fallback, linear_cpp._mod),
    "w8a8_linear": (_w8a8_cpu, _w8a8_cuda, _w8a8_fallback, linear_cpp._mod),
    "gguf_linear": (_gguf_cpu, _gguf_cuda, _gguf_fallback, gguf_linear_cpp._mod),
    # decoding is torch ops on any device already (bit-identical); CUDA gets the Triton decoder
    "gguf_dequantize": (_gguf_dequantize_any, _gguf_dequantize_cuda, _gguf_dequantize_any, gguf_linear_cpp._mod),
}
for _name, (_cpu, _cuda, _fallback, _load) in _BACKENDS.items():
    # CPU: csrc/linear.cpp and csrc/gguf_linear.cpp register their own CPU kernels when loaded
    LIB.impl(_name, _composite(_cpu, _fallback, _load), "CompositeExplicitAutograd")
    if HAS_TRITON:  # CUDA without triton: the fallback, with its warning
        LIB.impl(_name, _cuda, "CUDA")
