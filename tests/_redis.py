"""A private redis-server on a free loopback port, for the tests and ``benchmarks/fault_table.py``.

``RedisProc(dir).start(*options, password=None)`` starts a fresh, empty server on the
object's port (again after ``kill()``: same port, empty); ``stop()`` ends it politely,
``kill()`` with -9 (what the fault tests do to it). ``RedisProc.available()`` says whether
``redis-server`` is installed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProc:
    def __init__(self, root: Path):
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.dir, self.proc = Path(root), None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def start(self, *options: str, password: str | None = None) -> RedisProc:
        import redis

        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", *options]
        if password:
            args += ["--requirepass", password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=password)
        try:
            for _ in range(500):
                try:
                    client.ping()
                    return self
                except redis.exceptions.ConnectionError:
                    time.sleep(0.01)
            self.kill()
            raise RuntimeError(f"redis-server did not start on port {self.port}")
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
