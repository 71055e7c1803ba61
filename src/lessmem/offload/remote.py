"""``RedisTier``: a Redis server as the block store several processes share.

Blocks travel as :func:`pack_block` blobs (checksummed) under ``<prefix><key>``; with the
chained prefix keys of :mod:`lessmem.offload.hashing` the same prompt prefix, model and
cache config hit from any process. When the server cannot be reached the tier warns
once per outage, counts ``stats.errors``, answers misses and drops writes, and retries
after ``retry_after`` seconds — the cache keeps working from its other tiers.
``capacity`` (bytes, optional) bounds what *this client* has written (LRU, by DEL);
the server's own ``maxmemory`` policy still applies.

Example (needs a running server):
    >>> import torch
    >>> from lessmem.offload import RedisTier
    >>> t = RedisTier("redis://127.0.0.1:1/0")     # nothing listens there
    >>> import warnings
    >>> with warnings.catch_warnings(record=True):
    ...     t.put("a", {"x": torch.zeros(2)}); print(t.get("a"), t.stats.errors >= 1)
    None True
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict

from .serialize import CorruptBlockError, pack_block, unpack_block
from .tier import Tier, check_key


class RedisTier(Tier):
    """Blocks in Redis under ``prefix + key``; unreachable server = misses + a warning."""

    kind = "remote"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", capacity: int | None = None,
                 prefix: str = "lessmem:kv:", ttl: int | None = None, retry_after: float = 5.0,
                 socket_timeout: float = 1.0, name: str = "remote"):
        super().__init__(name, capacity)
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url {url!r} must start with redis://, rediss:// or unix://")
        if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
            raise ValueError(f"ttl={ttl!r} must be a positive int (seconds) or None")
        try:
            import redis
        except ImportError as e:  # pragma: no cover - optional dependency
            raise ValueError("the remote tier needs the 'redis' package (pip install redis)") from e
        self._redis = redis
        self.url, self.prefix, self.ttl, self.retry_after = url, prefix, ttl, float(retry_after)
        self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout,
                                           socket_connect_timeout=socket_timeout)
        self._down_until = 0.0
        self._written: OrderedDict[str, int] = OrderedDict()  # what this client wrote
        self._held = 0

    # -- failure handling -------------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, op: str, e: Exception) -> None:
        with self._lock:
            self.stats.errors += 1
            first = self._down_until <= time.monotonic()
            self._down_until = time.monotonic() + self.retry_after
        if first:
            warnings.warn(f"{self.name} tier: Redis at {self.url} unavailable during {op} ({e}); "
                          f"continuing without it, retrying in {self.retry_after:g}s",
                          RuntimeWarning, stacklevel=3)

    def _call(self, op: str, fn, default):
        if not self._available():
            with self._lock:
                self.stats.errors += 1
            return default
        try:
            return fn()
        except (self._redis.exceptions.ConnectionError, self._redis.exceptions.TimeoutError,
                OSError) as e:
            self._failed(op, e)
            return default

    @property
    def available(self) -> bool:
        """True unless the last call failed less than ``retry_after`` seconds ago."""
        return self._available()

    # -- interface --------------------------------------------------------------------
    def put(self, key: str, block: dict) -> None:
        check_key(key)
        blob = pack_block(block, meta={"key": key})
        n = len(blob)
        t0 = time.perf_counter()
        with self._lock:
            order = [(k, s) for k, s in self._written.items() if k != key]
            victims = self._victims(order, self._held - self._written.get(key, 0), n)
        for k in victims:
            self._evict(k)
        ok = self._call("put", lambda: self.client.set(self.prefix + key, blob, ex=self.ttl), None)
        if ok:
            with self._lock:
                self._held -= self._written.pop(key, 0)
                self._written[key] = n
                self._held += n
                self.stats.puts += 1
                self._timed(False, n, t0)

    def _evict(self, key: str) -> None:
        block = self.get(key) if self.on_evict is not None else None
        self._call("evict", lambda: self.client.delete(self.prefix + key), 0)
        with self._lock:
            self._held -= self._written.pop(key, 0)
            self.stats.evictions += 1
        if block is not None:
            self.on_evict(key, block)

    def get(self, key: str) -> dict | None:
        check_key(key)
        t0 = time.perf_counter()
        blob = self._call("get", lambda: self.client.get(self.prefix + key), None)
        if blob is None:
            with self._lock:
                self.stats.misses += 1
            return None
        try:
            block, meta = unpack_block(blob)
            if meta.get("key") != key:
                raise CorruptBlockError(f"value holds key {meta.get('key')!r}")
        except CorruptBlockError as e:
            warnings.warn(f"{self.name} tier: block {key!r} is corrupt ({e}); treating it as a miss",
                          RuntimeWarning, stacklevel=2)
            with self._lock:
                self.stats.corrupt += 1
                self.stats.misses += 1
            self._call("delete", lambda: self.client.delete(self.prefix + key), 0)
            return None
        with self._lock:
            self.stats.hits += 1
            self._timed(True, len(blob), t0)
            if key in self._written:
                self._written.move_to_end(key)
        return block

    def delete(self, key: str) -> bool:
        check_key(key)
        n = self._call("delete", lambda: self.client.delete(self.prefix + key), 0)
        with self._lock:
            self._held -= self._written.pop(key, 0)
            self._pinned.discard(key)
            if n:
                self.stats.deletes += 1
        return bool(n)

    def contains(self, key: str) -> bool:
        check_key(key)
        return bool(self._call("contains", lambda: self.client.exists(self.prefix + key), 0))

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._written)

    @property
    def nbytes(self) -> int:
        """Bytes this client has written and not deleted (the server may hold more)."""
        return self._held

    def close(self) -> None:
        super().close()
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection must not raise
            pass
