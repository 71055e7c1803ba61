"""Damaged ``.gguf`` files: every one gives ``ValueError("not a valid GGUF file: <path>: …")``.

A small valid file is built here field by field (its own writer, checked against the
``gguf`` package's reader), then truncated at every offset, replaced by random bytes,
and corrupted one header field at a time. Each case must raise that ``ValueError`` (no
``struct.error``, ``IndexError``, numpy reshape error or ``MemoryError``), from the
header reader, from ``open_gguf_reader``, from the explorer and from ``lessmem.load``,
without allocating memory in proportion to what the header claims.
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lessmem.formats.gguf_file import (
    GGUFArray,
    InvalidGGUFError,
    open_gguf_reader,
    read_gguf_header,
)

PREFIX = "not a valid GGUF file: "


# ----------------------------------------------------------------- a small GGUF file, by hand

def _u32(v):
    return struct.pack("<I", v)


def _u64(v):
    return struct.pack("<Q", v)


def _kv(name: str, key: str, vtype: int, value: bytes) -> list:
    k = key.encode()
    return [(f"{name}.key_len", _u64(len(k))), (f"{name}.key", k), (f"{name}.type", _u32(vtype)),
            (f"{name}.value", value)]


def _string(s: str) -> bytes:
    return _u64(len(s.encode())) + s.encode()


TENSORS = [  # name, ggml-order shape, ggml type, bytes
    ("tok.weight", (8, 4), 0, np.arange(32, dtype=np.float32).tobytes()),  # F32 [4, 8]
    ("blk.weight", (32, 2), 8, bytes(range(68))),  # Q8_0 [2, 32]: 2 blocks of 34 bytes
]


def _pieces() -> list[tuple[str, bytes]]:
    """The valid file as named pieces, so a test can replace exactly one field."""
    kvs = [
        *_kv("arch", "general.architecture", 8, _string("llama")),
        *_kv("align", "general.alignment", 4, _u32(32)),
        *_kv("count", "test.count", 10, _u64(7)),
        *_kv("scale", "test.scale", 6, struct.pack("<f", 0.5)),
        *_kv("flag", "test.flag", 7, b"\x01"),
        *_kv("tokens", "test.tokens", 9, _u32(8) + _u64(2) + _string("a") + _string("bc")),
        *_kv("ids", "test.ids", 9, _u32(5) + _u64(3) + struct.pack("<3i", 1, 2, 3)),
        *_kv("nested", "test.nested", 9, _u32(9) + _u64(2) + _u32(0) + _u64(2) + b"\x01\x02"
             + _u32(0) + _u64(1) + b"\x03"),
    ]
    pieces = [("magic", b"GGUF"), ("version", _u32(3)), ("n_tensors", _u64(len(TENSORS))),
              ("n_kv", _u64(8)), *kvs]
    offset = 0
    for i, (name, shape, gtype, data) in enumerate(TENSORS):
        pieces += [(f"t{i}.name_len", _u64(len(name))), (f"t{i}.name", name.encode()),
                   (f"t{i}.n_dims", _u32(len(shape)))]
        pieces += [(f"t{i}.dim{d}", _u64(n)) for d, n in enumerate(shape)]
        pieces += [(f"t{i}.type", _u32(gtype)), (f"t{i}.offset", _u64(offset))]
        offset += -(-len(data) // 32) * 32
    head = sum(len(b) for _, b in pieces)
    pieces.append(("pad", bytes(-head % 32)))
    for i, (_, _, _, data) in enumerate(TENSORS):
        pad = bytes(-len(data) % 32) if i + 1 < len(TENSORS) else b""  # no padding at the end
        pieces += [(f"t{i}.data", data + pad)]
    return pieces


def _file(**replace) -> bytes:
    pieces = _pieces()
    names = {n for n, _ in pieces}
    assert set(replace) <= names, set(replace) - names
    return b"".join(replace.get(n, b) for n, b in pieces)


VALID = _file()


def _write(tmp_path, data: bytes, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _expect_invalid(path, what: str | None = None, reader=read_gguf_header):
    """``reader(path)`` raises ValueError with the prefix and path (any other type fails)."""
    with pytest.raises(ValueError) as info:
        reader(path)
    msg = str(info.value)
    assert msg.startswith(f"{PREFIX}{path}: "), msg
    assert isinstance(info.value, InvalidGGUFError)
    if what is not None:
        assert what in msg, msg
    return msg


# ----------------------------------------------------------------- the valid file reads

def test_the_hand_built_file_is_valid_for_us_and_for_the_gguf_package(tmp_path):
    path = _write(tmp_path, VALID, "ok.gguf")
    h = read_gguf_header(path)
    assert (h.version, h.alignment, h.file_size) == (3, 32, len(VALID))
    assert h.metadata["general.architecture"] == "llama"
    assert h.metadata["test.count"] == 7 and h.metadata["test.scale"] == 0.5
    assert h.metadata["test.flag"] is True
    assert h.metadata["test.tokens"] == GGUFArray("string", 2)
    assert h.metadata["test.nested"] == GGUFArray("array", 2)
    assert [(t.name, t.shape, t.type_name, t.nbytes) for t in h.tensors] == [
        ("tok.weight", (8, 4), "F32", 128), ("blk.weight", (32, 2), "Q8_0", 68)]
    gguf = pytest.importorskip("gguf")
    r = open_gguf_reader(path)
    assert isinstance(r, gguf.GGUFReader) and r.data_offset == h.data_offset
    for ours, theirs in zip(h.tensors, r.tensors, strict=True):
        assert (ours.name, ours.offset, ours.nbytes) == (theirs.name, theirs.data_offset, theirs.n_bytes)
    assert np.array_equal(r.tensors[0].data.reshape(-1), np.arange(32, dtype=np.float32))


def test_the_built_in_model_file_reads_like_the_gguf_package_reads_it():
    from lessmem import models

    path = models.cache_dir("models") / models.BUILTIN[models.DEFAULT_MODEL].member
    if not path.is_file():
        pytest.skip("the built-in model is not downloaded")
    gguf = pytest.importorskip("gguf")
    h, r = read_gguf_header(path), gguf.GGUFReader(str(path))
    assert h.data_offset == r.data_offset and len(h.tensors) == len(r.tensors)
    assert all((a.name, a.offset, a.nbytes, list(a.shape)) == (b.name, b.data_offset, b.n_bytes,
                                                              [int(x) for x in b.shape])
               for a, b in zip(h.tensors, r.tensors, strict=True))
    assert h.metadata["llama.block_count"] == 30


# ----------------------------------------------------------------- truncations, random bytes

def test_every_truncation_is_rejected(tmp_path):
    """Cut at every offset short of the last tensor byte (the full file is valid)."""
    for n in range(len(VALID)):
        path = _write(tmp_path, VALID[:n])
        _expect_invalid(path)


@pytest.mark.parametrize("size", [0, 1, 3, 23, 24, 25, 100, 4096, 65536])
@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_are_rejected(tmp_path, size, seed):
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    _expect_invalid(_write(tmp_path, data))
    # the same bytes behind a good magic and version get past the first checks
    _expect_invalid(_write(tmp_path, b"GGUF" + _u32(3) + data))


# ----------------------------------------------------------------- one field corrupted

HUGE = 2**64 - 1
CORRUPT = [  # (field replaced, its new bytes, what the message must say)
    ("magic", b"GGML", "not the GGUF magic"),
    ("version", _u32(1), "version 1; allowed: 2, 3"),
    ("version", _u32(99), "version 99"),
    ("n_tensors", _u64(2**63), "tensor count is 9223372036854775808, more than"),
    ("n_tensors", _u64(HUGE), "tensor count"),
    ("n_tensors", _u64(3), None),  # one tensor more than there are: runs into the data
    ("n_kv", _u64(HUGE), "metadata count"),
    ("n_kv", _u64(9), None),
    ("arch.key_len", _u64(HUGE), "metadata key 0 length"),
    ("arch.key_len", _u64(2**40), "metadata key 0 length"),
    ("arch.key", b"\xff" * 20, "is not UTF-8"),
    ("arch.type", _u32(13), "has value type 13; allowed"),
    ("arch.type", _u32(2**32 - 1), "has value type 4294967295"),
    ("arch.value", _u64(HUGE) + b"llama", "metadata 'general.architecture' length"),
    ("align.value", _u32(3), "general.alignment is 3; allowed: a power of two"),
    ("align.value", _u32(0), "general.alignment is 0"),
    ("align.type", _u32(5), "general.alignment has value type int32; allowed: uint32"),
    ("scale.key", b"test.count", "metadata key 'test.count' appears twice"),  # both 10 bytes
    ("tokens.value", _u32(8) + _u64(HUGE) + _string("a") + _string("bc"), "'test.tokens' length"),
    ("tokens.value", _u32(8) + _u64(2) + _u64(HUGE) + b"a" + _string("bc"), "string length"),
    ("ids.value", _u32(5) + _u64(2**61) + struct.pack("<3i", 1, 2, 3), "'test.ids' length"),
    ("ids.value", _u32(77) + _u64(3) + struct.pack("<3i", 1, 2, 3), "element type 77"),
    ("nested.value", _u32(9) + _u64(HUGE), "'test.nested' length"),
    ("nested.value", (_u32(9) + _u64(1)) * 9 + _u32(0) + _u64(0), "nested deeper than 8"),
    ("t0.name_len", _u64(HUGE), "tensor 0 name length"),
    ("t0.name", b"\xfe" * 10, "is not UTF-8"),
    ("t1.name", b"tok.weight", "tensor 'tok.weight' appears twice"),
    ("t0.n_dims", _u32(5), "has 5 dimensions; allowed: 1 to 4"),
    ("t0.n_dims", _u32(0), "has 0 dimensions"),
    ("t0.n_dims", _u32(2**32 - 1), "4294967295 dimensions"),
    ("t0.dim0", _u64(HUGE), "needs bytes"),
    ("t0.dim1", _u64(2**62), "needs bytes"),
    ("t1.dim0", _u64(33), "not a multiple of its block size 32"),
    ("t0.type", _u32(4), "ggml type 4; allowed"),  # ids 4 and 5 were removed from ggml
    ("t0.type", _u32(2**31), "ggml type 2147483648"),
    ("t1.offset", _u64(HUGE - 31), "needs bytes"),
    ("t1.offset", _u64(129), "not a multiple of the alignment 32"),
    ("t1.offset", _u64(160), "(truncated?)"),  # aligned, but its 68 bytes end past the file
]


@pytest.mark.parametrize("field,new,what", CORRUPT, ids=[f"{c[0]}-{i}" for i, c in enumerate(CORRUPT)])
def test_a_corrupted_field_is_rejected_before_allocating(tmp_path, field, new, what):
    path = _write(tmp_path, _file(**{field: new}))
    tracemalloc.start()
    try:
        _expect_invalid(path, what)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, f"{peak} bytes allocated while rejecting a {len(VALID)}-byte file"


def test_a_byte_swapped_file_reads_and_is_checked_the_same_way(tmp_path):
    """Big-endian files (recognised by a byte-swapped version, as the gguf package does)."""
    be = _file(version=struct.pack(">I", 3), n_tensors=struct.pack(">Q", 2),
               n_kv=struct.pack(">Q", HUGE))
    _expect_invalid(_write(tmp_path, be), "metadata count is 18446744073709551615")


# ----------------------------------------------------------------- every entry point says it

@pytest.fixture
def truncated(tmp_path):
    return _write(tmp_path, VALID[:len(VALID) - 10], "truncated.gguf")


def test_open_gguf_reader_and_the_explorer_say_it(truncated, tmp_path):
    pytest.importorskip("gguf")
    from lessmem.eval import explore

    for path in (truncated, _write(tmp_path, b"GGUF" + bytes(100), "zeros.gguf")):
        _expect_invalid(path, reader=open_gguf_reader)
        _expect_invalid(path, reader=lambda p: explore.list_tensors(str(p)))
        _expect_invalid(path, reader=lambda p: explore.load_tensor(str(p), "tok.weight"))


def test_gguf_export_says_it(truncated, tmp_path):
    pytest.importorskip("gguf")
    from lessmem.weights.gguf_export import export_gguf

    _expect_invalid(truncated, reader=lambda p: export_gguf(p, tmp_path / "out.gguf", progress=False))
    assert not (tmp_path / "out.gguf").exists()


def test_lessmem_load_says_it(truncated, tmp_path):
    import lessmem

    for path in (truncated, _write(tmp_path, bytes(range(256)) * 4, "random.gguf")):
        _expect_invalid(path, reader=lessmem.load)


@pytest.mark.parametrize("cut", [3, 30, len(VALID) - 1])
def test_explore_cli_exits_2_with_one_line(truncated, tmp_path, capsys, cut):
    """End to end: ``lessmem explore --model bad.gguf --list-tensors`` (the CLI turns the
    ValueError into one line and exit status 2)."""
    from lessmem.cli import main

    path = _write(tmp_path, VALID[:cut])
    assert main(["explore", "--model", str(path), "--list-tensors"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a valid GGUF file" in err and "Traceback" not in err and len(err.splitlines()) == 1


# ----------------------------------------------------------------- mutated bytes (property)

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)),
                      min_size=1, max_size=8),
       cut=st.one_of(st.none(), st.integers(0, len(VALID))))
def test_mutated_bytes_give_a_header_or_a_clear_error(tmp_path, edits, cut):
    """Any mutation of the valid file is either read (and then every tensor lies inside the
    file, and the gguf package reads it too) or rejected with the prefixed ValueError."""
    data = bytearray(VALID)
    for pos, byte in edits:
        data[pos] = byte
    path = _write(tmp_path, bytes(data[:cut] if cut is not None else data), "mutated.gguf")
    try:
        h = read_gguf_header(path)
    except ValueError as e:
        assert isinstance(e, InvalidGGUFError) and str(e).startswith(f"{PREFIX}{path}: ")
        return
    assert all(h.data_offset <= t.offset and t.offset + t.nbytes <= h.file_size for t in h.tensors)
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(str(path))  # what we accept, the gguf package accepts
    assert [t.name for t in r.tensors] == [t.name for t in h.tensors]
