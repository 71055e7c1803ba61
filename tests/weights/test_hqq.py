"""HQQ (half-quadratic quantization): against RTN on the same weights and group size, against a
plain per-group reference twin, its building blocks, configs, quantize_/QuantLinear/checkpoint/CLI."""

import json

import pytest
import torch

import lessmem
from lessmem.formats.integer import choose_qparams
from lessmem.models import tiny_random
from lessmem.weights.config import WeightConfig
from lessmem.weights.hqq import (
    _step_scale,
    _step_zero,
    hqq_groups,
    hqq_quantize,
    lp_error,
    shrink_lp,
)
from lessmem.weights.qlinear import QuantLinear
from lessmem.weights.rtn import rtn_quantize

BETA = lessmem.HQQConfig().beta


def _heavy(n=96, k=256, seed=0):
    """Student-t (3 dof) weights with a few outlier columns, as trained LLM layers have."""
    torch.manual_seed(seed)  # torch.distributions samples from the global generator
    g = torch.Generator().manual_seed(seed)
    w = torch.distributions.StudentT(3.0).sample((n, k)) * 0.02
    w[:, torch.randperm(k, generator=g)[:4]] *= 6
    return w


def _per_group_lp(w, w_hat, gs):
    return lp_error(w.reshape(-1, gs), w_hat.reshape(-1, gs), 0.7, dim=1)


# ---- against RTN -------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_lp_error_never_worse_than_rtn_per_group_and_lower_overall(bits, gs):
    w = _heavy()
    h = hqq_quantize(w, bits, gs).dequantize()
    r = rtn_quantize(w, bits, gs, symmetric=False).dequantize()
    ph, pr = _per_group_lp(w, h, gs), _per_group_lp(w, r, gs)
    assert bool((ph <= pr * (1 + 1e-6)).all())  # RTN's own point is among the candidates
    assert ph.sum() < 0.985 * pr.sum(), (bits, gs, ph.sum().item(), pr.sum().item())


@pytest.mark.parametrize("bits", [3, 4])
def test_layer_output_error_below_rtn(bits):
    w = _heavy(128, 512, seed=1)
    x = torch.distributions.StudentT(4.0).sample((256, 512))  # seeded by _heavy
    ref = x @ w.T
    err = {}
    for name, qw in (("hqq", hqq_quantize(w, bits, 64)), ("rtn", rtn_quantize(w, bits, 64, False))):
        y = QuantLinear.from_quantized(qw)(x)  # through the layer the model will run
        err[name] = ((y - ref) ** 2).mean().item()
    assert err["hqq"] < 0.98 * err["rtn"], err


@pytest.fixture(scope="module")
def smol_down_proj():
    gguf = pytest.importorskip("gguf")
    from lessmem.base.paths import cache_dir

    path = cache_dir("models") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip("built-in SmolLM2 file not in the cache")
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.3.ffn_down.weight")
    w = gguf.quants.dequantize(t.data, t.tensor_type)  # [576, 1536] float32
    return torch.from_numpy(w.copy()).float()


@pytest.mark.model
@pytest.mark.parametrize("bits", [3, 4])
def test_real_layer_smollm2_weight_and_output_error_below_rtn(smol_down_proj, bits):
    w = smol_down_proj
    h, r = hqq_quantize(w, bits, 64), rtn_quantize(w, bits, 64, symmetric=False)
    assert lp_error(w, h.dequantize()) < 0.97 * lp_error(w, r.dequantize())
    x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0))
    e_h = ((x @ (h.dequantize() - w).T) ** 2).mean()
    e_r = ((x @ (r.dequantize() - w).T) ** 2).mean()
    assert e_h < 0.95 * e_r, (e_h.item(), e_r.item())


# ---- reference twin: one group at a time, written out plainly ------------------------------

def _reference_group(w, bits, iters=20, p=0.7, beta=BETA, kappa=1.01, tol=1e-4, code_units=True):
    """HQQ for one group w [gs]: the module doc's algorithm as scalar-per-group loops.
    code_units: errors measured in steps of RTN's scale s0 (else in weight units)."""
    qmax = 2**bits - 1
    s16, zp = choose_qparams(w[None], bits, False)
    s0, z_rtn = float(s16), float(zp)
    unit = s0 if code_units else 1.0

    def phi(s, z):
        u = torch.clamp(torch.round(w / s + z), 0, qmax)
        return ((w - s * (u - z)) / unit).abs().pow(p).sum().item()

    def shrink(x, b):
        return torch.sign(x) * torch.relu(x.abs() - x.abs().clamp(min=1e-30).pow(p - 1) / b)

    def run(s, z, update):
        best = (phi(s, z), s, z)
        b = beta
        for _ in range(iters):
            u = torch.clamp(torch.round(w / s + z), 0, qmax)
            e = shrink((w - s * (u - z)) / unit, b) * unit
            s, z = update(s, z, u, e)
            b *= kappa
            cur = phi(s, z)
            prev = best[0]
            if cur < prev:
                best = (cur, s, z)
            if not cur < prev * (1 - tol):
                break
        return best

    def zero_update(s, z, u, e):
        return s, (u - (w - e) / s).mean().item()

    def scale_update(s, z, u, e):
        d = u - z
        if (d * d).sum() == 0:
            return s, z
        fit = ((w - e) * d).sum().item() / (d * d).sum().item()
        return (float(torch.tensor(fit).half()) if fit > 0 else s), z

    lo = min(w.min().item(), 0.0)
    _, _, zf = run(s0, -lo / s0, zero_update)
    cands = [(phi(s0, z_rtn), s0, z_rtn)]
    for z in (z_rtn, min(max(round(zf), 0), qmax)):
        cands.append(run(s0, float(z), scale_update))
    best = cands[0]
    for c in cands[1:]:
        if c[0] < best[0]:
            best = c
    return best[1], best[2], best[0]


@pytest.mark.parametrize("code_units, beta", [(True, BETA), (False, 10.0)])
def test_matches_the_reference_twin(code_units, beta):
    w = _heavy(12, 128, seed=3)
    for bits in (2, 3, 4):
        s, z = hqq_groups(w.reshape(-1, 32), bits, beta=beta, code_units=code_units)
        s0, _ = choose_qparams(w.reshape(-1, 32), bits, False)
        for i, wg in enumerate(w.reshape(-1, 32)):
            rs, rz, rphi = _reference_group(wg, bits, beta=beta, code_units=code_units)
            u = torch.clamp(torch.round(wg / s[i].float() + z[i].float()), 0, 2**bits - 1)
            err = (wg - s[i].float() * (u - z[i].float())) / (float(s0[i]) if code_units else 1.0)
            ours = err.abs().pow(0.7).sum().item()
            assert ours == pytest.approx(rphi, rel=1e-5), (bits, i)
            assert float(s[i]) == pytest.approx(rs, rel=1e-3) and int(z[i]) == rz, (bits, i)


# ---- building blocks -----------------------------------------------------------------------

def test_shrink_p1_is_the_l1_proximal_operator():
    x = torch.linspace(-1, 1, 41)
    beta = 8.0
    grid = torch.linspace(-1.5, 1.5, 30001)  # argmin_e |e| + β/2 (e − x)² by brute force
    brute = torch.stack([grid[(grid.abs() + beta / 2 * (grid - xi) ** 2).argmin()] for xi in x])
    assert torch.allclose(shrink_lp(x, beta, 1.0), brute, atol=2e-4)


def test_shrink_lp_keeps_sign_zeroes_small_errors_and_shrinks_large_ones():
    x = torch.tensor([-3.0, -0.01, 0.0, 0.01, 3.0])
    y = shrink_lp(x, 10.0, 0.7)
    assert torch.equal(y[1:4], torch.zeros(3))  # |x|^(2−p) < 1/β: absorbed by the quadratic part
    assert bool((y.abs() <= x.abs()).all()) and y[0] < 0 < y[4]


@pytest.mark.parametrize("p", [0.5, 0.7, 1.0])
def test_quadratic_part_is_the_error_minus_its_shrinkage(p):
    from lessmem.weights.hqq import _quadratic_part

    r = torch.randn(4, 64) * 0.3
    r[0, :3] = 0.0
    a = r.abs()
    got = _quadratic_part(r, a, a.pow(p), 10.0)
    assert torch.allclose(got, r - shrink_lp(r, 10.0, p), atol=1e-6)


@pytest.mark.parametrize("unit", [1.0, 0.4])
def test_closed_form_steps_minimise_the_quadratic(unit):
    torch.manual_seed(0)
    w, e = torch.randn(3, 64), torch.randn(3, 64) * 0.01
    s, z = torch.full((3, 1), 0.4), torch.full((3, 1), 7.3)
    d = torch.clamp(torch.round(w / s + z), 0, 15) - z
    u_ = torch.full((3, 1), unit)
    q = ((w - s * d) - e) / u_  # (r − e) in steps of unit
    _, z1 = _step_zero(s, z, d, q, u_)
    u = d + z
    for dz in (-1e-2, 1e-2):  # ||w − e − s(u − z)||² is minimal at z1
        f = lambda zz: ((w - e - s * (u - zz)) ** 2).sum(1)  # noqa: E731
        assert bool((f(z1) <= f(z1 + dz)).all())
    s1, _ = _step_scale(s, z, d, q, u_)
    assert s1.dtype == torch.float32 and torch.equal(s1, s1.half().float())  # stored as fp16
    g = lambda ss: ((w - e - ss * d) ** 2).sum(1)  # noqa: E731
    assert bool((g(s1) <= g(s1 * 1.01)).all() and (g(s1) <= g(s1 * 0.99)).all())


def test_symmetric_and_int8_fit_the_scale_only():
    w = _heavy(32, 128, seed=2)
    for bits, gs in ((4, 32), (8, None)):
        h = hqq_quantize(w, bits, gs, symmetric=True)
        r = rtn_quantize(w, bits, gs, symmetric=True)
        assert torch.equal(h.zero, r.zero)  # zero point fixed at 2^(b−1)
        assert int(h.codes.min()) >= 1  # symmetric code range ±(2^(b−1) − 1)
        k = gs or 128
        assert bool((_per_group_lp(w, h.dequantize(), k) <= _per_group_lp(w, r.dequantize(), k)
                     * (1 + 1e-6)).all())
    assert lp_error(w, hqq_quantize(w, 4, 32, True).dequantize()) < lp_error(
        w, rtn_quantize(w, 4, 32, True).dequantize())


def test_deterministic_chunk_independent_and_iters0_is_rtn():
    w = _heavy(40, 256, seed=4)
    a, b = hqq_quantize(w, 3, 64), hqq_quantize(w, 3, 64)
    c = hqq_quantize(w, 3, 64, chunk_groups=7)
    for x, y in ((a, b), (a, c)):
        assert torch.equal(x.codes, y.codes) and torch.equal(x.scale, y.scale) and torch.equal(x.zero, y.zero)
    r, z = rtn_quantize(w, 3, 64, False), hqq_quantize(w, 3, 64, iters=0)
    assert torch.equal(r.codes, z.codes) and torch.equal(r.scale, z.scale) and torch.equal(r.zero, z.zero)


def test_all_zero_and_constant_groups():
    w = torch.zeros(4, 64)
    w[1] = 0.5
    q = hqq_quantize(w, 4, 32)
    assert torch.isfinite(q.scale.float()).all()
    assert torch.allclose(q.dequantize(), w, atol=1e-3)
    with pytest.raises(ValueError, match="group_size=48 does not divide in_features=64"):
        hqq_quantize(w, 4, 48)


# ---- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"bits": 7}, r"HQQConfig bits=7 is not supported; allowed: 2, 3, 4, 8"),
    ({"group_size": 48}, r"HQQConfig group_size=48; allowed: None \(per-channel\), 32, 64, 128, 256"),
    ({"lp_norm": 0}, r"HQQConfig lp_norm=0 must be a number in \(0.0, 1.0\]"),
    ({"lp_norm": 1.5}, r"HQQConfig lp_norm=1.5 must be a number in \(0.0, 1.0\]"),
    ({"beta": 0.0}, r"HQQConfig beta=0.0 must be a number in \(0.0, 1000000000000.0\]"),
    ({"kappa": 0.5}, r"HQQConfig kappa=0.5 must be a number in \[1.0, 10.0\]"),
    ({"iters": -1}, r"HQQConfig iters=-1 must be an integer \[0, 1000\]"),
    ({"iters": True}, r"HQQConfig iters=True must be an integer"),
    ({"bits": 8, "group_size": 64}, r"HQQConfig bits=8 is per-channel symmetric int8"),
    ({"overrides": {"*.q_proj": {"lp_norm": 2.0}}}, r"HQQConfig lp_norm=2.0"),
    ({"overrides": {"*.q_proj": {"alpha": 0.5}}}, r"unknown: \['alpha'\]"),
])
def test_bad_configs(kw, match):
    with pytest.raises(ValueError, match=match):
        lessmem.HQQConfig(**kw)


def test_config_defaults_dict_roundtrip_and_exports():
    cfg = lessmem.HQQConfig(bits=3, overrides={"*.down_proj": {"iters": 5}})
    assert (cfg.group_size, cfg.iters, cfg.lp_norm, cfg.beta, cfg.kappa) == (64, 20, 0.7, 0.03, 1.01)
    assert cfg.method == "hqq" and not cfg.needs_calibration
    assert WeightConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.for_module("model.layers.0.mlp.down_proj").iters == 5
    assert cfg.for_module("lm_head") is None
    assert lessmem.weights.HQQConfig is lessmem.HQQConfig


# ---- quantize_, QuantLinear, checkpoint, CLI --------------------------------------------------

def test_quantize_model_overrides_and_checkpoint_roundtrip(tmp_path):
    base = tiny_random("llama", seed=5)
    m = tiny_random("llama", seed=5)
    cfg = lessmem.HQQConfig(bits=3, group_size=32,
                            overrides={"*.v_proj": {"iters": 0}, "*.o_proj": {"bits": 4}})
    rep = lessmem.quantize_(m, cfg, progress=False)
    assert rep["method"] == "hqq" and rep["n_quantized"] == 14
    attn = m.model.layers[0].self_attn
    assert type(attn.q_proj) is QuantLinear and attn.q_proj.bits == 3 and attn.o_proj.bits == 4
    w_v = base.model.layers[0].self_attn.v_proj.weight
    assert torch.equal(attn.v_proj.codes(), rtn_quantize(w_v, 3, 32, False).codes)  # iters=0: RTN
    w_q = base.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(attn.q_proj.dequantized_weight(), hqq_quantize(w_q, 3, 32).dequantize())
    lessmem.save_quantized(m, tmp_path)
    meta = json.loads((tmp_path / "lessmem_quant.json").read_text())
    assert WeightConfig.from_dict(meta["quantization"]) == cfg
    m2, _ = lessmem.load(str(tmp_path))
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)


def test_int4_fused_layout_runs_hqq_codes():
    w = _heavy(256, 256, seed=6)
    qw = hqq_quantize(w, 4, 64)
    q = QuantLinear.from_quantized(qw)
    x = torch.randn(3, 256)
    ref = x @ qw.dequantize().T
    # int4pack holds a bf16 scale (and zero s·(8 − zp)): close to, not bit-equal with, fp16
    assert torch.allclose(q(x), ref, atol=2e-2 * ref.abs().max().item())
    assert torch.equal(q.codes(), qw.codes) and torch.equal(q.zero(), qw.zero)


def test_cli_quantize_hqq(tmp_path, capsys):
    from lessmem.cli import main
    from lessmem.models import tiny_tokenizer

    src = tmp_path / "tiny"
    tiny_random("llama").save_pretrained(str(src))
    tiny_tokenizer().save_pretrained(str(src))
    out = tmp_path / "hqq"
    rc = main(["quantize", "--model", str(src), "--method", "hqq", "--bits", "3", "--group-size", "32",
               "--iters", "10", "--out", str(out), "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["method"] == "hqq" and rep["quantized_linears"] == 14
    assert rep["calibration"] == "none (no calibration)"
    meta = json.loads((out / "lessmem_quant.json").read_text())
    assert meta["quantization"]["iters"] == 10 and meta["quantization"]["lp_norm"] == 0.7
    assert main(["quantize", "--model", str(src), "--method", "hqq", "--lp-norm", "2",
                 "--out", str(tmp_path / "bad")]) == 2
    # the CLI checks --lp-norm itself, before loading the model (e9b46f3)
    assert "--lp-norm 2: allowed: a number in (0, 1]" in capsys.readouterr().err


def test_docstring_examples():
    import doctest

    import lessmem.weights.hqq as mod

    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
