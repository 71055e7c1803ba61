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
