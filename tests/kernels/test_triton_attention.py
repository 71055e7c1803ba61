"""The Triton decode-attention kernel (kernels/attention_triton.py) against the
dequantize-everything reference, run on CPU tensors under Triton's interpreter.

The interpreter runs in one child process for the whole module (``_triton_interpret``:
triton fixes its mode at import, so this process stays normal). Tolerance: float32
accumulated in another order, |out − ref| ≤ 2e-5·max|ref| + 1e-6 and lse within 1e-5
(absolute) + 1e-5 (relative); fully masked rows exactly 0 and −inf like the reference.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'lessmem[gpu]'); "
                                     "the Triton kernels are tested under its interpreter")

from _triton_interpret import run_interpreted  # noqa: E402

from lessmem.formats.kvlayout import KVLayout  # noqa: E402
from lessmem.kernels.attention import QuantKV, QuantSide, SegmentedKV  # noqa: E402
from lessmem.kernels.attention_reference import attention_reference  # noqa: E402
from lessmem.kvcache.codec import encode, kv_layout  # noqa: E402
from lessmem.kvcache.presets import resolve  # noqa: E402

TARGET = "lessmem.kernels.attention_triton:triton_attention"
# (bits, tg, dg, kind, packing): kind "zp" = uint8 zero points, "sym" = constant zero, "lut" = table
LAYOUTS = [(4, 1, 64, "zp", None), (4, 32, 1, "zp", None), (2, 32, 1, "zp", None), (2, 1, 32, "sym", None),
           (3, 64, 1, "zp", None), (3, 1, 16, "sym", None), (8, 1, 64, "sym", None), (8, 1, 64, "lut", None),
           (2, 16, 1, "lut", None), (4, 1, 16, "zp", "stream"), (1, 1, 64, "sym", None)]
PRESETS = ["int8", "int4", "kivi-4", "kivi-2", "best-4", "best-3", "best-2", "fp8"]


def _side(g, B, H, T, D, bits, tg, dg, kind, packing=None):
    codes = torch.randint(0, 256, (B, H, T, D * bits // 8), dtype=torch.uint8, generator=g)
    scale = (torch.rand(B, H, T // tg, D // dg, generator=g) * 0.2 + 0.01).half()
    zp = lut = None
    zc = 0.0
    if kind == "zp":
        zp = torch.randint(0, 2**bits, (B, H, T // tg, D // dg), dtype=torch.uint8, generator=g)
    elif kind == "sym":
        zc = 2.0 ** (bits - 1)
    else:
        lut = torch.randn(2**bits, generator=g)
    layout = KVLayout(bits, D, dg, tg, has_zero_point=zp is not None, zero_const=zc,
                      levels=None if lut is None else tuple(lut.tolist()), packing=packing)
    return QuantSide(codes, scale, zp, layout)


def _layout_case(bits, tg, dg, kind, packing):
    g = torch.Generator().manual_seed(bits * 100 + tg + dg)
    B, Hkv, Hq, Tq, D = 2, 2, 6, 3, 64
    T = 100 if tg == 1 else 128  # 100: a partial last tile
    kv = QuantKV(_side(g, B, Hkv, T, D, bits, tg, dg, kind, packing),
                 _side(g, B, Hkv, T, D, bits, tg, dg, kind, packing))
    q = torch.randn(B, Hq, Tq, D, generator=g) * 0.3
    mask = torch.zeros(B, Tq, T)
    mask[1, :, :40] = float("-inf")  # left padding of row 1
    mask[0, 2, 70:] = float("-inf")
    mask[1, 1] = float("-inf")  # a row that sees nothing
    return q, kv, mask


def _preset_case(name):
    cfg = resolve(name)
    g = torch.Generator().manual_seed(len(name))
    B, Hkv, Hq, T, D = 1, 2, 8, 128, 64
    sides = []
    for spec in (cfg.keys, cfg.values):
        x = torch.randn(B, Hkv, T, D, generator=g)
        enc = encode(x, spec)
        sides.append(QuantSide(enc.codes, enc.scale, enc.zero_point, kv_layout(spec, D)))
    return torch.randn(B, Hq, 1, D, generator=g) * 0.2, QuantKV(*sides), None


def _segmented_case():
    # blocks that are views into bigger buffers (strides of the buffer, not of the part)
    g = torch.Generator().manual_seed(5)
    B, Hkv, Hq, Tq, D, seg, bounds = 1, 2, 4, 2, 64, 64, [0, 64, 128, 160]
    big = QuantKV(_side(g, B, Hkv, 256, D, 4, 32, 1, "zp"), _side(g, B, Hkv, 256, D, 2, 1, 32, "zp"))
    kv = QuantKV(big.keys.slice_tokens(0, 160), big.values.slice_tokens(0, 160))

    def parts(side):
        return tuple((x.codes, x.scale, x.zero_point) for x in
                     (side.slice_tokens(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=False)))
    segs = SegmentedKV(kv.keys, kv.values, parts(kv.keys), parts(kv.values), seg)
    mask = torch.zeros(B, Tq, 160)
    mask[0, 1, 100:] = float("-inf")
    return torch.randn(B, Hq, Tq, D, generator=g) * 0.3, segs, kv, mask


CASES = {f"layout-{c}": _layout_case(*c) for c in LAYOUTS}
CASES.update({f"preset-{p}": _preset_case(p) for p in PRESETS})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    calls = {name: (TARGET, (q, kv, mask), {"n_split": 2}) for name, (q, kv, mask) in CASES.items()}
    q, segs, _, mask = _segmented_case()
    calls["segmented"] = (TARGET, (q, segs, mask), {"n_split": 2})
    calls["segmented-1"] = (TARGET, (q, segs, mask), {"n_split": 1})
    q, kv, mask = CASES["layout-(4, 1, 64, 'zp', None)"]
    calls["one-split"] = (TARGET, (q, kv, mask), {"n_split": 1})
    bad = QuantKV(QuantSide(kv.keys.codes, kv.keys.scale.to("meta"), kv.keys.zero_point, kv.keys.layout),
                  kv.values)
    calls["device-mismatch"] = (TARGET, (q, bad, mask), {})
    return run_interpreted(calls, tmp_path_factory.mktemp("triton"))


def _check(res, q, kv, mask):
    assert res[0] == "ok", res
    out, lse = res[1]
    ref, ref_lse = attention_reference(q, kv, mask)
    assert out.dtype == torch.float32 and out.shape == ref.shape and lse.shape == ref_lse.shape
    tol = 2e-5 * float(ref.abs().max()) + 1e-6
    err = float((out - ref).abs().max())
    assert err <= tol, f"max |out - ref| = {err:.3g} > {tol:.3g}"
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead) and torch.all(out[dead] == 0)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(results, name):
    _check(results[name], *CASES[name])


@pytest.mark.parametrize("name", ["segmented", "segmented-1"])
def test_segmented_history_read_in_place(results, name):
    q, _, kv, mask = _segmented_case()
    _check(results[name], q, kv, mask)


def test_one_split_and_two_agree(results):
    (_, (o1, l1)), (_, (o2, l2)) = results["one-split"], results["layout-(4, 1, 64, 'zp', None)"]
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-6)


def test_device_mismatch_is_refused_by_name(results):
    status, kind, msg = results["device-mismatch"]
    assert (status, kind) == ("error", "ValueError")
    assert "key part 0 scale is on meta, q on cpu" in msg


def test_cpu_tensors_without_the_interpreter_are_refused():
    from lessmem.kernels import attention_triton

    if attention_triton.interpreting():
        pytest.skip("this process runs under TRITON_INTERPRET=1")
    q, kv, mask = CASES["preset-int4"]
    with pytest.raises(ValueError, match=r"runs on CUDA tensors \(q is on cpu\).*TRITON_INTERPRET=1"):
        attention_triton.triton_attention(q, kv, mask)


def test_a_packing_the_kernel_does_not_know_is_refused_by_name():
    from lessmem.kernels.attention_triton import check_layout

    lay = KVLayout(4, 64, 64)
    object.__setattr__(lay, "packing", "nibble-swapped")  # a packing added to KVLayout later
    with pytest.raises(ValueError, match="cannot read layout KVLayout.*packing 'nibble-swapped'; allowed: split"):
        check_layout(lay)
