"""Checking and reading the header of a ``.gguf`` file, without trusting it.

A GGUF file is a header followed by the tensor data::

    "GGUF"  version (u32, 2 or 3)  tensor_count (u64)  kv_count (u64)
    kv_count times:      key (string)  value_type (u32)  value
    tensor_count times:  name (string)  n_dims (u32)  dims (u64 × n_dims)  ggml_type (u32)
                         offset (u64, from the start of the data section)
    padding to ``general.alignment`` (default 32), then the data section

with ``string = length (u64) + UTF-8 bytes`` and an array value ``= element_type (u32)
+ count (u64) + elements``. Numbers are little-endian (a big-endian file is recognised by
its byte-swapped version, as the ``gguf`` package does).

``read_gguf_header(path)`` walks all of it and returns a ``GGUFHeader``; anything that
does not fit (a wrong magic, a truncated field, a count or a length larger than the
bytes left in the file, an unknown value or tensor type, a tensor whose bytes lie past
the end of the file …) raises ``InvalidGGUFError``, a ``ValueError`` whose message reads
``not a valid GGUF file: <path>: <what is wrong>``. Every count and length is checked
against the bytes left before anything is read or allocated, so a header claiming 2⁶⁴
tensors costs nothing. ``open_gguf_reader(path)`` checks the file this way and then
opens it with the ``gguf`` package's ``GGUFReader`` (what transformers and the
explorer read tensors with), so its errors carry the same prefix.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "bad.gguf")
    >>> _ = open(path, "wb").write(b"GGUF" + bytes(6))
    >>> try:
    ...     read_gguf_header(path)
    ... except ValueError as e:
    ...     print(str(e).replace(path, "bad.gguf"))
    not a valid GGUF file: bad.gguf: the file has 10 bytes, fewer than the 24 of a GGUF header
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml tensors have at most 4 dimensions
MAX_ARRAY_DEPTH = 8  # arrays of arrays: deeper than this is not a real file

# value type id -> (name, struct code); 8 string and 9 array are read by hand
_SCALARS = {0: ("uint8", "B"), 1: ("int8", "b"), 2: ("uint16", "H"), 3: ("int16", "h"),
            4: ("uint32", "I"), 5: ("int32", "i"), 6: ("float32", "f"), 7: ("bool", "?"),
            10: ("uint64", "Q"), 11: ("int64", "q"), 12: ("float64", "d")}
_STRING, _ARRAY = 8, 9
_VALUE_NAMES = {**{k: v[0] for k, v in _SCALARS.items()}, _STRING: "string", _ARRAY: "array"}

# ggml tensor type id -> (name, elements per block, bytes per block), as in ggml.h
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}


class InvalidGGUFError(ValueError):
    """A file that is not a well-formed GGUF file; the message names the file and the fault."""

    def __init__(self, path, what: str):
        super().__init__(f"not a valid GGUF file: {os.fspath(path)}: {what}")
        self.path, self.what = os.fspath(path), what


@dataclass(frozen=True)
class GGUFArray:
    """An array value of the header, summarised (its elements are skipped, not kept)."""

    element_type: str
    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes are: ``shape`` in ggml order (fastest dimension first, the
    reverse of torch's), ``offset`` from the start of the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A checked GGUF header: metadata (arrays summarised as ``GGUFArray``) and tensors."""

    path: str
    version: int
    alignment: int
    data_offset: int
    file_size: int
    metadata: dict = field(repr=False)
    tensors: tuple[GGUFTensorInfo, ...] = field(repr=False)


class _Cursor:
    """Reads the header front to back; every read is bounds-checked against the file end."""

    def __init__(self, buf, path, size: int):
        self.buf, self.path, self.size, self.pos, self.order = buf, path, size, 0, "<"

    def fail(self, what: str):
        raise InvalidGGUFError(self.path, what)

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> int:
        """Skip ``n`` bytes (checked); returns where they start."""
        if n > self.left():
            self.fail(f"{what} at byte {self.pos} needs {n} bytes but the file ends "
                      f"{self.left()} bytes later (truncated?)")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, code: str, what: str):
        fmt = self.order + code
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, item_bytes: int, width: str = "Q") -> int:
        """A count (u64 or u32) that must fit in the bytes left at ``item_bytes`` each at least."""
        n = self.scalar(width, what)
        if n * item_bytes > self.left():
            self.fail(f"{what} is {n}, more than the {self.left()} bytes left in the file can hold")
        return n

    def raw_string(self, what: str) -> bytes:
        n = self.count(f"{what} length", 1)
        start = self.take(n, what)
        return bytes(self.buf[start:start + n])

    def text(self, what: str) -> str:
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} {raw[:40]!r} is not UTF-8 text")


def _value(cur: _Cursor, vtype: int, what: str, depth: int = 0):
    """One metadata value of type ``vtype`` (arrays skipped and summarised)."""
    if vtype in _SCALARS:
        return cur.scalar(_SCALARS[vtype][1], what)
    if vtype == _STRING:
        return cur.raw_string(what).decode("utf-8", "replace")
    if vtype != _ARRAY:
        cur.fail(f"{what} has value type {vtype}; allowed: "
                 + ", ".join(f"{k} ({v})" for k, v in sorted(_VALUE_NAMES.items())))
    if depth >= MAX_ARRAY_DEPTH:
        cur.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
    etype = cur.scalar("I", f"{what} element type")
    if etype in _SCALARS:
        size = struct.calcsize(_SCALARS[etype][1])
        n = cur.count(f"{what} length", size)
        cur.take(n * size, f"{what} elements")
    elif etype == _STRING:
        n = cur.count(f"{what} length", 8)  # every string has its 8-byte length
        for _ in range(n):
            cur.take(cur.count(f"{what} string length", 1), f"{what} string")
    elif etype == _ARRAY:
        n = cur.count(f"{what} length", 12)  # every inner array has its type and length
        for i in range(n):
            _value(cur, _ARRAY, f"{what}[{i}]", depth + 1)
    else:
        cur.fail(f"{what} has element type {etype}; allowed: "
                 + ", ".join(f"{k} ({v})" for k, v in sorted(_VALUE_NAMES.items())))
    return GGUFArray(_VALUE_NAMES[etype], n)


def _metadata(cur: _Cursor, n_kv: int) -> dict:
    meta: dict = {}
    for i in range(n_kv):
        key = cur.text(f"metadata key {i}")
        if key in meta:
            cur.fail(f"metadata key {key!r} appears twice")
        vtype = cur.scalar("I", f"value type of {key!r}")
        if key == "general.alignment" and vtype != 4:
            cur.fail(f"general.alignment has value type {_VALUE_NAMES.get(vtype, vtype)}; "
                     "allowed: uint32")
        meta[key] = _value(cur, vtype, f"metadata {key!r}")
    return meta


def _tensor_info(cur: _Cursor, i: int):
    """(name, ggml-order shape, type id, data offset) of tensor ``i``, shape and type checked."""
    name = cur.text(f"tensor {i} name")
    n_dims = cur.scalar("I", f"tensor {name!r} dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        cur.fail(f"tensor {name!r} has {n_dims} dimensions; allowed: 1 to {MAX_DIMS}")
    shape = tuple(cur.scalar("Q", f"tensor {name!r} dimension {d}") for d in range(n_dims))
    ggml_type = cur.scalar("I", f"tensor {name!r} type")
    if ggml_type not in GGML_TYPES:
        cur.fail(f"tensor {name!r} has ggml type {ggml_type}; allowed: "
                 + ", ".join(f"{k} ({v[0]})" for k, v in sorted(GGML_TYPES.items())))
    offset = cur.scalar("Q", f"tensor {name!r} data offset")
    return name, shape, ggml_type, offset


def _tensor_bytes(cur: _Cursor, name: str, shape, ggml_type: int) -> int:
    type_name, block, type_size = GGML_TYPES[ggml_type]
    numel = 1
    for d in shape:  # at most 4 factors: an exact Python int, checked against the file below
        numel *= d
    if shape[0] % block:
        cur.fail(f"tensor {name!r} of type {type_name} has a first dimension of {shape[0]}, "
                 f"not a multiple of its block size {block}")
    return numel // block * type_size


def _tensors(cur: _Cursor, n_tensors: int, alignment: int) -> tuple[int, tuple]:
    """Read the tensor infos, then check each tensor's bytes against the data section."""
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    if data_offset > cur.size and infos:
        cur.fail(f"the data section would start at byte {data_offset}, past the end of the "
                 f"file ({cur.size} bytes)")
    out, names = [], set()
    for name, shape, ggml_type, offset in infos:
        if name in names:
            cur.fail(f"tensor {name!r} appears twice")
        names.add(name)
        nbytes = _tensor_bytes(cur, name, shape, ggml_type)
        if offset % alignment:
            cur.fail(f"tensor {name!r} starts at data offset {offset}, not a multiple of the "
                     f"alignment {alignment}")
        if data_offset + offset + nbytes > cur.size:
            cur.fail(f"tensor {name!r} needs bytes {data_offset + offset}..{data_offset + offset + nbytes} "
                     f"but the file ends at {cur.size} (truncated?)")
        out.append(GGUFTensorInfo(name, shape, ggml_type, GGML_TYPES[ggml_type][0],
                                  data_offset + offset, nbytes))
    return data_offset, tuple(out)


def _alignment(cur: _Cursor, meta: dict) -> int:
    a = meta.get("general.alignment", DEFAULT_ALIGNMENT)  # a uint32 (checked in _metadata)
    if a <= 0 or a & (a - 1):
        cur.fail(f"general.alignment is {a}; allowed: a power of two")
    return a


def _parse(cur: _Cursor) -> GGUFHeader:
    if cur.size < 24:
        cur.fail(f"the file has {cur.size} bytes, fewer than the 24 of a GGUF header")
    if bytes(cur.buf[:4]) != MAGIC:
        cur.fail(f"it starts with {bytes(cur.buf[:4])!r}, not the GGUF magic {MAGIC!r}")
    cur.pos = 4
    version = cur.scalar("I", "version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        cur.order = ">"
        version = struct.unpack_from(">I", cur.buf, 4)[0]
    if version not in VERSIONS:
        cur.fail(f"version {version}; allowed: {', '.join(map(str, VERSIONS))}")
    n_tensors = cur.count("tensor count", 32)  # name length, a dim, type, offset: >= 32 bytes
    n_kv = cur.count("metadata count", 13)  # key length, value type, a value: >= 13 bytes
    meta = _metadata(cur, n_kv)
    alignment = _alignment(cur, meta)
    data_offset, tensors = _tensors(cur, n_tensors, alignment)
    return GGUFHeader(os.fspath(cur.path), version, alignment, data_offset, cur.size, meta, tensors)


def read_gguf_header(path) -> GGUFHeader:
    """Check the whole header of the GGUF file at ``path`` and return it (see the module doc).

    Raises ``InvalidGGUFError`` (a ``ValueError``: ``not a valid GGUF file: <path>: …``) for
    a malformed file, ``OSError`` when it cannot be read at all.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise InvalidGGUFError(path, "the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(buf, path, size))


def open_gguf_reader(path):
    """``gguf.GGUFReader(path)`` after ``read_gguf_header(path)``: a malformed file raises
    ``InvalidGGUFError``, also where only the gguf package notices."""
    read_gguf_header(path)
    import gguf

    try:
        return gguf.GGUFReader(os.fspath(path))
    except (ValueError, KeyError, IndexError, OverflowError, struct.error) as exc:
        raise InvalidGGUFError(path, f"{type(exc).__name__}: {exc}") from exc


__all__ = ["GGUFArray", "GGUFHeader", "GGUFTensorInfo", "InvalidGGUFError", "read_gguf_header",
           "open_gguf_reader", "GGML_TYPES"]
