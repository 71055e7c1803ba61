"""Calibration data and the shared observe pass."""

import pytest
import torch

from lessmem.models import tiny_tokenizer
from lessmem.weights.calibrate import builtin_corpus, calibration_ids, describe
from lessmem.weights.observer import Observer, observe


def test_calibration_sources(tmp_path):
    tok = tiny_tokenizer()
    f = tmp_path / "c.txt"
    f.write_text("abcdefgh" * 10)
    a = calibration_ids(f, tok, 2, 16)
    b = calibration_ids(str(f), tok, 2, 16)
    c = calibration_ids(["abcdefgh" * 5, "abcdefgh" * 5], tok, 2, 16)
    assert a.shape == (2, 16) and torch.equal(a, b) and torch.equal(a[0], c[0])
    assert describe(str(f)) == f"file {f}" and describe(None).startswith("built-in corpus")
    d = calibration_ids(None, tok, 4, 64)  # the built-in corpus
    assert d.shape == (4, 64) and tok.decode(d[0]).strip() == builtin_corpus()[:64].strip()
    with pytest.raises(ValueError, match="calibration=int; allowed: None"):
        calibration_ids(5, tok, 1, 8)


def test_observer_statistics_match_direct_computation():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 4)
    xs = [torch.randn(3, 7, 16) for _ in range(2)]
    obs = observe({"lin": lin}, lambda: [lin(x) for x in xs], want_xtx=True, keep=10)["lin"]
    x = torch.cat([t.reshape(-1, 16) for t in xs])
    assert obs.n == 42
    torch.testing.assert_close(obs.hessian(), (2 * x.T.double() @ x.double() / 42).float())
    torch.testing.assert_close(obs.mean_abs(), x.abs().mean(0))
    torch.testing.assert_close(obs.abs_max, x.abs().amax(0))
    assert torch.equal(obs.samples(), x[:10])
    assert isinstance(obs, Observer)
