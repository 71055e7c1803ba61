"""weights.imatrix: llama.cpp importance matrices — collected, read and written in both of
llama.cpp's file formats (pinned by files built byte by byte here), used by GGUFConfig and
by ``lessmem quantize --format gguf --method imatrix / --imatrix / --imatrix-out``."""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
import torch
from _gguf_files import spread_norms as _spread_norms
from _gguf_files import tiny_gguf as _tiny_gguf

import lessmem
from lessmem.cli import main
from lessmem.formats.gguf import dequantize_gguf, quantize_gguf
from lessmem.models import tiny_random, tiny_tokenizer
from lessmem.weights.gguf_apply import apply_gguf
from lessmem.weights.gguf_linear import GGUFLinear
from lessmem.weights.imatrix import (
    IMatrix,
    IMatrixEntry,
    collect_imatrix,
    read_imatrix,
    write_imatrix,
)

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm sun. " * 30


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- llama.cpp layouts


def _legacy_file(entries, last_chunk=None, dataset=None) -> bytes:
    """A legacy imatrix file as llama.cpp's save_imatrix_legacy lays it out: int32 entry count;
    per entry int32 name length, the name, int32 ncall, int32 nval, float32 values; then
    int32 last chunk count and an int32-length-prefixed dataset name."""
    b = struct.pack("<i", len(entries))
    for name, ncall, values in entries:
        raw = name.encode()
        b += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, len(values))
        b += np.asarray(values, dtype="<f4").tobytes()
    if last_chunk is not None:
        b += struct.pack("<i", last_chunk)
    if dataset is not None:
        b += struct.pack("<i", len(dataset.encode())) + dataset.encode()
    return b


def _s(text: str) -> bytes:  # a GGUF string: uint64 length + UTF-8 bytes
    return struct.pack("<Q", len(text.encode())) + text.encode()


def _gguf_file(general_type="imatrix", drop_key=None, first_type=0, drop_tensor=None) -> bytes:
    """A GGUF imatrix file as llama.cpp's save_imatrix + gguf_write_to_buf write it: GGUF v3,
    KVs general.type / imatrix.datasets / imatrix.chunk_count / imatrix.chunk_size, then per
    entry (names sorted) <name>.in_sum2 and <name>.counts F32 tensors with trailing ne of 1
    dropped (ggml_n_dims), each tensor's data padded to 32 bytes."""
    kvs = {"general.type": _s("general.type") + struct.pack("<I", 8) + _s(general_type),
           "imatrix.datasets": _s("imatrix.datasets") + struct.pack("<IIQ", 9, 8, 1) + _s("calib.txt"),
           "imatrix.chunk_count": _s("imatrix.chunk_count") + struct.pack("<II", 4, 3),
           "imatrix.chunk_size": _s("imatrix.chunk_size") + struct.pack("<II", 4, 512)}
    kv = [v for k, v in kvs.items() if k != drop_key]
    tensors = [("blk.0.attn_q.weight.in_sum2", [4], [8.0, 4.0, 0.0, 2.0]),
               ("blk.0.attn_q.weight.counts", [1], [4.0]),
               ("blk.0.ffn_down_exps.weight.in_sum2", [2, 2], [3.0, 6.0, 5.0, 5.0]),
               ("blk.0.ffn_down_exps.weight.counts", [1, 2], [3.0, 0.0])]
    tensors = [t for t in tensors if t[0] != drop_tensor]
    infos, data = b"", b""
    for i, (name, ne, values) in enumerate(tensors):
        ttype = first_type if i == 0 else 0
        infos += _s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<q", n) for n in ne)
        infos += struct.pack("<iQ", ttype, len(data))
        raw = np.asarray(values, dtype="<f4").tobytes()
        if ttype == 1:  # F16: half the bytes
            raw = np.asarray(values, dtype="<f2").tobytes()
        data += raw + bytes(-len(raw) % 32)
    head = b"GGUF" + struct.pack("<Iqq", 3, len(tensors), len(kv)) + b"".join(kv) + infos
    return head + bytes(-len(head) % 32) + data


HAND = IMatrix({"blk.0.attn_q.weight": IMatrixEntry([8, 4, 0, 2], [4]),
                "blk.0.ffn_down_exps.weight": IMatrixEntry([3, 6, 5, 5], [3, 0])},
               chunk_size=512, chunk_count=3, datasets=("calib.txt",))


def test_reads_a_gguf_file_built_byte_by_byte_and_writes_the_same_bytes(tmp_path):
    p = tmp_path / "hand.gguf"
    p.write_bytes(_gguf_file())
    im = read_imatrix(p)
    assert im == HAND
    assert im.importance("blk.0.attn_q.weight").tolist() == [2.0, 1.0, 0.0, 0.5]  # in_sum2 / counts
    assert im.importance("model.layers.0.self_attn.q_proj").tolist() == [2.0, 1.0, 0.0, 0.5]
    assert im.key("model.layers.0.self_attn.q_proj.weight") == "blk.0.attn_q.weight"
    assert im.importance("blk.0.ffn_down_exps.weight").tolist() == [1.0, 2.0, 1.0, 1.0]  # count 0: ones
    assert im.importance("blk.1.attn_q.weight") is None
    out = write_imatrix(HAND, tmp_path / "ours.gguf")
    assert out.read_bytes() == p.read_bytes()
    r = gguf.GGUFReader(str(out))  # the gguf package reads it as llama.cpp's format too
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.datasets"].contents() == ["calib.txt"]
    assert [t.name for t in r.tensors][:2] == ["blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts"]


def test_reads_a_legacy_file_built_byte_by_byte(tmp_path):
    entries = [("blk.0.attn_q.weight", 4, [4.0, 8.0, 2.0, 0.0]), ("blk.0.ffn_up.weight", 2, [3.0, 1.0])]
    p = tmp_path / "hand.dat"
    p.write_bytes(_legacy_file(entries, last_chunk=4, dataset="wiki.train.raw"))
    im = read_imatrix(p)
    assert sorted(im.entries) == ["blk.0.attn_q.weight", "blk.0.ffn_up.weight"]
    assert im.importance("blk.0.attn_q.weight").tolist() == [1.0, 2.0, 0.5, 0.0]  # values / ncall
    assert im.importance("model.layers.0.mlp.up_proj").tolist() == [1.5, 0.5]
    assert (im.chunk_count, im.datasets) == (4, ("wiki.train.raw",))
    assert write_imatrix(im, tmp_path / "again.dat").read_bytes() == p.read_bytes()
    # older files end after the entries, or after the chunk count; ncall 0: the values as they are
    p.write_bytes(_legacy_file([("blk.0.attn_q.weight", 0, [4.0, 8.0])]))
    im = read_imatrix(p)
    assert im.importance("blk.0.attn_q.weight").tolist() == [4.0, 8.0] and im.chunk_count == 0
    p.write_bytes(_legacy_file(entries, last_chunk=7))
    assert read_imatrix(p).chunk_count == 7 and read_imatrix(p).datasets == ()


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama with K-quant-sized layers (256 / 512 columns), spread input scales, and the
    importance matrix of 3 windows of 64 tokens, plus every linear's inputs as hooks saw them."""
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    _spread_norms(m)
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [mod.register_forward_pre_hook(lambda mod, args, n=name: seen.setdefault(n, []).append(args[0]))
             for name, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
    im = collect_imatrix(m, _ids(3 * 64), n_samples=3, seq_len=64)
    for h in hooks:
        h.remove()
    return m, im, seen


def test_collect_matches_the_sums_of_squares_of_the_hooked_inputs(tiny):
    m, im, seen = tiny
    assert len(im) == 14 and "output.weight" not in im.entries  # llama-imatrix skips the output
    assert (im.chunk_size, im.chunk_count, im.datasets) == (64, 3, ("token ids (192,)",))
    assert "blk.1.ffn_down.weight" in im.entries and "blk.0.attn_q.weight" in im.entries
    for name, xs in seen.items():
        if name == "lm_head":
            continue
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).double()
        e = im.entries[im.key(name)]
        assert e.counts.tolist() == [3 * 64]
        np.testing.assert_allclose(e.in_sum2, (x * x).sum(0).numpy(), rtol=1e-6)
        np.testing.assert_allclose(im.importance(name), (x * x).mean(0).numpy(), rtol=1e-5)
    with_output = collect_imatrix(m, _ids(64), n_samples=1, seq_len=64, process_output=True)
    assert len(with_output) == 15 and with_output.entries["output.weight"].n_cols == 256


def test_collect_tokenizes_text_and_checks_its_input():
    m = tiny_random("llama")
    im = collect_imatrix(m, TEXT, tiny_tokenizer(), n_samples=2, seq_len=32)
    assert im.entries["blk.0.attn_q.weight"].counts.tolist() == [64]
    assert im.datasets[0].startswith("text given by the caller")
    with pytest.raises(ValueError, match="n_samples=0"):
        collect_imatrix(m, TEXT, tiny_tokenizer(), n_samples=0)
    with pytest.raises(ValueError, match="too short"):
        collect_imatrix(m, "abc", tiny_tokenizer(), n_samples=2, seq_len=32)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        collect_imatrix(m, torch.full((64,), 9999), n_samples=1, seq_len=64)


def test_both_formats_round_trip(tiny, tmp_path):
    _, im, _ = tiny
    g = write_imatrix(im, tmp_path / "im.gguf")
    assert read_imatrix(g) == im  # sums and counts exactly, and the metadata
    assert write_imatrix(read_imatrix(g), tmp_path / "again.gguf").read_bytes() == g.read_bytes()
    d = write_imatrix(im, tmp_path / "im.dat")
    back = read_imatrix(d)  # per-call means: the same importance, not the same sums
    assert sorted(back.entries) == sorted(im.entries)
    assert (back.chunk_count, back.datasets) == (im.chunk_count, im.datasets)
    for name in im.entries:
        assert back.entries[name].counts.tolist() == [3]  # ncall: ceil(192 rows / 64 per chunk)
        np.testing.assert_allclose(back.importance(name), im.importance(name), rtol=1e-6)
    assert write_imatrix(back, tmp_path / "again.dat").read_bytes() == d.read_bytes()
    assert write_imatrix(im, tmp_path / "x.bin", fmt="gguf").read_bytes()[:4] == b"GGUF"
    with pytest.raises(ValueError, match="fmt='csv'"):
        write_imatrix(im, tmp_path / "x.csv", fmt="csv")


def _expect_invalid(path, data: bytes, match: str | None = None):
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match) as info:
        read_imatrix(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("data, match", [
    (b"", "the file is empty"),
    (b"\x01\x00", "truncated"),
    (struct.pack("<i", 0), "entry count 0"),
    (struct.pack("<i", 10**9) + bytes(64), "needs at least"),
    (struct.pack("<ii", 1, -5) + bytes(32), "name length -5"),
    (struct.pack("<ii", 1, 10**6) + bytes(32), "name length 1000000"),
    (_legacy_file([("blk.0.attn_q.weight", 1, [])]) + bytes(16), "has 0 values"),
    (_legacy_file([("blk.0.attn_q.weight", 1, [1.0])])[:-8] + struct.pack("<i", 10**8) + bytes(4),
     "values"),
    (_legacy_file([("blk.0.attn_q.weight", 1, [1.0, float("nan")])]), "NaN"),
    (_legacy_file([("blk.0.attn_q.weight", 1, [1.0, -2.0])]), "negative"),
    (_legacy_file([("blk.0.attn_q.weight", -3, [1.0])]), "ncall -3"),
    (_legacy_file([("a", 1, [1.0]), ("a", 1, [2.0])]), "appears twice"),
    (_legacy_file([("a", 1, [1.0])], 1, "data") + b"junk", "bytes follow the dataset name"),
    (_legacy_file([("a", 1, [1.0])], 1)[:-2], "truncated"),
    (_legacy_file([("a", 1, [1.0])], 1, "data")[:-2], "dataset name length"),
    (_legacy_file([("\xff", 1, [1.0])]).replace(b"\xc3\xbf", b"\xff\xff"), "not UTF-8"),
])
def test_garbled_legacy_files_are_value_errors(tmp_path, data, match):
    _expect_invalid(tmp_path / "bad.dat", data, match)


@pytest.mark.parametrize("kwargs, match", [
    (dict(general_type="model"), "general.type is 'model', not 'imatrix'"),
    (dict(drop_key="imatrix.chunk_size"), "missing imatrix metadata imatrix.chunk_size"),
    (dict(drop_key="imatrix.datasets"), "missing imatrix metadata imatrix.datasets"),
    (dict(first_type=1), "is F16; allowed: F32"),
    (dict(drop_tensor="blk.0.attn_q.weight.counts"), "mismatched sums and counts for blk.0.attn_q.weight"),
])
def test_garbled_gguf_files_are_value_errors(tmp_path, kwargs, match):
    _expect_invalid(tmp_path / "bad.gguf", _gguf_file(**kwargs), match)


def test_truncated_files_are_value_errors_at_every_cut(tmp_path):
    legacy = _legacy_file([("blk.0.attn_q.weight", 2, [1.0, 2.0, 3.0]), ("blk.0.ffn_up.weight", 2, [4.0])],
                          last_chunk=2, dataset="d.txt")
    valid_ends = {len(legacy), len(legacy) - 9, len(legacy) - 13}  # without the dataset / chunk count
    p = tmp_path / "cut"
    for cut in range(1, len(legacy)):
        p.write_bytes(legacy[:cut])
        if cut in valid_ends:
            assert len(read_imatrix(p)) == 2
        else:
            with pytest.raises(ValueError, match="not a valid imatrix file"):
                read_imatrix(p)
    whole = _gguf_file()
    data_end = len(whole) - 32 + 8  # the last tensor's 8 bytes; only its padding may be cut
    for cut in range(1, len(whole)):
        p.write_bytes(whole[:cut])
        if cut >= data_end:
            assert read_imatrix(p) == HAND
        else:
            with pytest.raises(ValueError, match="not a valid"):
                read_imatrix(p)
    p.write_bytes(b"GGUF" + bytes(range(256)) * 4)  # garbled after the magic
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        read_imatrix(p)


def test_a_model_gguf_is_not_an_imatrix(tmp_path):
    from lessmem.weights.gguf_export import write_model_gguf

    p = write_model_gguf(tiny_random("llama"), tmp_path / "model.gguf", "q8_0")
    with pytest.raises(ValueError, match="missing imatrix metadata"):
        read_imatrix(p)
    with pytest.raises(ValueError, match="does not exist"):
        read_imatrix(tmp_path / "nope.dat")


def _weighted_error(w: torch.Tensor, w_hat: torch.Tensor, importance) -> float:
    """Σ_j importance[j] · Σ_rows (W - Ŵ)[row, j]²: E‖(W - Ŵ) x‖² for uncorrelated columns."""
    err = ((w.double() - w_hat.double()) ** 2).sum(0)
    return float((err * torch.as_tensor(np.asarray(importance), dtype=torch.float64)).sum())


def test_the_imatrix_lowers_the_weighted_error_of_k_quants(tiny):
    m, im, _ = tiny
    lower = {}
    for typ in ("q2_k", "q3_k", "q4_k", "q5_k"):
        with_im = without = 0.0
        for name, mod in m.named_modules():
            imp = im.importance(name) if isinstance(mod, torch.nn.Linear) else None
            if imp is None:
                continue
            w = mod.weight.detach()
            for weights, acc in ((imp, "with"), (None, "without")):
                w_hat = dequantize_gguf(quantize_gguf(w, typ, imatrix=weights), typ, tuple(w.shape))
                e = _weighted_error(w, w_hat, imp)
                if acc == "with":
                    with_im += e
                else:
                    without += e
        lower[typ] = with_im / without
    assert lower["q4_k"] < 0.8, lower  # ~0.42 here
    assert all(v < 0.9 for v in lower.values()), lower  # ~0.3-0.5


def test_gguf_config_encodes_each_linear_with_its_importance(tiny, tmp_path):
    _, im, _ = tiny
    path = write_imatrix(im, tmp_path / "im.dat")
    for source in (im, path, str(path)):
        m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
        _spread_norms(m)
        w = m.model.layers[0].mlp.down_proj.weight.detach().clone()
        rep = apply_gguf(m, lessmem.GGUFConfig("Q4_K_M", imatrix=source))
        assert rep["imatrix"]["entries"] == 14 and rep["imatrix"]["not_found"] == ["lm_head"]
        q = m.model.layers[0].mlp.down_proj
        assert isinstance(q, GGUFLinear) and q.gguf_type == "q4_k"
        imp = read_imatrix(path).importance("blk.0.ffn_down.weight") if source is not im else \
            im.importance("blk.0.ffn_down.weight")
        assert np.array_equal(q.qweight.numpy(), quantize_gguf(w, "q4_k", imatrix=imp))
        assert not np.array_equal(q.qweight.numpy(), quantize_gguf(w, "q4_k"))
    cfg = lessmem.GGUFConfig("Q4_K_M", imatrix=str(path))
    assert cfg.to_dict()["imatrix"] == str(path)
    assert lessmem.GGUFConfig("Q4_K_M", imatrix=im).to_dict()["imatrix"] == "in memory (14 entries)"
    assert "imatrix" not in lessmem.GGUFConfig("Q4_K_M").to_dict()


def test_gguf_config_imatrix_checks(tmp_path):
    with pytest.raises(ValueError, match="GGUFConfig imatrix=.*does not exist"):
        lessmem.GGUFConfig("Q4_K_M", imatrix=str(tmp_path / "missing.dat"))
    (tmp_path / "bad.dat").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="GGUFConfig imatrix=.*truncated"):
        lessmem.GGUFConfig("Q4_K_M", imatrix=tmp_path / "bad.dat")
    with pytest.raises(ValueError, match="must be an IMatrix"):
        lessmem.GGUFConfig("Q4_K_M", imatrix={"blk.0.attn_q.weight": [1.0]})
    m = tiny_random("llama")  # 64 columns; the entry has 32 values
    wrong = IMatrix({"blk.0.attn_q.weight": IMatrixEntry(np.ones(32), [8]),
                     "blk.9.ffn_up.weight": IMatrixEntry(np.ones(64), [8])})  # no such tensor: ignored
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight' has 32 values but tensor .* has 64 columns"):
        apply_gguf(m, lessmem.GGUFConfig("Q4_0", imatrix=wrong))
    assert type(m.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # nothing changed
    ok = IMatrix({"blk.9.ffn_up.weight": IMatrixEntry(np.ones(64), [8])})
    rep = apply_gguf(m, lessmem.GGUFConfig("Q4_0", imatrix=ok))
    assert rep["imatrix"]["weighted"] == [] and rep["n_quantized"] == 15


# ----------------------------------------------------------------------------- the CLI


def _tensors(path) -> dict:
    return {t.name: (t.tensor_type.name, np.array(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


def test_cli_method_imatrix_end_to_end(tmp_path, capsys):
    src = tmp_path / "tiny.gguf"
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    _spread_norms(m)
    _tiny_gguf(src, m)
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    base = ["quantize", "--model", str(src), "--format", "gguf", "--type", "Q4_K_M", "--json"]
    out1, dat = tmp_path / "q1.gguf", tmp_path / "im.dat"
    rc = main([*base, "--method", "imatrix", "--calibration", str(calib), "--n-samples", "4",
               "--seq-len", "64", "--imatrix-out", str(dat), "--out", str(out1)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rep = json.loads(cap.out)
    assert rep["imatrix"]["tensors_weighted"] == 14 and rep["imatrix"]["written"] == str(dat)
    assert rep["imatrix"]["from"] == f"computed: 4 x 64 tokens of {calib}"
    im = read_imatrix(dat)
    assert len(im) == 14 and im.entries["blk.0.attn_q.weight"].counts.tolist() == [4]  # ncall
    r = gguf.GGUFReader(str(out1))
    assert r.fields["quantize.imatrix.entries_count"].contents() == 14
    assert r.fields["quantize.imatrix.file"].contents() == str(dat)
    assert r.fields["quantize.imatrix.dataset"].contents() == str(calib)
    assert r.fields["quantize.imatrix.chunks_count"].contents() == 4
    # the written .dat gives the same importance (4 x 64 rows: exact in float32): the same bytes
    out2 = tmp_path / "q2.gguf"
    assert main([*base, "--imatrix", str(dat), "--out", str(out2)]) == 0
    capsys.readouterr()
    t1, t2 = _tensors(out1), _tensors(out2)
    assert t1 == t2 and t1["blk.0.ffn_up.weight"][0] == "Q4_K"
    out3 = tmp_path / "q3.gguf"  # without an imatrix the K-quant tensors come out otherwise
    assert main([*base, "--out", str(out3)]) == 0
    capsys.readouterr()
    assert _tensors(out3)["blk.0.ffn_up.weight"] != t1["blk.0.ffn_up.weight"]


def test_cli_imatrix_bad_input_is_one_line(tmp_path, capsys):
    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src, tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2))
    (tmp_path / "junk.dat").write_bytes(b"\x05\x00\x00\x00garbage")
    write_imatrix(IMatrix({"blk.0.attn_q.weight": IMatrixEntry(np.ones(64), [1])}), tmp_path / "other.dat")
    write_imatrix(IMatrix({"blk.7.attn_q.weight": IMatrixEntry(np.ones(256), [1])}), tmp_path / "none.dat")
    out = tmp_path / "q.gguf"
    g = ["quantize", "--model", str(src), "--format", "gguf", "--out", str(out)]
    rows = [
        (["quantize", "--model", str(tmp_path), "--method", "imatrix", "--out", str(tmp_path / "d")],
         "--method imatrix: needs --format gguf"),
        (["quantize", "--model", str(tmp_path), "--imatrix", str(tmp_path / "other.dat"),
          "--out", str(tmp_path / "d")], "needs --format gguf"),
        ([*g, "--imatrix", str(tmp_path / "junk.dat")], "not a valid imatrix file"),
        ([*g, "--imatrix", str(tmp_path / "missing.dat")], "allowed: an existing imatrix file"),
        ([*g, "--imatrix", str(tmp_path / "other.dat")], "has 64 values but tensor 'blk.0.attn_q.weight' has 256"),
        ([*g, "--imatrix", str(tmp_path / "none.dat")], "none of its 1 entries"),
        ([*g, "--imatrix", str(tmp_path / "other.dat"), "--method", "imatrix"], "choose one of"),
        ([*g, "--imatrix-out", str(tmp_path / "x.dat")], "needs --method imatrix"),
        ([*g, "--method", "imatrix", "--imatrix-out", str(out)], "is the --out file"),
        ([*g, "--method", "imatrix", "--imatrix-out", str(tmp_path)], "--imatrix-out"),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv, expect in rows:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expect in err and "Traceback" not in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
