"""``GGUFLinear``: a linear layer whose weight is held as raw GGUF blocks.

The weight ``W [N, K]`` (``N = out_features``, ``K = in_features``) lives in the one
registered buffer ``qweight`` — uint8 ``[N, K / block_size * type_size]``, the bytes a
``.gguf`` file stores for the tensor (llama.cpp's layout, any of the twelve types of
``kernels.gguf_linear_cpp.KERNEL_TYPES``: the ten of ``formats.gguf`` and IQ4_NL / IQ4_XS) — plus an optional float32 ``bias`` (and ``out_perm``, below). Nothing else is kept, so
``nbytes`` is ``N · K · bpw / 8`` (+ bias): Q4_0 4.5 bits per weight, Q4_K 4.5, Q6_K
6.5625, Q8_0 8.5, against 32 for the float layer.

Forward: up to ``FUSED_MAX_ROWS`` input rows (decoding) go through the op
``torch.ops.lessmem.gguf_linear`` (``kernels.linear_ops``): on CPU tensors the fused C++
kernel ``kernels.gguf_linear_cpp.gguf_linear`` (blocks decoded in registers, no float
matrix), on CUDA the Triton kernel ``kernels.gguf_linear_triton``; more rows (prefill)
decode the weight once (``torch.ops.lessmem.gguf_dequantize``, bit-identical to
``formats.gguf.dequantize_gguf``) and use BLAS, then drop it. Without a compiler, on
another device, or for a type the Triton kernel does not take, the torch fallback
``kernels.gguf_linear_torch`` runs (after one warning where a faster kernel was expected).

Rows held in another order than the outputs (``out_perm``): a llama.cpp file stores the q/k
projections of a Llama with each head's rotary pairs interleaved, where transformers
expects the two halves. Reordering those rows would copy them (8 MB on the built-in model,
held beside the file's own pages); with ``out_perm`` the layer keeps the file's rows as
they are mapped and gathers its outputs instead (output ``j`` is row ``out_perm[j]``; one
``index_select`` of a few hundred floats per decode call). Everything seen from outside is
in output order: ``weight``, ``dequantized_weight()``, ``state_dict()`` (a checkpoint holds
the rows reordered: it loads into a layer without ``out_perm``, or back into this one's order)
and ``rows_in_output_order()``.

Example:
    >>> import torch
    >>> from lessmem.weights.gguf_linear import GGUFLinear
    >>> _ = torch.manual_seed(0)
    >>> lin = torch.nn.Linear(256, 64)
    >>> q = GGUFLinear.from_linear(lin, "Q4_K")
    >>> q.gguf_type, q.nbytes, q.bits_per_weight
    ('q4_k', 9472, 4.5)
    >>> x = torch.randn(2, 256)
    >>> bool((q(x) - lin(x)).abs().max() < 0.2)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.gguf import quantize_gguf
from ..kernels import gguf_linear_cpp as kernel
from ..kernels import linear_ops  # noqa: F401  (registers torch.ops.lessmem.gguf_linear)
from ..kernels._build import cpu_capability
from .qlinear import FUSED_MAX_ROWS, held_nbytes  # FUSED_MAX_ROWS: above it, decode once + BLAS
from .rtn import check_size

_GGUF = torch.ops.lessmem.gguf_linear.default  # by overload: less dispatch per call
_DEQUANT = torch.ops.lessmem.gguf_dequantize.default
DECODE_WEIGHTS_MAX = 1 << 22  # prefill decodes at most this many weights (16 MB of floats) at once


def _has_bf16_dot() -> bool:
    """The CPU multiplies bfloat16 in hardware: AMX-BF16 tiles or AVX512-BF16 dot products
    (another torch, without the report: no, float32 stays)."""
    cap = cpu_capability()
    return bool(cap.get("amx_bf16") or cap.get("avx512_bf16"))


# Prompt rows (more than FUSED_MAX_ROWS) of a layer with int8_activations multiply bfloat16
# copies of x and of the decoded weight where the CPU multiplies bfloat16 in hardware
# (AMX-BF16 or AVX512-BF16: oneDNN's kernels; float32 sums, bf16 products out), and that
# layer's prompt attention takes bf16 q, k, v (kvcache.attention): the reduced-precision
# activations llama.cpp also uses for prompts (it rounds them to int8, its KV to f16). The
# evaluation switches int8 activations off, and with them this. bench_e2e on the built-in
# model, a two-core Sapphire Rapids class Xeon (AMX), chunks of 256 (e2e_prefill_fp32.json ->
# e2e_prefill_bf16.json, fresh processes): 4096-token prompt 11.7 -> 8.4 s (DynamicCache),
# 12.0 -> 9.1 s (best-4). On a two-core AMD EPYC with AVX512-BF16 and no AMX, chunks of 512
# (e2e_prefill_avx512bf16_before.json -> _after.json, same sitting): 1024 tokens 2.5 -> 1.2 s
# (DynamicCache), 2.3 -> 1.3 s (best-4); 4096 tokens 12.1 -> 8.2 s, 12.2 -> 9.0 s. Elsewhere
# float32, as without the flag.
BF16_PROMPT_ROWS = _has_bf16_dot()


class GGUFLinear(nn.Module):
    """A linear layer with its weight in a GGUF block type; see the module doc."""

    def __init__(self, in_features: int, out_features: int, gguf_type, bias: bool = True, *,
                 qweight: torch.Tensor | None = None, int8_activations: bool = False,
                 out_perm: torch.Tensor | None = None):
        """``qweight``: raw rows to hold as they are (no copy: a view of a memory-mapped file
        stays one, and two layers given one tensor share it); default zeros.
        ``out_perm``: output ``j`` is computed from row ``out_perm[j]`` of ``qweight`` (a
        permutation of ``range(out_features)``; module doc); default: row ``j``.
        ``int8_activations``: decode rows (up to ``FUSED_MAX_ROWS``) of a Q4_0, Q4_1 or Q8_0
        weight are quantized to int8 per block of 32 and multiplied with integer dot products
        (``kernels.gguf_linear_cpp.gguf_linear_q8``, what llama.cpp does; ~1.5-2x faster, the
        outputs move by ~0.5% of their range); other types ignore it. Prompt rows (more than
        ``FUSED_MAX_ROWS``) of any type then multiply in bfloat16 where the CPU multiplies
        bfloat16 in hardware (``BF16_PROMPT_ROWS``: AMX-BF16 or AVX512-BF16); elsewhere, and
        with the flag off, in float32."""
        super().__init__()
        if not isinstance(int8_activations, bool):
            raise ValueError(f"GGUFLinear int8_activations={int8_activations!r} must be True or False")
        self.int8_activations = int8_activations
        check_size("in_features", in_features)
        check_size("out_features", out_features)
        if not isinstance(bias, bool):
            raise ValueError(f"GGUFLinear bias={bias!r} must be True or False")
        t = kernel.check_shape(gguf_type, out_features, in_features)  # ValueError naming the fix
        self.in_features, self.out_features = int(in_features), int(out_features)
        self._type = t
        row_bytes = in_features // t.block_size * t.type_size
        if qweight is None:
            qweight = torch.zeros(out_features, row_bytes, dtype=torch.uint8)
        elif (not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.uint8
              or tuple(qweight.shape) != (out_features, row_bytes) or not qweight.is_contiguous()):
            raise ValueError(f"qweight must be a contiguous uint8 tensor of shape {(out_features, row_bytes)} "
                             f"({t.name.upper()} rows of {in_features} weights), got "
                             f"{getattr(qweight, 'dtype', type(qweight).__name__)} "
                             f"{tuple(getattr(qweight, 'shape', ()))}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("out_perm", _check_perm(out_perm, out_features, qweight.device), persistent=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_raw(cls, raw, gguf_type, in_features: int, bias: torch.Tensor | None = None,
                 device=None) -> GGUFLinear:
        """Wrap raw GGUF rows (uint8 tensor or ndarray ``[N, row_bytes]``) of a ``[N, K]`` weight,
        held (with ``bias``) on ``device`` (default: raw's)."""
        raw = torch.as_tensor(raw)
        if raw.dtype != torch.uint8 or raw.dim() != 2:
            raise ValueError(f"raw GGUF rows must be a 2-D uint8 array [out_features, row_bytes], "
                             f"got dtype {raw.dtype} and shape {tuple(raw.shape)}")
        m = cls(in_features, raw.shape[0], gguf_type, bias is not None)
        if tuple(raw.shape) != tuple(m.qweight.shape):
            raise ValueError(f"raw has shape {tuple(raw.shape)}; in_features={in_features} in "
                             f"{m.gguf_type.upper()} needs {tuple(m.qweight.shape)}")
        m.qweight.copy_(raw)
        if bias is not None:
            m.bias.data = bias.detach().float().clone().reshape(-1)
        return m.to(raw.device if device is None else device)

    @classmethod
    def from_linear(cls, lin: nn.Linear, gguf_type, imatrix=None) -> GGUFLinear:
        """Encode ``lin.weight`` in ``gguf_type`` with llama.cpp's quantizer (``imatrix``: optional
        per-input-column importance, as ``llama-quantize --imatrix``)."""
        raw = quantize_gguf(lin.weight.detach(), gguf_type, imatrix=imatrix)
        return cls.from_raw(torch.from_numpy(raw), gguf_type, lin.in_features, lin.bias,
                            device=lin.weight.device)

    # ---- inspection ---------------------------------------------------------------
    @property
    def gguf_type(self) -> str:
        """Lower-case GGUF type name (``"q4_k"``)."""
        return self._type.name

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight of the GGUF type (block scales included, bias excluded)."""
        return self._type.bits_per_weight

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the layer holds (raw blocks + bias)."""
        return held_nbytes(self)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 ``W_hat [N, K]`` in output order, bit-identical to
        ``formats.gguf.dequantize_gguf`` of ``rows_in_output_order()`` (a new tensor)."""
        w = _DEQUANT(self.qweight, self._type.ggml_id, self.out_features, self.in_features)
        return w if self.out_perm is None else w.index_select(0, self.out_perm)

    def rows_in_output_order(self) -> torch.Tensor:
        """The raw rows with row ``j`` for output ``j``: ``qweight`` itself, or a reordered
        copy when the layer holds them in another order (``out_perm``)."""
        return self.qweight if self.out_perm is None else self.qweight.index_select(0, self.out_perm)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.out_perm is not None:  # saved in output order: loads into any GGUFLinear
            destination[prefix + "qweight"] = self.rows_in_output_order()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "qweight"
        rows = state_dict.get(key)
        if self.out_perm is not None and rows is not None and rows.shape[:1] == self.out_perm.shape:
            # saved in output order, held in this layer's own (what out_perm, and the lean
            # step's gather built from it, keep reading)
            back = torch.argsort(self.out_perm).to(rows.device)
            state_dict = {**state_dict, key: rows.index_select(0, back)}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def weight(self) -> torch.Tensor:
        """Read-only float view for code that inspects ``.weight``: decoded on each access."""
        return self.dequantized_weight()

    # ---- compute ------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features; this layer takes {self.in_features}")
        if self.out_perm is None:
            return self._rows(x, self.bias)
        y = self._rows(x, None).index_select(-1, self.out_perm)  # outputs in order, then the bias
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _rows(self, x: torch.Tensor, bias) -> torch.Tensor:
        """The outputs in ``qweight``'s row order."""
        if x.numel() > FUSED_MAX_ROWS * self.in_features:  # prefill: decode, BLAS
            return self._decoded_matmul(x, bias)
        # the op (kernels.linear_ops): CPU C++, CUDA Triton, the bias added inside
        return _GGUF(x, self.qweight, self._type.ggml_id, self.out_features, bias, self.int8_activations)

    @property
    def bf16_prompt_rows(self) -> bool:
        """Prompt rows multiply in bfloat16 (``int8_activations`` on a CPU with bfloat16 dot
        products, ``BF16_PROMPT_ROWS``); the attention of the layer this projects for follows
        it (``kvcache.attention``)."""
        return self.int8_activations and BF16_PROMPT_ROWS

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """Prompt rows (more than ``FUSED_MAX_ROWS``, float32) write their outputs into the
        float32 ``out`` directly, the same numbers as ``forward`` (a bfloat16 product cast
        once, into ``out``): the serving step's row plan fills one output for all its rows so.
        False where it does not apply (``out`` untouched)."""
        if (self.out_perm is not None or out.dtype != torch.float32 or x.dtype != torch.float32
                or x.numel() <= FUSED_MAX_ROWS * self.in_features or x.shape[-1] != self.in_features):
            return False
        self._decoded_matmul(x, self.bias, out)
        return True

    def _decoded_matmul(self, x: torch.Tensor, bias, out: torch.Tensor | None = None) -> torch.Tensor:
        """Many rows: decode the weight and use BLAS, ``DECODE_WEIGHTS_MAX`` weights of it at a
        time, so a large matrix (a 49k-row tied ``lm_head``) is never held whole as floats.
        With ``int8_activations`` where ``BF16_PROMPT_ROWS``, x and the decoded rows are rounded
        to bfloat16 for the product (``bf16_prompt_rows``). ``out``: a float32 tensor (x is
        float32) the outputs are written to (``forward_into``)."""
        bf16 = self.bf16_prompt_rows and x.device.type == "cpu"
        xf = x.to(torch.bfloat16) if bf16 else x.float()
        bias = None if bias is None else bias.float()

        def product(n0: int, n1: int, o: torch.Tensor | None) -> torch.Tensor:
            """float32 outputs n0..n1, written to ``o`` where given."""
            b = None if bias is None else bias[n0:n1]
            if not bf16:
                w = _DEQUANT(self.qweight[n0:n1], self._type.ggml_id, n1 - n0, self.in_features)
                r = F.linear(xf, w, b)
                return r if o is None else o.copy_(r)
            # the rows decoded straight to bfloat16 (= the float32 decode's .to(bfloat16))
            w = kernel.gguf_dequantize(self.qweight[n0:n1], self._type, n1 - n0, self.in_features,
                                       dtype=torch.bfloat16)
            r = F.linear(xf, w)  # float32 sums, the product in bf16
            o = r.float() if o is None else o.copy_(r)  # (cast once, into o)
            return o if b is None else o.add_(b)  # the bias added in float32

        step = max(1, DECODE_WEIGHTS_MAX // self.in_features)
        if self.out_features <= step:
            return product(0, self.out_features, out) if out is not None else \
                product(0, self.out_features, None).to(x.dtype)
        y = out if out is not None else torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32,
                                                    device=x.device)
        for n0 in range(0, self.out_features, step):
            n1 = min(n0 + step, self.out_features)
            product(n0, n1, y[..., n0:n1])
        return y if out is not None else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"gguf_type={self.gguf_type}, bias={self.bias is not None}"
                + (", int8_activations=True" if self.int8_activations else "")
                + (", out_perm=..." if self.out_perm is not None else ""))


def _check_perm(perm, n: int, device) -> torch.Tensor | None:
    """``perm`` as an int64 tensor on ``device`` after checking it is a permutation of ``range(n)``."""
    if perm is None:
        return None
    if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int32, torch.int64) or perm.dim() != 1:
        raise ValueError(f"out_perm must be a 1-D integer tensor, got {getattr(perm, 'dtype', type(perm).__name__)}")
    if perm.numel() != n or not torch.equal(perm.sort().values.cpu(), torch.arange(n)):
        raise ValueError(f"out_perm must be a permutation of range({n}) (one entry per output)")
    return perm.to(device=device, dtype=torch.int64)


def set_int8_activations(model: nn.Module, on: bool = True) -> int:
    """Turn ``int8_activations`` on or off for every ``GGUFLinear`` of ``model``; returns how many."""
    if not isinstance(on, bool):
        raise ValueError(f"set_int8_activations on={on!r} must be True or False")
    n = 0
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            m.int8_activations = on
            n += 1
    return n
