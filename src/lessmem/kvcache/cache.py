"""``KVCache``: the quantized KV cache as a transformers ``Cache``.

Per-layer objects own the storage (:class:`~lessmem.kvcache.layer.QuantizedKVLayer`;
for sliding-window layers transformers' own ``DynamicSlidingWindowLayer`` when
``KVConfig.sliding == "exact"``, or :class:`~lessmem.kvcache.layer.SlidingQuantizedKVLayer`,
quantized and bounded by the window, when it is ``"quantize"``); the container routes
and adds up ``memory()``.

Passing the cache to a model: transformers 5.24 takes it as ``cache=`` (the older
``past_key_values=`` still works there with a deprecation warning; it leaves the models'
``forward`` in 5.40 and ``generate`` in 6.0). :func:`cache_kwarg` names the keyword the
given model takes, so code written against it runs on both sides of the rename.

Bad input is refused before anything is stored, with a message naming the value and what
is allowed: a model instead of its config, a layer index outside ``0..layers-1``, keys and
values of different shapes, dtypes or devices, or a ``crop``/``truncate_to`` beyond what
can be removed.

Example:
    >>> import torch, lessmem
    >>> from lessmem.models import tiny_random
    >>> from lessmem.kvcache.cache import cache_kwarg
    >>> model = tiny_random("llama")
    >>> cache = lessmem.KVCache(model.config, "kivi-4")
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False,
    ...                      **{cache_kwarg(model): cache})
    >>> cache.get_seq_length(), cache.memory()["total"] > 0
    (6, True)
    >>> cache.truncate_to(4)
    >>> cache.get_seq_length()
    4
"""

from __future__ import annotations

import inspect
import numbers
from functools import lru_cache

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..formats.hadamard import HadamardRotation
from .attention import is_enabled
from .config import KVConfig
from .layer import QuantizedKVLayer, SlidingQuantizedKVLayer, crop_to_length
from .presets import resolve
from .shape import head_dim as model_head_dim

ATTENTION_MODES = ("auto", "fused", "reference")

_CACHE_KWARG: dict[type, str] = {}  # model class -> the keyword its forward takes the cache by


def cache_kwarg(model) -> str:
    """The keyword ``model``'s ``forward`` (and ``generate``) takes the cache under:
    ``"cache"`` on transformers 5.24 and later, ``"past_key_values"`` before.

    Decided once per model class from its forward's signature: the name it lists (``cache``
    when it lists both and the installed transformers has moved to ``cache``); a forward
    that lists neither (a ``**kwargs`` wrapper) gets the installed transformers' own name.

    Example:
        >>> from lessmem.models import tiny_random
        >>> cache_kwarg(tiny_random("llama")) in ("cache", "past_key_values")
        True
    """
    cls = type(model)
    name = _CACHE_KWARG.get(cls)
    if name is None:
        forward = getattr(model, "forward", None)
        if not callable(forward):
            raise TypeError(f"cache_kwarg: {model!r} has no forward method; allowed: a "
                            "transformers model")
        try:
            params = inspect.signature(forward).parameters
        except (TypeError, ValueError):  # a builtin or C-implemented forward: no signature
            params = {}
        new, old = "cache" in params, "past_key_values" in params
        if new and old:
            name = _library_cache_kwarg()
        else:
            name = "cache" if new else "past_key_values" if old else _library_cache_kwarg()
        _CACHE_KWARG[cls] = name
    return name


@lru_cache(maxsize=None)
def cache_kwargs(model, cache) -> dict:
    """Forward kwargs passing ``cache`` under :func:`cache_kwarg`, with ``use_cache``."""
    return {cache_kwarg(model): cache, "use_cache": True}


PREFILL_CHUNK = 512  # prompt tokens a forward in prefill_chunks (the benchmarks' and the CLI's)


def prefill_chunks(model, cache, input_ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Feed ``input_ids`` [B, T] to ``model`` into ``cache`` (any transformers cache: a
    lessmem one, a ``DynamicCache``) ``chunk`` tokens a forward (default ``PREFILL_CHUNK``);
    returns the last position's logits [B, vocab] (float32). One forward over a long prompt
    holds every activation of it at once, each chunk only its own. Checked first: nothing is
    fed when ``input_ids`` or ``chunk`` is refused."""
    if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1
            or input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool):
        raise ValueError(f"input_ids {_describe(input_ids) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}; "
                         "allowed: integer token ids [batch, tokens], at least one token")
    step = PREFILL_CHUNK if chunk is None else chunk
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"chunk={chunk!r}; allowed: a positive integer (tokens a forward) or None")
    step, kw, out = int(step), cache_kwargs(model, cache), None
    with torch.no_grad():
        for a in range(0, input_ids.shape[1], step):
            out = model(input_ids[:, a:a + step], **kw, logits_to_keep=1)
    return out.logits[:, -1].float()


def _library_cache_kwarg() -> str:
    """The installed transformers' own name: what its reference model (Llama) takes."""
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def check_model_config(model_config):
    """The text part of ``model_config`` after checking it is a transformers config (a
    model, a dict or None is refused with the fix in the message). Every cache class runs
    this first, before it opens anything."""
    from transformers import PretrainedConfig

    if not isinstance(model_config, PretrainedConfig):
        got = type(model_config).__name__
        if isinstance(getattr(model_config, "config", None), PretrainedConfig):
            hint = f"got a model ({got}); pass model.config"
        elif isinstance(model_config, dict):
            hint = "got a dict; build a config first, e.g. transformers.AutoConfig.for_model(**d)"
        else:
            hint = f"got {model_config!r} ({got})"
        raise TypeError(f"model_config: {hint}; allowed: a transformers PretrainedConfig "
                        "(e.g. model.config)")
    text = model_config.get_text_config()
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        v = getattr(text, name, None)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"model_config: {type(text).__name__}.{name}={v!r}; allowed: the "
                             "config of a decoder language model (a positive integer)")
    return text


def _check_channels(cfg: KVConfig, text, head_dim: int) -> None:
    """A config with bits per key channel fits this model: one bit width per channel of its
    head_dim, an order for all KV heads or one per head (ValueError before anything is
    stored; such configs are calibrated for one model, see ``lessmem.eval.channels``)."""
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    for layer in range(text.num_hidden_layers):
        k = cfg.for_layer(layer)[0]
        if not k.channel_bits:
            continue
        n, order = len(k.channel_bits), len(k.channel_order)
        if n != head_dim or order not in (0, head_dim, kv_heads * head_dim):
            raise ValueError(f"layer {layer}: keys with {n} channel bits and {order} channel_order entries; "
                             f"allowed for this model: {head_dim} bits (head_dim) and an order of {head_dim} "
                             f"or {kv_heads} x {head_dim} entries (a config calibrated for another model?)")


def _layer_types(model_config) -> list[str]:
    n = model_config.num_hidden_layers
    types = getattr(model_config, "layer_types", None)
    if types:
        return list(types)[:n]
    if getattr(model_config, "sliding_window", None) is not None and getattr(
            model_config, "use_sliding_window", True):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def _check_kv(layer, k, v, idx: int) -> None:
    """Raise (storing nothing) unless ``k``/``v`` are tensors ``[batch, heads, tokens,
    head_dim]`` that agree with each other and with what ``layer`` already holds."""
    for name, t in (("key_states", k), ("value_states", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            what = _describe(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"update(layer {idx}): {name} is {what}; allowed: a floating-point "
                            "tensor [batch, heads, tokens, head_dim]")
    quantized_layer = isinstance(layer, QuantizedKVLayer)
    same = k.shape == v.shape if quantized_layer else k.shape[:3] == v.shape[:3]
    if not same or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(f"update(layer {idx}): key_states {_describe(k)} and value_states "
                         f"{_describe(v)} differ; allowed: the same shape, dtype and device")
    if not layer.is_initialized:
        return
    if quantized_layer:
        held = (layer.batch_size, layer.num_heads, layer.head_dim, layer.device)
    elif getattr(layer, "keys", None) is not None:
        held = (*layer.keys.shape[:2], layer.keys.shape[3], layer.keys.device)
    else:
        return
    got = (k.shape[0], k.shape[1], k.shape[3], k.device)
    if got != held:
        raise ValueError(f"update(layer {idx}): key_states {_describe(k)} do not continue what "
                         f"the layer holds (batch {held[0]}, heads {held[1]}, head_dim "
                         f"{held[2]}, on {held[3]}); allowed: new tokens of the same batch, "
                         "heads, head_dim and device")


class KVCache(Cache):
    """Quantized KV cache for a transformers model; see the module doc.

    ``model_config``: the model's config, ``model.config`` (a model itself is refused
    with that hint; its ``_attn_implementation`` is read, never written, to pick the
    fused path; see ``lessmem.kvcache.enable``).
    ``config``: a preset name (``lessmem presets``) or a :class:`KVConfig`.
    ``attention``: ``"auto"`` (fused when the model was switched with
    ``lessmem.kvcache.enable``), ``"fused"`` (always return views; needs the switch) or
    ``"reference"`` (always return dequantized tensors).

    Shortening: :meth:`truncate_to` keeps a given number of tokens; ``crop`` is
    transformers' name for it (negative: tokens to remove).
    """

    def __init__(self, model_config, config: str | KVConfig = "int4", attention: str = "auto"):
        text = check_model_config(model_config)
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r}; allowed: {', '.join(ATTENTION_MODES)}")
        self.kv_config = resolve(config)
        self.model_config = model_config
        self.attention = attention
        head_dim = model_head_dim(text)
        cfg = self.kv_config
        _check_channels(cfg, text, head_dim)
        self.rotations = (
            HadamardRotation(head_dim, seed=cfg.rotation_seed) if cfg.rotate_keys else None,
            HadamardRotation(head_dim, seed=cfg.rotation_seed + 1) if cfg.rotate_values else None,
        )
        layers = []
        for i, kind in enumerate(_layer_types(text)):
            if kind in ("sliding_attention", "chunked_attention") and cfg.sliding == "exact":
                window = text.sliding_window if kind == "sliding_attention" else text.attention_chunk_size
                layers.append(DynamicSlidingWindowLayer(sliding_window=window))
            elif kind == "sliding_attention":
                layers.append(self._new_sliding_layer(i, text.sliding_window))
            else:
                layers.append(self._new_layer(i))
        super().__init__(layers=layers)

    def _new_layer(self, layer_idx: int) -> QuantizedKVLayer:
        """The storage of one quantized layer (a subclass builds its own kind here, once)."""
        return QuantizedKVLayer(self.kv_config, layer_idx, self.rotations, self._fused)

    def _new_sliding_layer(self, layer_idx: int, sliding_window: int) -> QuantizedKVLayer:
        """A quantized sliding-window layer: it drops what slid out of its window."""
        return SlidingQuantizedKVLayer(self.kv_config, layer_idx, sliding_window, self.rotations, self._fused)

    def _fused(self) -> bool:
        if self.attention == "auto":
            return is_enabled(self.model_config)
        return self.attention == "fused"

    # ---- checked entry points (transformers' Cache interface) --------------------------
    def _index(self, layer_idx) -> int:
        """``layer_idx`` as an int in ``0..len(layers)-1``, or a TypeError/IndexError."""
        n = len(self.layers)
        if type(layer_idx) is int and 0 <= layer_idx < n:  # the hot path: one check
            return layer_idx
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, numbers.Integral):
            raise TypeError(f"layer_idx={layer_idx!r}; allowed: an integer 0..{n - 1}")
        if not 0 <= layer_idx < n:
            raise IndexError(f"layer_idx={layer_idx}: this cache has {n} layers; allowed: "
                             f"0..{n - 1}")
        return int(layer_idx)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Append new keys/values to layer ``layer_idx`` (checked first: nothing is stored
        when the index or the tensors are refused)."""
        i = self._index(layer_idx)
        _check_kv(self.layers[i], key_states, value_states, i)
        return super().update(key_states, value_states, i, *args, **kwargs)

    def prefill(self, model, input_ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Logits [B, vocab] after feeding ``input_ids`` [B, T] into this cache ``chunk`` tokens
        a forward (default 512; :func:`prefill_chunks`), so a long prompt's activations are
        held a chunk at a time. For ``generate``, prefill all but the prompt's last token, then
        pass the whole prompt and this cache: it feeds only the tokens the cache lacks.
        (``TieredKVCache.prefill`` also loads and saves the prompt's state in its tiers.)"""
        return prefill_chunks(model, self, input_ids, chunk)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._index(layer_idx))

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return super().get_max_length(None if layer_idx is None else self._index(layer_idx))

    def get_mask_sizes(self, *args, **kwargs):
        args = list(args)
        if "layer_idx" in kwargs:
            kwargs["layer_idx"] = self._index(kwargs["layer_idx"])
        elif len(args) > 1:
            args[1] = self._index(args[1])
        return super().get_mask_sizes(*args, **kwargs)

    # ---- shortening ---------------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """transformers' ``Cache.crop``: a negative value removes that many tokens (what
        ``generate`` passes), a positive one is the length to keep (the older
        ``crop(max_length)``), 0 removes nothing (transformers' sliding layers still drop
        what their window no longer needs). lessmem code calls :meth:`truncate_to`."""
        length = crop_to_length(tokens_to_remove, self.get_seq_length())
        if tokens_to_remove == 0:
            super().crop(0)
        else:
            self.truncate_to(length)

    def truncate_to(self, length: int) -> None:
        """Keep the first ``length`` tokens of every layer and drop the rest.

        All or nothing: every quantized layer is checked first (only tokens still held in
        full precision can go: the quantized history is never re-quantized), and
        transformers' sliding layers are put back as they were if one refuses."""
        n = self.get_seq_length()
        if isinstance(length, bool) or not isinstance(length, numbers.Integral):
            raise TypeError(f"truncate_to({length!r}); allowed: an integer 0..{n}")
        if not 0 <= length <= n:
            raise ValueError(f"truncate_to({length}): the cache holds {n} tokens; allowed: 0..{n}")
        length = int(length)
        targets = [min(length, layer.get_seq_length()) for layer in self.layers]
        for layer, t in zip(self.layers, targets, strict=True):
            if isinstance(layer, QuantizedKVLayer):
                layer.check_truncate(t)
        others = [(i, layer) for i, layer in enumerate(self.layers)
                  if not isinstance(layer, QuantizedKVLayer) and layer.get_seq_length() > targets[i]]
        saved = [dict(layer.__dict__) for _, layer in others]  # crop only reassigns attributes
        for i, layer in others:
            try:
                layer.crop(targets[i] - layer.get_seq_length())
            except (RuntimeError, ValueError) as e:
                for (_, other), state in zip(others, saved, strict=True):
                    other.__dict__.clear()
                    other.__dict__.update(state)
                raise ValueError(f"truncate_to({length}): layer {i} ({type(layer).__name__}) "
                                 f"refused ({e}); allowed: what that layer can still remove; "
                                 "nothing was changed") from e
        for layer, t in zip(self.layers, targets, strict=True):
            if isinstance(layer, QuantizedKVLayer):
                layer.truncate_to(t)

    # ---- accounting ---------------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes held, by part, summed from the tensors actually held.

        Keys: ``codes``, ``scales``, ``zero_points`` (quantized history), ``window``
        (full-precision recent tokens, and unquantized/sliding layers), ``sinks``,
        ``total``, ``fp16_equivalent`` (the same tokens at 2 bytes per element),
        ``compression`` (fp16_equivalent / total), ``k_bits``/``v_bits`` (stored bits
        per quantized element, metadata included; 0 before any token is quantized),
        ``tokens`` (sequence length), ``window_room`` (the windows' buffers' room for tokens
        to come: allocated, held, and not in ``total``, which counts what the tokens take;
        under ``WINDOW_GRAIN`` tokens a layer, see ``base.placement``).
        """
        tot = dict(codes=0, scales=0, zero_points=0, window=0, sinks=0)
        room = 0
        kq = vq = qel = 0
        fp16 = 0
        for layer in self.layers:
            if isinstance(layer, QuantizedKVLayer):
                m = layer.memory()
                for k in tot:
                    tot[k] += m[k]
                room += m["window_room"]
                kq, vq, qel = kq + m["k_quant_bytes"], vq + m["v_quant_bytes"], qel + m["quant_elements"]
                fp16 += layer.fp16_equivalent()
            elif isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None:
                b = layer.keys.numel() * layer.keys.element_size() * 2
                tot["window"] += b
                fp16 += 2 * 2 * layer.keys.numel()
        total = sum(tot.values())
        out = dict(tot)
        out.update(total=total, fp16_equivalent=fp16,
                   compression=(fp16 / total) if total else 0.0,
                   k_bits=8 * kq / qel if qel else 0.0, v_bits=8 * vq / qel if qel else 0.0,
                   tokens=self.get_seq_length(), window_room=room)
        return out

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self.layers)}, config={self.kv_config})"


def quantized_layers(cache: KVCache) -> list[QuantizedKVLayer]:
    return [layer for layer in cache.layers if isinstance(layer, QuantizedKVLayer)]
