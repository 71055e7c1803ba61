"""model_fingerprint: equal weights -> equal id wherever they came from; any change -> new id."""

import pytest
import torch

import lessmem
from lessmem.kvcache.identity import model_fingerprint
from lessmem.models import tiny_random


def test_same_weights_same_id_across_builds():
    assert model_fingerprint(tiny_random("llama", seed=1)) == model_fingerprint(tiny_random("llama", seed=1))


def test_other_weights_other_id():
    assert model_fingerprint(tiny_random("llama", seed=1)) != model_fingerprint(tiny_random("llama", seed=2))


def test_dtype_changes_the_id():
    a = tiny_random("llama", seed=1)
    b = tiny_random("llama", seed=1, dtype=torch.bfloat16)
    assert model_fingerprint(a) != model_fingerprint(b)


def test_quantize_changes_the_id():
    m = tiny_random("llama", seed=1)
    before = model_fingerprint(m)
    lessmem.quantize_(m, lessmem.RTNConfig(bits=4, group_size=32), progress=False)
    assert model_fingerprint(m) != before


def test_in_place_edit_invalidates_the_memo():
    m = tiny_random("llama", seed=1)
    before = model_fingerprint(m)
    with torch.no_grad():
        next(m.parameters())[0, 0] += 1.0
    assert model_fingerprint(m) != before


def test_config_path_does_not_matter():
    a, b = tiny_random("llama", seed=3), tiny_random("llama", seed=3)
    a.config._name_or_path, b.config._name_or_path = "/home/x/cache/m", "/srv/y/m"
    assert model_fingerprint(a) == model_fingerprint(b)


def test_casting_the_same_model_changes_the_id():
    m = tiny_random("llama", seed=4)
    before = model_fingerprint(m)
    m.to(torch.bfloat16)  # same Parameter objects and versions, new storage and dtype
    assert model_fingerprint(m) != before


def test_meta_tensors_are_refused_by_name():
    with torch.device("meta"):
        m = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="meta device"):
        model_fingerprint(m)
