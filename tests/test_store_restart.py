"""The session store restarting under a live stream (a real redis-server with its append-only file
fsynced on every write, killed with SIGKILL and started again on the same port and files): a
stream sees only a pause, no error (its client need not resume anything), with exactly the tokens
of a run without the restart, and the record holds each of them once (a commit names the length it
extends, so retrying it is safe)."""
from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time

import pytest

from specdec.core.redis_store import RedisSessionStore
from specdec.orchestrator.loop import Orchestrator, collect

from redis_server import free_port, ping
from test_worker_failure import greedy

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server to restart one")


class PersistentRedis:
    def __init__(self, workdir) -> None:
        self.port = free_port()
        self.argv = [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "yes", "--appendfsync", "always", "--dir", str(workdir)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not ping("127.0.0.1", self.port):
            assert time.monotonic() < deadline and self.proc.poll() is None, "redis-server did not start"
            time.sleep(0.02)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


async def test_a_redis_restart_mid_stream_is_only_a_pause(cluster, tmp_path):
    redis = PersistentRedis(tmp_path)
    redis.start()
    store = RedisSessionStore.from_url(f"redis://127.0.0.1:{redis.port}/0")
    live = cluster.orchestrator
    orch = Orchestrator(live.target, live.verifier, store, live.config, live.drafter_address)
    try:
        request = greedy(150, drafter="ngram")
        _, expected, _ = await collect(orch.generate(request))
        ids, gaps, last_at, restarted = [], [], None, False
        async for chunk in orch.generate(request):
            now = time.monotonic()
            if last_at is not None:
                gaps.append(now - last_at)
            last_at = now
            ids.extend(chunk.token_ids)
            if not restarted and len(ids) >= 20:
                restarted = True
                redis.kill()
                asyncio.get_running_loop().call_later(0.5, redis.start)  # down for half a second
        assert restarted and tuple(ids) == expected
        assert max(gaps) >= 0.4  # it did wait for the store...
        record = await store.get(chunk.session_id)
        assert record.output_ids == expected and record.status.value == "finished"  # ...and wrote each token once
    finally:
        await store.close()
        if redis.proc.poll() is None:
            redis.kill()
