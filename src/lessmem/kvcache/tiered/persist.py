"""Prefix persistence of a tiered cache: save, verified restore, and ``prefill``.

The bodies of :meth:`TieredKVCache.save_prefix`, ``restore_blocks``, ``restore_prefix``
and ``prefill`` (see their docstrings); the records themselves are
:class:`~.prefix.PrefixStore`'s.
"""

from __future__ import annotations

import warnings

import torch

from ...offload import TierFullError
from ..cache import check_model_config, prefill_chunks
from ..shape import head_dim as model_head_dim
from .blocks import BlockLostError


def check_restorable(cache) -> None:
    if len(cache.tiered) != len(cache.layers):
        raise ValueError("prefix save/restore needs every layer quantized; allowed: configs "
                         "without skip_layers and models without exact sliding-window layers")


def check_empty(cache, what: str) -> None:
    if cache.get_seq_length():
        raise ValueError(f"{what} needs an empty cache; allowed: a fresh cache or after reset()")


def check_shareable(cache, what: str) -> None:
    if cache.store.model_id is None:
        raise ValueError(f"{what} needs to know the model (a config cannot tell two checkpoints, a "
                         "quantized model or another dtype apart); allowed: TieredKVCache(cfg, ..., "
                         "model=model), model_id='<id of these weights>', or prefill(model, ids)")


def save_prefix(cache, token_ids, logits: torch.Tensor | None) -> str:
    ids = torch.as_tensor(token_ids).reshape(-1).tolist()
    if cache.get_seq_length() != len(ids):
        raise ValueError(f"the cache holds {cache.get_seq_length()} tokens, token_ids has "
                         f"{len(ids)}; allowed: the ids the cache was filled with")
    check_restorable(cache)
    check_shareable(cache, "save_prefix")
    cache.prefetcher.drain()  # block keys may change below: no gather may be in flight
    cache.set_tokens(ids)
    return cache.prefixes.save(cache.tiered, ids, logits)


def _start_restore(cache, what: str, token_ids, model) -> list[int]:
    check_restorable(cache)
    check_empty(cache, what)
    if model is not None:
        cache.recovery.bind(model)
    ids = torch.as_tensor(token_ids).reshape(-1).tolist()
    cache.set_tokens(ids)
    return ids


def restore_blocks(cache, token_ids, dtype, device, model) -> int:
    ids = _start_restore(cache, "restore_blocks", token_ids, model)
    if cache.store.model_id is None:  # unbound: nothing stored can be known to be this model's
        return 0
    text = check_model_config(cache.model_config)
    dtype = dtype or getattr(text, "torch_dtype", None) or torch.float32
    return cache.prefixes.restore_blocks(cache.tiered, ids, model_head_dim(text), dtype, device)


def restore_prefix(cache, token_ids, model) -> torch.Tensor | None:
    ids = _start_restore(cache, "restore_prefix", token_ids, model)
    if cache.store.model_id is None:
        return None
    return cache.prefixes.restore(cache.tiered, ids)


def prefill(cache, model, input_ids: torch.Tensor, chunk: int | None, save: bool, reuse_prefix: bool):
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}; allowed: [batch, tokens]")
    cache.recovery.bind(model)  # its fingerprint names the state; lost blocks can be recomputed
    single = input_ids.shape[0] == 1 and len(cache.tiered) == len(cache.layers)
    start = 0  # prompt tokens already in the cache (restored blocks)
    if single and not cache.get_seq_length():
        logits = cache.restore_prefix(input_ids[0])
        if logits is not None and logits.numel():
            return logits.to(model.device if hasattr(model, "device") else "cpu")
        if logits is not None:
            raise ValueError("the saved prefix has no logits; allowed: restore_prefix() then feed a token")
        cache.set_tokens(input_ids[0])
        if reuse_prefix:
            start = cache.restore_blocks(input_ids[0], dtype=getattr(model, "dtype", None),
                                         device=getattr(model, "device", None))
    # the tokens not restored, a chunk a forward, only the last position's logits computed
    logits = prefill_chunks(model, cache, input_ids[:, start:], chunk or cache.block_tokens)
    if save and single:
        try:
            cache.save_prefix(input_ids[0], logits)
        except (TierFullError, BlockLostError) as e:  # the prefill stands: its blocks stay readable
            warnings.warn(f"the prompt's state was not saved for reuse ({e}); allowed: a lower "
                          "tier with room for it", RuntimeWarning, stacklevel=3)
    return logits
