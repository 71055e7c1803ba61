"""What one layer's attention sees at one step: a snapshot of the cache plus the new tokens.

Chronological order of the keys/values: ``[sinks | quantized history | window | current]``.
``LayerView.attend`` computes attention over it without inflating the history:

- full-precision parts (sinks, window, current chunk): one SDPA call that also returns
  the log-sum-exp of each query row (``aten._scaled_dot_product_flash_attention_for_cpu``
  on CPU; the math formula elsewhere);
- quantized history: ``lessmem.kernels.attention.quantized_attention`` (fused kernel);
- the two merged exactly: lse = logaddexp(lse_h, lse_f),
  out = out_h·e^(lse_h − lse) + out_f·e^(lse_f − lse).

Rotation: keys are stored as R·k, so q·k = (R q)·(R k) and the kernel gets R q; values
stored as R·v give Σ p (R v) = R (Σ p v), un-rotated once on the output.

``LayerView.materialize`` is the dequantized path (what ``KVCache(attention="reference")``
and unswitched models get): dequantize everything with the layouts, concatenate.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import prompt_attention
from ..kernels.attention import (
    QuantKV,
    QuantSide,
    fused_attention,
    fused_attention_rows,
    quantized_attention,
)

# Set by lessmem_attention (kvcache.attention) while a prompt chunk of a layer with reduced-
# precision activations attends on a CPU with bf16 dot products (AMX-BF16 or AVX512-BF16):
# the full-precision attention calls below then take bfloat16 copies of q, k and v (oneDNN's
# bf16 kernels; the softmax, its log-sum-exp and the merges stay float32). Decode rows never
# see it.
PROMPT_BF16: contextvars.ContextVar = contextvars.ContextVar("lessmem_prompt_bf16", default=False)
BF16_MIN_ROWS = 17  # query rows (per KV head) below which attention stays float32


def _bf16(q, k, v, mask):
    """q, k, v (and an additive mask) in bfloat16 where PROMPT_BF16 holds for this many rows."""
    if not PROMPT_BF16.get() or q.shape[-2] < BF16_MIN_ROWS or q.dtype != torch.float32:
        return None
    m = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(torch.bfloat16))
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), m


def _additive(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float()


def _is_plain_causal(mask: torch.Tensor, Tq: int, L: int) -> bool:
    """True when a bool mask [B, 1, Tq, L] only says "causal, bottom-right aligned": every
    earlier position visible, causal within the last Tq (what transformers builds for a
    chunk after a history without padding). Such a mask is dropped, so no [Tq, L] mask
    is expanded or copied. Remembered on the tensor (one mask serves every layer)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2] != Tq or mask.shape[-1] != L:
        return False
    memo = getattr(mask, "_lessmem_plain_causal", None)
    if memo is None:
        tail = mask[..., L - Tq:]
        causal = torch.ones(Tq, Tq, dtype=torch.bool, device=mask.device).tril()
        memo = bool(mask[..., :L - Tq].all()) and bool((tail == causal).all())
        try:
            mask._lessmem_plain_causal = memo
        except (AttributeError, RuntimeError):
            pass
    return memo


def _bf16_kernel(q, k, mask) -> bool:
    """A prompt chunk in bfloat16 (``PROMPT_BF16``, as ``_bf16``) without a mask, on a CPU
    where ``kernels.prompt_attention`` runs: its bf16 dot-product kernel takes the call."""
    return (mask is None and q.dtype == torch.float32 and q.shape[-2] >= BF16_MIN_ROWS and PROMPT_BF16.get()
            and prompt_attention.supports(q, k))


def _causal_mask(q, k, mask, causal: bool):
    """``mask``, or where ``causal`` (and no mask) the causal tail mask over k's positions."""
    if not causal or mask is not None or q.shape[2] == 1:
        return mask
    B, Tq, n = q.shape[0], q.shape[2], k.shape[2]
    return _causal_tail(n, Tq, q.device).expand(B, 1, Tq, n).contiguous()


def _fp_attention(q, k, v, mask, scaling, causal: bool = False):
    """(out, lse) of q over full-precision k, v (GQA expanded here); mask additive/None.
    ``causal`` (no mask): the queries are the last of k's positions, each seeing itself and
    everything before it."""
    if _bf16_kernel(q, k, mask):
        return prompt_attention.bf16_attention(q, k, v, scaling, causal)
    mask = _causal_mask(q, k, mask, causal)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if q.device.type == "cpu":
        low = _bf16(q, k, v, mask)  # a prompt chunk in bf16 (PROMPT_BF16): out back to float32, lse is
        q_, k_, v_, m_ = low if low is not None else (q, k, v, mask)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_, k_, v_, 0.0, False, attn_mask=m_, scale=scaling)
        return (out if low is None else out.float()), lse
    s = (q @ k.transpose(-1, -2)) * scaling
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0) @ v, lse


def _causal_tail(n: int, Tq: int, device) -> torch.Tensor:
    """Additive mask [1, 1, Tq, n]: the queries are the last Tq of n positions, each sees
    itself and every position before it (causal, bottom-right aligned)."""
    cols = torch.arange(n, device=device)
    rows = torch.arange(Tq, device=device) + (n - Tq)
    return _additive(cols[None, :] <= rows[:, None])[None, None]


def _merge(out_a, lse_a, out_b, lse_b):
    """Exact union of two attention results over disjoint key sets, by their log-sum-exp:
    ``(out, lse)``; a side that saw no key (lse = -inf) weighs nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return out_a * w_a + out_b.nan_to_num(0.0) * w_b, lse


def _sdpa_gqa(q, k, v, mask, scaling, causal: bool = False):
    """SDPA over full-precision k, v with fewer KV heads than query heads, read in place
    (``enable_gqa``, torch 2.5+; older torch expands them). ``causal`` as ``_fp_attention``."""
    if _bf16_kernel(q, k, mask):
        return prompt_attention.bf16_attention(q, k, v, scaling, causal)[0]
    mask = _causal_mask(q, k, mask, causal)
    low = _bf16(q, k, v, mask) if q.device.type == "cpu" else None  # a prompt chunk in bf16
    q_, k_, v_, m_ = low if low is not None else (q, k, v, mask)
    try:
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_, scale=scaling, enable_gqa=True)
        return out if low is None else out.float()
    except TypeError:
        return _fp_attention(q, k, v, mask, scaling)[0]


FUSED_MAX_QUERIES = 32  # up to this many query tokens, one C++ call does everything
PREFILL_DEQUANT_QUERIES = 64  # from this many (unmasked), dequantize the history and use flash attention
PREFILL_SLICE_TOKENS = 2048  # ... a slice of this many history tokens at a time


def _rot_matrix(rot, device, heads: int | None = None) -> torch.Tensor:
    """Rᵀ as a dense matrix, so rotate(x) = x @ Rᵀ and inverse(y) = y @ R (cached). A
    rotation with one matrix per KV head (``per_head``: a layer's keys stored at calibrated
    bits per channel) gives [heads, n, n] for the ``heads`` on the axis x has at −3 (KV heads
    for keys, query heads for queries)."""
    per_head = getattr(rot, "per_head", False)
    cache = rot.__dict__.setdefault("_lessmem_rt", {})
    key = (device, heads) if per_head else device
    if key not in cache:
        if per_head:
            cache[key] = rot.transposed(heads).to(device)
        else:
            cache[key] = rot.rotate(torch.eye(rot.n, device=device))
    return cache[key]


def _rot_matrices(view, heads: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(Rᵀ of the keys' rotation, R of the values'), as ``fused_attention_rows`` takes them
    (``heads``: the query heads, for a rotation with one matrix per KV head)."""
    rk = _rot_matrix(view.rot_k, "cpu", heads).contiguous() if view.rot_k is not None else None
    if view.rot_v is None:
        return rk, None
    cache = view.rot_v.__dict__.setdefault("_lessmem_r", {})
    if "cpu" not in cache:
        cache["cpu"] = _rot_matrix(view.rot_v, "cpu").T.contiguous()
    return rk, cache["cpu"]


def attend_decode_rows(views: list, q: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """Decode rows, one query token each, over their own views' histories: ``q`` [R, Hq, D]
    as the model made it (unscaled), row r against ``views[r]`` (all rotated like
    ``views[0]``). One C++ call (``fused_attention_rows``) scales and rotates the queries,
    reads every history and every full-precision piece (sinks, window, current token) in
    place, as stored (fp16 or fp32), and un-rotates and sums the parts: nothing is
    concatenated or cast around it. A row's result does not depend on the others.
    Returns [R, Hq, D] float32, or None without the C++ kernel (or off the CPU: the rows
    then go through ``LayerView.attend``'s op path, Triton on CUDA)."""
    if q.device.type != "cpu":  # the one-call kernel reads CPU memory: the caller takes the op path
        return None
    return attend_rows(views[0], q, scaling, [v.history for v in views], [v.fp_pieces() for v in views])


def attend_rows(rotated, q: torch.Tensor, scaling: float, histories: list, fp_pieces: list) -> torch.Tensor | None:
    """:func:`attend_decode_rows` on its parts: ``rotated`` holds ``rot_k``/``rot_v`` (a view
    or a layer), row r reads ``histories[r]`` and the full-precision ``fp_pieces[r]``
    (sinks, window, current token, in order). CPU only; None without the C++ kernel."""
    rk, rv = _rot_matrices(rotated, q.shape[1])
    return fused_attention_rows(q, scaling, rk, rv, histories, fp_pieces)


@dataclass
class LayerView:
    """Snapshot of one layer for one attention call (see module doc)."""

    sinks: tuple[torch.Tensor, torch.Tensor] | None  # [B, H, s, D] each
    history: QuantKV | None
    window: tuple[torch.Tensor, torch.Tensor] | None
    current: tuple[torch.Tensor, torch.Tensor]
    rot_k: object | None = None
    rot_v: object | None = None
    queries: object | None = None  # the layer's QueryMoments (key_rounding="attention"), fed here

    @property
    def n_sinks(self) -> int:
        return 0 if self.sinks is None else self.sinks[0].shape[2]

    @property
    def n_history(self) -> int:
        return 0 if self.history is None else self.history.n_tokens

    def _fp_parts(self, dtype):
        parts = [p for p in (self.sinks, self.window, self.current) if p is not None and p[0].shape[2]]
        if len(parts) == 1:
            return parts[0][0].to(dtype), parts[0][1].to(dtype)
        k = torch.cat([p[0] for p in parts], dim=2)  # (cat promotes fp16 parts to the widest dtype)
        v = torch.cat([p[1] for p in parts], dim=2)
        return k.to(dtype), v.to(dtype)

    def dequantized_history(self, dtype=torch.float32):
        """Keys and values of the history in float [B, H, Nh, D] (dequantized path only)."""
        k = self.history.keys.dequantize()
        v = self.history.values.dequantize()
        if self.rot_k is not None:
            k = self.rot_k.inverse(k)
        if self.rot_v is not None:
            v = self.rot_v.inverse(v)
        return k.to(dtype), v.to(dtype)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized path: all keys/values in order, in the current tokens' dtype."""
        dtype = self.current[0].dtype
        ks, vs = [], []
        for part in (self.sinks, "h", self.window, self.current):
            if part == "h":
                if self.n_history:
                    k, v = self.dequantized_history(dtype)
                    ks.append(k)
                    vs.append(v)
            elif part is not None and part[0].shape[2]:
                ks.append(part[0].to(dtype))
                vs.append(part[1].to(dtype))
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def _attend_one_call(self, qf, kf, vf, mask, scaling, L):
        B, Hq, Tq, D = qf.shape
        s, nh = self.n_sinks, self.n_history
        m_h = m_f = None
        if mask is not None:
            m = _additive(mask)
            if m.shape[-1] != L:
                raise ValueError(f"attention mask covers {m.shape[-1]} positions, the cache holds {L}")
            m = m.expand(B, 1, Tq, L)[:, 0]
            m_h = m[..., s:s + nh]
            m_f = torch.cat([m[..., :s], m[..., s + nh:]], dim=-1)
        q_f = qf * scaling
        q_h = q_f @ _rot_matrix(self.rot_k, qf.device, Hq) if self.rot_k is not None else q_f
        res = fused_attention(q_h, self.history, m_h, q_f, kf, vf, m_f, causal=mask is None and Tq > 1)
        if res is None:
            return None
        out_h, out_f, _ = res
        if self.rot_v is not None:
            out_h = out_h @ _rot_matrix(self.rot_v, qf.device).T
        return out_f + out_h

    def fp_pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The non-empty full-precision (keys, values) pieces in order: sinks, window, current."""
        return [p for p in (self.sinks, self.window, self.current) if p is not None and p[0].shape[2]]

    def _attend_row(self, q, scaling):
        """One decode row (batch 1, one query token, no mask): :func:`attend_decode_rows` for
        one view; None without the C++ kernel or off the CPU."""
        Hq, D = q.shape[1], q.shape[3]
        out = attend_decode_rows([self], q.reshape(1, Hq, D), scaling)
        if out is None:
            return None
        out = out.view(1, Hq, 1, D)
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _history_slices(self):
        """The history as ``(keys, values)`` :class:`QuantSide` pieces of at most
        ``PREFILL_SLICE_TOKENS`` tokens, in order, read in place (a SegmentedKV's parts are
        walked, not joined)."""
        h = self.history
        if hasattr(h, "k_parts"):
            sides = [(QuantSide(kp[0], kp[1], kp[2], h.k.layout), QuantSide(vp[0], vp[1], vp[2], h.v.layout))
                     for kp, vp in zip(h.k_parts, h.v_parts, strict=True)]
        else:
            sides = [(h.keys, h.values)]
        for k, v in sides:
            n = k.n_tokens
            step = max(k.tg, v.tg)
            step = max(step, PREFILL_SLICE_TOKENS // step * step)
            if n <= step:
                yield k, v
                continue
            for t0 in range(0, n, step):
                t1 = min(t0 + step, n)
                yield k.slice_tokens(t0, t1), v.slice_tokens(t0, t1)

    def _attend_dequantized(self, qf, kf, vf, scaling):
        """A long chunk of queries (prefill): the work is the Tq × L scores, not reading the
        history, so the history is dequantized a slice at a time (``PREFILL_SLICE_TOKENS``;
        consecutive small pieces, such as a paged cache's blocks, joined up to that many
        tokens) and each slice goes to flash attention with every query row (no mask: the whole
        history precedes the chunk; the query heads sharing a KV head are stacked as rows, so
        the KV heads are never repeated). The full-precision parts (sinks, window, current
        chunk, causal within it) are one more call; the pieces merge by their log-sum-exp.
        Transient memory is one slice's float keys and values, whatever the context length."""
        B, Hq, Tq, D = qf.shape
        out, lse = _fp_attention(qf, kf, vf, None, scaling, causal=True)
        qh = qf @ _rot_matrix(self.rot_k, qf.device, Hq) if self.rot_k is not None else qf
        Hkv = self.history.n_kv_heads
        qg = qh.reshape(B, Hkv, Hq // Hkv * Tq, D)  # query heads of one KV head as rows
        out_h = lse_h = None
        group, n = [], 0  # consecutive pieces (a paged cache's blocks) joined up to a slice's tokens

        def flush(out_h, lse_h):
            kf_h = group[0][0] if len(group) == 1 else torch.cat([k for k, _ in group], dim=2)
            vf_h = group[0][1] if len(group) == 1 else torch.cat([v for _, v in group], dim=2)
            o, l = _fp_attention(qg, kf_h, vf_h, None, scaling)  # as many heads
            return (o, l) if out_h is None else _merge(out_h, lse_h, o, l)

        for ks, vs in self._history_slices():
            if group and n + ks.n_tokens > PREFILL_SLICE_TOKENS:
                out_h, lse_h = flush(out_h, lse_h)
                group, n = [], 0
            group.append((ks.to_float(), vs.to_float()))
            n += ks.n_tokens
        out_h, lse_h = flush(out_h, lse_h)
        out_h = out_h.reshape(B, Hq, Tq, D)
        if self.rot_v is not None:
            out_h = out_h @ _rot_matrix(self.rot_v, qf.device).T
        return _merge(out_h, lse_h.reshape(B, Hq, Tq), out, lse)[0]

    def attend(self, q: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention output [B, Hq, Tq, D] (q's dtype) for queries q [B, Hq, Tq, D].

        ``mask``: None (causal among the current tokens) or [B, 1, Tq, L] bool/additive
        over all L = sinks + history + window + current positions.
        """
        B, Hq, Tq, D = q.shape
        if self.queries is not None and not self.queries.full:
            self.queries.add(q)
        if B == 1 and Tq == 1 and mask is None and self.n_history:
            out = self._attend_row(q, scaling)
            if out is not None:
                return out
        qf = q.float()
        kf, vf = self._fp_parts(torch.float32)
        s, nh = self.n_sinks, self.n_history
        L = nh + kf.shape[2]
        if mask is not None and _is_plain_causal(mask, Tq, L):
            mask = None
        if nh and Tq <= FUSED_MAX_QUERIES:
            out = self._attend_one_call(qf, kf, vf, mask, scaling, L)
            if out is not None:
                return out.to(q.dtype)
        if nh and mask is None and Tq >= PREFILL_DEQUANT_QUERIES:
            return self._attend_dequantized(qf, kf, vf, scaling).to(q.dtype)
        if mask is not None:
            m = _additive(mask)[..., -Tq:, :]
            if m.shape[-1] != L:
                raise ValueError(f"attention mask covers {m.shape[-1]} positions, the cache holds {L}")
            m = m.expand(B, 1, Tq, L)
            m_fp = torch.cat([m[..., :s], m[..., s + nh:]], dim=-1).contiguous()
            m_h = m[:, 0, :, s:s + nh].contiguous()
        else:  # causal within the current chunk
            m_h = m_fp = None
        causal = mask is None and Tq > 1
        if not nh:  # no history to merge with: no log-sum-exp needed, GQA without copies
            return _sdpa_gqa(qf, kf, vf, m_fp, scaling, causal).to(q.dtype)
        out_f, lse_f = _fp_attention(qf, kf, vf, m_fp, scaling, causal)
        qh = qf * scaling
        if self.rot_k is not None:
            qh = self.rot_k.rotate(qh)
        out_h, lse_h = quantized_attention(qh, self.history, m_h)
        if self.rot_v is not None:
            out_h = self.rot_v.inverse(out_h)
        return _merge(out_h, lse_h, out_f, lse_f)[0].to(q.dtype)
