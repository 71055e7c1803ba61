"""One forward pass for a whole scheduler step: ragged requests packed into one sequence.

The engine packs the step's tokens of every scheduled request into one row —
``[decode tokens of requests a, b, ... | prompt chunk of request c | ...]`` — with each
token's own position (``position_ids``), and hands the model a :class:`BatchCache`.
The linear layers then see all the step's tokens at once (the weights are read once per
step, not once per request), while attention stays per request: ``BatchCache.update``
cuts the new keys/values at the segment bounds, appends each piece to its request's
own cache and returns a :class:`BatchView`, which lessmem's attention function
(:func:`lessmem.kvcache.attention.lessmem_attention`, which calls ``attend`` on any
view) answers per request, each over its own quantized pages and window (the decode
rows of all requests in one C++ call, a prompt chunk alone): no padding to the longest
request, no attention mask over the packed sequence. This is the
"packed, ragged" batch of Orca/vLLM (Yu et al., 2022, "Orca: A Distributed Serving
System for Transformer-Based Generative Models"), on lessmem's caches.

Batch invariance. A float matmul's rows are not independent of how many rows are
multiplied together (BLAS picks other kernels and blockings for other shapes), so a
request decoded beside others would drift, by rounding, from the same request decoded
alone. With ``row_plan`` installed, every ``nn.Linear`` of the model multiplies each
prompt chunk on its own and the decode tokens in fixed tiles of :data:`TILE` rows
(padded): a token's result then depends on its own row only, and greedy outputs are
identical alone and in any batch (tested).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from ..kvcache.view import LayerView, attend_decode_rows

TILE = 16  # decode rows per matmul when batch invariance is on


@dataclass
class Segment:
    """Tokens ``[start, end)`` of the packed step belong to ``cache`` (a request's)."""

    start: int
    end: int
    cache: object
    chunk: bool  # a prompt chunk (multiplied alone) rather than a decode token


class BatchView:
    """Attention over a packed step: each segment against its own cache's view. The
    decode rows (one token of a request with a quantized history) are answered together,
    in one C++ call over all their requests (``fused_attention_rows``): one parallel
    region a layer instead of one per request, the window and current token read where
    they lie. A request's result does not depend on the others in the call."""

    def __init__(self, views: list, segments: list[Segment]):
        self.views, self.segments = views, segments

    def _batchable(self) -> list[int]:
        """Segments answered together: decode rows over a quantized history, rotated like the
        first of them (a pool's caches share their rotation objects: ``PagePool.rotations``)."""
        rows, rots = [], None
        for i, (view, s) in enumerate(zip(self.views, self.segments, strict=True)):
            if s.end - s.start != 1 or not isinstance(view, LayerView) or not view.n_history:
                continue
            rots = rots or (view.rot_k, view.rot_v)
            if view.rot_k is rots[0] and view.rot_v is rots[1]:
                rows.append(i)
        return rows

    def _decode_rows(self, q: torch.Tensor, rows: list[int], scaling: float):
        """[1, Hq, R, D] for the decode rows ``rows`` (segment indices), or None."""
        idx = torch.tensor([self.segments[i].start for i in rows], device=q.device)
        q_r = q[0].index_select(1, idx).transpose(0, 1)  # [R, Hq, D], scaled in the kernel's call
        out = attend_decode_rows([self.views[i] for i in rows], q_r, scaling)
        return None if out is None else out.transpose(0, 1).unsqueeze(0).to(q.dtype)

    def attend(self, q: torch.Tensor, mask, scaling: float) -> torch.Tensor:
        rows = self._batchable()
        together = self._decode_rows(q, rows, scaling) if rows else None
        if together is not None and len(rows) == len(self.segments):
            return together
        outs, j = [], 0
        for i, (view, s) in enumerate(zip(self.views, self.segments, strict=True)):
            if together is not None and j < len(rows) and rows[j] == i:
                outs.append(together[:, :, j:j + 1])
                j += 1
            else:
                outs.append(view.attend(q[:, :, s.start:s.end], None, scaling))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class BatchCache(Cache):
    """The transformers ``Cache`` a packed step's forward gets (module doc)."""

    def __init__(self, segments: list[Segment], num_layers: int):
        super().__init__(layers=[DynamicLayer() for _ in range(num_layers)])
        self.segments = segments
        self.total = segments[-1].end if segments else 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        views = []
        for s in self.segments:  # the request's layer itself: the engine's tensors need no checks
            k, v = s.cache.layers[layer_idx].update(key_states[:, :, s.start:s.end],
                                                    value_states[:, :, s.start:s.end])
            views.append(k if hasattr(k, "attend") else LayerView(None, None, None, (k, v)))
        view = BatchView(views, self.segments)
        return view, view

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.total, 0  # the packed step itself: lessmem attention reads no mask

    @property
    def is_compileable(self) -> bool:
        return False


# ---- batch-invariant linears -----------------------------------------------------------
_PLAN: contextvars.ContextVar = contextvars.ContextVar("lessmem_row_plan", default=None)


def _tiled(x2: torch.Tensor, weight, bias) -> torch.Tensor:
    n = x2.shape[0]
    pad = -n % TILE
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    if x2.shape[0] == TILE:
        return F.linear(x2, weight, bias)[:n]
    out = torch.cat([F.linear(x2[i:i + TILE], weight, bias) for i in range(0, x2.shape[0], TILE)])
    return out[:n]


def _invariant_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    plan = _PLAN.get()
    if plan is None:
        return F.linear(x, module.weight, module.bias)
    return _planned(x, plan, module.out_features,
                    lambda x2, out: out.copy_(F.linear(x2, module.weight, module.bias)),
                    lambda x2: _tiled(x2, module.weight, module.bias))


def _invariant_own(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A quantized linear (``GGUFLinear``, ``QuantLinear``, ``FP8Linear``): its fused kernel
    computes each row on its own up to ``FUSED_MAX_ROWS`` rows, but above that it decodes the
    weight for BLAS (``FP8Linear``: one matmul at any size; cuBLAS picks its algorithm by the
    row count), whose rows depend on their neighbours. So the plan keeps the decode rows in tiles of
    :data:`TILE` (the fused kernel) and each prompt chunk alone, as for ``nn.Linear``."""
    plan = _PLAN.get()
    forward = type(module).forward
    if plan is None:
        return forward(module, x)

    def tiles(x2):
        if x2.shape[0] <= TILE:
            return forward(module, x2)
        return torch.cat([forward(module, x2[i:i + TILE]) for i in range(0, x2.shape[0], TILE)])

    into = getattr(module, "forward_into", None)  # (GGUFLinear: a chunk's outputs written in place)

    def alone(x2, out):
        if into is None or not into(x2, out):
            out.copy_(forward(module, x2))
    return _planned(x, plan, module.out_features, alone, tiles)


def _planned(x: torch.Tensor, plan, out_features: int, alone, tiled) -> torch.Tensor:
    """The step's outputs: the decode rows (``rows``: a slice where they lie together, as the
    engine packs them first, else an index tensor) in tiles, each chunk alone (``alone(x2,
    out)`` writes a chunk's outputs into its part of the step's)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    total, chunks, rows = plan
    if x2.shape[0] != total or not chunks:  # only decode rows (or the lm_head's kept rows)
        out = tiled(x2)
    else:
        out = x2.new_empty(x2.shape[0], out_features)
        if rows is not None:
            out[rows] = tiled(x2[rows])
        for s, e in chunks:
            alone(x2[s:e], out[s:e])
    return out.reshape(*shape[:-1], out_features)


_HOLDERS = "_lessmem_row_plans"  # a module's attribute: how many RowPlans hold its forward


class RowPlan:
    """Installs the batch-invariant ``forward`` on a model's ``nn.Linear`` modules (exactly
    that class) and on lessmem's quantized linears (their own kernels, in pieces) and sets
    the plan of each step (:meth:`step`); :meth:`remove` restores them."""

    def __init__(self, model: torch.nn.Module):
        from ..weights.fp8 import FP8Linear
        from ..weights.gguf_linear import GGUFLinear
        from ..weights.qlinear import QuantLinear

        own = (GGUFLinear, QuantLinear, FP8Linear)
        self.modules = [m for m in model.modules() if type(m) is torch.nn.Linear or isinstance(m, own)]
        for m in self.modules:
            held = m.__dict__.get(_HOLDERS, 0)
            if not held:
                m.forward = (_invariant_linear if type(m) is torch.nn.Linear else _invariant_own).__get__(m)
            m.__dict__[_HOLDERS] = held + 1

    def step(self, segments: list[Segment]):
        total = segments[-1].end
        chunks = [(s.start, s.end) for s in segments if s.chunk]
        rows = [i for s in segments if not s.chunk for i in range(s.start, s.end)]
        together = rows and rows == list(range(rows[0], rows[-1] + 1))  # a view, not a gather
        return _PLAN.set((total, chunks, slice(rows[0], rows[-1] + 1) if together
                          else torch.tensor(rows) if rows else None))

    @staticmethod
    def done(token) -> None:
        _PLAN.reset(token)

    def remove(self) -> None:
        """Give the modules back; their own ``forward`` returns when no other plan holds them
        (two engines on one model: closing one leaves the other's steps invariant)."""
        for m in self.modules:
            held = m.__dict__.get(_HOLDERS, 1) - 1
            if held > 0:
                m.__dict__[_HOLDERS] = held
            else:
                m.__dict__.pop(_HOLDERS, None)
                m.__dict__.pop("forward", None)
        self.modules = []
