"""Sessions' KV blocks in Redis (core/kv_blocks.py is the format): written by a background writer
off the verify path, read back when a session opens on a replica that has never seen it.

Layout: ``{prefix}:kv:{<session id>}:<block index>``, the session's hash tag (one Redis Cluster
slot with its record, so a resume's MGET and a writer's pipeline reach one node per session on a
Redis Cluster) and its TTL. A block is written once, when it is full; a resumed session
uses the longest run of valid blocks from position 0 and recomputes the rest. Blocks are never
refreshed, so none outlives the session's record (whose TTL every commit renews), and at most
``max_session_tokens`` positions of a session are kept: its Redis memory for KV is capped at
``max_session_tokens // block_tokens`` blocks of `BlockLayout.payload_bytes` plus an 80-byte header.
A write that fails is tried again while the Redis fails over (core/redis_connect.retry_budget); a
read that fails is not waited for: the session opening recomputes those positions instead.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
import torch
from redis.exceptions import RedisClusterException, RedisError

from specdec.core.kv_blocks import BlockLayout, CorruptBlock, PendingBlock, decode_block
from specdec.core.redis_connect import FAILOVER_ERRORS, connect, retry_budget
from specdec.core.retry import retry_for
from specdec.core.sessions import check_session_id, short_id

log = logging.getLogger(__name__)


class RedisKVStore:
    def __init__(self, client: aioredis.Redis, layout: BlockLayout, *, prefix: str = "specdec", ttl_s: float = 3600,
                 queue_blocks: int = 256, max_session_tokens: int = 4096) -> None:
        self._redis = client
        self._max_blocks = max_session_tokens // layout.block_tokens
        self.layout = layout
        self._prefix = prefix
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._queue: asyncio.Queue | None = None
        self._queue_blocks = queue_blocks
        self._writer: asyncio.Task | None = None
        self.written = self.dropped = self.rejected = 0  # blocks: stored, not queued (full queue), refused on read

    @classmethod
    def from_url(cls, url: str, layout: BlockLayout, **kwargs) -> "RedisKVStore":
        """Any URL form core/redis_connect.py accepts (a single server, a cluster, a Sentinel primary).
        Blocks are a cache: no replica acknowledgement is waited for."""
        return cls(connect(url), layout, **kwargs)

    def key(self, session_id: str, index: int) -> str:
        return f"{self._prefix}:kv:{{{check_session_id(session_id)}}}:{index}"

    def offer(self, session_id: str, blocks: Sequence[tuple[int, bytes | PendingBlock]]) -> None:
        """Queue full blocks for writing; never waits: with the queue full they are dropped (a
        resumed session recomputes what is missing), and counted."""
        check_session_id(session_id)  # here, not in the writer, which must not die of one bad id
        if self._queue is None:
            self._queue = asyncio.Queue(self._queue_blocks)
            self._writer = asyncio.ensure_future(self._write_forever())
        for index, data in blocks:
            if index >= self._max_blocks:
                continue  # past the per-session cap: recomputed on resume
            try:
                self._queue.put_nowait((session_id, index, data))
            except asyncio.QueueFull:
                self.dropped += 1

    async def _write_forever(self) -> None:
        budget = await retry_budget(self._redis)
        log.info("KV blocks: a failed write is tried again for up to %g s (%s), then dropped", budget.seconds, budget.source)
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < 32:
                batch.append(self._queue.get_nowait())
            try:
                if any(isinstance(data, PendingBlock) for _, _, data in batch):  # from device memory: wait and encode off the loop
                    batch = await asyncio.to_thread(_encoded, batch)
                await self._write(batch, budget.seconds)
                self.written += len(batch)
            except (RedisError, RedisClusterException, OSError, RuntimeError, ValueError) as exc:  # the writer lives on
                self.dropped += len(batch)
                log.warning("could not write %d KV blocks: %s", len(batch), exc)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _write(self, batch: list[tuple[str, int, bytes]], budget_s: float) -> None:
        """One round trip for the lot, tried again while Redis fails over (blocks offered meanwhile
        wait in the queue, or are dropped when it is full)."""
        async def write() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                for session_id, index, data in batch:
                    pipe.set(self.key(session_id, index), data, px=self._ttl_ms)
                await pipe.execute()

        await retry_for(write, budget_s, FAILOVER_ERRORS)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until what was offered so far is written or dropped (tests, shutdown), at most ``timeout_s``."""
        if self._queue is not None:
            try:
                await asyncio.wait_for(self._queue.join(), timeout_s)
            except TimeoutError:
                log.warning("KV blocks still queued after %.1f s: not waiting longer", timeout_s)

    async def load(self, session_id: str, token_ids: Sequence[int]) -> list[torch.Tensor]:
        """The longest run of valid blocks from position 0 for these tokens (never the position of the
        last token: a prefill must compute at least one). Anything unusable ends the run."""
        b = self.layout.block_tokens
        wanted = (len(token_ids) - 1) // b
        if wanted <= 0:
            return []
        try:
            raw = await self._redis.mget([self.key(session_id, i) for i in range(wanted)])
        except (RedisError, RedisClusterException, OSError) as exc:
            log.warning("session %s: KV blocks unreadable (%s): recomputing", short_id(session_id), exc)
            return []
        blocks = []
        for i, data in enumerate(raw):
            if data is None:
                break
            try:
                blocks.append(decode_block(data, self.layout, i * b, token_ids))
            except CorruptBlock as exc:
                self.rejected += 1
                log.warning("session %s: KV block %d refused (%s): recomputing from there", short_id(session_id), i, exc)
                break
        return blocks

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
        await self._redis.aclose()


def _encoded(batch: list[tuple[str, int, bytes | PendingBlock]]) -> list[tuple[str, int, bytes]]:
    return [(session_id, index, data.encode() if isinstance(data, PendingBlock) else data) for session_id, index, data in batch]
