"""Switching a model to lessmem's fused attention, explicitly and reversibly.

``enable(model)`` registers the attention function ``"lessmem"`` with transformers
(``AttentionInterface`` and the matching SDPA-style mask in ``AttentionMaskInterface``)
and sets the model's attention implementation to it; it returns a handle whose
``disable()`` (or leaving the ``with`` block) restores the previous implementation.
Nothing else about the model changes.

The ``"lessmem"`` function computes attention straight from a lessmem cache layer
(the :class:`~lessmem.kvcache.view.LayerView` that ``KVCache.update`` returns while the
model is switched, or any object with the same ``attend(query, mask, scaling)`` method,
such as the serving engine's per-step batch view) and otherwise falls through to transformers' SDPA, so a switched
model still works with ``DynamicCache`` or no cache at all. A :class:`KVCache` notices
the switch by reading the model config it was built from (``_attn_implementation``):
without ``enable`` it returns dequantized tensors (the dequantized path), which is
correct with any attention implementation but inflates the history each step.

Example:
    >>> import torch, lessmem
    >>> from lessmem.models import tiny_random
    >>> model = tiny_random("llama")
    >>> with lessmem.kvcache.enable(model):
    ...     cache = lessmem.KVCache(model.config, "int4")
    ...     out = model(torch.tensor([[1, 2, 3]]), cache=cache)  # older transformers: past_key_values=
    ...     model.config._attn_implementation
    'lessmem'
    >>> model.config._attn_implementation
    'sdpa'
"""

from __future__ import annotations

import contextvars

import torch

from ..kernels import prompt_attention
from .view import BF16_MIN_ROWS, PROMPT_BF16, _bf16, _bf16_kernel, _is_plain_causal

NAME = "lessmem"


def _prompt_bf16(module, query) -> bool:
    """A prompt chunk on the CPU of a layer whose linears multiply prompts in bfloat16
    (``GGUFLinear.bf16_prompt_rows``: reduced-precision activations on a CPU with bf16 dot products)."""
    if query.shape[-2] < BF16_MIN_ROWS or query.dtype != torch.float32 or query.device.type != "cpu":
        return False
    return bool(getattr(getattr(module, "o_proj", None), "bf16_prompt_rows", False))


def lessmem_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention function: fused path for lessmem layer views, SDPA otherwise.
    A prompt chunk of a layer with bf16 prompt rows attends with bfloat16 q, k, v
    (``view.PROMPT_BF16``); everything else in q's dtype."""
    token = PROMPT_BF16.set(True) if _prompt_bf16(module, query) else None
    try:
        return _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    finally:
        if token is not None:
            PROMPT_BF16.reset(token)


def _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if DYNAMIC_PROMPT.get():  # a DynamicCache's prompt chunk: the trims a lessmem layer makes
        _trim_dynamic_chunk(module, query)
    softcap = kwargs.get("softcap")  # Gemma-2's attn_logit_softcapping: SDPA cannot apply it
    if hasattr(key, "attend"):  # a LayerView, or any view of that protocol (the serving engine's batch view)
        if softcap is None:
            out = key.attend(query, attention_mask, scale)  # [B, Hq, Tq, D]
            return out.transpose(1, 2).contiguous(), None
        if not hasattr(key, "materialize"):
            raise ValueError("softcap (attention logit soft-capping, e.g. Gemma-2) is not supported "
                             f"by {type(key).__name__}; allowed: a model without softcap, or a "
                             "lessmem KVCache (its layer views dequantize for soft-capped attention)")
        key, value = key.materialize()
    if softcap is not None:
        return _softcapped(query, key, value, attention_mask, scale, float(softcap)), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = _kernel_causal(module, query, key, attention_mask, dropout, is_causal, kwargs)
    if causal is not None:  # a prompt chunk in bf16 on the bf16 dot-product kernel
        out = prompt_attention.bf16_attention(query, key, value, scale, causal)[0]
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    low = _bf16(query, key, value, attention_mask) if key.dtype == torch.float32 else None
    if low is not None:  # a prompt chunk in bf16 (PROMPT_BF16); the output back in float32
        out, w = sdpa_attention_forward(module, *low, dropout=dropout, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
        return out.float(), w
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


# Set (by lessmem.decode's switched forward) while a prompt chunk runs over a plain
# DynamicCache: its layers are transformers', so the attention trims for them (_trim_dynamic_chunk)
DYNAMIC_PROMPT: contextvars.ContextVar = contextvars.ContextVar("lessmem_dynamic_prompt", default=False)


def _trim_dynamic_chunk(module, query) -> None:
    """A long prompt chunk over a ``DynamicCache`` (``DYNAMIC_PROMPT``) trims the C heap as a
    lessmem layer's update does (``kvcache.layer.trim_for_chunk``): with ``base.cpu.tune_heap``'s
    thresholds nothing else returns a chunk's freed pages, and a 512-token DynamicCache
    prefill of the built-in model peaked ~10 MiB higher without these (two sets of four probe
    runs: medians 381 and 385.5 MiB over the pre-import RSS without, 370.5 and 372 with; the
    prefill as fast). Nothing else trims here: a lessmem layer has trimmed in its update, and
    the serving engine's full-precision pages never do (its next step reuses them)."""
    from . import layer

    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int):
        layer.trim_for_chunk(idx, query)


def _kernel_causal(module, query, key, mask, dropout, is_causal, kwargs) -> bool | None:
    """Whether a prompt chunk in bfloat16 (``PROMPT_BF16``) over plain tensors (a DynamicCache,
    no cache) goes to ``kernels.prompt_attention`` instead of SDPA: True (causal, the
    queries the last of the keys) or False (every query sees every key), from what SDPA would
    have done with the same arguments; None (SDPA) for any mask other than a plain causal
    one, dropout, or an extra term SDPA adds (position bias, attention sinks)."""
    if (dropout or key.dtype != torch.float32 or kwargs.get("position_bias") is not None
            or kwargs.get("s_aux") is not None or not _bf16_kernel(query, key, None)):
        return None
    Tq, L = query.shape[2], key.shape[2]
    if mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and Tq != L:  # (SDPA's is_causal aligns top-left there)
            return None
        return bool(causal)
    return True if _is_plain_causal(mask, Tq, L) else None


def _softcapped(q, k, v, mask, scaling: float, softcap: float):
    """Attention with soft-capped logits, ``softcap * tanh(q·k * scaling / softcap)`` (Gemma-2),
    softmax in float32; ``k``/``v`` may have fewer heads than ``q`` (GQA). ``mask``: bool
    (True = attend), additive, or None (causal, the queries being the last of the keys).
    Returns [B, Tq, Hq, D] as transformers' attention functions do."""
    import torch

    from .view import _additive, _causal_tail

    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scaling
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s + _additive(mask[..., : k.shape[2]])
    elif q.shape[2] > 1:
        s = s + _causal_tail(k.shape[2], q.shape[2], q.device)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ v.float()).to(q.dtype).transpose(1, 2).contiguous()


def register() -> None:
    """Register ``"lessmem"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, lessmem_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


_HOLDERS = "_lessmem_attention_switches"  # on the model: [open switches, implementation before]


class _Switch:
    def __init__(self, model):
        self.model, self._open = model, True

    def disable(self) -> None:
        """Give the switch back (once; later calls do nothing). The model's attention returns
        to what it was before the first ``enable`` when no other switch is open: two engines
        on one model, closed in any order, each keep lessmem attention while they run."""
        if not self._open:
            return
        self._open = False
        holders = self.model.__dict__.get(_HOLDERS)
        if holders is None:
            return
        holders[0] -= 1
        if holders[0] <= 0:
            del self.model.__dict__[_HOLDERS]
            _set(self.model, holders[1])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.disable()
        return False


def _set(model, impl) -> None:
    try:
        model.set_attn_implementation(impl)
    except Exception:  # older/newer transformers: fall back to the config field
        model.config._attn_implementation = impl


def enable(model) -> _Switch:
    """Run ``model``'s attention through lessmem (see module doc); returns a handle
    with ``disable()`` that also works as a context manager. Switches nest and may be
    disabled in any order: the last one open restores the model's own implementation."""
    register()
    holders = model.__dict__.get(_HOLDERS)
    if holders is None:
        previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
        holders = model.__dict__[_HOLDERS] = [0, previous]
    if getattr(model.config, "_attn_implementation", None) != NAME:
        _set(model, NAME)
        if model.config._attn_implementation != NAME:
            if not holders[0]:
                del model.__dict__[_HOLDERS]
            raise ValueError(f"could not switch the model's attention to {NAME!r}")
    holders[0] += 1
    return _Switch(model)


def is_enabled(model_config) -> bool:
    return getattr(model_config, "_attn_implementation", None) == NAME
