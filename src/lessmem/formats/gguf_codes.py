"""The integer grid inside GGUF blocks: read a block's scales, re-choose only its codes.

Error-feedback quantizers (GPTQ inside the K-quants, ``weights.gguf_gptq``) fix a block's
scales first, with llama.cpp's own quantizer, and then pick each element's code one
column at a time. They need three things per block type, given here for the five legacy
types (blocks of 32), the five K-quants (super-blocks of 256) and IQ4_NL / IQ4_XS:

- ``grid(raw, t)`` -> ``Grid(d, m, off, qmax, levels)``, ``d``/``m`` ``[R, n]`` float32 per
  element: element e decodes as ``d_e * (u_e - off) - m_e`` for its stored code ``u_e``
  in ``0..qmax`` (``Grid.decode``); the nearest code to a value x is
  ``clip(rint((x + m) / d) + off, 0, qmax)``, the rounding llama.cpp's K-quant
  quantizers end with (``_requant``), so re-choosing the codes of an unchanged block
  gives its own codes back where ``d != 0``. The IQ4 types have no even grid: ``levels``
  (llama.cpp's ``kvalues_iq4nl``) and ``d_e * levels[u_e]``, the nearest level found as
  their quantizer finds it (``best_index_int8`` of ``x / d``);
- ``codes(raw, t)`` -> the stored codes ``u`` ``[R, n]`` (uint8);
- ``with_codes(raw, t, u)`` -> a copy of ``raw`` with only the codes replaced (every code
  of a block type sits in one contiguous byte range, after or before its scales).

``raw`` is one tensor's rows ``[R, row_bytes]`` (whole blocks), ``n`` its columns.

Example:
    >>> import numpy as np
    >>> from lessmem.formats.gguf import quantize_gguf, dequantize_gguf
    >>> x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    >>> raw = quantize_gguf(x, "q4_k")
    >>> g = grid(raw, "q4_k")
    >>> bool(np.array_equal(nearest_codes(x, g, codes(raw, "q4_k")), codes(raw, "q4_k")))
    True
    >>> y = g.d * (codes(raw, "q4_k").astype(np.float32) - g.off) - g.m
    >>> bool(np.allclose(y, dequantize_gguf(raw, "q4_k", (2, 256)).numpy(), atol=1e-6))
    True
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from . import gguf_iquants as I
from . import gguf_kquants as K
from . import gguf_legacy as L
from .gguf_search import _rint

F32 = np.float32


class Grid(NamedTuple):
    d: np.ndarray  # [R, n] step per element (its block's / sub-block's scale)
    m: np.ndarray  # [R, n] offset subtracted after the product (0 for symmetric types)
    off: int  # code of the value 0 of a symmetric type (8 for Q4_0, 4 for Q3_K ...), else 0
    qmax: int  # largest code
    levels: np.ndarray | None = None  # the IQ4 types' value table (u -> level), else None

    def decode(self, u: np.ndarray, dtype=F32) -> np.ndarray:
        """The values codes ``u`` (shaped like ``d``) decode to, computed in ``dtype`` (float32:
        exactly as the decoders compute them)."""
        u = np.asarray(u)
        q = self.levels[u] if self.levels is not None else u.astype(F32) - F32(self.off)
        return self.d.astype(dtype) * q.astype(dtype) - self.m.astype(dtype)


class _Spec(NamedTuple):
    start: int  # the codes' byte range in a block
    stop: int
    pack: Callable[[np.ndarray], np.ndarray]  # codes [B, block] -> bytes [B, stop - start]
    unpack: Callable[[np.ndarray], np.ndarray]  # block bytes [B, size] -> codes [B, block]
    scales: Callable[[np.ndarray], tuple]  # block bytes -> (d [B, S], m [B, S] or None)
    off: int
    qmax: int
    levels: np.ndarray | None = None


def _i8(r: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(r).view(np.int8)


def _legacy(start, stop, bits, signed, affine):
    """Spec of a legacy type: fp16 d at byte 0 (and min at 2), codes from ``start``."""
    qh = bits == 5
    lo = start + (4 if qh else 0)  # nibbles after the 4 bytes of fifth bits

    def pack(u):
        nib = L._nibbles(u)
        return np.concatenate([L._high_bits(u), nib], axis=1) if qh else nib

    def unpack(r):
        u = L._unnibble(r[:, lo:lo + 16])
        return u | (L._unhigh_bits(r[:, start:start + 4]) << 4) if qh else u

    def scales(r):
        return L.fp16_at(r, 0), (-L.fp16_at(r, 2) if affine else None)

    return _Spec(start, stop, pack, unpack, scales, (1 << (bits - 1)) if signed else 0, (1 << bits) - 1)


def _q8_scales(r):
    return L.fp16_at(r, 0), None


SPECS: dict[str, _Spec] = {
    "q4_0": _legacy(2, 18, 4, True, False),
    "q4_1": _legacy(4, 20, 4, False, True),
    "q5_0": _legacy(2, 22, 5, True, False),
    "q5_1": _legacy(4, 24, 5, False, True),
    # Q8_0 keeps llama.cpp's symmetric -127..127 (stored as int8; off 127, qmax 254)
    "q8_0": _Spec(2, 34, lambda u: (u.astype(np.int16) - 127).astype(np.int8).view(np.uint8),
                  lambda r: (_i8(r[:, 2:34]).astype(np.int16) + 127).astype(np.uint8),
                  _q8_scales, 127, 254),
    "q2_k": _Spec(16, 80, K._pack_2bit, lambda r: K._unpack_2bit(r[:, 16:80]), K.scales_q2_k, 0, 3),
    "q3_k": _Spec(0, 96, K.codes_q3_k, K.uncodes_q3_k, lambda r: (K.scales_q3_k(r), None), 4, 7),
    "q4_k": _Spec(16, 144, K.codes_q4_k, K.uncodes_q4_k, K.scales_q45_k, 0, 15),
    "q5_k": _Spec(16, 176, K.codes_q5_k, K.uncodes_q5_k, K.scales_q45_k, 0, 31),
    "q6_k": _Spec(0, 192, K.codes_q6_k, K.uncodes_q6_k, lambda r: (K.scales_q6_k(r), None), 32, 63),
    "iq4_nl": _Spec(2, 18, I._pack_nibbles, lambda r: I._unpack_nibbles(r[:, 2:18]),
                    lambda r: (I._fp16_at(r, 0), None), 0, 15, I._V),
    "iq4_xs": _Spec(8, 136, I._pack_nibbles, lambda r: I._unpack_nibbles(r[:, 8:136]),
                    lambda r: (I.scales_iq4_xs(r), None), 0, 15, I._V),
}


def _spec(qtype):
    from .gguf import gguf_type

    t = gguf_type(qtype)
    if t.name not in SPECS:
        raise ValueError(f"GGUF type {t.name.upper()} has no integer grid to re-choose codes on; "
                         f"allowed: {', '.join(n.upper() for n in SPECS)}")
    return t, SPECS[t.name]


def _blocks(raw: np.ndarray, t) -> np.ndarray:
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % t.type_size:
        raise ValueError(f"raw {t.name.upper()} rows must be [rows, k * {t.type_size}] bytes, got "
                         f"shape {tuple(raw.shape)}")
    return raw.reshape(-1, t.type_size)


def grid(raw: np.ndarray, qtype) -> Grid:
    """Per-element scale and offset of ``raw``'s blocks (see the module doc)."""
    t, s = _spec(qtype)
    b = _blocks(raw, t)
    d, m = s.scales(b)  # [B, S] per sub-block (S = 1 for legacy types)
    rep = t.block_size // d.shape[1]
    d = np.repeat(d, rep, axis=1)
    m = np.zeros_like(d) if m is None else np.repeat(m, rep, axis=1)
    rows = raw.shape[0]
    return Grid(d.reshape(rows, -1).astype(F32), m.reshape(rows, -1).astype(F32), s.off, s.qmax, s.levels)


def codes(raw: np.ndarray, qtype) -> np.ndarray:
    """The stored codes ``u`` (0..qmax) of ``raw``, ``[rows, n]`` uint8."""
    t, s = _spec(qtype)
    return s.unpack(_blocks(raw, t)).astype(np.uint8).reshape(raw.shape[0], -1)


def with_codes(raw: np.ndarray, qtype, u: np.ndarray) -> np.ndarray:
    """A copy of ``raw`` whose codes are ``u`` ([rows, n], each 0..qmax); scales kept."""
    t, s = _spec(qtype)
    b = _blocks(raw, t).copy()
    u = np.asarray(u)
    if u.size != b.shape[0] * t.block_size:
        raise ValueError(f"codes have {u.size} elements; raw holds {b.shape[0] * t.block_size}")
    if u.size and (int(u.min()) < 0 or int(u.max()) > s.qmax):
        raise ValueError(f"{t.name.upper()} codes must lie in 0..{s.qmax}, got {int(u.min())}..{int(u.max())}")
    b[:, s.start:s.stop] = s.pack(u.reshape(-1, t.block_size).astype(np.uint8))
    return b.reshape(raw.shape)


def nearest_codes(x: np.ndarray, g: Grid, keep: np.ndarray) -> np.ndarray:
    """The code nearest to each ``x`` on grid ``g`` (same shape as ``g.d``, or a column of
    it); where a step is 0 every code decodes alike and ``keep``'s code stays."""
    if g.levels is not None:  # IQ4: the level nearest x / d, as llama.cpp's quantizer picks it
        u = I._best_index(I._inv(g.d) * np.asarray(x, dtype=F32))
        return np.where(g.d != 0, u, keep).astype(np.uint8)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(g.d != 0, (np.asarray(x, dtype=F32) + g.m) / g.d, F32(0))
    u = np.clip(_rint(v) + g.off, 0, g.qmax)
    return np.where(g.d != 0, u, keep).astype(np.uint8)


__all__ = ["Grid", "SPECS", "grid", "codes", "with_codes", "nearest_codes"]
