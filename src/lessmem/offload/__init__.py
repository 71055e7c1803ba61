"""The offload layer: tiers (device, host, disk, remote) behind one interface.

- :class:`DeviceTier`, :class:`HostTier` (RAM), :class:`DiskTier` (checksummed files,
  atomic writes, survives restarts), :class:`RedisTier` (shared store) — each with
  ``put/get/get_many/delete/contains/keys/nbytes/capacity/stats`` and LRU within a byte
  capacity; an evicted block leaves only once a lower tier has taken it.
- :class:`TierStack`: placement, write-back/write-through, demotion.
- :mod:`~lessmem.offload.serialize`: block <-> checksummed bytes (bit-exact).
- :mod:`~lessmem.offload.hashing`: deterministic chained prefix keys.
- :func:`parse_bytes`, :func:`parse_offload_spec`, :func:`build_tiers`: what
  ``--kv-budget``/``--offload`` take, and the tiers they name.

This layer imports only ``lessmem.formats`` (and torch, numpy, optionally redis).

Example:
    >>> import torch, tempfile
    >>> from lessmem.offload import TierStack, HostTier, DiskTier
    >>> with TierStack([HostTier(1 << 20), DiskTier(tempfile.mkdtemp())]) as s:
    ...     _ = s.put("k", {"x": torch.ones(3)})
    ...     print(s.get("k")["x"].tolist())
    [1.0, 1.0, 1.0]
"""

from .disk import DiskTier
from .hashing import layer_key, namespace, prefix_hashes, sequence_hash
from .memory import DeviceTier, HostTier, MemoryTier, move_block
from .remote import RedisTier
from .serialize import CorruptBlockError, block_nbytes, pack_block, unpack_block
from .spec import (
    TierSpec,
    build_tier,
    build_tiers,
    check_block_tokens,
    parse_bytes,
    parse_offload_spec,
)
from .stack import WRITE_POLICIES, TierStack
from .tier import Tier, TierFullError, TierStats, TierUnavailableError

__all__ = [
    "Tier", "TierStats", "TierFullError", "TierUnavailableError", "MemoryTier", "DeviceTier", "HostTier", "DiskTier",
    "RedisTier", "TierStack", "WRITE_POLICIES", "pack_block", "unpack_block",
    "block_nbytes", "CorruptBlockError", "prefix_hashes", "sequence_hash", "layer_key", "namespace",
    "parse_bytes", "parse_offload_spec", "build_tier", "build_tiers", "check_block_tokens", "TierSpec", "move_block",
]
