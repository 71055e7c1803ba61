"""The production torch fallbacks (``linear_torch``, ``gguf_linear_torch``) against their test
oracles (``linear_reference``, ``gguf_linear_reference``), the dispatch that picks them, and
the rule that no production module imports an oracle."""

import ast
import re
from pathlib import Path

import pytest
import torch
from _cases import gguf_rows as _raw
from _cases import lowbit_case as _lowbit_case
from _cases import random_gguf_blocks as _random_blocks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lessmem
from lessmem.formats.gguf import GGUF_TYPES
from lessmem.kernels import gguf_linear_cpp, gguf_linear_torch, linear_cpp, linear_torch
from lessmem.kernels import linear_reference as ref
from lessmem.kernels.gguf_linear_reference import gguf_linear_ref, gguf_weight_ref

ROWS = [1, 2, 3, 4, 5, 7, 8, 16]  # the batch sizes test_linear_kernels runs the C++ kernel at
TYPES = list(GGUF_TYPES)


@pytest.fixture(params=["one slice", "slices of 3 rows"])
def slices(request, monkeypatch):
    """Run each fallback with its default slicing and with the weight expanded 3 rows at a
    time (so slice boundaries, e.g. inside 3-bit code words, are crossed)."""
    if request.param != "one slice":
        monkeypatch.setattr(linear_torch, "row_slices",
                            lambda n, k: [(r, min(n, r + 3)) for r in range(0, n, 3)])
        monkeypatch.setattr(gguf_linear_torch, "row_slices", linear_torch.row_slices)
    return request.param


class _Seen(TorchDispatchMode):
    """Records the dtype and device of every tensor a torch op returns."""

    def __init__(self):
        super().__init__()
        self.dtypes, self.devices = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
                self.devices.add(t.device.type)
        return out


def _no_float64(fn):
    with _Seen() as seen:
        y = fn()
    assert torch.float64 not in seen.dtypes and seen.dtypes, seen.dtypes
    return y


# ---------------------------------------------------------------- linear_torch


@pytest.mark.parametrize("m", [1, 3, 20])
def test_int8_fallback_matches_oracle(slices, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randint(-127, 128, (48, 96), dtype=torch.int8, generator=g)
    s = (torch.rand(48, generator=g) / 50).half()
    x = torch.randn(m, 96, generator=g)
    y = _no_float64(lambda: linear_torch.int8_linear_torch(x, w, s))
    torch.testing.assert_close(y, ref.int8_linear_ref(x, w, s), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,k", [(1, 64), (5, 64), (3, 4096)])
def test_w8a8_fallback_integer_sums_exact(slices, m, k):
    """The sums are exact integers (as the C++ kernel's int32 ones) even where one float32
    dot product over K would round: at K = 4096 sums reach 4096 · 127² > 2²⁴."""
    g = torch.Generator().manual_seed(k + m)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    xq[0] = 127
    w = torch.randint(-127, 128, (32, k), dtype=torch.int8, generator=g)
    w[:4] = torch.randint(120, 128, (4, k), dtype=torch.int8, generator=g)  # sums near 2^26
    ones_x, ones_w = torch.ones(m), torch.ones(32, dtype=torch.float16)
    y = _no_float64(lambda: linear_torch.w8a8_linear_torch(xq, ones_x, w, ones_w))
    assert torch.equal(y, (xq.long() @ w.long().T).float())
    sx, sw = torch.rand(m, generator=g) / 100, (torch.rand(32, generator=g) / 50).half()
    torch.testing.assert_close(linear_torch.w8a8_linear_torch(xq, sx, w, sw),
                               ref.w8a8_linear_ref(xq, sx, w, sw), rtol=1e-6, atol=0)


def test_act16_rounding_matches_oracle_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 256, generator=g) * torch.rand(7, 1, generator=g) * 10
    x[2, :64] = 0  # an all-zero group: d = 0, q = 0
    x[3, 5] = 1e4  # an outlier coarsens its own group only
    q, d = linear_torch.quantize_act16(x, 64)
    q_ref, d_ref = ref.quantize_act16(x, 64)
    assert torch.equal(q, q_ref.float()) and torch.equal(d, d_ref)
    assert d[2, 0] == 0 and (q[2, :64] == 0).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("gs,n,k", [(32, 37, 224), (64, 19, 576), (128, 5, 384), (32, 7, 512)])
def test_lowbit_fallback_matches_oracle(slices, bits, sym, gs, n, k):
    u, codes, scale, zero = _lowbit_case(bits, n, k, gs, sym, bits * 1000 + gs + n)
    w = ref.dequant_grouped_weight(u, scale, zero, gs)
    gen = torch.Generator().manual_seed(7)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        y = _no_float64(lambda x=x: linear_torch.lowbit_linear_torch(x, codes, bits, scale, zero, gs))
        assert y.dtype == torch.float32 and y.shape == (m, n)
        torch.testing.assert_close(y, ref.lowbit_linear_ref(x, codes, bits, scale, zero, gs),
                                   rtol=1e-5, atol=1e-5)
        # the 16-bit activation rounding stays inside its bound against float activations
        _, d = ref.quantize_act16(x, gs)
        bound = (d.double().repeat_interleave(gs, dim=1) / 2) @ w.abs().T
        bound += 1e-5 * (x.double().abs() @ w.abs().T)
        assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


def test_lowbit_fallback_bias(slices):
    u, codes, scale, zero = _lowbit_case(3, 9, 64, 32, False, 3)
    x, bias = torch.randn(3, 64), torch.randn(9)
    y = linear_torch.lowbit_linear_torch(x, codes, 3, scale, zero, 32, bias)
    torch.testing.assert_close(y, ref.lowbit_linear_ref(x, codes, 3, scale, zero, 32) + bias,
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- gguf_linear_torch


@pytest.mark.parametrize("t", TYPES)
def test_gguf_torch_decoders_bit_identical(t):
    n, k = 6, 512
    for raw in (_raw(t, n, k, seed=1), _random_blocks(t, n, k, seed=2)):
        oracle = gguf_weight_ref(raw, t, n)
        with _Seen() as seen:
            w = gguf_linear_torch.gguf_dequantize_torch(raw, t, n)
        assert torch.float64 not in seen.dtypes
        assert w.shape == (n, k) and w.numpy().tobytes() == oracle.numpy().tobytes()


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_gguf_fallback_matches_oracle(slices, t, m):
    n, k = 37, 512
    raw = _raw(t, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
    y = _no_float64(lambda: gguf_linear_torch.gguf_linear_torch(x, raw, t, n))
    oracle = gguf_linear_ref(x, raw, t, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, oracle, rtol=1e-5, atol=1e-5 * oracle.abs().max().item())


def test_gguf_fallback_leading_dims_bias_dtype(slices):
    raw = _raw("q6_k", 8, 256, seed=3)
    x, b = torch.randn(2, 3, 256), torch.randn(8)
    y = gguf_linear_torch.gguf_linear_torch(x, raw, "q6_k", 8, bias=b)
    assert y.shape == (2, 3, 8)
    torch.testing.assert_close(y, gguf_linear_ref(x, raw, "q6_k", 8) + b, rtol=1e-5, atol=1e-5)
    yb = gguf_linear_torch.gguf_linear_torch(x.bfloat16(), raw, "q6_k", 8)
    assert yb.dtype == torch.bfloat16


def test_gguf_fallback_does_not_go_through_numpy(monkeypatch):
    raw, x = _raw("q4_k", 4, 256, seed=0), torch.randn(2, 256)
    expect = gguf_linear_ref(x, raw, "q4_k", 4)

    def refuse(self, *args, **kwargs):
        raise AssertionError("Tensor.numpy() called on the fallback path")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    y = gguf_linear_torch.gguf_linear_torch(x, raw, "q4_k", 4)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- dispatch


def test_without_compiler_the_kernels_run_the_torch_fallbacks(monkeypatch):
    monkeypatch.setattr(linear_cpp, "_mod", lambda: None)
    monkeypatch.setattr(gguf_linear_cpp, "_mod", lambda: None)
    u, codes, scale, zero = _lowbit_case(4, 11, 128, 32, False, 9)
    x, bias = torch.randn(2, 3, 128), torch.randn(11)
    y = linear_cpp.lowbit_linear(x, codes, 4, scale, zero, 32, bias)
    assert torch.equal(y, linear_torch.lowbit_linear_torch(x.reshape(6, 128), codes, 4, scale,
                                                           zero, 32, bias).view(2, 3, 11))
    w, s = torch.randint(-127, 128, (11, 128), dtype=torch.int8), (torch.rand(11) / 50).half()
    assert torch.equal(linear_cpp.int8_linear(x, w, s),
                       linear_torch.int8_linear_torch(x.reshape(6, 128), w, s).view(2, 3, 11))
    xq, sx = torch.randint(-127, 128, (3, 128), dtype=torch.int8), torch.rand(3)
    assert torch.equal(linear_cpp.w8a8_linear(xq, sx, w, s),
                       linear_torch.w8a8_linear_torch(xq, sx, w, s))
    raw = _raw("q5_k", 11, 256, seed=4)
    xg = torch.randn(3, 256)
    assert torch.equal(gguf_linear_cpp.gguf_linear(xg, raw, "q5_k", 11, bias),
                       gguf_linear_torch.gguf_linear_torch(xg, raw, "q5_k", 11, bias))
    assert torch.equal(gguf_linear_cpp.gguf_dequantize(raw, "q5_k", 11, 256),
                       gguf_weight_ref(raw, "q5_k", 11))


def test_tensors_off_the_cpu_take_the_torch_fallback():
    """Tensors on another device (here ``meta``, which has no memory the C++ kernels could
    read) go the torch path on their own device, whether or not the kernels compiled."""
    meta = torch.device("meta")
    u, codes, scale, zero = _lowbit_case(3, 11, 128, 32, False, 9)
    x = torch.randn(2, 128, device=meta)
    raw = _raw("q3_k", 11, 256, seed=5).to(meta)
    w, s = torch.empty(11, 128, dtype=torch.int8, device=meta), scale[:, 0].to(meta)
    with _Seen() as seen:
        y = linear_cpp.lowbit_linear(x, codes.to(meta), 3, scale.to(meta), zero.to(meta), 32)
        y8 = linear_cpp.int8_linear(x, w, s)
        xq = torch.empty(2, 128, dtype=torch.int8, device=meta)
        y88 = linear_cpp.w8a8_linear(xq, torch.empty(2, device=meta), w, s)
        yg = gguf_linear_cpp.gguf_linear(torch.randn(2, 256, device=meta), raw, "q3_k", 11)
        wg = gguf_linear_cpp.gguf_dequantize(raw, "q3_k", 11, 256)
    for out, shape in ((y, (2, 11)), (y8, (2, 11)), (y88, (2, 11)), (yg, (2, 11)), (wg, (11, 256))):
        assert out.device == meta and tuple(out.shape) == shape and out.dtype == torch.float32
    assert seen.devices == {"meta"}  # decoded where the tensors are: nothing came to the CPU


# ---------------------------------------------------------------- oracles stay test-only

SRC = Path(lessmem.__file__).parent
ORACLES = sorted(".".join(("lessmem", *p.relative_to(SRC).with_suffix("").parts))
                 for p in SRC.rglob("*_reference.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _docstrings(tree):
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _named_modules(source: str, module: str, is_package: bool):
    """Every dotted name ``source`` imports (``import a.b``, ``from ..a import b`` resolved
    against ``module``) and every non-docstring string shaped like a module ``*_reference``
    (as ``importlib.import_module`` and the lazy exports take)."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join([*base, *([node.module] if node.module else [])])
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if re.fullmatch(r"[\w.]*_reference", node.value):
                yield node.value


def _relative_match(name: str, oracle: str) -> bool:
    """A module string such as ``"._reference"`` (lazy exports) that names ``oracle``'s tail."""
    return name.endswith("_reference") and ("." + oracle).endswith("." + name.lstrip("."))


def _oracle_users():
    users = []
    for path in SRC.rglob("*.py"):
        module = _module_name(path)
        if module in ORACLES:  # an oracle may build on another oracle
            continue
        names = _named_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
        for name in names:
            if any(name == o or name.startswith(o + ".") or _relative_match(name, o) for o in ORACLES):
                users.append((module, name))
    return users


def test_no_production_module_imports_a_test_oracle():
    """The ``*_reference`` modules are the tests' oracles (slow, float64, obviously correct);
    the production fallbacks are ``*_torch`` (kernels) and nothing in lessmem imports an
    oracle. attention_reference's fallback is attention_torch; linear_reference's is
    linear_torch; gguf_linear_reference's is gguf_linear_torch."""
    assert {"lessmem.kernels.attention_reference", "lessmem.kernels.linear_reference",
            "lessmem.kernels.gguf_linear_reference", "lessmem.formats._reference",
            "lessmem.formats._gguf_reference", "lessmem.eval._reference",
            "lessmem.plan._reference"} <= set(ORACLES)
    assert _oracle_users() == []


@pytest.mark.parametrize("source,module", [
    ("from . import linear_reference as ref", "lessmem.kernels.linear_cpp"),
    ("from .gguf_linear_reference import gguf_weight_ref", "lessmem.kernels.gguf_linear_cpp"),
    ("from ..formats._reference import pack_bits_reference", "lessmem.weights.rtn"),
    ("import lessmem.eval._reference", "lessmem.eval.cli"),
    ("import importlib\nm = importlib.import_module('lessmem.plan._reference')", "lessmem.plan.cli"),
])
def test_the_oracle_import_check_sees_each_form(source, module):
    names = set(_named_modules(source, module, False))
    assert any(n in ORACLES or n.startswith(tuple(o + "." for o in ORACLES)) for n in names), names
