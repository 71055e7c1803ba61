"""How one side (keys or values) of a quantized KV history lies in memory: :class:`KVLayout`.

A layout is the one description of the stored bytes that every reader and writer shares:
the KV encoder (``lessmem.kvcache.codec``) packs codes with it, the torch fallback and the
cache's dequantized path unpack with it, the C++ attention kernel receives its parameters
(``lessmem.kernels.attention``), and the test oracle (``lessmem.kernels.attention_reference``)
reads the same fields but decodes with its own plain bit arithmetic.

One side of a history of T tokens (B sequences, H heads, head dim D) is stored as up to
three parts, tokens along dim 2:

- ``codes``: uint8 ``[B, H, T, row_bytes]``, one packed row of D codes per token
  (``row_bytes = D · bits / 8``). Packing ``"split"`` (bits dividing 8): byte j holds the
  codes of channels ``j, j + D/p, j + 2·D/p, …`` (p = 8 / bits codes per byte, the lowest
  bits first), so unpacking is one contiguous, vectorizable loop per slot; at 8 bits a
  byte is a code. Packing ``"stream"`` (any bits): the row's codes as a little-endian bit
  stream (as :func:`~lessmem.formats.packing.pack_bits` writes it).
  Packing ``"mixed"`` (``channel_bits`` given: bits per channel, non-increasing): the row
  is the runs of equal bits one after another, each a multiple of 8 channels packed as a
  bit stream (8 codes of b bits in b bytes: one load, per-lane shifts); a 0-bit run stores
  no bytes and its codes are 0 (its channels dequantize to ``−scale · z``, the group's
  constant).
- ``scale``: fp16 ``[B, H, ceil(T / tg), D / dg]``, one per group of ``tg`` tokens × ``dg``
  channels (``token_group`` × ``channel_group``).
- ``zero_point``: uint8, the shape of ``scale``; only when ``has_zero_point``.

A code ``c`` dequantizes as ``x = scale · (lut[c] − z)``: ``lut`` is ``levels`` (a table of
2^bits floats) or the code itself when ``levels`` is None; ``z`` is the stored zero point,
or ``zero_const`` when there is none.

Example:
    >>> import torch
    >>> lay = KVLayout(bits=4, head_dim=4, channel_group=4)
    >>> codes = lay.pack(torch.tensor([[[[1, 3, 2, 4]]]], dtype=torch.uint8))
    >>> [hex(b) for b in codes.flatten().tolist()]   # channel 0 low nibble, channel 2 high
    ['0x21', '0x43']
    >>> lay.unpack(codes).tolist()
    [[[[1, 3, 2, 4]]]]
    >>> lay.dequantize(codes, torch.full((1, 1, 1, 1), 0.5).half()).tolist()
    [[[[0.5, 1.5, 1.0, 2.0]]]]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .packing import pack_bits, unpack_bits

PACKINGS = ("split", "stream", "mixed")
MAX_RUNS = 4  # runs of equal bits in a mixed row (the kernels receive them in one int64)
PARTS = ("codes", "scale", "zero_point")


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r}; allowed: an integer >= 1")


@dataclass(frozen=True)
class KVLayout:
    """The stored layout of one side of a quantized KV history (see the module doc).

    ``packing`` defaults to ``"split"`` when ``bits`` divides 8, else ``"stream"``.
    """

    bits: int
    head_dim: int
    channel_group: int
    token_group: int = 1
    has_zero_point: bool = False
    zero_const: float = 0.0
    levels: tuple[float, ...] | None = None
    packing: str | None = None
    channel_bits: tuple[int, ...] | None = None
    _luts: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    CODES_DTYPE: ClassVar[torch.dtype] = torch.uint8
    SCALE_DTYPE: ClassVar[torch.dtype] = torch.float16
    ZERO_POINT_DTYPE: ClassVar[torch.dtype] = torch.uint8

    def __post_init__(self):
        if self.channel_bits is not None:
            self._check_channel_bits()
        if isinstance(self.bits, bool) or self.bits not in range(1, 9):
            raise ValueError(f"bits={self.bits!r}; allowed: 1 to 8")
        for name in ("head_dim", "channel_group", "token_group"):
            _positive_int(name, getattr(self, name))
        D, bits = self.head_dim, self.bits
        if D % self.channel_group:
            raise ValueError(f"channel_group={self.channel_group} does not divide head_dim={D}; "
                             "allowed: a divisor of head_dim")
        if self.channel_bits is not None:
            self._check_runs()
            return
        if (D * bits) % 8:
            raise ValueError(f"head_dim={D} at {bits} bits is not a whole number of bytes per row; "
                             "allowed: head_dim · bits a multiple of 8")
        packing = self.packing if self.packing is not None else ("split" if 8 % bits == 0 else "stream")
        if packing not in PACKINGS[:2]:
            raise ValueError(f"packing={packing!r}; allowed: {', '.join(PACKINGS[:2])} ('mixed' comes "
                             "with channel_bits)")
        if packing == "split" and 8 % bits:
            raise ValueError(f"packing 'split' needs bits dividing 8, got bits={bits}; "
                             "allowed: 1, 2, 4, 8 (or packing 'stream')")
        object.__setattr__(self, "packing", packing)
        if self.levels is not None:
            levels = tuple(float(v) for v in self.levels)
            if len(levels) != 2**bits:
                raise ValueError(f"levels has {len(levels)} entries; allowed: 2**bits = {2**bits}")
            object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "zero_const", float(self.zero_const))

    def _check_channel_bits(self) -> None:
        cb = self.channel_bits
        if not isinstance(cb, (tuple, list)) or not all(
                isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 8 for b in cb):
            raise ValueError(f"channel_bits={cb!r}; allowed: a tuple of integers 0 to 8, one per channel")
        cb = tuple(cb)
        object.__setattr__(self, "channel_bits", cb)
        if self.bits != max(cb, default=0):
            raise ValueError(f"bits={self.bits!r} with channel_bits; allowed: their largest, {max(cb, default=0)}")

    def _check_runs(self) -> None:
        cb, D = self.channel_bits, self.head_dim
        if len(cb) != D:
            raise ValueError(f"channel_bits has {len(cb)} entries; allowed: one per channel, head_dim={D}")
        if any(a < b for a, b in zip(cb, cb[1:], strict=False)):
            raise ValueError(f"channel_bits={cb!r} rise; allowed: non-increasing bits (channels are stored "
                             "sorted by their bits)")
        if self.packing not in (None, "mixed"):
            raise ValueError(f"packing={self.packing!r} with channel_bits; allowed: 'mixed'")
        if self.levels is not None or not self.has_zero_point or self.token_group < 2 or self.channel_group != 1:
            raise ValueError("channel_bits need per-channel groups with zero points (token_group > 1, "
                             "channel_group 1, has_zero_point, no levels): the uint format per channel")
        runs = self.runs
        if len(runs) > MAX_RUNS:
            raise ValueError(f"channel_bits make {len(runs)} runs of equal bits; allowed: at most {MAX_RUNS}")
        for b, n in runs:
            if b and n % 8:
                raise ValueError(f"a run of {n} channels at {b} bits; allowed: runs of a multiple of 8 "
                                 "channels (0-bit runs: any number)")
        object.__setattr__(self, "packing", "mixed")

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """``(bits, channels)`` of each run of equal bits in the row (one run when uniform)."""
        if self.channel_bits is None:
            return ((self.bits, self.head_dim),)
        out: list[list[int]] = []
        for b in self.channel_bits:
            if out and out[-1][0] == b:
                out[-1][1] += 1
            else:
                out.append([b, 1])
        return tuple((b, n) for b, n in out)

    @property
    def mean_bits(self) -> float:
        """Code bits per channel (the mean of ``channel_bits`` when they differ)."""
        return self.row_bytes * 8 / self.head_dim

    @property
    def kernel_bits(self) -> int:
        """The bits as the compiled kernels receive them: ``bits``, or for a mixed row its
        runs in one int64, 14 bits a run from the lowest: run bits + 16 · channels."""
        if self.channel_bits is None:
            return self.bits
        return sum((b + 16 * n) << (14 * i) for i, (b, n) in enumerate(self.runs))

    @functools.cached_property
    def _run_layouts(self):
        """(byte offset, channel offset, layout of the run or None for 0 bits) per run (made
        once per layout: a block's pack and every dequantized read use them)."""
        out, byte, ch = [], 0, 0
        for b, n in self.runs:
            out.append((byte, ch, KVLayout(bits=b, head_dim=n, channel_group=1, packing="stream") if b else None))
            byte += n * b // 8
            ch += n
        return out

    # ---- sizes and part names ---------------------------------------------------
    @property
    def row_bytes(self) -> int:
        """Bytes of one token's packed code row."""
        if self.channel_bits is not None:
            return sum(self.channel_bits) // 8
        return self.head_dim * self.bits // 8

    @property
    def parts(self) -> tuple[str, ...]:
        """Names of the stored parts: ``codes``, ``scale`` and, if stored, ``zero_point``."""
        return PARTS if self.has_zero_point else PARTS[:2]

    def tokens_per_row(self, part: str) -> int:
        """Tokens that share one row (along dim 2) of ``part``: 1 for codes, tg otherwise."""
        if part not in PARTS:
            raise ValueError(f"part={part!r}; allowed: {', '.join(PARTS)}")
        return 1 if part == "codes" else self.token_group

    def part_shape(self, part: str, batch: int, heads: int, tokens: int) -> tuple[int, int, int, int]:
        """Shape of ``part`` for ``tokens`` tokens of ``batch`` × ``heads`` streams."""
        rows = -(-tokens // self.tokens_per_row(part))
        width = self.row_bytes if part == "codes" else self.head_dim // self.channel_group
        return (batch, heads, rows, width)

    # ---- codes --------------------------------------------------------------------
    def pack(self, u: torch.Tensor) -> torch.Tensor:
        """uint8 codes ``[..., D]`` (each < 2^bits) -> packed rows ``[..., row_bytes]``."""
        if u.shape[-1] != self.head_dim:
            raise ValueError(f"codes have {u.shape[-1]} channels; allowed: head_dim={self.head_dim}")
        u = u.to(self.CODES_DTYPE)
        if self.packing == "mixed":
            rows = [lay.pack(u[..., c:c + lay.head_dim]) for _, c, lay in self._run_layouts if lay]
            return torch.cat(rows, -1) if rows else u[..., :0].contiguous()
        if self.bits == 8:
            return u.contiguous()
        if self.packing == "split":  # byte j = Σ_i code[i·D/p + j] << (bits·i)
            n = self.row_bytes
            out = u[..., :n].clone()
            for i in range(1, 8 // self.bits):
                out |= u[..., i * n:(i + 1) * n] << (self.bits * i)
            return out
        return pack_bits(u, self.bits).view(*u.shape[:-1], self.row_bytes)

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        """int64 codes ``[..., D]`` from packed rows ``[..., row_bytes]``."""
        if codes.shape[-1] != self.row_bytes:
            raise ValueError(f"code rows of {codes.shape[-1]} bytes; allowed: row_bytes={self.row_bytes}")
        if self.packing == "mixed":
            parts = [lay.unpack(codes[..., o:o + lay.row_bytes]) if lay else
                     torch.zeros(*codes.shape[:-1], n, dtype=torch.long, device=codes.device)
                     for (o, _, lay), (_, n) in zip(self._run_layouts, self.runs, strict=True)]
            return torch.cat(parts, -1)
        if self.bits == 8:
            return codes.long()
        lead = codes.shape[:-1]
        if self.packing == "split":  # [..., p, D/p]: slot i holds channels i·D/p + j
            shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=codes.device)
            slots = (codes.unsqueeze(-2) >> shifts[:, None]) & ((1 << self.bits) - 1)
            return slots.reshape(*lead, self.head_dim).long()
        n = codes.numel() // self.row_bytes * self.head_dim
        return unpack_bits(codes.contiguous(), self.bits, n).view(*lead, self.head_dim).long()

    def lut(self, device=None) -> torch.Tensor | None:
        """``levels`` as float32 ``[2^bits]`` on ``device`` (cached), or None."""
        if self.levels is None:
            return None
        dev = torch.device(device) if device is not None else torch.device("cpu")
        t = self._luts.get(dev)
        if t is None:
            t = self._luts[dev] = torch.tensor(self.levels, dtype=torch.float32, device=dev)
        return t

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor,
                   zero_point: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[B, H, T, D]`` from the stored parts (tokens along dim 2)."""
        if (zero_point is not None) != self.has_zero_point:
            raise ValueError(f"zero_point {'given' if zero_point is not None else 'missing'}; this layout "
                             f"{'stores' if self.has_zero_point else 'has no'} zero points")
        c = self.unpack(codes)
        T = c.shape[2]
        x = self.lut(c.device)[c] if self.levels is not None else c.float()

        def expand(t):
            t = t.float().repeat_interleave(self.token_group, dim=2)[:, :, :T]
            return t.repeat_interleave(self.channel_group, dim=3)

        z = expand(zero_point) if zero_point is not None else self.zero_const
        return expand(scale) * (x - z)
