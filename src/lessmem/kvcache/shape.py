"""The one place that reads a model's head dimension from its transformers config.

Example:
    >>> from transformers import LlamaConfig
    >>> head_dim(LlamaConfig(hidden_size=576, num_attention_heads=9))
    64
    >>> head_dim(LlamaConfig(hidden_size=576, num_attention_heads=9, head_dim=32))
    32
"""

from __future__ import annotations


def head_dim(model_config) -> int:
    """Channels per attention head of ``model_config`` (its text part for a multimodal
    model): the config's ``head_dim`` when it states one, else ``hidden_size //
    num_attention_heads``; ValueError when neither gives a whole positive number."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    d = getattr(text, "head_dim", None)
    if d:
        return int(d)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1 or hidden < heads \
            or hidden % heads:
        raise ValueError(f"model config {type(text).__name__}: hidden_size={hidden!r}, "
                         f"num_attention_heads={heads!r} give no head_dim; allowed: a config with "
                         "head_dim, or hidden_size a positive multiple of num_attention_heads")
    return hidden // heads
