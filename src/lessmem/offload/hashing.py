"""Deterministic chained prefix hashes: the keys under which KV blocks are shared.

Block ``i`` of a token sequence (tokens ``[i*B, (i+1)*B)``) is keyed by::

    ns    = blake2b-256(model_id || canonical JSON of the cache config)
    h_0   = blake2b-256(ns  || int64-LE tokens of block 0)
    h_i   = blake2b-256(h_{i-1} || int64-LE tokens of block i)

so a key names the *whole prefix* up to the end of its block (two prompts share block
``i`` only if they agree on every token before it), the model and the cache config.
Nothing here uses Python's salted ``hash()``: the same inputs give the same keys in
every process and on every machine.

Example:
    >>> from lessmem.offload.hashing import prefix_hashes, layer_key
    >>> hs = prefix_hashes(list(range(10)), block_tokens=4, model_id="m", cache_config={"bits": 4})
    >>> len(hs)                      # only full blocks get keys
    2
    >>> hs == prefix_hashes(list(range(10)) + [99], 4, "m", {"bits": 4})
    True
    >>> layer_key(hs[0], 3)[-4:]
    '-L03'
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping, Sequence

import numpy as np


def _canon(obj):
    if hasattr(obj, "to_dict"):
        return _canon(obj.to_dict())
    if isinstance(obj, Mapping):
        return {str(k): _canon(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_canon(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if "torch.dtype" in str(type(obj)) or type(obj).__name__ == "dtype":
        return str(obj)
    raise ValueError(
        f"cache_config value {obj!r} of type {type(obj).__name__} cannot be hashed; "
        "allowed: None, bool, int, float, str, list, tuple, dict, dtype or objects with to_dict()")


def namespace(model_id: str, cache_config: Mapping | None) -> bytes:
    """32-byte digest of the model id and the cache config (canonical JSON, sorted keys)."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id={model_id!r} must be a non-empty string")
    cfg = json.dumps(_canon(cache_config or {}), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(model_id.encode() + b"\0" + cfg.encode(), digest_size=32).digest()


def _ids(token_ids) -> np.ndarray:
    seq = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
    return np.asarray(seq, dtype="<i8").reshape(-1)


def prefix_hashes(token_ids: Sequence[int], block_tokens: int, model_id: str,
                  cache_config: Mapping | None = None, first_block: int = 0) -> list[str]:
    """Hex chain hash of every *full* block of ``token_ids`` (see module doc).

    ``first_block > 0`` makes the first block ``first_block`` tokens long (e.g. the
    attention sinks) and the following ones ``block_tokens`` long.
    """
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens!r} must be a positive int")
    if not isinstance(first_block, int) or first_block < 0:
        raise ValueError(f"first_block={first_block!r} must be a non-negative int")
    ids = _ids(token_ids)
    prev = namespace(model_id, cache_config)
    bounds = [0, first_block] if first_block else [0]
    while bounds[-1] + block_tokens <= len(ids):
        bounds.append(bounds[-1] + block_tokens)
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b > len(ids):
            break
        prev = hashlib.blake2b(prev + ids[a:b].tobytes(), digest_size=32).digest()
        out.append(prev.hex())
    return out


def sequence_hash(token_ids: Sequence[int], model_id: str, cache_config: Mapping | None = None) -> str:
    """Hex hash of a whole token sequence (any length), the model and the cache config."""
    ns = namespace(model_id, cache_config)
    return hashlib.blake2b(ns + _ids(token_ids).tobytes(), digest_size=32).hexdigest()


def layer_key(block_hash: str, layer: int) -> str:
    """Store key of one layer's slice of a block: ``<hash>-L<layer>``."""
    if not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer={layer!r} must be a non-negative int")
    return f"{block_hash}-L{layer:02d}"
