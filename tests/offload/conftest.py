"""Offload tests: one thread (the redis-server fixtures live in ``tests/conftest.py``), and
``redis_proc``: a redis-server with extra options that a test may kill and restart on
the same port (the fault tests)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

# 2 shared cores: OpenMP spinning across busy processes makes tiny ops 100x slower
torch.set_num_threads(1)


class RedisProc:
    """``start(*options)`` a fresh, empty server on this object's port; ``kill()`` it (-9)."""

    def __init__(self, tmp_path):
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            pytest.skip("redis-server is not installed; the remote-tier fault tests need one")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir, self.proc = tmp_path, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self, *options: str, password: str | None = None) -> RedisProc:
        import redis

        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", *options]
        if password:
            args += ["--requirepass", password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=password)
        for _ in range(250):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        else:
            self.kill()
            pytest.fail("redis-server did not start")
        client.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_proc(tmp_path_factory):
    srv = RedisProc(tmp_path_factory.mktemp("redis-proc"))
    yield srv
    srv.kill()
