"""``RedisTier``: a Redis server as the block store several processes share.

Blocks travel as :func:`pack_block` blobs (checksummed) under ``<prefix><key>``; with the
chained prefix keys of :mod:`lessmem.offload.hashing` the same prompt prefix, model and
cache config hit from any process. ``capacity`` (bytes, optional) bounds what *this
client* has written (LRU, by DEL); the server's own ``maxmemory`` policy still applies.

Faults never lose a block silently and never escape as raw Redis errors:

- ``put`` raises :class:`TierUnavailableError` when the server cannot be reached (also
  during ``retry_after`` seconds after a failure, without trying) or answers with an
  error (e.g. ``OOM command not allowed`` under ``maxmemory`` + ``noeviction``): nothing
  was stored and the caller still has the block.
- ``get``/``contains``/``delete`` on an unreachable server are misses (False), counted
  in ``stats.errors``; the cache recomputes what it cannot read.
- A block this client stored that the server no longer has (restarted empty, flushed,
  evicted under ``maxmemory``) is a miss too.
- Each kind of trouble warns ONCE per tier (outage: again only after the server was
  back); warnings, ``repr`` and ``url`` show the URL with its password as ``***``.

Example (needs a running server):
    >>> import torch, warnings
    >>> from lessmem.offload import RedisTier, TierUnavailableError
    >>> t = RedisTier("redis://:secret@127.0.0.1:1/0")     # nothing listens there
    >>> with warnings.catch_warnings(record=True):
    ...     try:
    ...         t.put("a", {"x": torch.zeros(2)})
    ...     except TierUnavailableError:
    ...         print("not stored;", t.get("a"), t.stats.errors >= 2, t)
    not stored; None True RedisTier('remote', redis://:***@127.0.0.1:1/0)
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict

from lessmem.base.tierspec import redact_url

from .serialize import CorruptBlockError, pack_block, unpack_block
from .tier import Tier, TierUnavailableError, check_key

_FAILED = object()  # what _call returns for a get that could not be answered


class RedisTier(Tier):
    """Blocks in Redis under ``prefix + key``; unreachable server = misses + one warning."""

    kind = "remote"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", capacity: int | None = None,
                 prefix: str = "lessmem:kv:", ttl: int | None = None, retry_after: float = 5.0,
                 socket_timeout: float = 1.0, name: str = "remote"):
        super().__init__(name, capacity)
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url {redact_url(url)!r} must start with redis://, rediss:// or unix://")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0):
            raise ValueError(f"ttl={ttl!r} must be a positive int (seconds) or None")
        for opt, v in (("retry_after", retry_after), ("socket_timeout", socket_timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"{opt}={v!r} must be a non-negative number of seconds")
        if not isinstance(prefix, str):
            raise ValueError(f"prefix={prefix!r} must be a str (prepended to every Redis key)")
        try:
            import redis
        except ImportError as e:  # pragma: no cover - optional dependency
            raise ValueError("the remote tier needs the 'redis' package (pip install redis)") from e
        self._redis = redis
        self.url = redact_url(url)  # the password never leaves the client object
        self.prefix, self.ttl, self.retry_after = prefix, ttl, float(retry_after)
        self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout,
                                           socket_connect_timeout=socket_timeout)
        self._secret = self.client.connection_pool.connection_kwargs.get("password") or None
        self._down_until = 0.0
        self._warned: set[str] = set()  # kinds of trouble already warned about
        self._written: OrderedDict[str, int] = OrderedDict()  # what this client wrote
        self._held = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.url})"

    # -- failure handling -------------------------------------------------------------
    def _warn_once(self, kind: str, text: str) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        if self._secret:
            text = text.replace(self._secret, "***")
        warnings.warn(f"{self.name} tier (Redis at {self.url}): {text}", RuntimeWarning, stacklevel=4)

    def _call(self, op: str, fn, default, raise_: bool = False):
        """``fn()``; on a connection error or an error reply: count it, warn once, and
        return ``default`` (or, ``raise_``, raise TierUnavailableError)."""
        if time.monotonic() < self._down_until:
            with self._lock:
                self.stats.errors += 1
            if raise_:
                raise TierUnavailableError(f"{self.name} tier (Redis at {self.url}) is unavailable "
                                           f"(failed less than {self.retry_after:g}s ago); {op}: nothing stored")
            return default
        exc = self._redis.exceptions
        try:
            out = fn()
        except (exc.ConnectionError, exc.TimeoutError, OSError) as e:
            with self._lock:
                self.stats.errors += 1
                self._down_until = time.monotonic() + self.retry_after
            self._warn_once("down", f"unavailable during {op} ({e}); continuing without it "
                                    f"(reads are misses, writes stay in the tiers above), "
                                    f"retrying after {self.retry_after:g}s")
            return self._give_up(op, e, default, raise_)
        except exc.RedisError as e:  # an error reply: OOM under noeviction, READONLY, ...
            with self._lock:
                self.stats.errors += 1
            self._warn_once(f"reply:{type(e).__name__}", f"{op} refused ({type(e).__name__}: {e})")
            return self._give_up(op, e, default, raise_)
        if "down" in self._warned:  # back: a later outage warns again
            with self._lock:
                self._warned.discard("down")
        return out

    def _give_up(self, op: str, e: Exception, default, raise_: bool):
        if raise_:
            msg = f"{self.name} tier (Redis at {self.url}): {op} failed ({type(e).__name__}: {e}); nothing stored"
            raise TierUnavailableError(msg.replace(self._secret, "***") if self._secret else msg) from None
        return default

    @property
    def available(self) -> bool:
        """True unless the last call failed less than ``retry_after`` seconds ago."""
        return time.monotonic() >= self._down_until

    # -- interface --------------------------------------------------------------------
    def put(self, key: str, block: dict) -> None:
        """Store the block, or raise :class:`TierUnavailableError` (nothing stored)."""
        check_key(key)
        blob = pack_block(block, meta={"key": key})
        n = len(blob)
        t0 = time.perf_counter()
        with self._lock:
            order = ((k, s) for k, s in self._written.items() if k != key)
            victims = self._victims(order, self._held - self._written.get(key, 0), n)
        self._call("put", lambda: self.client.set(self.prefix + key, blob, ex=self.ttl), None, raise_=True)
        with self._lock:
            self._held -= self._written.pop(key, 0)
            self._written[key] = n
            self._held += n
            self.stats.puts += 1
            self._timed(False, n, t0)
        for k in victims:  # after the write: a failed put evicts nothing
            self._evict(k)

    def _evict(self, key: str) -> None:
        block = self.get(key) if self.on_evict is not None else None
        if not self._hand_down(key, block):
            return
        self._call("evict", lambda: self.client.delete(self.prefix + key), 0)
        with self._lock:
            self._held -= self._written.pop(key, 0)
            self.stats.evictions += 1

    def get(self, key: str) -> dict | None:
        check_key(key)
        t0 = time.perf_counter()
        blob = self._call("get", lambda: self.client.get(self.prefix + key), _FAILED)
        if blob is None or blob is _FAILED:
            self._miss(key, lost=blob is None)
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
            if n:
                self.stats.deletes += 1
        return bool(n)

    def contains(self, key: str) -> bool:
        check_key(key)
        return bool(self._call("contains", lambda: self.client.exists(self.prefix + key), 0))

    def _miss(self, key: str, lost: bool) -> None:
        """Count a miss; ``lost``: the server answered that it has no such key."""
        with self._lock:
            self.stats.misses += 1
            n = self._written.pop(key, 0) if lost else 0
            self._held -= n
        if n:  # the server dropped what it acknowledged: restarted empty, flushed, evicting
            self._warn_once("lost", f"block {key!r} this client stored is gone (server restarted, "
                                    "flushed, or evicting under maxmemory); treating it and any "
                                    "others as misses (the cache recomputes them)")

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
