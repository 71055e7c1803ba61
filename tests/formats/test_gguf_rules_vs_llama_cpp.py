"""``base.gguf_rules`` against llama.cpp's own quantizer (``llama_model_quantize`` from the
``llama-cpp-python`` package, where it is installed: a benchmark dependency, so this
module is skipped elsewhere): every tensor of every file type gets the type llama.cpp gives
it, on a float file whose rows (96) are not a multiple of the K-quants' 256, so every
fallback is taken, and whose feed-forward rows (512) are."""

from __future__ import annotations

import pytest

from lessmem.base.gguf_rules import FILE_TYPES, tensor_type

llama_cpp = pytest.importorskip("llama_cpp")

LAYERS, HEADS, KV_HEADS = 16, 3, 1


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    from lessmem.models import tiny_random
    from lessmem.weights.gguf_export import write_model_gguf

    m = tiny_random("llama", num_layers=LAYERS, hidden_size=96, num_heads=HEADS, num_kv_heads=KV_HEADS,
                    intermediate_size=512)
    return write_model_gguf(m, tmp_path_factory.mktemp("f32") / "tiny.f32.gguf", "f32")


def _llama_cpp_types(src, out, ftype: str) -> dict[str, tuple[str, int, int]]:
    import gguf

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    assert rc == 0, f"llama_model_quantize {ftype} returned {rc}"
    reader = gguf.GGUFReader(str(out))
    return {t.name: (t.tensor_type.name.lower(), int(t.shape[0]), len(t.shape)) for t in reader.tensors}


def test_f32_source_file_holds_floats(f32_file):
    import gguf

    reader = gguf.GGUFReader(str(f32_file))
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}


@pytest.mark.parametrize("ftype", list(FILE_TYPES))
def test_every_tensor_type_equals_llama_cpp(f32_file, tmp_path, ftype):
    got = _llama_cpp_types(f32_file, tmp_path / f"tiny.{ftype}.gguf", ftype)
    has_output = "output.weight" in got
    ours = {name: tensor_type(ftype, name, cols, LAYERS, has_output=has_output, ndim=ndim,
                              n_gqa=HEADS // KV_HEADS)
            for name, (_, cols, ndim) in got.items()}
    theirs = {name: typ for name, (typ, _, _) in got.items()}
    diff = {n: (ours[n], theirs[n]) for n in got if ours[n] != theirs[n]}
    assert not diff, f"{ftype}: (lessmem, llama.cpp) differ on {diff}"


@pytest.fixture(scope="module")
def gqa4_file(tmp_path_factory):
    """Four query heads per KV head: the IQ4 types' attn_v rule (Q5_K) applies."""
    from lessmem.models import tiny_random
    from lessmem.weights.gguf_export import write_model_gguf

    m = tiny_random("llama", num_layers=LAYERS, hidden_size=256, num_heads=4, num_kv_heads=1,
                    intermediate_size=512)
    return write_model_gguf(m, tmp_path_factory.mktemp("f32") / "tiny.gqa4.f32.gguf", "f32")


@pytest.mark.parametrize("ftype", ["IQ4_NL", "IQ4_XS", "Q4_K_M", "Q3_K_M"])
@pytest.mark.parametrize("has_imatrix", [False, True])
def test_imatrix_and_gqa_rules_equal_llama_cpp(gqa4_file, tmp_path, ftype, has_imatrix):
    """With an importance matrix llama.cpp keeps IQ4's first ffn_down layers at IQ4 (Q5_K
    without); a matrix of one entry is enough for it to count as given."""
    import ctypes

    import gguf
    import numpy as np

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    vals = np.ones(512, dtype=np.float32)
    arr = (llama_cpp.llama_model_imatrix_data * 2)()
    arr[0].name, arr[0].size = b"blk.0.ffn_down.weight", vals.size
    arr[0].data = vals.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    arr[1].name = None
    if has_imatrix:
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    out = tmp_path / f"tiny.{ftype}.gguf"
    assert llama_cpp.llama_model_quantize(str(gqa4_file).encode(), str(out).encode(), ctypes.byref(params)) == 0
    got = {t.name: (t.tensor_type.name.lower(), int(t.shape[0]), len(t.shape)) for t in gguf.GGUFReader(str(out)).tensors}
    has_output = "output.weight" in got
    diff = {n: (tensor_type(ftype, n, cols, LAYERS, has_output=has_output, ndim=ndim, n_gqa=4,
                            has_imatrix=has_imatrix), typ)
            for n, (typ, cols, ndim) in got.items()}
    diff = {n: v for n, v in diff.items() if v[0] != v[1]}
    assert not diff, f"{ftype} imatrix={has_imatrix}: (lessmem, llama.cpp) differ on {diff}"
    if ftype.startswith("IQ4"):  # the rules this test is for were taken
        assert got["blk.3.attn_v.weight"][0] == "q5_k"
        assert got["blk.0.ffn_down.weight"][0] == ("iq4_xs" if ftype == "IQ4_XS" else "iq4_nl") \
            if has_imatrix else "q5_k"
