"""lessmem's kernels as torch ops: ``torch.ops.lessmem.quantized_attention`` and its backends.

The op takes a quantized history flattened into tensors and ints, so torch.compile can
trace through it (its fake kernel gives the output shapes) and the dispatcher picks the
backend from the tensors' device:

- CPU: registered by :mod:`lessmem.kernels.attention` (the C++ kernel, or the torch
  fallback without a compiler);
- CUDA: the Triton kernel (:mod:`lessmem.kernels.attention_triton`, ``_triton_backend``),
  registered by :mod:`lessmem.kernels.attention` when triton is installed (and imported at
  the first CUDA call, not before); a ``mixed`` layout (bits per key channel), which the
  Triton kernel does not read, goes to the torch fallback there;
- any other device, and CUDA without triton: the torch fallback, after one warning that
  names the slow path (registered by :mod:`lessmem.kernels.attention` too, beside the
  history classes it rebuilds).

Schema: ``quantized_attention(q, k_codes[], k_scale[], k_zero_point[], k_lut?, k_layout,
v_codes[], v_scale[], v_zero_point[], v_lut?, v_layout, mask?, seg) -> (out, lse)``: the
lists hold one tensor per part of a :class:`~lessmem.kernels.attention.SegmentedKV` (one
part for a :class:`~lessmem.kernels.attention.QuantKV`, seg 0), ``*_zero_point`` empty when
the layout stores none; ``k_layout``/``v_layout`` are ids from :func:`layout_id` (a
:class:`~lessmem.formats.kvlayout.KVLayout` is not a tensor; the id names the shared layout
object for the life of the process).

Example:
    >>> import torch
    >>> from lessmem.formats.kvlayout import KVLayout
    >>> from lessmem.kernels.attention import QuantKV, QuantSide
    >>> from lessmem.kernels.ops import quantized_attention_op
    >>> lay = KVLayout(bits=4, head_dim=64, channel_group=64, zero_const=8.0)
    >>> side = QuantSide(torch.zeros(1, 2, 32, 32, dtype=torch.uint8), torch.ones(1, 2, 32, 1).half(), None, lay)
    >>> out, lse = quantized_attention_op(torch.zeros(1, 4, 1, 64), QuantKV(side, side))
    >>> tuple(out.shape), tuple(lse.shape), round(float(lse[0, 0, 0]), 4)   # log(32) over 32 equal scores
    ((1, 4, 1, 64), (1, 4, 1), 3.4657)
"""

from __future__ import annotations

import threading

import torch

from ..formats.kvlayout import KVLayout

SCHEMA = ("quantized_attention(Tensor q, Tensor[] k_codes, Tensor[] k_scale, Tensor[] k_zero_point, "
          "Tensor? k_lut, int k_layout, Tensor[] v_codes, Tensor[] v_scale, Tensor[] v_zero_point, "
          "Tensor? v_lut, int v_layout, Tensor? mask, int seg) -> (Tensor, Tensor)")

LIB = torch.library.Library("lessmem", "DEF")
LIB.define(SCHEMA)

class Interned:
    """Objects an op takes by an int (a schema holds tensors and scalars, not a layout or a
    config): equal objects share one id for the life of the process. ``id_of(obj)`` is the
    int (a hit on the same object costs one dict lookup), ``get(i)`` the object back."""

    def __init__(self, cls: type, name: str, id_fn: str):
        self.cls, self.name, self.id_fn = cls, name, id_fn
        self._lock = threading.Lock()
        self._objs: list = []
        self._ids: dict = {}
        self._by_object: dict[int, tuple[object, int]] = {}

    def id_of(self, obj) -> int:
        hit = self._by_object.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        if not isinstance(obj, self.cls):
            raise TypeError(f"{self.name}={obj!r}; allowed: a {self.cls.__module__}.{self.cls.__name__}")
        with self._lock:
            i = self._ids.get(obj)
            if i is None:
                i = self._ids[obj] = len(self._objs)
                self._objs.append(obj)
            self._by_object[id(obj)] = (obj, i)  # the object is kept alive, so its id() stays its own
        return i

    def get(self, i: int):
        if not 0 <= i < len(self._objs):
            raise ValueError(f"{self.name} id {i}; allowed: an id from {self.id_fn} "
                             f"(0 to {len(self._objs) - 1})")
        return self._objs[i]


_LAYOUTS = Interned(KVLayout, "layout", "lessmem.kernels.ops.layout_id")


def layout_id(layout: KVLayout) -> int:
    """The op's int for ``layout`` (equal layouts share one id)."""
    return _LAYOUTS.id_of(layout)


def layout_of(i: int) -> KVLayout:
    """The layout behind an op's layout id."""
    return _LAYOUTS.get(i)


def parts(codes, scale, zero_point) -> list[tuple]:
    """``(codes, scale, zero point or None)`` per part from the op's lists."""
    zps = list(zero_point) if len(zero_point) else [None] * len(codes)
    if not len(codes) or len(scale) != len(codes) or len(zps) != len(codes):
        raise ValueError(f"{len(codes)} code, {len(scale)} scale and {len(zero_point)} zero-point parts; "
                         "allowed: one or more parts, as many of each (zero points: none or as many)")
    return list(zip(codes, scale, zps, strict=True))


def op_args(q, kv, mask):
    """The op's arguments for a QuantKV or SegmentedKV ``kv``."""
    if hasattr(kv, "k_parts"):  # a SegmentedKV: its parts, read in place
        k, v, kp, vp, seg = kv.k, kv.v, kv.k_parts, kv.v_parts, int(kv.seg)
    else:
        k, v, seg = kv.keys, kv.values, 0
        kp, vp = [(k.codes, k.scale, k.zero_point)], [(v.codes, v.scale, v.zero_point)]

    def side(lay, ps):
        zp = [p[2] for p in ps] if lay.has_zero_point else []
        return [p[0] for p in ps], [p[1] for p in ps], zp, lay.lut(q.device), layout_id(lay)
    return (q, *side(k.layout, kp), *side(v.layout, vp), mask, seg)


def quantized_attention_op(q, kv, mask=None):
    """``torch.ops.lessmem.quantized_attention`` on ``kv`` (the dispatcher picks the backend)."""
    return torch.ops.lessmem.quantized_attention(*op_args(q, kv, mask))


@torch.library.register_fake("lessmem::quantized_attention", lib=LIB)
def _fake(q, k_codes, k_scale, k_zero_point, k_lut, k_layout, v_codes, v_scale, v_zero_point, v_lut,
          v_layout, mask, seg):
    B, Hq, Tq, D = q.shape
    return q.new_empty((B, Hq, Tq, D), dtype=torch.float32), q.new_empty((B, Hq, Tq), dtype=torch.float32)


def _triton_backend(q, k_codes, k_scale, k_zero_point, k_lut, k_layout, v_codes, v_scale, v_zero_point,
                    v_lut, v_layout, mask, seg):
    from . import attention_triton  # imported on first CUDA call: triton costs ~0.25 s to import

    return attention_triton.attention_parts(
        q, layout_of(k_layout), parts(k_codes, k_scale, k_zero_point), layout_of(v_layout),
        parts(v_codes, v_scale, v_zero_point), k_lut, v_lut, mask, seg)
