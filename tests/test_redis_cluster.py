"""Sessions on a real Redis Cluster (3 primaries, 3 replicas) and on a Sentinel-managed primary
(tests/redis_cluster.py starts both): the URL forms, no hot slot, the sharded running index,
MOVED/ASK while a slot migrates, a primary killed mid-stream (its replica promoted: a pause, the
same tokens, each written once), a shard that stays down (only its sessions fail, UNAVAILABLE),
a Sentinel promotion inside the commit-retry window, and a deployment over the cluster giving the
tokens a single-server one gives.

Nothing here times anything: a fault test waits for the event it needs (a promotion, a node back)
with a ceiling, and asserts what the code decides (tokens, records, error types)."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import signal
import statistics
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from redis.crc import key_slot

from specdec.core.errors import InvalidRequest, StoreUnavailable
from specdec.core.redis_connect import ACCEPTED_FORMS, RedisUrlError, connect, parse_redis_url
from specdec.core.redis_store import RUNNING_BUCKETS, RedisSessionStore
from specdec.core.sessions import SessionRecord, SessionStatus, SpecCounters
from specdec.orchestrator.loop import Orchestrator, collect
from specdec.v1 import common_pb2, generation_pb2 as pb

from cluster import start_cluster
from redis_server import delete_prefix
from test_worker_failure import greedy

ROOT = Path(__file__).resolve().parents[1]


def _prefix() -> str:
    return f"specdec-test-{uuid.uuid4().hex[:8]}"


def _record(session_id: str | None = None, **changes) -> SessionRecord:
    record = SessionRecord.new(prompt_ids=[1, 2, 3], params={"max_new_tokens": 8}, seed=5)
    if session_id is not None:
        changes["session_id"] = session_id
    return dataclasses.replace(record, **changes)


# --- URLs (no server needed) ---------------------------------------------------------------------


@pytest.mark.parametrize("url, kind, nodes, service, db, acks", [
    ("redis://127.0.0.1:6379/0", "single", (), "", 0, 0),
    ("rediss://:pw@h:6380/2", "single", (), "", 0, 0),  # redis-py parses the rest itself
    ("redis+cluster://10.0.0.1:7000", "cluster", (("10.0.0.1", 7000),), "", 0, 1),
    ("redis+cluster://a:7000,b:7001,[::1]:7002?replica_acks=0", "cluster", (("a", 7000), ("b", 7001), ("::1", 7002)), "", 0, 0),
    ("rediss+cluster://u:p@a:7000", "cluster", (("a", 7000),), "", 0, 1),
    ("redis+sentinel://s1:26379,s2:26379/mymaster", "sentinel", (("s1", 26379), ("s2", 26379)), "mymaster", 0, 1),
    ("redis+sentinel://:pw@s1:26379/sessions/3?replica_acks=2", "sentinel", (("s1", 26379),), "sessions", 3, 2),
])
def test_accepted_url_forms(url, kind, nodes, service, db, acks):
    target = parse_redis_url(url)
    assert (target.kind, target.nodes, target.service_name, target.db, target.replica_acks) == (kind, nodes, service, db, acks)


@pytest.mark.parametrize("url, why", [
    ("http://h:6379", "unknown scheme"),
    ("127.0.0.1:6379", "no scheme"),
    ("redis://h:port/0", "Port could not be cast"),
    ("redis+cluster://", "no host:port"),
    ("redis+cluster://h", "is not host:port"),
    ("redis+cluster://h:70000", "is not host:port"),
    ("redis+cluster://h:7000/0", "has no path"),
    ("redis+cluster://h:7000?replica_acks=x", "replica_acks"),
    ("redis+cluster://h:7000?socket_timeout=-1", "socket_timeout must be positive"),
    ("redis+cluster://h:7000?db=1", "unknown option"),
    ("redis+sentinel://s:26379", "names the service"),
    ("redis+sentinel://s:26379/a/b", "is not a number"),
])
def test_bad_urls_are_refused_naming_the_accepted_forms(url, why):
    with pytest.raises(RedisUrlError, match=re.escape(why)) as caught:
        RedisSessionStore.from_url(url)
    assert ACCEPTED_FORMS in str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, InvalidRequest)  # the CLI prints it, no traceback


def test_a_password_in_a_bad_url_is_not_echoed():
    with pytest.raises(RedisUrlError) as caught:
        parse_redis_url("redis+sentinel://user:s3cret@s:26379")
    assert "s3cret" not in str(caught.value)


def test_every_redis_client_is_built_from_the_url_in_one_place():
    """No code builds a Redis client from a URL except core/redis_connect.py (so every role, test
    and benchmark accepts the cluster and sentinel forms)."""
    offenders = []
    for folder in ("core", "services", "orchestrator", "specdec", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "redis_connect.py" or path == Path(__file__):
                continue
            if re.search(r"\bRedis(Cluster)?\.from_url\(", path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


# --- the cluster: layout -------------------------------------------------------------------------


async def test_keys_per_slot_after_1000_sessions(redis_cluster):
    """No hot slot and no hot key: after 1,000 sessions the fullest slot holds at most 3x the mean
    number of specdec keys of the slots in use, every shard holds about a third of them, and the
    fullest running-index bucket at most 3x the mean bucket. Session ids are fixed, so the figures
    are the same on every run."""
    prefix = _prefix()
    store = RedisSessionStore.from_url(redis_cluster.url, prefix=prefix)
    ids = [hashlib.sha256(f"slots-{i}".encode()).hexdigest()[:32] for i in range(1000)]
    try:
        for i in range(0, len(ids), 100):
            await asyncio.gather(*(store.create(_record(sid)) for sid in ids[i : i + 100]))
        client = connect(redis_cluster.url)
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        buckets = [await client.zcard(k) for k in store.running_keys]
        await client.aclose()
        assert len(keys) == 3 * len(ids) + sum(1 for n in buckets if n)
        per_slot = Counter(key_slot(k) for k in keys)
        mean = len(keys) / len(per_slot)
        slots = redis_cluster.servers[redis_cluster.primaries()[0]].client().execute_command("CLUSTER", "SLOTS")
        per_shard = Counter(_owner(slots, key_slot(k)) for k in keys)
        print(f"keys per slot: max {max(per_slot.values())}, mean {mean:.2f} over {len(per_slot)} slots; "
              f"per shard {sorted(per_shard.values())}; running buckets max {max(buckets)}, mean {statistics.mean(buckets):.1f}")
        assert max(per_slot.values()) <= 3 * mean
        assert len(per_shard) == 3 and max(per_shard.values()) <= 1.5 * len(keys) / 3
        assert sum(buckets) == len(ids) and max(buckets) <= 3 * len(ids) / RUNNING_BUCKETS
    finally:
        await store.close()
        delete_prefix(redis_cluster.url, prefix)


def _owner(slots_reply, slot: int) -> int:
    return next(int(nodes[0][1]) for start, end, *nodes in slots_reply if int(start) <= slot <= int(end))


async def test_the_reaper_reads_every_bucket_of_the_running_index(redis_cluster):
    prefix = _prefix()
    store = RedisSessionStore.from_url(redis_cluster.url, prefix=prefix)
    old = time.time() - 100
    stale = [_record(created_at=old, updated_at=old) for _ in range(20)]
    fresh = _record()
    try:
        for record in (*stale, fresh):
            await store.create(record)
        assert len({store.running_key(r.session_id) for r in stale}) > 5  # spread over many buckets (and shards)
        marked = await store.abandon_stale(10.0)
        assert sorted(marked) == sorted(r.session_id for r in stale)
        assert {(await store.get(r.session_id)).status for r in stale} == {SessionStatus.FAILED}
        assert (await store.get(fresh.session_id)).status is SessionStatus.RUNNING
        assert await store.abandon_stale(10.0) == []  # marked sessions left the index
    finally:
        await store.close()
        delete_prefix(redis_cluster.url, prefix)


async def test_a_write_no_replica_acknowledged_is_unavailable(redis_cluster):
    """replica_acks more than the cluster has: every write is refused as not durable (UNAVAILABLE
    with a message), never reported done."""
    prefix = _prefix()
    store = RedisSessionStore.from_url(f"{redis_cluster.url}?replica_acks=2&replica_ack_timeout_ms=20", prefix=prefix)
    try:
        with pytest.raises(StoreUnavailable, match="could not replicate"):
            await store.create(_record())
    finally:
        await store.close()
        delete_prefix(redis_cluster.url, prefix)


# --- the cluster: faults --------------------------------------------------------------------------


async def test_a_client_with_a_stale_slot_map_follows_ask_and_moved(redis_cluster):
    """The session's slot migrates to another primary under a client that knows the old map: mid-
    migration its commits follow ASK, after it MOVED; each lands once, reads see them all."""
    prefix = _prefix()
    store = RedisSessionStore.from_url(redis_cluster.url, prefix=prefix)
    record = _record()
    sid = record.session_id
    try:
        await store.create(record, "h")
        await store.commit(sid, [1], SpecCounters(verify_steps=1), (0,), holder="h", after=0)
        key = store.session_key(sid)
        slot = key_slot(key.encode())
        src = redis_cluster.primary_of(key)
        dst = next(p for p in redis_cluster.primaries() if p != src)
        ids = {n["port"]: n["id"] for n in redis_cluster.nodes()}
        src_c, dst_c = redis_cluster.servers[src].client(), redis_cluster.servers[dst].client()
        dst_c.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        src_c.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
        keys = src_c.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        src_c.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
        await store.commit(sid, [2], SpecCounters(verify_steps=2), (0,), holder="h", after=1)  # ASK
        assert (await store.get(sid)).output_ids == (1, 2)
        for port in (dst, src, *(p for p in redis_cluster.primaries() if p not in (src, dst))):
            redis_cluster.servers[port].client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
        await store.commit(sid, [3], SpecCounters(verify_steps=3), (0,), holder="h", after=2)  # MOVED
        await store.finish(sid, SessionStatus.FINISHED, "length", holder="h")
        got = await store.get(sid)
        assert (got.output_ids, got.step_ks, got.status) == ((1, 2, 3), (0, 0, 0), SessionStatus.FINISHED)
        assert redis_cluster.primary_of(key) == dst
        redis_cluster.wait_ok()
    finally:
        await store.close()
        delete_prefix(redis_cluster.url, prefix)


async def test_a_shard_that_stays_down_fails_only_its_sessions(redis_cluster):
    """A shard's primary and replica frozen: commits of its sessions are UNAVAILABLE (with a
    message), every other session commits; once it is back its sessions go on, each commit once."""
    prefix = _prefix()
    store = RedisSessionStore.from_url(f"{redis_cluster.url}?socket_timeout=0.5&socket_connect_timeout=0.5", prefix=prefix)
    records = [_record() for _ in range(12)]
    try:
        for record in records:
            await store.create(record, "h")
        home = {r.session_id: redis_cluster.primary_of(store.session_key(r.session_id)) for r in records}
        victim = Counter(home.values()).most_common(1)[0][0]
        frozen = [redis_cluster.servers[victim], redis_cluster.servers[redis_cluster.replica_of(victim)]]
        assert len(set(home.values())) > 1
        for server in frozen:
            server.signal(signal.SIGSTOP)
        try:
            results = await asyncio.gather(*(store.commit(r.session_id, [7], SpecCounters(), (1,), holder="h", after=0)
                                             for r in records), return_exceptions=True)
        finally:
            for server in frozen:
                server.signal(signal.SIGCONT)
        for record, result in zip(records, results):
            if home[record.session_id] == victim:
                assert isinstance(result, StoreUnavailable) and "unavailable" in str(result), result
            else:
                assert result is None, result
        redis_cluster.wait_ok()
        redis_cluster.wait_replicas_online()
        for record in records:  # the refused commits again (safe: a commit names the length it extends)
            await store.commit(record.session_id, [7], SpecCounters(), (1,), holder="h", after=0)
            got = await store.get(record.session_id)
            assert (got.output_ids, got.step_ks) == ((7,), (1,))
    finally:
        await store.close()
        delete_prefix(redis_cluster.url, prefix)


def _patient_orchestrator(cluster, store) -> Orchestrator:
    """The test cluster's orchestrator over ``store``, retrying store writes for up to 60 s: a ceiling
    for the pause, not a figure (how long a promotion takes on a loaded machine varies)."""
    live = cluster.orchestrator
    return Orchestrator(live.target, live.verifier, store, dataclasses.replace(live.config, store_retry_s=60.0),
                        live.drafter_address)


async def _streams_through(orch: Orchestrator, n: int, hit, recover,
                           after_tokens: int = 20) -> tuple[list[tuple[str, tuple[int, ...]]], float]:
    """``n`` greedy streams at once; when the first has ``after_tokens`` tokens, ``hit(session_id)``
    runs at once (the stream cannot commit again before it), then ``recover()`` in a thread while
    the streams go on. Returns each stream's (session id, tokens) and the first stream's longest gap."""
    results: list[tuple[str, list[int]]] = [("", []) for _ in range(n)]
    fired: list[asyncio.Future] = []
    gaps: list[float] = []

    async def one(i: int) -> None:
        ids: list[int] = []
        last = None
        async for chunk in orch.generate(greedy(150, drafter="ngram")):
            now = time.monotonic()
            if i == 0 and last is not None:
                gaps.append(now - last)
            last = now
            ids.extend(chunk.token_ids)
            results[i] = (chunk.session_id, ids)
            if i == 0 and not fired and len(ids) >= after_tokens:
                hit(chunk.session_id)
                fired.append(asyncio.ensure_future(asyncio.to_thread(recover)))

    await asyncio.gather(*(one(i) for i in range(n)))
    assert fired, "the fault never fired"
    await fired[0]
    return [(sid, tuple(ids)) for sid, ids in results], max(gaps)


async def test_a_primary_killed_mid_stream_is_a_pause(cluster, redis_cluster):
    """SIGKILL of the primary holding a stream's session: its replica is promoted, the killed node
    comes back as a replica (as a supervisor restarts it), and every stream ends with exactly the
    tokens of an undisturbed run, each written once: nothing lost, nothing twice."""
    prefix = _prefix()
    store = RedisSessionStore.from_url(redis_cluster.url, prefix=prefix)
    orch = _patient_orchestrator(cluster, store)
    killed = {}

    def kill_its_primary(session_id: str) -> None:
        key = store.session_key(session_id)
        killed.update(key=key, port=redis_cluster.primary_of(key))
        redis_cluster.servers[killed["port"]].signal(signal.SIGKILL)

    def promote_and_restart() -> None:  # what the cluster and a supervisor do
        redis_cluster.servers[killed["port"]].proc.wait()
        killed["new"] = redis_cluster.wait_primary_changes(killed["key"], killed["port"])
        redis_cluster.restart(killed["port"])

    try:
        _, expected, _ = await collect(orch.generate(greedy(150, drafter="ngram")))
        streams, longest_gap = await _streams_through(orch, 4, kill_its_primary, promote_and_restart)
        assert killed["new"] != killed["port"]
        assert longest_gap >= 0.5  # the stream did wait for the promotion (which takes a node timeout, 1 s, at least)
        for session_id, ids in streams:
            assert ids == expected
            record = await store.get(session_id)
            assert record.output_ids == expected and record.status is SessionStatus.FINISHED
        redis_cluster.wait_ok()
        redis_cluster.wait_replicas_online()
    finally:
        await store.close()
        delete_prefix(redis_cluster.url, prefix)


# --- Sentinel ------------------------------------------------------------------------------------


async def test_a_sentinel_promotion_mid_stream_is_a_pause(cluster, redis_sentinel):
    """SIGKILL of the Sentinel-managed primary mid-stream: the Sentinel promotes a replica, the
    client finds it, and the streams end with exactly the undisturbed tokens, each written once."""
    prefix = _prefix()
    store = RedisSessionStore.from_url(redis_sentinel.url, prefix=prefix)
    orch = _patient_orchestrator(cluster, store)
    promoted = {}

    def kill_the_primary(_session_id: str) -> None:
        promoted["old"] = redis_sentinel.current_primary()
        redis_sentinel.servers[promoted["old"]].signal(signal.SIGKILL)

    def promote_and_restart() -> None:  # what the Sentinel and a supervisor do
        redis_sentinel.servers[promoted["old"]].proc.wait()
        promoted["new"] = redis_sentinel.wait_promotion(promoted["old"])
        redis_sentinel.restart_as_replica(promoted["old"], promoted["new"])

    try:
        _, expected, _ = await collect(orch.generate(greedy(150, drafter="ngram")))
        streams, longest_gap = await _streams_through(orch, 3, kill_the_primary, promote_and_restart)
        assert promoted["new"] != promoted["old"]
        assert longest_gap >= 0.5  # it waited for the promotion (down-after-milliseconds is 1 s)
        for session_id, ids in streams:
            assert ids == expected
            record = await store.get(session_id)
            assert record.output_ids == expected and record.status is SessionStatus.FINISHED
        redis_sentinel.wait_replicas(2)
    finally:
        await store.close()
        delete_prefix(redis_sentinel.url, prefix)


# --- end to end ----------------------------------------------------------------------------------


async def test_a_deployment_over_the_cluster_gives_the_single_server_tokens(cluster, tiny_pair, redis_cluster):
    """Greedy and seeded requests (both rules) through drafter, verifier and orchestrator servers whose
    sessions live on the Redis Cluster: the very tokens of the deployment on one Redis server."""
    target, draft = tiny_pair
    prefix = _prefix()
    on_cluster = await start_cluster(target, draft, redis_cluster.url, prefix=prefix)
    fixed = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=3)
    requests = [pb.GenerateRequest(text="def f(x):", max_new_tokens=40, drafter="model", speculation=fixed),
                pb.GenerateRequest(text="import os\n", max_new_tokens=40, drafter="model", speculation=fixed,
                                   sampling=common_pb2.SamplingParams(temperature=0.8, seed=7, rule=common_pb2.VERIFICATION_RULE_COUPLED)),
                pb.GenerateRequest(text="class A:", max_new_tokens=40, drafter="model", speculation=fixed,
                                   sampling=common_pb2.SamplingParams(temperature=1.0, seed=11,
                                                                      rule=common_pb2.VERIFICATION_RULE_REJECTION))]
    try:
        for request in requests:
            single = await cluster.stub.Generate(request)
            sharded = await on_cluster.stub.Generate(request)
            assert list(sharded.token_ids) == list(single.token_ids) and len(single.token_ids) > 0
            record = await on_cluster.store.get(sharded.session_id)  # and the record is on the cluster
            assert record.output_ids == tuple(sharded.token_ids) and record.status is SessionStatus.FINISHED
    finally:
        await on_cluster.stop()
        delete_prefix(redis_cluster.url, prefix)
