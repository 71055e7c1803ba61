"""A lean decode step for Llama-family models: one new token per sequence, without
transformers' per-module machinery.

A decode step of a small model on a CPU is mostly overhead, not arithmetic: on the
built-in model (30 layers) transformers runs ~2,000 small tensor ops and ~600 module
calls per token (RMSNorm alone is seven ops, rotary embedding five per tensor), about as
much time as the fused weight kernels themselves. ``lean_decode(model)`` replaces, for
decode steps only, the model's forward with a straight walk over its layers that calls
the same weights and the same cache:

- RMSNorm as one call (float32 on the CPU: ``rms_norm_rows`` in C++, which adds the squares
  in ``at::sum``'s own order; elsewhere ``torch.rms_norm``; other dtypes follow
  transformers' float32 round trip), the rotary embedding on a sign-folded sine
  (``rope_rows`` in C++ on the CPU), bit-identical to transformers';
- each projection called directly: a ``GGUFLinear`` through its op
  (``torch.ops.lessmem.gguf_linear``), anything else as its module; on the CPU, q/k/v and
  gate/up of ``GGUFLinear`` layers as one C++ call each (``gguf_linear_multi``: one
  parallel region instead of three or two, the same columns bit for bit, llama.cpp's
  permuted q/k rows gathered in the call), the q/k/v row split into heads and rotated in
  one more (``qkv_rope_rows``), ``silu(gate) · up`` in one (``silu_mul_rows``);
- attention straight from the cache: a lessmem layer appends the token and attends in one
  call (``QuantizedKVLayer.decode_row``: the fused kernel over its quantized blocks, no
  view object in between) or, for ``DynamicCache``, one SDPA call with GQA over its
  layer, which grows in place (``_dynamic_append``) instead of being copied whole each step;
- after a prefill chunk into such a cache (the model's forward), the pages its
  activations freed go back to the operating system (``base.cpu.trim_heap``), so they do
  not stay in the RSS the decode holds; so do, after a decode step that moved a lessmem
  cache's window blocks into its history (every ``block_size`` tokens), the pages of the
  history pieces that step replaced (a piece is rejoined with each new block: left to the
  allocator, the old copies' pages stayed in the decode's RSS;
  ``benchmarks/results/e2e_trim_after.json`` against ``e2e_trim_before.json``), and, right after a ``DynamicCache`` layer moves to bigger
  buffers (of ``TRIM_GROWN_BYTES`` or more), the pages of the old ones: the first step after
  a prefill moves every layer, and without the trims it held the old KV and the new at once.

A serving step of decode rows only takes it too (``serve_step``, called by
``lessmem.serve.Engine``): each row a request's token at its own position, the rows handed
to the step's ``BatchCache`` packed as the model's forward would, for models whose
projections are all ``GGUFLinear`` (each row then computed on its own by the fused kernel).

Which calls take it: ``input_ids`` of one token per row, a ``DynamicCache`` or lessmem
``KVCache`` that already holds the prompt, no padding (an ``attention_mask`` of ones, if
any), positions that continue the cache, the model in ``eval()`` mode, no hooks on its
modules. Anything else (prefill, padding, output_attentions, a hook, a module replaced
after the switch) takes the model's own forward, so the switch never changes what a
call may do; it is checked on every call (a few tens of µs). With a lessmem cache the
logits are transformers' bit for bit; with a ``DynamicCache`` the attention
(``one_token_attention``) sums in another order, so they are equal up to float rounding
(tested on every supported architecture; int8 activations can turn a rounding difference
into a different int8 code, and so a larger logit difference).

Supported architectures (``ARCHS``): Llama, Mistral, Qwen2 and Qwen3 (QK-norm) without
sliding-window layers; ``why_not(model)`` says why another is refused.

Example:
    >>> import torch, lessmem
    >>> from lessmem.models import tiny_random
    >>> model = tiny_random("llama")
    >>> with lessmem.lean_decode(model) as switch:
    ...     cache = lessmem.KVCache(model.config, "int8")
    ...     _ = model(torch.tensor([[1, 2, 3]]), cache=cache)    # prefill: the model's forward
    ...     out = model(torch.tensor([[4]]), cache=cache)         # decode: the lean step
    >>> switch.steps, tuple(out.logits.shape)
    (1, (1, 1, 272))
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import nn

from .base.cpu import trim_heap
from .kvcache.attention import DYNAMIC_PROMPT
from .kvcache.layer import append_rows
from .kvcache.view import attend_rows

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
_ACTS = ("silu", "swish")
_KWARGS = frozenset({"input_ids", "cache", "past_key_values", "attention_mask", "position_ids",
                     "cache_position", "use_cache", "return_dict", "logits_to_keep"})


def why_not(model) -> str | None:
    """None when ``model`` can take the lean step, else why not (one sentence)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHS:
        return f"architecture {kind!r} (allowed: {', '.join(ARCHS)})"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not isinstance(getattr(inner, name, None), nn.Module):
            return f"the model has no model.{name}"
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        return "the model has no lm_head"
    from .kvcache.cache import _layer_types

    if any(t != "full_attention" for t in _layer_types(cfg)):
        return "sliding-window layers (the lean step attends to the whole cache)"
    if getattr(cfg, "hidden_act", None) not in _ACTS:
        return f"activation {getattr(cfg, 'hidden_act', None)!r} (allowed: {', '.join(_ACTS)})"
    for i, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for part, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                            (mlp, ("gate_proj", "up_proj", "down_proj")),
                            (layer, ("input_layernorm", "post_attention_layernorm"))):
            for n in names:
                if not isinstance(getattr(part, n, None), nn.Module):
                    return f"layer {i} has no {n}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm,
                 *(getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n))]
        if not all(_is_rms(m) for m in norms):
            return f"layer {i} normalizes with {type(norms[0]).__name__}, not an RMSNorm"
        if not isinstance(getattr(attn, "head_dim", None), int) or not hasattr(attn, "scaling"):
            return f"layer {i}'s attention has no head_dim or scaling"
    if not _is_rms(inner.norm):
        return "the final norm is not an RMSNorm"
    own, held = model.__dict__.get("forward"), model.__dict__.get("_lessmem_lean")
    if own is not None and (held is None or getattr(own, "__self__", None) is not held):
        return "model.forward was replaced on the instance (a hook such as accelerate's device map)"
    return None


def _is_rms(m) -> bool:
    return (type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and isinstance(getattr(m, "variance_epsilon", None), float))


def _proj(m):
    """A callable x -> m(x) without the module call: the GGUF op for a GGUFLinear. Tensors
    and flags are read from the module at each call (its ``_buffers``/``_parameters`` dicts:
    cheap), so moving the model or ``set_int8_activations`` after the switch is seen."""
    from .weights.gguf_linear import _GGUF, GGUFLinear
    from .weights.qlinear import FUSED_MAX_ROWS

    if type(m) is GGUFLinear and m.out_perm is None:
        bufs, params, tid, n = m._buffers, m._parameters, m._type.ggml_id, m.out_features
        fused_max = FUSED_MAX_ROWS * m.in_features
        return lambda x: (_GGUF(x, bufs["qweight"], tid, n, params.get("bias"), m.int8_activations)
                          if x.numel() <= fused_max else m.forward(x))
    if type(m) is nn.Linear:
        params = m._parameters
        return lambda x: F.linear(x, params["weight"], params["bias"])
    return m.forward


def _glue():
    """The C++ module with the step's glue (``gguf_linear_multi``, ``rms_norm_rows``,
    ``rope_rows``: csrc/gguf_linear.cpp), or None without a compiler."""
    from .kernels import gguf_linear_cpp

    return gguf_linear_cpp._mod()


def _norm(m, glue=None):
    """RMSNorm as a callable: for float32 CPU tensors one C++ call (``rms_norm_rows``), else
    one ``torch.rms_norm`` for float32, else transformers' steps (the same numbers: tested
    bit for bit)."""
    params, eps = m._parameters, m.variance_epsilon

    def norm(x):
        w = params["weight"]
        if w.dtype == torch.float32 and x.dtype == torch.float32:
            if glue is not None and x.device.type == "cpu" and w.device.type == "cpu":
                return glue.rms_norm_rows(x, w, eps)  # torch.rms_norm is seven ops: ~20 µs here
            return F.rms_norm(x, (w.shape[-1],), w, eps)
        return _rms_steps(x, w, eps)
    return norm


def _multi(mods, glue):
    """Several ``GGUFLinear`` of one input as one C++ call (``gguf_linear_multi``: one
    parallel region, x quantized once; the same columns bit for bit): a callable x -> y
    [..., ΣN] or None (then: call them one by one) when the modules are not all GGUFLinear
    or there is no C++ module. The callable itself answers None for a call it does not
    take (not float32 on the CPU, more rows than the fused kernel, mixed int8 flags)."""
    from .weights.gguf_linear import GGUFLinear
    from .weights.qlinear import FUSED_MAX_ROWS

    if glue is None or not all(type(m) is GGUFLinear for m in mods):
        return None
    if any(m.out_perm is not None and m.bias is not None for m in mods):
        return None  # (the bias goes after the gather: one by one)
    bufs = [m._buffers for m in mods]
    params = [m._parameters for m in mods]
    ids = [m._type.ggml_id for m in mods]
    ns = [m.out_features for m in mods]
    fused_max = FUSED_MAX_ROWS * mods[0].in_features
    order = None  # rows held in another order than the outputs (GGUFLinear.out_perm): gathered in the call
    if any(m.out_perm is not None for m in mods):
        starts = [sum(ns[:i]) for i in range(len(ns))]
        order = torch.cat([s + (m.out_perm.cpu() if m.out_perm is not None else torch.arange(n))
                           for m, s, n in zip(mods, starts, ns, strict=True)]).long().contiguous()

    def call(x):  # (~11 µs of Python around the kernel before: sets, generators, a gather op)
        if x.dtype is not torch.float32 or not x.is_cpu or x.numel() > fused_max:
            return None
        flag = mods[0].int8_activations
        ws = [b["qweight"] for b in bufs]
        for m, w in zip(mods, ws, strict=True):
            if m.int8_activations is not flag or not w.is_cpu:
                return None
        return glue.gguf_linear_multi(x, ws, ids, ns, [p.get("bias") for p in params], flag, order)
    return call


def _rms_steps(x, w, eps):
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


class _Layer:
    __slots__ = ("ln1", "ln2", "q", "k", "v", "o", "gate", "up", "down", "q_norm", "k_norm",
                 "qkv", "gate_up", "hq", "hkv", "d", "scale", "idx")

    def __init__(self, layer, idx: int, cfg, glue=None):
        a, m = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = _norm(layer.input_layernorm, glue), _norm(layer.post_attention_layernorm, glue)
        self.q, self.k, self.v, self.o = (_proj(a.q_proj), _proj(a.k_proj), _proj(a.v_proj), _proj(a.o_proj))
        self.gate, self.up, self.down = _proj(m.gate_proj), _proj(m.up_proj), _proj(m.down_proj)
        self.qkv = _multi((a.q_proj, a.k_proj, a.v_proj), glue)
        self.gate_up = _multi((m.gate_proj, m.up_proj), glue)
        self.q_norm = _norm(a.q_norm, glue) if hasattr(a, "q_norm") else None
        self.k_norm = _norm(a.k_norm, glue) if hasattr(a, "k_norm") else None
        self.d = int(a.head_dim)
        self.hq = cfg.num_attention_heads
        self.hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.scale = float(a.scaling)
        self.idx = idx


class LeanDecode:
    """The switch: ``model.forward`` takes the lean step where it can (module doc).
    ``disable()`` (or leaving the ``with`` block) puts the model's own forward back.

    What the step calls is gathered on the first decode call and gathered again when a
    module of the model was replaced since (``lessmem.quantize_`` after the switch); a
    copy (``copy.deepcopy``, pickling) gathers its own."""

    def __init__(self, model):
        reason = why_not(model)
        if reason is not None:
            raise ValueError(f"lean_decode: this model cannot take the lean step: {reason}")
        self.model = model
        self.steps = 0  # decode calls that took the lean step (the rest took the model's forward)
        self.serve_steps = 0  # serving steps that took it (serve_step)
        self._parts = None
        self._history = None  # (id of the cache, its first layer's history tokens) after the last step
        model.forward = self._call
        model._lessmem_lean = self

    def __getstate__(self):  # a copy gathers its own weights and counts its own steps
        return {"model": self.model}

    def __setstate__(self, state):
        self.model = state["model"]
        self.steps = self.serve_steps = 0
        self._parts = None
        self._history = None

    def _build(self) -> None:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        model = self.model
        inner = model.model
        glue = self._glue = _glue()
        self._layers = [_Layer(layer, i, model.config, glue) for i, layer in enumerate(inner.layers)]
        self._embed = inner.embed_tokens
        self._norm = _norm(inner.norm, glue)
        self._head = _proj(model.lm_head)
        self._rotary = inner.rotary_emb
        from .weights.gguf_linear import GGUFLinear

        projections = [model.lm_head, *(p for layer in inner.layers for mod in (layer.self_attn, layer.mlp)
                                        for n, p in mod.named_children() if n.endswith("_proj"))]
        self._all_gguf = all(type(p) is GGUFLinear for p in projections)  # (serve_step: rows on their own)
        # what the step depends on, checked on every call: (parent, child name, child)
        self._parts = [(p, n, c) for p in model.modules() for n, c in p._modules.items() if c is not None]
        self._modules = [model, *(c for _, _, c in self._parts)]
        # the same, as flat lists the per-step check walks in C (map/any): 400 modules
        # checked one by one in Python took ~200 µs a step
        self._slots = ([p._modules for p, _, _ in self._parts], [n for _, n, _ in self._parts],
                       [c for _, _, c in self._parts])
        self._hooks = [d for m in self._modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        from .kvcache.cache import KVCache
        from .kvcache.layer import QuantizedKVLayer

        self._kv_types = (KVCache, QuantizedKVLayer)  # for step's direct path (not imported per step)
        fields = CausalLMOutputWithPast.__dataclass_fields__
        self._out_cls = CausalLMOutputWithPast
        self._cache_field = "cache" if "cache" in fields else "past_key_values"

    def disable(self) -> None:
        if self.model.__dict__.get("forward") == self._call:
            del self.model.forward
        if self.model.__dict__.get("_lessmem_lean") is self:
            del self.model._lessmem_lean

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.disable()

    # ---- the switch ---------------------------------------------------------------
    def _call(self, *args, **kwargs):
        ids = args[0] if len(args) == 1 else kwargs.get("input_ids") if not args else None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if ids is None or len(args) > 1 or not self._eligible(ids, cache, kwargs):
            chunk = isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 1 and _cache_ok(cache)
            # a DynamicCache's prompt chunk (_cache_ok's only cache without a kv_config) trims
            # inside too (kvcache.attention._trim_dynamic_chunk)
            token = DYNAMIC_PROMPT.set(True) if chunk and not hasattr(cache, "kv_config") else None
            try:
                out = type(self.model).forward(self.model, *args, **kwargs)
            finally:
                if token is not None:
                    DYNAMIC_PROMPT.reset(token)
            if chunk:
                trim_heap()  # a prefill chunk freed its activations: hand the pages back (base.cpu)
            return out
        self.steps += 1
        logits = self.step(ids, cache)
        self._trim_after_flush(cache)
        return self._out_cls(logits=logits, **{self._cache_field: cache})

    def _trim_after_flush(self, cache) -> None:
        """``trim_heap`` when this step moved blocks into the history of the same lessmem
        cache as the last step (its first layer's ``n_history`` grew): the pieces it replaced
        are free by now. One call every ``block_size`` tokens (a few ms at 4k context). (A
        ``DynamicCache`` layer trims as its buffers grow: ``_dynamic_append``.)"""
        n = getattr(cache.layers[0], "n_history", None) if getattr(cache, "layers", None) else None
        last, self._history = self._history, (id(cache), n)  # (no reference: the cache may go)
        if n is not None and last is not None and last[0] == id(cache) and last[1] != n:
            trim_heap()

    def _eligible(self, ids, cache, kw) -> bool:
        if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1
                or not _KWARGS.issuperset(kw) or kw.get("use_cache") is False
                or kw.get("return_dict") is False or self.model.training or not _cache_ok(cache)):
            return False
        past = cache.get_seq_length()
        if past == 0:
            return False
        mask, pos, cpos = kw.get("attention_mask"), kw.get("position_ids"), kw.get("cache_position")
        if mask is not None and (mask.dim() != 2 or mask.shape != (ids.shape[0], past + 1) or not bool(mask.all())):
            return False
        if pos is not None and (pos.numel() != ids.shape[0] or bool((pos != past).any())):
            return False
        if cpos is not None and (cpos.numel() != 1 or int(cpos) != past):
            return False
        return self._ready()

    def _ready(self) -> bool:
        """Gathered for the model as it is now, and no hook anywhere (else: its forward)."""
        from torch.nn.modules import module as _m

        if _m._global_forward_hooks or _m._global_forward_pre_hooks:
            return False
        if self._parts is None or any(map(operator.is_not, map(dict.get, *self._slots[:2]), self._slots[2])):
            if why_not(self.model) is not None:
                return False
            self._build()
        return not any(self._hooks)  # (registering a hook fills the module's own dict)

    # ---- the step -----------------------------------------------------------------
    def serve_step(self, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor | None:
        """Logits ``[B, vocab]`` for a serving step of decode rows only: row b is token
        ``ids[b]`` of its own request at position ``positions[b]``, ``cache`` the step's
        ``serve.batch.BatchCache`` (each request's cache; the rows go to it packed as one
        sequence, as the model's forward would hand them). None where this model cannot take
        it, and the caller runs the model's forward: a hook or a replaced module, or a
        projection that is not a ``GGUFLinear``, or more rows than its fused kernel takes at
        once (there each row is computed on its own, so a request's result does not depend on
        the rows beside it, as the serving engine's batch invariance requires)."""
        from .weights.qlinear import FUSED_MAX_ROWS

        if (self.model.__dict__.get("_lessmem_lean") is not self or self.model.training
                or ids.numel() > FUSED_MAX_ROWS or not self._ready() or not self._all_gguf):
            return None  # (switched off, or a step this model can't take: the model's forward)
        self.serve_steps += 1
        return self.step(ids.view(-1, 1), cache, positions=positions.view(-1))[:, 0]

    @torch.no_grad()
    def step(self, ids: torch.Tensor, cache, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, 1, vocab]`` for one new token per row ``ids [B, 1]``, appending its
        keys and values to ``cache`` (no eligibility checks: see ``_eligible``). ``positions``
        [B]: a serving step (``serve_step``); else every row is at the cache's length."""
        packed = positions is not None
        dynamic = not packed and not hasattr(cache, "kv_config")  # a DynamicCache (_cache_ok allows no other)
        x = self._embed(ids)  # [B, 1, H]
        B = x.shape[0]
        if packed:
            pos = positions.to(device=x.device, dtype=torch.long).view(B, 1)
        else:
            pos = torch.full((B, 1), cache.get_seq_length(), dtype=torch.long, device=x.device)
        cos, sin = self._rotary(x, pos)  # [B, 1, D]
        half = cos.shape[-1] // 2
        cos = cos.unsqueeze(1)  # [B, 1, 1, D] against [B, heads, 1, D]
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(1)
        glue = self._glue if x.dtype == torch.float32 and x.device.type == "cpu" else None
        # a plain KVCache on its fused path: each layer appends and hands back its view directly
        # (KVCache.update's checks, transformers' Cache.update and the per-layer switch test
        # cost ~15 µs a layer; the keys and values are this step's own)
        kv_cache, kv_layer = self._kv_types
        views = (not packed and not dynamic and type(cache) is kv_cache and cache._fused()
                 and all(type(layer) is kv_layer and layer.is_initialized and layer.quantized
                         for layer in cache.layers))
        # a serving step: row b's request cache (one token a segment), for _rows_attend; the fused
        # attention (the model's switch, which a layer asks its cache about) checked once a step
        caches = ([s.cache for s in cache.segments] if packed and x.device.type == "cpu"
                  and len(getattr(cache, "segments", ())) == B else None)
        if caches is not None and not all(getattr(c, "layers", None) and getattr(c.layers[0], "_fused", None)
                                          and c.layers[0]._fused() for c in caches):
            caches = None
        for L in self._layers:
            h = L.ln1(x)
            y = L.qkv(h) if L.qkv is not None else None  # q, k and v in one call
            if y is not None and glue is not None and L.q_norm is None:  # split and rotated in one call
                q, k, v = glue.qkv_rope_rows(y, cos, sin, L.hq, L.hkv, L.d)
            else:
                if y is not None:
                    nq, nk = L.hq * L.d, L.hkv * L.d
                    q = y[..., :nq].view(B, L.hq, 1, L.d)
                    k = y[..., nq:nq + nk].view(B, L.hkv, 1, L.d)
                    v = y[..., nq + nk:].view(B, L.hkv, 1, L.d)
                else:
                    q = L.q(h).view(B, L.hq, 1, L.d)
                    k = L.k(h).view(B, L.hkv, 1, L.d)
                    v = L.v(h).view(B, L.hkv, 1, L.d)
                if L.q_norm is not None:
                    q, k = L.q_norm(q), L.k_norm(k)
                if glue is not None:  # = transformers' q·cos + rotate_half(q)·sin, bit for bit
                    q, k = glue.rope_rows(q, cos, sin), glue.rope_rows(k, cos, sin)
                else:
                    qk = torch.cat([q, k], dim=1)  # rotate both in one go
                    swapped = torch.cat([qk[..., half:], qk[..., :half]], dim=-1)
                    qk = qk * cos + swapped * sin  # (sin sign-folded above)
                    q, k = qk[:, :L.hq], qk[:, L.hq:]
            if views:  # append and attend in one call: the fused kernel over its blocks
                a = cache.layers[L.idx].decode_row(q, k, v, L.scale)
            elif packed and (a := self._rows_attend(caches, L.idx, q, k, v, L.scale)) is not None:
                pass  # each row against its own request's layer, all in one kernel call
            elif packed:  # the rows as one sequence [1, heads, B, D], each to its request's cache
                kv, _ = cache.update(k.transpose(0, 2), v.transpose(0, 2), L.idx)
                a = kv.attend(q.transpose(0, 2), None, L.scale).transpose(0, 2)
            else:
                kv, vv = _dynamic_append(cache.layers[L.idx], k, v) if dynamic else cache.update(k, v, L.idx)
                if hasattr(kv, "attend"):  # a lessmem layer view: the fused kernel over its blocks
                    a = kv.attend(q, None, L.scale)
                else:
                    a = one_token_attention(q, kv, vv, L.scale)
            x = x + L.o(a.reshape(B, 1, L.hq * L.d))
            h = L.ln2(x)
            y = L.gate_up(h) if L.gate_up is not None else None
            if y is not None and glue is not None:
                x = x + L.down(glue.silu_mul_rows(y))  # = F.silu(gate) * up, bit for bit
            elif y is not None:
                n = y.shape[-1] // 2
                x = x + L.down(F.silu(y[..., :n]) * y[..., n:])
            else:
                x = x + L.down(F.silu(L.gate(h)) * L.up(h))
        return self._head(self._norm(x))

    def _rows_attend(self, caches, idx: int, q, k, v, scale: float):
        """A serving step's attention in layer ``idx`` without the step's ``BatchCache`` and
        views (``cache.update`` then ``BatchView.attend``): row b (``q``/``k``/``v`` [B, heads,
        1, D]) against ``caches[b]``'s layer, every row in one ``attend_rows`` call over the
        same pieces those views hand it (sinks, window, the row's own token; the history as
        stored), then each token appended, as the views' path does: the same numbers, bit for
        bit. None (nothing appended) where a layer is not a quantized one whose update is just
        that (``QuantizedKVLayer.row_parts``: a serving engine's paged layers) with a history,
        or the rows' rotations differ (``caches`` is None off the fused path: ``step``); the
        caller takes the views then."""
        if caches is None:
            return None
        layers = [c.layers[idx] for c in caches]
        first, kv_layer = layers[0], self._kv_types[1]
        B, Hq, _, D = q.shape
        ks, vs = k.split(1), v.split(1)
        hists, pieces = [], []
        for layer, kb, vb in zip(layers, ks, vs, strict=True):
            parts = (layer.row_parts(kb, vb) if isinstance(layer, kv_layer) and layer.is_initialized
                     and layer.quantized and layer.rot_k is first.rot_k and layer.rot_v is first.rot_v else None)
            if parts is None:
                return None
            hists.append(parts[0])
            pieces.append(parts[1])
        out = attend_rows(first, q.reshape(B, Hq, D), scale, hists, pieces)
        if out is None:
            return None
        append_rows(layers, k, v)  # (each token to its own layer, as _append; in one call where it can)
        return out.view(B, Hq, 1, D).to(q.dtype)


SPLIT_PIECE_TOKENS = 1024  # one_token_attention splits a history only into pieces of >= this many tokens
# the CPU flash kernel that also returns the log-sum-exp (a private op of torch >= 2.2)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def one_token_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one new token per row over full-precision keys and values read in
    place: q [B, Hq, 1, D], k and v [B, Hkv, T, D] (any strides with unit last one, e.g.
    the first T tokens of a growing buffer), Hq a multiple of Hkv; returns [B, Hq, 1, D].

    The query heads sharing a KV head are its query rows ([B, Hkv, Hq/Hkv, D]: no mask is
    needed for one token), so each KV head is read once (``enable_gqa`` repeats the keys
    and values per query head on the CPU). On the CPU, with few (batch x KV head) problems
    for the threads (3 KV heads on 2 threads: one thread does two), a long history is cut
    into pieces passed as a batch (a strided view, nothing copied) to the flash kernel,
    which returns each piece's log-sum-exp, and the pieces are merged exactly (below ~2k
    tokens the merge costs more than it saves, so pieces have >= SPLIT_PIECE_TOKENS).
    Equal to ``scaled_dot_product_attention(..., enable_gqa=True)`` up to float rounding."""
    B, Hq, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    pieces = _split_pieces(B * Hkv, T) if q.device.type == "cpu" and B == 1 else 1
    if pieces < 2 or _FLASH_CPU is None or k.stride(-1) != 1 or v.stride(-1) != 1:
        return F.scaled_dot_product_attention(qg, k, v, scale=scale).view(B, Hq, 1, D)
    flash = _FLASH_CPU
    P = T // pieces

    def cut(x):  # [1, Hkv, T, D] -> [pieces, Hkv, P, D], piece i = tokens [i*P, (i+1)*P)
        return x.as_strided((pieces, Hkv, P, D), (P * x.stride(2), x.stride(1), x.stride(2), 1),
                            x.storage_offset())

    o, lse = flash(qg.expand(pieces, -1, -1, -1), cut(k), cut(v), scale=scale)
    if T > pieces * P:  # the tokens left over: one more piece
        o2, lse2 = flash(qg, k[:, :, pieces * P:], v[:, :, pieces * P:], scale=scale)
        o, lse = torch.cat([o, o2]), torch.cat([lse, lse2])
    w = torch.softmax(lse.float(), dim=0).unsqueeze(-1)
    return (o.float() * w).sum(0, keepdim=True).to(q.dtype).view(B, Hq, 1, D)


def _split_pieces(problems: int, T: int) -> int:
    """How many pieces to cut a history of T tokens into so that ``problems`` (batch x KV
    heads) times pieces fills the threads evenly: threads / gcd(problems, threads), at most
    8, and none shorter than SPLIT_PIECE_TOKENS."""
    threads = torch.get_num_threads()
    if problems >= 4 * threads:
        return 1
    return max(1, min(8, threads // math.gcd(problems, threads), T // SPLIT_PIECE_TOKENS))


GROW_MIN = 64  # a DynamicCache layer's buffer grows by max(this, an eighth) tokens at a time


TRIM_GROWN_BYTES = 4 << 20  # _dynamic_append trims the heap after a layer moves to buffers this big


def _dynamic_append(layer, k: torch.Tensor, v: torch.Tensor):
    """``DynamicLayer.update`` for one new token without copying the whole layer: transformers
    concatenates (a step at 16k tokens copied 750 MB on the built-in model); here the layer's
    keys and values become the first n tokens of a buffer with room to grow (by an eighth,
    so at most 12.5% more memory) and the token is written in place. The layer stays what
    transformers expects (``keys``/``values`` [B, H, n, D] tensors, views now); when anything
    else replaced them since (its own update, crop, a beam reorder), they are adopted anew."""
    keys, values = layer.keys, layer.values
    held = layer.__dict__.get("_lessmem_buf")
    B, H, n, D = keys.shape
    if held is None or held[2] is not keys or held[3] is not values or held[0].shape[2] < n + 1:
        cap = n + 1 + max(GROW_MIN, n // 8)
        kb, vb = keys.new_empty(B, H, cap, D), values.new_empty(B, H, cap, D)
        kb[:, :, :n].copy_(keys)
        vb[:, :, :n].copy_(values)
        grew = True
    else:
        kb, vb, grew = held[0], held[1], False
    kb[:, :, n:n + 1].copy_(k)
    vb[:, :, n:n + 1].copy_(v)
    layer.keys, layer.values = kb[:, :, :n + 1], vb[:, :, :n + 1]
    layer._lessmem_buf = (kb, vb, layer.keys, layer.values)
    del keys, values, held
    if grew and kb.device.type == "cpu" and 2 * kb.nbytes >= TRIM_GROWN_BYTES:
        # the old tensors are free now; left to the allocator, their pages stay resident and
        # the next layer's bigger buffers are placed beside them, so the step that moves every
        # layer (the first after a prefill) held the old KV and the new at once
        trim_heap()
    return layer.keys, layer.values


def _cache_ok(cache) -> bool:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from .kvcache.cache import KVCache
    from .kvcache.tiered.cache import TieredKVCache

    if type(cache) in (KVCache, TieredKVCache):
        return True
    return type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)


def lean_decode(model) -> LeanDecode:
    """Switch ``model`` to the lean decode step (module doc); a ValueError says why a model
    cannot take it. Switching a switched model returns its existing switch."""
    held = model.__dict__.get("_lessmem_lean")
    if held is not None and model.__dict__.get("forward") == held._call:
        return held
    return LeanDecode(model)


def lean_disable(model) -> bool:
    """Put the model's own forward back if ``model`` was switched; returns whether it was."""
    held = model.__dict__.get("_lessmem_lean")
    if held is None:
        return False
    held.disable()
    return True
