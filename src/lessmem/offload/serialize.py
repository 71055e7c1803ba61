"""Block serialization: a dict of tensors (or QTensors) <-> checksummed bytes.

A *block* is a mapping ``name -> torch.Tensor | QTensor`` (e.g. the quantized keys and
values of 256 tokens of one layer). On disk and in Redis it travels as::

    magic   8 bytes  b"LMKVBLK2"
    hlen    u32      length of the JSON header
    plen    u64      length of the payload
    crc     u32      CRC-32 over (header JSON || payload)
    header  hlen bytes of UTF-8 JSON: {"v": 1, "tensors": [...], "meta": {...}}
    payload plen bytes: every tensor's raw bytes, each starting at a 64-byte boundary

Each tensor entry records name, dtype, shape, offset and nbytes; a QTensor is stored as
its component tensors plus its format, shape, dtype and group metadata, so
``unpack_block(pack_block(b))`` is bit-exact. Any mismatch (magic, lengths, CRC,
table) raises :class:`CorruptBlockError` — corrupted bytes are never returned as data.
CRC-32 (zlib, ~4x faster than blake2b here, and it releases the GIL so a prefetch
thread verifies while attention computes) detects every burst error up to 32 bits and
random corruption with probability 1 − 2⁻³²; it guards against storage faults, not
against an adversary (keys, not checksums, carry identity).

Example:
    >>> import torch
    >>> from lessmem.offload.serialize import pack_block, unpack_block
    >>> blob = pack_block({"k": torch.arange(6, dtype=torch.int16).reshape(2, 3)}, meta={"layer": 3})
    >>> block, meta = unpack_block(blob)
    >>> block["k"].tolist(), meta
    ([[0, 1, 2], [3, 4, 5]], {'layer': 3})
"""

from __future__ import annotations

import functools
import json
import math
import struct
import zlib
from typing import Mapping

import torch

from lessmem.formats.granularity import Granularity, GroupMeta
from lessmem.formats.qtensor import QFormat, QTensor

MAGIC = b"LMKVBLK2"
VERSION = 2
_FIXED = struct.Struct("<8sIQI")  # magic, hlen, plen, crc32
HEADER_BYTES = _FIXED.size
_ALIGN = 64

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)}


class CorruptBlockError(ValueError):
    """The bytes of a block do not verify (bad magic, length, checksum or table)."""


def block_nbytes(block: Mapping[str, torch.Tensor | QTensor]) -> int:
    """Bytes held by the tensors of a block (QTensors count codes + metadata)."""
    if not isinstance(block, Mapping):
        raise ValueError(f"a block is a dict of tensors, got {type(block).__name__}")
    total = 0
    for name, v in block.items():
        if isinstance(v, QTensor):
            total += v.nbytes
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        else:
            raise ValueError(f"block entry {name!r} is a {type(v).__name__}; allowed: torch.Tensor, QTensor")
    return total


def _dtype_name(dt: torch.dtype) -> str:
    name = str(dt).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dt} cannot be serialized; allowed: {', '.join(sorted(_DTYPES))}")
    return name


def _flatten(block: Mapping) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """Block -> flat (name, tensor) list + description of the QTensors in it."""
    flat: list[tuple[str, torch.Tensor]] = []
    qdesc: dict[str, dict] = {}
    for name, v in block.items():
        if not isinstance(name, str) or "#" in name:
            raise ValueError(f"block entry name {name!r} must be a str without '#'")
        if isinstance(v, QTensor):
            parts = {"codes": v.codes, "scale": v.scale, "zero_point": v.zero_point}
            parts.update({f"extra.{k}": t for k, t in v.extra.items()})
            for p, t in parts.items():
                if t is not None:
                    flat.append((f"{name}#{p}", t))
            f = v.fmt
            qdesc[name] = {
                "fmt": {"kind": f.kind, "bits": f.bits, "granularity": f.granularity.to_dict(),
                        "symmetric": f.symmetric, "variant": f.variant},
                "shape": list(v.shape), "dtype": _dtype_name(v.dtype),
                "meta": None if v.meta is None else
                [list(v.meta.shape), list(v.meta.perm), list(v.meta.permuted_shape)],
                "parts": [p for p, t in parts.items() if t is not None],
            }
        elif isinstance(v, torch.Tensor):
            flat.append((name, v))
        else:
            raise ValueError(f"block entry {name!r} is a {type(v).__name__}; allowed: torch.Tensor, QTensor")
    return flat, qdesc


def pack_block(block: Mapping[str, torch.Tensor | QTensor], meta: dict | None = None) -> bytes:
    """Serialize a block (and a small JSON-able ``meta`` dict) to checksummed bytes."""
    flat, qdesc = _flatten(block)
    table, chunks, off = [], [], 0
    for name, t in flat:
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        pad = (-off) % _ALIGN
        if pad:
            chunks.append(b"\0" * pad)
            off += pad
        table.append({"name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                      "offset": off, "nbytes": len(raw)})
        chunks.append(raw)
        off += len(raw)
    header = json.dumps({"v": VERSION, "tensors": table, "q": qdesc, "meta": meta or {}},
                        separators=(",", ":"), sort_keys=True).encode()
    payload = b"".join(chunks)
    crc = zlib.crc32(payload, zlib.crc32(header))
    return _FIXED.pack(MAGIC, len(header), len(payload), crc) + header + payload


def read_header(prefix: bytes) -> tuple[int, int, int]:
    """(header length, payload length, crc) from the first ``HEADER_BYTES`` of a blob."""
    if len(prefix) < HEADER_BYTES:
        raise CorruptBlockError(f"block truncated: {len(prefix)} bytes < {HEADER_BYTES}-byte header")
    magic, hlen, plen, crc = _FIXED.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}; expected {MAGIC!r}")
    return hlen, plen, crc


@functools.lru_cache(maxsize=4096)
def _parse_header(header: bytes, plen: int) -> tuple[tuple, dict, dict]:
    """The tensor table ``(name, dtype, shape, offset, nbytes)``, QTensor descriptions and
    meta of a header, checked against the payload length. Cached: a tier re-reads the
    same blocks every decoding step, and parsing is most of a small block's CPU cost
    (the CRC over the header and payload is still checked on every read)."""
    try:
        head = json.loads(header)
        if head.get("v") != VERSION:
            raise CorruptBlockError(f"block version {head.get('v')!r}; this reader knows {VERSION}")
        table = []
        for e in head["tensors"]:
            o, n, dt = e["offset"], e["nbytes"], _DTYPES[e["dtype"]]
            shape = tuple(e["shape"])
            if o < 0 or o + n > plen:
                raise CorruptBlockError(f"tensor {e['name']!r} [{o}, {o + n}) outside payload of {plen}")
            if n % dt.itemsize or n // dt.itemsize != math.prod(shape):
                raise CorruptBlockError(f"tensor {e['name']!r}: {n} bytes do not hold {list(shape)} {dt}")
            table.append((e["name"], dt, shape, o, n))
        return tuple(table), head["q"], head["meta"]
    except CorruptBlockError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptBlockError(f"block table unreadable: {e}") from e


def unpack_block(blob: bytes | bytearray | memoryview) -> tuple[dict, dict]:
    """Verify and deserialize; returns ``(block, meta)``. Raises CorruptBlockError.

    A ``bytearray`` is used in place (the tensors view into it, no copy); read-only
    bytes are copied once."""
    view = memoryview(blob)
    hlen, plen, crc = read_header(view[:HEADER_BYTES])
    if len(view) != HEADER_BYTES + hlen + plen:
        raise CorruptBlockError(
            f"block length {len(view)} != {HEADER_BYTES + hlen + plen} (header {hlen} + payload {plen})")
    body = view[HEADER_BYTES:]
    if zlib.crc32(body) != crc:
        raise CorruptBlockError("block checksum mismatch")
    try:
        table, qdesc, meta = _parse_header(bytes(body[:hlen]), plen)
        if not isinstance(blob, bytearray):
            blob = bytearray(view)
        start = HEADER_BYTES + hlen
        flat = {}
        for name, dt, shape, o, n in table:  # each tensor views the blob (no copy)
            flat[name] = (torch.frombuffer(blob, dtype=dt, offset=start + o, count=n // dt.itemsize)
                          .view(shape) if n else torch.empty(shape, dtype=dt))
        if not qdesc:
            return flat, dict(meta)
        block: dict = {}
        for name, t in flat.items():
            if "#" not in name:
                block[name] = t
        for name, q in qdesc.items():
            f = q["fmt"]
            fmt = QFormat(f["kind"], f["bits"], Granularity.from_dict(f["granularity"]),
                          f["symmetric"], f["variant"])
            gm = None if q["meta"] is None else GroupMeta(*(tuple(x) for x in q["meta"]))
            get = lambda p, name=name: flat.get(f"{name}#{p}")  # noqa: E731
            block[name] = QTensor(
                codes=get("codes"), scale=get("scale"), zero_point=get("zero_point"), fmt=fmt,
                shape=tuple(q["shape"]), dtype=_DTYPES[q["dtype"]], meta=gm,
                extra={p[6:]: get(p) for p in q["parts"] if p.startswith("extra.")})
        # restore the caller's entry order
        order = [e[0].split("#")[0] for e in table]
        block = {k: block[k] for k in dict.fromkeys(order)}
        return block, dict(meta)
    except CorruptBlockError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CorruptBlockError(f"block table unreadable: {e}") from e
