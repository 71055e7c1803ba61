"""Mixture-of-experts MLPs as ordinary linears, so every weight method reaches them.

transformers 5 stores a MoE layer's experts fused: one module (``MixtralExperts``,
``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ...) holding two 3-D parameters,
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, and looping over the experts
the router picked. Those are not ``nn.Linear``, so a linear-by-linear quantizer would
leave most of a MoE model's bytes in full precision. :func:`split_experts` replaces each
such module by :class:`LinearExperts`: a list of ``E`` experts, expert ``e`` holding the
linears ``gate_up_proj`` ``(H -> 2I)`` and ``down_proj`` ``(I -> H)`` built from rows
``e`` of the fused tensors (names ``...mlp.experts.3.down_proj``, so ``skip`` and
``overrides`` patterns such as ``"down_proj"`` apply). Same routing, same arithmetic:
unquantized, the split model's logits equal the fused model's.

A fused module is split only when its parameters are exactly those two (no biases, no
extra tensors such as gpt-oss' clamped and interleaved experts use); others are left as
they are and reported by :func:`fused_expert_params`.

Example:
    >>> import torch, transformers
    >>> cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
    >>> split_experts(model)
    1
    >>> type(model.model.layers[0].mlp.experts[2].down_proj).__name__
    'Linear'
"""

from __future__ import annotations

import torch
from torch import nn


class _Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, device=None, dtype=None):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, device=device, dtype=dtype)


class LinearExperts(nn.ModuleList):
    """The experts of one MoE layer as ``E`` pairs of linears; called like the fused module:
    ``(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act_fn, device=None, dtype=None):
        super().__init__(_Expert(hidden, inter, device, dtype) for _ in range(num_experts))
        self.num_experts = num_experts
        object.__setattr__(self, "act_fn", act_fn)  # not a child: the list holds experts only

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():  # only the experts some token was routed to
            if not 0 <= e < self.num_experts:
                continue  # a router's "no expert" index (num_experts) selects nothing
            token, slot = torch.where(top_k_index == e)
            gate, up = self[e].gate_up_proj(hidden_states[token]).chunk(2, dim=-1)
            y = self[e].down_proj(self.act_fn(gate) * up) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _fused(mod: nn.Module) -> bool:
    """A fused experts module of the standard kind: exactly ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``, an ``act_fn``, no buffers."""
    params = dict(mod.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or not hasattr(mod, "act_fn") \
            or any(True for _ in mod.named_buffers(recurse=False)):
        return False
    gu, dn = params["gate_up_proj"], params["down_proj"]
    if gu.dim() != 3 or dn.dim() != 3 or gu.shape[1] % 2:
        return False
    E, two_i, H = gu.shape
    return tuple(dn.shape) == (E, H, two_i // 2)


def split_experts(model: nn.Module) -> int:
    """Replace every fused experts module of ``model`` by :class:`LinearExperts` holding the
    same weights (a view of them where the layout allows; meta tensors stay meta); returns
    how many were replaced."""
    found = [(n, m) for n, m in model.named_modules() if _fused(m)]
    for name, mod in found:
        gu, dn = mod.gate_up_proj, mod.down_proj
        E, two_i, H = gu.shape
        new = LinearExperts(E, H, two_i // 2, mod.act_fn, device="meta", dtype=gu.dtype)
        for e, ex in enumerate(new):  # the rows of the fused tensors, as they are
            ex.gate_up_proj.weight = nn.Parameter(gu.data[e], requires_grad=gu.requires_grad)
            ex.down_proj.weight = nn.Parameter(dn.data[e], requires_grad=dn.requires_grad)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return len(found)


def fused_expert_params(model: nn.Module) -> list[str]:
    """Names of 3-D expert parameters :func:`split_experts` could not turn into linears."""
    return [f"{n}.{p}" if n else p for n, m in model.named_modules()
            for p, t in m.named_parameters(recurse=False)
            if t.dim() == 3 and ("expert" in n.lower() or "expert" in p.lower())]
