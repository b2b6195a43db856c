"""How long a failed store call is tried again, and which calls are: the budget read from the
deployment (a Redis Cluster's ``cluster-node-timeout``, a Sentinel's ``down-after-milliseconds``,
Redis's default when CONFIG is refused, a restart's for one server), the operator's setting over
it, and every store call of a stream behind that retry (create, commit, finish; on resume the read
and the claim; KV block writes), which waits while the store is away and fails with
UNAVAILABLE, saying how long it tried, once the budget is spent.

Nothing here times anything: a store that is away is one that refuses a given number of calls."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid

import pytest
import redis.exceptions
import torch

from specdec import roles
from specdec.core.errors import StoreUnavailable
from specdec.core.kv_blocks import BlockLayout
from specdec.core.redis_connect import (REDIS_DEFAULT_NODE_TIMEOUT_MS, RESTART_RETRY_S, connect, failover_budget_s,
                                        retry_budget)
from specdec.core.redis_kv import RedisKVStore
from specdec.core.redis_store import RedisSessionStore
from specdec.core.sessions import InMemorySessionStore, SessionStatus
from specdec.orchestrator.loop import Orchestrator, collect
from specdec.orchestrator.request import DEFAULT_STORE_RETRY_S, OrchestratorConfig

from redis_cluster import NODE_TIMEOUT_MS
from test_worker_failure import greedy

UNAVAILABLE = "the session store is unavailable (Redis unreachable or failing over); retry shortly"


# --- the budget, read from the deployment ---------------------------------------------------------


async def test_a_cluster_budget_is_read_from_its_node_timeout(redis_cluster):
    """The test cluster runs with a cluster-node-timeout that is not Redis's default: the budget
    follows the cluster's (twice its detection time plus the margin), not the default's."""
    assert NODE_TIMEOUT_MS != REDIS_DEFAULT_NODE_TIMEOUT_MS
    store = RedisSessionStore.from_url(redis_cluster.url, prefix="specdec-unused")
    try:
        budget = await store.retry_budget()
    finally:
        await store.close()
    assert budget.seconds == failover_budget_s(NODE_TIMEOUT_MS) > 2 * NODE_TIMEOUT_MS / 1000
    assert f"cluster-node-timeout {NODE_TIMEOUT_MS} ms" in budget.source


async def test_a_cluster_that_refuses_config_gets_redis_default(redis_cluster):
    """A user not allowed CONFIG (as where CONFIG is renamed away): Redis's default node timeout
    is assumed, and the log line says so and why."""
    user, password = f"nocfg{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    nodes = [server.client() for server in redis_cluster.servers.values()]
    for node in nodes:
        node.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                         commands=["+@all", "-config"])
    client = connect(redis_cluster.url.replace("redis+cluster://", f"redis+cluster://{user}:{password}@"))
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):  # the user can do all but CONFIG
            await client.config_get("cluster-node-timeout")
        budget = await retry_budget(client)
    finally:
        await client.aclose()
        for node in nodes:
            node.acl_deluser(user)
    assert budget.seconds == failover_budget_s(REDIS_DEFAULT_NODE_TIMEOUT_MS)
    assert "could not be read" in budget.source and "CONFIG GET" in budget.source and "default" in budget.source


async def test_a_sentinel_budget_is_read_from_down_after(redis_sentinel):
    store = RedisSessionStore.from_url(redis_sentinel.url, prefix="specdec-unused")
    try:
        budget = await store.retry_budget()
    finally:
        await store.close()
    assert budget.seconds == failover_budget_s(1000)  # tests/redis_cluster.py: down-after-milliseconds 1000
    assert "down-after-milliseconds 1000 ms" in budget.source


async def test_one_server_budget_is_a_restart(redis_url):
    store = RedisSessionStore.from_url(redis_url, prefix="specdec-unused")
    try:
        assert (await store.retry_budget()).seconds == RESTART_RETRY_S
    finally:
        await store.close()


async def test_the_operator_setting_wins_and_the_budget_is_logged(redis_cluster, caplog):
    store = RedisSessionStore.from_url(redis_cluster.url, prefix="specdec-unused")
    try:
        with caplog.at_level(logging.INFO, logger="specdec.roles"):
            derived = await roles.with_store_retry(OrchestratorConfig(), store)
            set_by_hand = await roles.with_store_retry(OrchestratorConfig(store_retry_s=12.5), store)
            in_memory = await roles.with_store_retry(OrchestratorConfig(), InMemorySessionStore())
    finally:
        await store.close()
    assert derived.store_retry_s == failover_budget_s(NODE_TIMEOUT_MS)
    assert set_by_hand.store_retry_s == 12.5
    assert in_memory.store_retry_s == DEFAULT_STORE_RETRY_S
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.roles"]
    assert len(lines) == 3 and f"cluster-node-timeout {NODE_TIMEOUT_MS} ms" in lines[0] and "--store-retry-s" in lines[1]


# --- every store call of a stream waits out the store, within the budget --------------------------


class AwayStore:
    """A store that is away for the next ``away[method]`` calls of a method (-1: for good), as an
    orchestrator sees a failover: each such call is StoreUnavailable, then the real store answers."""

    def __init__(self, store, **away: int) -> None:
        self._store, self.away = store, away
        self.refused: dict[str, int] = {name: 0 for name in away}

    def __getattr__(self, name):
        real = getattr(self._store, name)
        if name not in self.away:
            return real

        async def call(*args, **kwargs):
            if self.away[name] != 0:
                self.away[name] -= self.away[name] > 0
                self.refused[name] += 1
                raise StoreUnavailable(UNAVAILABLE)
            return await real(*args, **kwargs)

        return call


def orchestrator(cluster, store, retry_s: float) -> Orchestrator:
    live = cluster.orchestrator
    config = dataclasses.replace(live.config, store_retry_s=retry_s)
    return Orchestrator(live.target, live.verifier, store, config, live.drafter_address)


# A ceiling, not a figure: these stores answer after a few refusals, which takes well under a second.
PATIENT_S = 60.0


async def test_a_stream_waits_while_the_store_is_away(cluster):
    """Its create, every commit and its finish refused a few times each: the stream only waits, and
    ends with exactly the tokens of a run the store never left, each committed once."""
    _, expected, _ = await collect(orchestrator(cluster, cluster.store, PATIENT_S).generate(greedy(40, drafter="ngram")))
    away = AwayStore(cluster.store, create=2, commit=5, finish=2)
    last, ids, _ = await collect(orchestrator(cluster, away, PATIENT_S).generate(greedy(40, drafter="ngram")))
    assert ids == expected and away.refused == {"create": 2, "commit": 5, "finish": 2}
    record = await cluster.store.get(last.session_id)
    assert record.output_ids == expected and record.status is SessionStatus.FINISHED


async def test_a_resume_waits_while_the_store_is_away(cluster):
    """A cut stream resumed while the store is away: its read and its claim wait too."""
    orch = orchestrator(cluster, cluster.store, PATIENT_S)
    _, expected, _ = await collect(orch.generate(greedy(60, drafter="ngram")))
    received: list[int] = []
    async with contextlib.aclosing(orch.generate(greedy(60, drafter="ngram"))) as chunks:
        async for chunk in chunks:
            session_id = chunk.session_id
            received.extend(chunk.token_ids)
            if len(received) >= 10:
                break  # the client goes away: the session is marked cancelled, its tokens kept
    away = AwayStore(cluster.store, get=3, claim=3)
    _, rest, _ = await collect(orchestrator(cluster, away, PATIENT_S).resume(session_id, "", len(received)))
    assert tuple(received) + rest == expected and away.refused == {"get": 3, "claim": 3}


async def test_past_the_budget_the_stream_fails_unavailable_saying_how_long_it_tried(cluster):
    away = AwayStore(cluster.store, commit=-1)
    chunks = orchestrator(cluster, away, 0.2).generate(greedy(40, drafter="ngram"))
    with pytest.raises(StoreUnavailable) as err:
        await collect(chunks)
    assert str(err.value).startswith(UNAVAILABLE) and "tried for 0.2 s" in str(err.value)
    assert away.refused["commit"] >= 2  # it was tried again before it failed


# --- KV blocks --------------------------------------------------------------------------------------


class PipelinesThatFail:
    """A client whose next ``fail`` pipelines fail as a primary's death does (ConnectionError)."""

    def __init__(self, client, fail: int) -> None:
        self._client, self.fail = client, fail

    def __getattr__(self, name):
        return getattr(self._client, name)

    def pipeline(self, *args, **kwargs):
        pipe = self._client.pipeline(*args, **kwargs)
        if self.fail > 0:
            self.fail -= 1

            async def execute(*_a, **_k):
                raise redis.exceptions.ConnectionError("Connection closed by server.")

            pipe.execute = execute
        return pipe


async def test_kv_block_writes_wait_while_redis_is_away(redis_url, redis_prefix):
    """The writer tries a batch again while Redis is away, within the budget: no block is dropped."""
    layout = BlockLayout(1, 1, 2, torch.float32, 4, b"\0" * 16)
    client = PipelinesThatFail(connect(redis_url), fail=3)
    store = RedisKVStore(client, layout, prefix=redis_prefix)
    session_id = uuid.uuid4().hex
    try:
        store.offer(session_id, [(0, b"block-0"), (1, b"block-1")])
        await store.flush(timeout_s=PATIENT_S)
        assert (store.written, store.dropped, client.fail) == (2, 0, 0)
        assert await client.mget([store.key(session_id, 0), store.key(session_id, 1)]) == [b"block-0", b"block-1"]
    finally:
        await store.aclose()
