"""In-memory tiers: ``DeviceTier`` (where attention runs) and ``HostTier`` (CPU RAM).

Both hold blocks as live tensors in an LRU ``OrderedDict`` under a byte budget; the byte
count is the sum of the tensors held (``QTensor.nbytes`` for quantized entries), so the
budget is checked against what is actually resident. On a CPU-only machine the device
is the CPU and a put is zero-copy; on CUDA the device tier copies blocks into device
memory and the host tier copies into pinned buffers while a bounded pinned pool has room
(``pinned_pool`` bytes), pageable memory after that.

Example:
    >>> import torch
    >>> from lessmem.offload import DeviceTier
    >>> t = DeviceTier(capacity=512, device="cpu")
    >>> t.put("a", {"x": torch.zeros(64)}); t.put("b", {"x": torch.ones(64)})
    >>> t.put("c", {"x": torch.ones(64)})      # 768 > 512: evicts "a" (least recent)
    >>> t.keys(), t.stats.evictions
    (['b', 'c'], 1)
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from lessmem.formats.qtensor import QTensor

from .serialize import block_nbytes
from .tier import Tier, check_capacity, check_key


def _move(t: torch.Tensor | None, device, pin: bool) -> torch.Tensor | None:
    if t is None:
        return None
    if pin:
        return t.detach().to("cpu").pin_memory()
    return t.detach().to(device, non_blocking=False)


def move_block(block: dict, device, pin: bool = False) -> dict:
    """A copy of ``block`` with every tensor on ``device`` (pinned host memory if ``pin``)."""
    out = {}
    for name, v in block.items():
        if isinstance(v, QTensor):
            out[name] = QTensor(
                codes=_move(v.codes, device, pin), scale=_move(v.scale, device, pin),
                zero_point=_move(v.zero_point, device, pin), fmt=v.fmt, shape=v.shape,
                dtype=v.dtype, meta=v.meta,
                extra={k: _move(t, device, pin) for k, t in v.extra.items()})
        elif isinstance(v, torch.Tensor):
            out[name] = _move(v, device, pin)
        else:
            raise ValueError(f"block entry {name!r} is a {type(v).__name__}; allowed: torch.Tensor, QTensor")
    return out


class MemoryTier(Tier):
    """LRU blocks of live tensors on ``device`` within ``capacity`` bytes."""

    kind = "memory"

    def __init__(self, name: str, capacity: int | None, device="cpu", pinned_pool: int = 0):
        super().__init__(name, capacity)
        self.device = torch.device(device)
        self.pinned_pool = int(pinned_pool)
        self.pinned_bytes = 0
        self._blocks: OrderedDict[str, tuple[dict, int, bool]] = OrderedDict()
        self._held = 0

    def put(self, key: str, block: dict) -> None:
        check_key(key)
        n = block_nbytes(block)
        t0 = time.perf_counter()
        with self._lock:
            old = self._blocks.get(key)
            held = self._held - (old[1] if old else 0)
            lru = ((k, v[1]) for k, v in self._blocks.items() if k != key)  # read only as far as needed
            victims = self._victims(lru, held, n)
            pin = self.device.type == "cpu" and torch.cuda.is_available() and \
                self.pinned_bytes + n <= self.pinned_pool
            stored = move_block(block, self.device, pin)
            for k in victims:
                if not self._evict(k):
                    break  # no lower tier takes blocks now: keep them (over capacity, counted)
            if key in self._blocks:
                self._remove(key)
            self._blocks[key] = (stored, n, pin)
            self._held += n
            self.pinned_bytes += n if pin else 0
            self.stats.puts += 1
            self._timed(False, n, t0)

    def _evict(self, key: str) -> bool:
        """Demote ``key`` (``on_evict``) and drop it; False (kept) when no lower tier took it.
        Demoted first: a concurrent reader finds the block in one tier or the other."""
        if not self._hand_down(key, self._blocks[key][0]):
            return False
        self.stats.evictions += 1
        self._remove(key)
        return True

    def _remove(self, key: str) -> None:
        _, n, pin = self._blocks.pop(key)
        self._held -= n
        self.pinned_bytes -= n if pin else 0

    def resize(self, capacity: int | None) -> None:
        """Change the byte budget, evicting least-recently-used blocks to fit (a block that
        no lower tier takes stays, and the tier stays over its capacity)."""
        with self._lock:
            self.capacity = check_capacity(capacity)
            while capacity is not None and self._held > capacity and self._blocks:
                if not self._evict(next(iter(self._blocks))):
                    break

    def get(self, key: str, touch: bool = True) -> dict | None:
        """The block (``touch=False``: without making it most recently used)."""
        return self.get_many([key], touch=touch)[0]

    def get_many(self, keys: list[str], threads: int = 1, touch: bool = True) -> list[dict | None]:
        """``[get(k, touch) for k in keys]`` under one lock (a tiered cache looks up every
        block of a layer at every decoding step)."""
        out = []
        with self._lock:
            for key in keys:
                entry = self._blocks.get(key)
                if entry is None:
                    self.stats.misses += 1
                    out.append(None)
                    continue
                if touch:
                    self._blocks.move_to_end(key)
                self.stats.hits += 1
                self.stats.bytes_read += entry[1]
                out.append(entry[0])
        return out

    def contains_many(self, keys: list[str]) -> list[bool]:
        """``[contains(k) for k in keys]`` under one lock."""
        with self._lock:
            return [k in self._blocks for k in keys]

    def delete(self, key: str) -> bool:
        with self._lock:
            if key not in self._blocks:
                return False
            self._remove(key)
            self.stats.deletes += 1
            return True

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._blocks

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    @property
    def nbytes(self) -> int:
        return self._held


class DeviceTier(MemoryTier):
    """Where attention runs: CUDA memory when present (or ``device=``), else CPU RAM."""

    kind = "device"

    def __init__(self, capacity: int | None, device=None, name: str = "device"):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(name, capacity, device=device)


class HostTier(MemoryTier):
    """CPU RAM; pinned buffers (up to ``pinned_pool`` bytes) when CUDA is present."""

    kind = "host"

    def __init__(self, capacity: int | None, pinned_pool: int = 256 << 20, name: str = "host"):
        super().__init__(name, capacity, device="cpu", pinned_pool=pinned_pool)
