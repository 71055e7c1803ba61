"""Quantize-on-append as a torch op: ``torch.ops.lessmem.kv_encode``.

``kv_encode(x, spec_id, layout_id) -> (codes, scale, zero_point)`` quantizes one chunk
``x [B, H, T, D]`` of keys or values into the stored layout (``zero_point`` is an empty
tensor for a layout that stores none). ``spec_id`` names a
:class:`~lessmem.kvcache.config.KVTensorConfig` (:func:`spec_id`; like the layouts of
``kernels.ops.layout_id``, a config is not a tensor), ``layout_id`` its
:class:`~lessmem.formats.kvlayout.KVLayout` (``kernels.ops.layout_id``). Backends:

- CUDA: the Triton store kernel (:mod:`.store_triton`, one launch per side), or codec's
  torch ops for a geometry it cannot tile;
- every other device (the CPU included): ``codec.encode`` (torch ops on the device).

The fake kernel gives the part shapes, so ``torch.compile`` traces an append through it.
:func:`encode_chunk` is what the cache's layers call.

Example:
    >>> import torch
    >>> from lessmem.kvcache.presets import resolve
    >>> enc = encode_chunk(torch.randn(1, 2, 32, 64), resolve("int4").keys)
    >>> tuple(enc.codes.shape), tuple(enc.scale.shape), tuple(enc.zero_point.shape)  # uint keys
    ((1, 2, 32, 32), (1, 2, 32, 1), (1, 2, 32, 1))
"""

from __future__ import annotations

import importlib.util

import torch

from ..kernels.ops import LIB, Interned, layout_id, layout_of
from .codec import Encoded, encode, kv_layout
from .config import KVTensorConfig

LIB.define("kv_encode(Tensor x, int spec_id, int layout_id) -> (Tensor, Tensor, Tensor)")

_SPECS = Interned(KVTensorConfig, "spec", "lessmem.kvcache.encode_op.spec_id")


def spec_id(spec: KVTensorConfig) -> int:
    """The op's int for ``spec`` (equal configs share one id, kept for the process)."""
    return _SPECS.id_of(spec)


def spec_of(i: int) -> KVTensorConfig:
    return _SPECS.get(i)


def _out(enc: Encoded):
    zp = enc.zero_point if enc.zero_point is not None else enc.codes.new_empty(0, dtype=torch.uint8)
    return enc.codes, enc.scale, zp


def _torch_backend(x, sid, lid):
    return _out(encode(x, spec_of(sid), layout_of(lid)))


def _cuda_backend(x, sid, lid):
    from . import store_triton  # imported at the first CUDA chunk: triton is slow to import

    try:
        return _out(store_triton.encode(x, spec_of(sid), layout_of(lid)))
    except NotImplementedError:  # a geometry the kernel cannot tile: codec's torch ops
        return _torch_backend(x, sid, lid)


@torch.library.register_fake("lessmem::kv_encode", lib=LIB)
def _fake(x, sid, lid):
    lay = layout_of(lid)
    B, H, T, _ = x.shape
    zp = x.new_empty(lay.part_shape("zero_point", B, H, T) if lay.has_zero_point else (0,), dtype=torch.uint8)
    return (x.new_empty(lay.part_shape("codes", B, H, T), dtype=lay.CODES_DTYPE),
            x.new_empty(lay.part_shape("scale", B, H, T), dtype=lay.SCALE_DTYPE), zp)


LIB.impl("kv_encode", _torch_backend, "CompositeExplicitAutograd")
if importlib.util.find_spec("triton") is not None:
    LIB.impl("kv_encode", _cuda_backend, "CUDA")

_OP = torch.ops.lessmem.kv_encode.default


def encode_chunk(x: torch.Tensor, spec: KVTensorConfig) -> Encoded:
    """``codec.encode(x, spec)`` through the op (the dispatcher picks the backend)."""
    codes, scale, zp = _OP(x, spec_id(spec), layout_id(kv_layout(spec, x.shape[-1])))
    return Encoded(codes, scale, zp if zp.numel() else None)
