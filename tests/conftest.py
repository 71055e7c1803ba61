"""Fixtures shared by test directories: private redis-servers on free loopback ports (``_redis.py``)."""

from __future__ import annotations

import pytest
from _redis import RedisProc, free_port


def _server(tmp_path_factory, name: str) -> RedisProc:
    if not RedisProc.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server); "
                    "the remote-tier tests need a real server")
    return RedisProc(tmp_path_factory.mktemp(name))


@pytest.fixture
def redis_server(tmp_path_factory):
    """A running server (``.url``; ``.stop()`` ends it)."""
    srv = _server(tmp_path_factory, "redis").start("--protected-mode", "yes")
    yield srv
    srv.stop()


@pytest.fixture
def redis_proc(tmp_path_factory):
    """A server the test starts with its own options, and may kill (-9) and restart empty."""
    srv = _server(tmp_path_factory, "redis-proc")
    yield srv
    srv.kill()


@pytest.fixture
def dead_redis_url():
    return f"redis://127.0.0.1:{free_port()}/0"
