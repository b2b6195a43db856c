"""Commits of many streams in one turn of the event loop go to Redis as one pipeline (core/redis_batch.py),
each caller still getting its own reply or error, on a real Redis server."""
from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import pytest

from specdec.core.errors import SessionNotFound, StoreUnavailable
from specdec.core.redis_store import RedisSessionStore
from specdec.core.sessions import SessionRecord, SpecCounters

from redis_server import delete_prefix


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisSessionStore]:
    prefix = f"specdec-test-{uuid.uuid4().hex[:8]}"
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    yield store
    await store.close()
    delete_prefix(redis_url, prefix)


def count_pipelines(store: RedisSessionStore, monkeypatch) -> list[int]:
    """Each pipeline the store's client opens, as the number of commands it sent."""
    sizes: list[int] = []
    client = store._redis
    real = client.pipeline

    def pipeline(*args, **kwargs):
        pipe = real(*args, **kwargs)
        execute = pipe.execute

        async def counted(*a, **k):
            sizes.append(len(pipe.command_stack))
            return await execute(*a, **k)

        pipe.execute = counted
        return pipe

    monkeypatch.setattr(client, "pipeline", pipeline)
    return sizes


async def sessions(store: RedisSessionStore, n: int) -> list[SessionRecord]:
    records = [SessionRecord.new([1, 2, 3], {"max_new_tokens": 8}, seed=i) for i in range(n)]
    for record in records:
        await store.create(record)
    return records


async def test_commits_made_at_once_go_as_one_pipeline_and_each_lands(store, monkeypatch) -> None:
    records = await sessions(store, 20)
    sizes = count_pipelines(store, monkeypatch)
    await asyncio.gather(*(store.commit(r.session_id, [i, i + 1], SpecCounters(), (1,), after=0)
                           for i, r in enumerate(records)))
    assert sizes == [20]
    for i, r in enumerate(records):
        assert (await store.get(r.session_id)).output_ids == (i, i + 1)
    # the next step's commits: a second pipeline, each appended after the first
    await asyncio.gather(*(store.commit(r.session_id, [7], SpecCounters(), (0,), after=2) for r in records))
    assert sizes == [20, 20]
    for r in records:
        assert (await store.get(r.session_id)).output_ids[2:] == (7,)


async def test_a_commit_that_fails_fails_alone(store) -> None:
    records = await sessions(store, 3)
    missing = SessionRecord.new([1], {}, seed=9).session_id  # never created
    results = await asyncio.gather(*(store.commit(sid, [5], SpecCounters(), after=0)
                                     for sid in [records[0].session_id, missing, records[1].session_id]),
                                   return_exceptions=True)
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], SessionNotFound)
    assert (await store.get(records[1].session_id)).output_ids == (5,)


async def test_a_cancelled_caller_leaves_the_others_and_its_commit_lands(store) -> None:
    records = await sessions(store, 4)
    tasks = [asyncio.ensure_future(store.commit(r.session_id, [3], SpecCounters(), after=0)) for r in records]
    await asyncio.sleep(0)  # every call queued, the pipeline not yet sent
    tasks[0].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError) and done[1:] == [None] * 3
    for r in records:
        assert (await store.get(r.session_id)).output_ids == (3,)  # sent with the others


async def test_an_unreachable_redis_fails_every_batched_commit_with_store_unavailable() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisSessionStore.from_url(f"redis://127.0.0.1:{port}/0")
    try:
        results = await asyncio.wait_for(asyncio.gather(
            *(store.commit(SessionRecord.new([1], {}, seed=i).session_id, [1], SpecCounters()) for i in range(3)),
            return_exceptions=True), timeout=30)
        assert all(isinstance(r, StoreUnavailable) for r in results), results
    finally:
        await store.close()
