"""Fused GGUF dequant-matmul (C++ and its torch fallback, ``gguf_linear_torch``) against the
test oracle ``gguf_linear_reference`` (numpy decoders, float64 matmul);
GGUFLinear and apply_gguf on a tiny Llama."""

import copy

import pytest
import torch
from _cases import gguf_rows as _raw
from _cases import random_gguf_blocks as _random_blocks
from transformers import LlamaConfig, LlamaForCausalLM

import lessmem
from lessmem.formats.gguf import dequantize_gguf, gguf_type, quantize_gguf
from lessmem.kernels import gguf_linear_cpp as kern
from lessmem.kernels.gguf_linear_reference import gguf_linear_ref, gguf_weight_ref
from lessmem.models import tiny_random
from lessmem.weights.gguf_apply import apply_gguf
from lessmem.weights.gguf_linear import GGUFLinear

TYPES = list(kern.KERNEL_TYPES)  # the ten of GGUF_TYPES and iq4_nl, iq4_xs


@pytest.fixture(params=["cpp", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(kern, "_mod", lambda: None)
    elif not kern.available():
        pytest.skip("no C++ compiler: only the torch fallback runs")
    return request.param


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_fused_matches_reference(backend, t, m):
    n, k = 37, 512  # odd N; two K-quant super-blocks, 16 legacy blocks per row
    raw = _raw(t, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
    y = kern.gguf_linear(x, raw, t, n)
    ref = gguf_linear_ref(x, raw, t, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("t", ["q4_0", "q5_1", "q4_k", "q6_k", "iq4_xs"])
def test_threaded_large_layers(t):
    """Over ~1M weights the rows are split across threads (the pool): same results."""
    n, k = 613, 2048
    raw = _raw(t, n, k, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        for m in (1, 3, 9):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            ref = gguf_linear_ref(x, raw, t, n)
            torch.testing.assert_close(kern.gguf_linear(x, raw, t, n), ref, rtol=1e-5,
                                       atol=1e-5 * ref.abs().max().item())
        assert torch.equal(kern.gguf_dequantize(raw, t, n, k), dequantize_gguf(raw, t, (n, k)))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("t", TYPES)
def test_decoders_bit_identical(backend, t):
    n, k = 6, 512
    for raw in (_raw(t, n, k, seed=1), _random_blocks(t, n, k, seed=2)):
        ref = dequantize_gguf(raw, t, (n, k))
        dq = kern.gguf_dequantize(raw, t, n, k)
        assert dq.numpy().tobytes() == ref.numpy().tobytes()  # every bit, signs of zero too
        # straight to bfloat16 (prompt rows on AMX-BF16): torch's round-to-nearest-even of the float32 decode
        dq16 = kern.gguf_dequantize(raw, t, n, k, dtype=torch.bfloat16)
        assert dq16.dtype == torch.bfloat16
        assert torch.equal(dq16.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
        # the fused path on one-hot inputs returns each weight exactly
        assert torch.equal(kern.gguf_linear(torch.eye(k), raw, t, n).T, ref)


def test_batched_leading_dims_bias_and_dtype(backend):
    raw = _raw("q4_k", 8, 256, seed=3)
    x, b = torch.randn(2, 3, 256), torch.randn(8)
    y = kern.gguf_linear(x, raw, "Q4_K", 8, bias=b)
    assert y.shape == (2, 3, 8)
    torch.testing.assert_close(y, gguf_linear_ref(x, raw, "q4_k", 8) + b, rtol=1e-5, atol=1e-5)
    yb = kern.gguf_linear(x.bfloat16(), raw, "q4_k", 8)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), gguf_linear_ref(x.bfloat16().float(), raw, "q4_k", 8),
                               rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="bias has 7 values; out_features=8"):
        kern.gguf_linear(x, raw, "q4_k", 8, bias=torch.zeros(7))


def test_kernel_bad_inputs():
    raw = _raw("q8_0", 4, 64, seed=0)
    with pytest.raises(ValueError, match=r"'Q9_K' is not supported; allowed: Q4_0, .*Q6_K"):
        kern.gguf_linear(torch.randn(1, 64), raw, "Q9_K", 4)
    with pytest.raises(ValueError, match=r"raw holds 272 bytes but \[4, 96\] in Q8_0 needs 408"):
        kern.gguf_linear(torch.randn(1, 96), raw, "q8_0", 4)
    with pytest.raises(ValueError, match="in_features=48 must be a positive multiple of the Q8_0 block size 32"):
        kern.gguf_dequantize(raw, "q8_0", 4, 48)
    with pytest.raises(ValueError, match="uint8 torch.Tensor"):
        kern.gguf_linear(torch.randn(1, 64), raw.to(torch.int16), "q8_0", 4)
    with pytest.raises(ValueError, match=r"dtype=torch.float16; allowed: torch.float32, torch.bfloat16"):
        kern.gguf_dequantize(raw, "q8_0", 4, 64, dtype=torch.float16)


# ---------------------------------------------------------------- GGUFLinear


@pytest.mark.parametrize("t", ["q4_0", "q5_1", "q8_0", "q3_k", "q4_k", "q6_k"])
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_gguf_linear_module(t, m):
    torch.manual_seed(m)
    lin = torch.nn.Linear(256, 45)  # odd out_features, with bias
    q = GGUFLinear.from_linear(lin, t.upper())
    assert q.gguf_type == t and q.qweight.dtype == torch.uint8
    w_hat = dequantize_gguf(quantize_gguf(lin.weight.detach(), t), t, (45, 256))
    assert torch.equal(q.dequantized_weight(), w_hat)
    x = torch.randn(m, 256)
    ref = x.double() @ w_hat.double().T + lin.bias.double()
    torch.testing.assert_close(q(x).double(), ref, rtol=1e-5, atol=1e-5)
    assert q.nbytes == 45 * 256 * gguf_type(t).bits_per_weight / 8 + 45 * 4
    assert q(x.bfloat16()).dtype == torch.bfloat16


def test_gguf_linear_no_bias_and_state_dict():
    lin = torch.nn.Linear(512, 16, bias=False)
    q = GGUFLinear.from_linear(lin, "q4_k")
    assert q.bias is None and set(q.state_dict()) == {"qweight"}
    assert q.nbytes == 16 * 2 * 144
    q2 = GGUFLinear(512, 16, "q4_k", bias=False)
    q2.load_state_dict(q.state_dict())
    x = torch.randn(1, 512)
    assert torch.equal(q(x), q2(x))


def test_gguf_linear_bad_inputs():
    with pytest.raises(ValueError, match="'Q3_K_XL' is not supported; allowed: Q4_0, Q4_1, Q5_0"):
        GGUFLinear(256, 8, "Q3_K_XL")
    with pytest.raises(ValueError, match="in_features=288 must be a positive multiple of the Q4_K block size 256"):
        GGUFLinear(288, 8, "q4_k")
    with pytest.raises(ValueError, match="raw has shape"):
        GGUFLinear.from_raw(torch.zeros(4, 10, dtype=torch.uint8), "q8_0", 64)
    with pytest.raises(ValueError, match="2-D uint8"):
        GGUFLinear.from_raw(torch.zeros(4, 68), "q8_0", 64)
    with pytest.raises(ValueError, match="input has 32 features; this layer takes 64"):
        GGUFLinear(64, 4, "q8_0")(torch.randn(1, 32))


# ---------------------------------------------------------------- apply_gguf


def _old_float_path(model, types):
    """What apply_gguf did before GGUFLinear: decode each weight back into the nn.Linear."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name in types:
                t = types[name]
                mod.weight.copy_(dequantize_gguf(quantize_gguf(mod.weight, t), t, tuple(mod.weight.shape)))


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q4_0", "Q8_0", "Q6_K"])
def test_apply_gguf_matches_float_path_and_shrinks(mix):
    m = tiny_random("llama", hidden_size=256, intermediate_size=512, num_heads=4)
    old = copy.deepcopy(m)
    fp32_bytes = sum(mod.weight.numel() * 4 for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    rep = apply_gguf(m, lessmem.GGUFConfig(mix))
    _old_float_path(old, rep["types"])
    assert set(rep) >= {"method", "config", "types", "bytes", "bits_per_weight", "n_quantized"}
    assert rep["kept_float"] == {} and rep["n_quantized"] == 15
    held = [mod for mod in m.modules() if isinstance(mod, GGUFLinear)]
    assert len(held) == 15 and not any(type(mod) is torch.nn.Linear for mod in m.modules())
    assert rep["bytes_held"] == sum(q.nbytes for q in held) == rep["bytes"]  # no biases in Llama
    assert rep["bytes_held"] < fp32_bytes / 3.5
    x = torch.randint(0, 272, (2, 24))
    with torch.no_grad():
        assert torch.equal(m(x).logits, old(x).logits)  # 48 rows: decode once + BLAS, same floats
        y, ref = m(x[:1, :5]).logits, old(x[:1, :5]).logits  # 5 rows: the fused kernel
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_apply_gguf_tied_lm_head_stays_float():
    cfg = LlamaConfig(vocab_size=272, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    old = copy.deepcopy(m)
    rep = apply_gguf(m, lessmem.GGUFConfig("Q4_K_M"))
    assert list(rep["kept_float"]) == ["lm_head"] and rep["types"]["lm_head"] == "q6_k"
    assert type(m.lm_head) is torch.nn.Linear and m.lm_head.weight is m.model.embed_tokens.weight
    assert rep["bytes"] > rep["bytes_held"]  # the tied Q6_K tensor is counted, not held as blocks
    _old_float_path(old, rep["types"])
    x = torch.randint(0, 272, (1, 30))
    with torch.no_grad():
        assert torch.equal(m(x).logits, old(x).logits)


def test_gguf_weight_ref_shape():
    raw = _raw("q6_k", 3, 512, seed=5)
    assert gguf_weight_ref(raw, "q6_k", 3).shape == (3, 512)


# ---- int8 activations (gguf_linear_q8, llama.cpp's quantized matmul) ----

def _q8_reference(x, raw, t, n, absolute=False):
    """float64: x rounded to int8 per block of 32 as the kernel rounds it (float32 dx = amax /
    127, codes rint(x * (1 / dx))), times the decoded weight (``absolute``: |x| times
    |weight|, the size the sums' rounding errors scale with)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(d > 0, torch.round(xb * torch.where(d > 0, 1 / d, 0)), 0)
    xq = codes.double() * d.double()
    w = gguf_weight_ref(raw, t, n).double()
    return xq.reshape(x.shape).abs() @ w.abs().T if absolute else xq.reshape(x.shape) @ w.T


@pytest.mark.parametrize("t", kern.Q8_TYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_q8_activations_match_reference(backend, t, m):
    n, k = 300, 512  # enough rows for two threads
    raw = _raw(t, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7 + m))
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    y = kern.gguf_linear_q8(x, raw, t, n).double()
    ref = _q8_reference(x, raw, t, n)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    # the int8 rounding moves y a little against float activations, not more
    yf = gguf_linear_ref(x, raw, t, n).double()
    assert 0 < (y - yf).abs().max() <= 0.05 * yf.abs().max()


@pytest.mark.parametrize("t", kern.Q8_TYPES)
def test_q8_rows_independent_of_batch(t):
    n, k = 200, 256
    raw = _raw(t, n, k, seed=3)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    together = kern.gguf_linear_q8(x, raw, t, n)
    alone = torch.cat([kern.gguf_linear_q8(x[i:i + 1], raw, t, n) for i in range(9)])
    assert torch.equal(together, alone)  # bit for bit: serve's batched rows equal alone


@pytest.mark.parametrize("t", kern.Q8_TYPES)
@pytest.mark.parametrize("k", [32, 96, 576, 1536])
def test_q8_block_counts_and_row_tails(t, k):
    """Rows of 1, 3, 18 and 48 blocks (an odd count leaves the last pair of blocks half
    empty, 18 a group of 16 and one of 2 in the 512-bit path), 37 rows (not a multiple of
    the four a call takes), random bytes in every field (subnormal and zero scales among
    them), 1-6 x rows: as the reference, and each x row as alone."""
    n = 37
    raw = _random_blocks(t, n, k, seed=k)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(k))
    alone = torch.cat([kern.gguf_linear_q8(x[i:i + 1], raw, t, n) for i in range(6)])
    # random scales make sums that cancel: the rounding is bounded by the sum of |terms|
    size = _q8_reference(x.abs(), raw, t, n, absolute=True)
    for m in (1, 2, 3, 5, 6):
        y = kern.gguf_linear_q8(x[:m], raw, t, n)
        ref = _q8_reference(x[:m], raw, t, n)
        assert ((y.double() - ref).abs() <= 1e-6 * size[:m]).all()
        assert torch.equal(y, alone[:m])


_GUARD_PAGE = """
import ctypes, mmap, sys, torch
from lessmem.formats.gguf import gguf_type
from lessmem.kernels import gguf_linear_cpp as kern
t, n, k = sys.argv[1], 5, 96
row = k // 32 * gguf_type(t).type_size
page = mmap.PAGESIZE
mm = mmap.mmap(-1, 2 * page)
base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
raw = torch.frombuffer(mm, dtype=torch.uint8, count=n * row, offset=page - n * row).view(n, row)
raw.copy_(torch.randint(0, 256, (n, row), dtype=torch.uint8))
raw.view(-1)[1::2] &= 0x3B  # (finite fp16 scales wherever they fall: high bytes < 0x3C)
assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(base + page), page, 0) == 0  # the next page: unreadable
y = kern.gguf_linear_q8(torch.randn(3, k), raw, t, n)
print("ok", bool(torch.isfinite(y).all()))
"""


@pytest.mark.skipif(not kern.available(), reason="no C++ compiler: only the torch fallback runs")
@pytest.mark.parametrize("t", kern.Q8_TYPES)
def test_q8_reads_nothing_past_the_last_block(t):
    """Weights that end where readable memory ends (the next page unreadable): the kernels'
    vector loads take only a block's own bytes, so the last block of the last row does not
    fault (memory-mapped GGUF files end somewhere)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _GUARD_PAGE, t], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["ok", "True"], out.stderr[-2000:]


def test_q8_bad_inputs_and_module_switch():
    raw = _raw("q4_k", 4, 256, seed=0)
    with pytest.raises(ValueError, match="q4_0, q4_1, q8_0"):
        kern.gguf_linear_q8(torch.randn(1, 256), raw, "q4_k", 4)
    with pytest.raises(ValueError, match="int8_activations"):
        GGUFLinear(256, 4, "q4_0", int8_activations="yes")
    lin = torch.nn.Linear(256, 8)
    q = GGUFLinear.from_linear(lin, "q4_1")
    x = torch.randn(2, 256)
    exact = q(x)
    from lessmem.weights.gguf_linear import set_int8_activations
    assert set_int8_activations(torch.nn.Sequential(q), True) == 1
    approx = q(x)
    assert not torch.equal(exact, approx)
    assert torch.allclose(approx.double(), (_q8_reference(x, q.qweight, "q4_1", 8) + q.bias.double()), atol=1e-5)
    x20 = torch.randn(20, 256)  # more than FUSED_MAX_ROWS rows (prefill): BLAS, float32 activations
    w = q.dequantized_weight()  # or bf16 ones where the CPU multiplies bf16 (gguf_linear.BF16_PROMPT_ROWS)
    from lessmem.weights.gguf_linear import BF16_PROMPT_ROWS
    want = (torch.nn.functional.linear(x20.bfloat16(), w.bfloat16()).float() + q.bias if BF16_PROMPT_ROWS
            else torch.nn.functional.linear(x20, w, q.bias))
    assert torch.equal(q(x20), want)


def test_rms_norm_rows_bit_identical_to_transformers_steps():
    """The lean step's RMSNorm (``rms_norm_rows``) adds the squares itself in at::sum's order
    where its check found that order, else calls at::mean: either way the same bits as
    transformers' float32 steps, for row lengths below, at and past one vector, long rows
    (the reduction's cascade levels), several rows, and every magnitude."""
    g = kern._mod()
    if g is None:
        pytest.skip("no C++ compiler")
    gen = torch.Generator().manual_seed(0)
    for H in [*range(1, 70), 127, 128, 129, 576, 577, 896, 2048, 2049, 5000, 40000]:
        for R in (1, 3):
            scale = 10 ** (torch.rand(1, generator=gen).item() * 6 - 3)
            x = torch.randn(R, 1, H, generator=gen) * scale
            w = torch.randn(H, generator=gen)
            ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
            assert torch.equal(g.rms_norm_rows(x, w, 1e-6), ref), (H, R)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # x86: vectors of 8 or 16 floats
        assert g.rms_sum_width(576) in (8, 16)  # (the built-in model's rows: added here)
    assert g.rms_sum_width(15) == 0  # (shorter than a vector: torch's scalar loop, its own call)
    with pytest.raises(ValueError, match="rms_norm_rows"):
        g.rms_norm_rows(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3), 1e-6)


def test_qkv_rope_and_silu_mul_rows_bit_identical_to_torch_ops():
    """The lean step's one-call glue: ``qkv_rope_rows`` splits a fused q/k/v row into heads
    and rotates q and k as transformers does (q·cos + rotate_half(q)·sin); ``silu_mul_rows``
    is F.silu(gate) · up. The same bits as the torch ops, two rows at once; bad shapes named."""
    g = kern._mod()
    if g is None:
        pytest.skip("no C++ compiler")
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D = 2, 6, 2, 32
    y = torch.randn(B, 1, (Hq + 2 * Hkv) * D, generator=gen)
    cos, sin = torch.randn(B, 1, D, generator=gen), torch.randn(B, 1, D, generator=gen)

    def rope(t):  # transformers' rotate_half form with the sign folded into sin (as the step passes it)
        half = D // 2
        s = torch.cat([-sin[..., :half], sin[..., half:]], -1).unsqueeze(1)
        return t * cos.unsqueeze(1) + torch.cat([t[..., half:], t[..., :half]], -1) * s

    folded = torch.cat([-sin[..., :D // 2], sin[..., D // 2:]], -1)
    q, k, v = g.qkv_rope_rows(y, cos, folded, Hq, Hkv, D)
    nq, nk = Hq * D, Hkv * D
    assert torch.equal(q, rope(y[..., :nq].view(B, Hq, 1, D)))
    assert torch.equal(k, rope(y[..., nq:nq + nk].view(B, Hkv, 1, D)))
    assert torch.equal(v, y[..., nq + nk:].view(B, Hkv, 1, D))
    gu = torch.randn(B, 1, 2 * 100, generator=gen) * 4
    assert torch.equal(g.silu_mul_rows(gu), torch.nn.functional.silu(gu[..., :100]) * gu[..., 100:])
    with pytest.raises(ValueError, match="qkv_rope_rows"):
        g.qkv_rope_rows(y, cos, folded, Hq, Hkv + 1, D)
    with pytest.raises(ValueError, match="silu_mul_rows"):
        g.silu_mul_rows(torch.zeros(3, 5))
