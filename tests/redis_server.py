"""A Redis for the tests: the one on 127.0.0.1:6379 if it answers, else a throwaway redis-server.

Tests never flush a database; each uses its own key prefix and deletes its keys afterwards.
Set SPECDEC_TEST_REDIS_URL to point the tests at another server.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specdec.core.redis_connect import connect_sync
from specdec.ports import free_ports

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 6379


def ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if a Redis at host:port answers PING (without AUTH)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def free_port() -> int:
    return free_ports(1)  # outside the ephemeral range (specdec/ports.py says why)


@contextmanager
def throwaway_redis_server(redis_server: str, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run redis-server on a free port, no persistence, in a temp dir; yield its URL; stop it."""
    with tempfile.TemporaryDirectory(prefix="specdec-redis-") as tmp:
        port = free_port()
        log_path = Path(tmp) / "redis.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--daemonize", "no", "--dir", tmp],
                stdout=log, stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + start_timeout_s
            while not ping("127.0.0.1", port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}:\n{log_path.read_text()}")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def redis_url_for_tests() -> Iterator[str]:
    """The URL of a Redis the tests may use; RuntimeError (saying what to install) if none."""
    if url := os.environ.get("SPECDEC_TEST_REDIS_URL"):
        yield url
    elif ping(DEFAULT_HOST, DEFAULT_PORT):
        yield f"redis://{DEFAULT_HOST}:{DEFAULT_PORT}/0"
    elif server := shutil.which("redis-server"):
        with throwaway_redis_server(server) as url:
            yield url
    else:
        raise RuntimeError(
            f"these tests need Redis: nothing answers on {DEFAULT_HOST}:{DEFAULT_PORT} and redis-server is not on PATH; "
            "install it (apt-get install redis-server) or set SPECDEC_TEST_REDIS_URL"
        )


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key that starts with `prefix` (SCAN, never FLUSH); return how many. Any URL form
    of core/redis_connect.py: on a cluster SCAN visits every primary and DEL goes slot by slot."""
    client = connect_sync(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=500))
        for i in range(0, len(keys), 500):
            pipe = client.pipeline(transaction=False)
            for key in keys[i : i + 500]:  # one key per command: a cluster pipeline sends each to its node
                pipe.delete(key)
            pipe.execute()
        return len(keys)
    finally:
        client.close()
