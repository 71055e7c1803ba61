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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.attention import QuantKV, fused_attention, quantized_attention


def _additive(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float()


def _fp_attention(q, k, v, mask, scaling):
    """(out, lse) of q over full-precision k, v (GQA expanded here); mask additive/None."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scaling)
        return out, lse
    s = (q @ k.transpose(-1, -2)) * scaling
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0) @ v, lse


def _sdpa_gqa(q, k, v, mask, scaling):
    """SDPA over full-precision k, v with fewer KV heads than query heads, read in place
    (``enable_gqa``, torch 2.5+; older torch expands them)."""
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    except TypeError:
        return _fp_attention(q, k, v, mask, scaling)[0]


FUSED_MAX_QUERIES = 32  # up to this many query tokens, one C++ call does everything
PREFILL_DEQUANT_QUERIES = 64  # from this many (unmasked), dequantize the history and use flash attention


def _rot_matrix(rot, device) -> torch.Tensor:
    """Rᵀ as a dense matrix, so rotate(x) = x @ Rᵀ and inverse(y) = y @ R (cached)."""
    cache = rot.__dict__.setdefault("_lessmem_rt", {})
    if device not in cache:
        cache[device] = rot.rotate(torch.eye(rot.n, device=device))
    return cache[device]


@dataclass
class LayerView:
    """Snapshot of one layer for one attention call (see module doc)."""

    sinks: tuple[torch.Tensor, torch.Tensor] | None  # [B, H, s, D] each
    history: QuantKV | None
    window: tuple[torch.Tensor, torch.Tensor] | None
    current: tuple[torch.Tensor, torch.Tensor]
    rot_k: object | None = None
    rot_v: object | None = None

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
        q_h = q_f @ _rot_matrix(self.rot_k, qf.device) if self.rot_k is not None else q_f
        res = fused_attention(q_h, self.history, m_h, q_f, kf, vf, m_f, causal=mask is None and Tq > 1)
        if res is None:
            return None
        out_h, out_f, _ = res
        if self.rot_v is not None:
            out_h = out_h @ _rot_matrix(self.rot_v, qf.device).T
        return out_f + out_h

    def _attend_dequantized(self, qf, scaling):
        """A long chunk of queries (prefill): the work is the Tq × L scores, not reading the
        history, so the history is dequantized once (this layer's, for this call only) and
        one flash-attention call covers every position, causal within the current chunk."""
        k, v = self.materialize()
        k, v = k.float(), v.float()
        Tq, L = qf.shape[2], k.shape[2]
        cols = torch.arange(L, device=qf.device)
        rows = torch.arange(Tq, device=qf.device) + (L - Tq)
        m = _additive(cols[None, :] <= rows[:, None])[None, None]
        out, _ = _fp_attention(qf, k, v, m, scaling)
        return out

    def attend(self, q: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention output [B, Hq, Tq, D] (q's dtype) for queries q [B, Hq, Tq, D].

        ``mask``: None (causal among the current tokens) or [B, 1, Tq, L] bool/additive
        over all L = sinks + history + window + current positions.
        """
        B, Hq, Tq, D = q.shape
        qf = q.float()
        kf, vf = self._fp_parts(torch.float32)
        s, nh = self.n_sinks, self.n_history
        L = nh + kf.shape[2]
        if nh and Tq <= FUSED_MAX_QUERIES:
            out = self._attend_one_call(qf, kf, vf, mask, scaling, L)
            if out is not None:
                return out.to(q.dtype)
        if nh and mask is None and Tq >= PREFILL_DEQUANT_QUERIES:
            return self._attend_dequantized(qf, scaling).to(q.dtype)
        if mask is not None:
            m = _additive(mask)[..., -Tq:, :]
            if m.shape[-1] != L:
                raise ValueError(f"attention mask covers {m.shape[-1]} positions, the cache holds {L}")
            m = m.expand(B, 1, Tq, L)
            m_fp = torch.cat([m[..., :s], m[..., s + nh:]], dim=-1).contiguous()
            m_h = m[:, 0, :, s:s + nh].contiguous()
        else:
            m_h = None
            m_fp = None
            if Tq > 1:  # causal within the current chunk (bottom-right aligned)
                n = kf.shape[2]
                cols = torch.arange(n, device=q.device)
                rows = torch.arange(Tq, device=q.device) + (n - Tq)
                allowed = cols[None, :] <= rows[:, None]
                m_fp = _additive(allowed)[None, None].expand(B, 1, Tq, n).contiguous()
        if not nh:  # no history to merge with: no log-sum-exp needed, GQA without copies
            return _sdpa_gqa(qf, kf, vf, m_fp, scaling).to(q.dtype)
        out_f, lse_f = _fp_attention(qf, kf, vf, m_fp, scaling)
        qh = qf * scaling
        if self.rot_k is not None:
            qh = self.rot_k.rotate(qh)
        out_h, lse_h = quantized_attention(qh, self.history, m_h)
        if self.rot_v is not None:
            out_h = self.rot_v.inverse(out_h)
        lse = torch.logaddexp(lse_h, lse_f)
        w_h = torch.exp(lse_h - lse).nan_to_num(0.0).unsqueeze(-1)
        w_f = torch.exp(lse_f - lse).nan_to_num(0.0).unsqueeze(-1)
        out = out_h * w_h + out_f.nan_to_num(0.0) * w_f
        return out.to(q.dtype)
