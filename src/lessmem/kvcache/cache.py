"""``KVCache``: the quantized KV cache as a transformers ``Cache``.

Per-layer objects own the storage (:class:`~lessmem.kvcache.layer.QuantizedKVLayer`,
or transformers' own ``DynamicSlidingWindowLayer`` for sliding-window layers when
``KVConfig.sliding == "exact"``); the container routes and adds up ``memory()``.

Example:
    >>> import torch, lessmem
    >>> from lessmem.models import tiny_random
    >>> model = tiny_random("llama")
    >>> cache = lessmem.KVCache(model.config, "kivi-4")
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False,
    ...                      past_key_values=cache)
    >>> cache.get_seq_length(), cache.memory()["total"] > 0
    (6, True)
"""

from __future__ import annotations

from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..formats.hadamard import HadamardRotation
from .attention import is_enabled
from .config import KVConfig
from .layer import QuantizedKVLayer
from .presets import resolve
from .shape import head_dim as model_head_dim

ATTENTION_MODES = ("auto", "fused", "reference")


def cache_kwarg(model) -> str:
    """The keyword the model's forward takes the cache under (``cache`` on newer
    transformers, ``past_key_values`` before)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _layer_types(model_config) -> list[str]:
    n = model_config.num_hidden_layers
    types = getattr(model_config, "layer_types", None)
    if types:
        return list(types)[:n]
    if getattr(model_config, "sliding_window", None) is not None and getattr(
            model_config, "use_sliding_window", True):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


class KVCache(Cache):
    """Quantized KV cache for a transformers model; see the module doc.

    ``model_config``: the model's config (its ``_attn_implementation`` is read, never
    written, to pick the fused path; see ``lessmem.kvcache.enable``).
    ``config``: a preset name (``lessmem presets``) or a :class:`KVConfig`.
    ``attention``: ``"auto"`` (fused when the model was switched with
    ``lessmem.kvcache.enable``), ``"fused"`` (always return views; needs the switch) or
    ``"reference"`` (always return dequantized tensors).
    """

    def __init__(self, model_config, config: str | KVConfig = "int4", attention: str = "auto"):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r}; allowed: {', '.join(ATTENTION_MODES)}")
        self.kv_config = resolve(config)
        self.model_config = model_config
        self.attention = attention
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        head_dim = model_head_dim(text)
        cfg = self.kv_config
        self.rotations = (
            HadamardRotation(head_dim, seed=cfg.rotation_seed) if cfg.rotate_keys else None,
            HadamardRotation(head_dim, seed=cfg.rotation_seed + 1) if cfg.rotate_values else None,
        )
        layers = []
        for i, kind in enumerate(_layer_types(text)):
            if kind in ("sliding_attention", "chunked_attention") and cfg.sliding == "exact":
                window = text.sliding_window if kind == "sliding_attention" else text.attention_chunk_size
                layers.append(DynamicSlidingWindowLayer(sliding_window=window))
            else:
                layers.append(QuantizedKVLayer(cfg, i, self.rotations, self._fused))
        super().__init__(layers=layers)

    def _fused(self) -> bool:
        if self.attention == "auto":
            return is_enabled(self.model_config)
        return self.attention == "fused"

    def memory(self) -> dict:
        """Bytes held, by part, summed from the tensors actually held.

        Keys: ``codes``, ``scales``, ``zero_points`` (quantized history), ``window``
        (full-precision recent tokens, and unquantized/sliding layers), ``sinks``,
        ``total``, ``fp16_equivalent`` (the same tokens at 2 bytes per element),
        ``compression`` (fp16_equivalent / total), ``k_bits``/``v_bits`` (stored bits
        per quantized element, metadata included; 0 before any token is quantized),
        ``tokens`` (sequence length).
        """
        tot = dict(codes=0, scales=0, zero_points=0, window=0, sinks=0)
        kq = vq = qel = 0
        fp16 = 0
        for layer in self.layers:
            if isinstance(layer, QuantizedKVLayer):
                m = layer.memory()
                for k in tot:
                    tot[k] += m[k]
                kq, vq, qel = kq + m["k_quant_bytes"], vq + m["v_quant_bytes"], qel + m["quant_elements"]
                if layer.is_initialized:
                    fp16 += 2 * 2 * layer.batch_size * layer.num_heads * layer.length * layer.head_dim
            elif isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None:
                b = layer.keys.numel() * layer.keys.element_size() * 2
                tot["window"] += b
                fp16 += 2 * 2 * layer.keys.numel()
        total = sum(tot.values())
        out = dict(tot)
        out.update(total=total, fp16_equivalent=fp16,
                   compression=(fp16 / total) if total else 0.0,
                   k_bits=8 * kq / qel if qel else 0.0, v_bits=8 * vq / qel if qel else 0.0,
                   tokens=self.get_seq_length())
        return out

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self.layers)}, config={self.kv_config})"


def quantized_layers(cache: KVCache) -> list[QuantizedKVLayer]:
    return [layer for layer in cache.layers if isinstance(layer, QuantizedKVLayer)]
