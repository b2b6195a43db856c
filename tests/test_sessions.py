"""The SessionStore contract, run against the in-memory store and the Redis store alike: on one
Redis server, on a Redis Cluster (3 primaries with a replica each) and on a Sentinel-managed
primary (tests/redis_cluster.py starts both for real)."""
from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from specdec.core.errors import CorruptRecord, InvalidRequest, SessionMoved, SessionNotFound, SessionOutOfSync, SessionTakenOver
from specdec.core.redis_connect import connect
from specdec.core.redis_store import RUNNING_BUCKETS, RedisSessionStore
from specdec.core.sessions import (
    InMemorySessionStore,
    SessionRecord,
    SessionStatus,
    SessionStore,
    SpecCounters,
    check_session_id,
    new_session_id,
    pack_ids,
    unpack_ids,
)

from redis_server import delete_prefix

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
MakeStore = Callable[..., SessionStore]


REDIS_KINDS = {"redis": "redis_url", "cluster": "redis_cluster_url", "sentinel": "redis_sentinel"}


@pytest.fixture(params=["memory", *REDIS_KINDS])
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[MakeStore]:
    """make_store(ttl_s=3600) -> a store of the parametrized kind, closed after the test."""
    if request.param != "memory":
        url = request.getfixturevalue(REDIS_KINDS[request.param])
        url = url if isinstance(url, str) else url.url
        prefix = f"specdec-test-{uuid.uuid4().hex[:8]}"
        request.addfinalizer(lambda: delete_prefix(url, prefix))
    created: list[SessionStore] = []

    def make(ttl_s: float = 3600) -> SessionStore:
        if request.param == "memory":
            store: SessionStore = InMemorySessionStore(ttl_s)
        else:
            store = RedisSessionStore.from_url(url, ttl_s=ttl_s, prefix=prefix)
        created.append(store)
        return store

    yield make
    for store in created:
        await store.close()


# The Redis-specific tests below run on one server and on the cluster (``any_redis_url``).
@pytest.fixture
async def redis_store(any_redis_url: str, any_redis_prefix: str) -> AsyncIterator[RedisSessionStore]:
    store = RedisSessionStore.from_url(any_redis_url, ttl_s=3600, prefix=any_redis_prefix)
    yield store
    await store.close()


@pytest.fixture
async def raw(any_redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client (of the same kind: a cluster client on the cluster), to look at and tamper with
    what the store wrote."""
    client = connect(any_redis_url)
    yield client
    await client.aclose()


def make_record(**changes) -> SessionRecord:
    record = SessionRecord.new(
        prompt_ids=[1, 2, 3, 0, -5, INT32_MAX, INT32_MIN],
        params={"temperature": 0.7, "max_new_tokens": 16, "stop": ["\n\n", "é"], "top_p": None},
        seed=2**64 - 1,
    )
    return dataclasses.replace(record, **changes)


# --- the contract, both stores ----------------------------------------------------------------


async def test_store_follows_protocol(make_store: MakeStore) -> None:
    assert isinstance(make_store(), SessionStore)


async def test_create_get_round_trip(make_store: MakeStore) -> None:
    store = make_store()
    record = make_record()
    await store.create(record)
    assert await store.get(record.session_id) == record
    # A record created with output and a final status (e.g. an import) round-trips too.
    done = make_record(
        output_ids=(7, 8, 9), status=SessionStatus.FINISHED, finish_reason="length",
        counters=SpecCounters(drafts=2, draft_tokens=8, accepted_tokens=5, verify_steps=3), params={},
    )
    await store.create(done)
    assert await store.get(done.session_id) == done


async def test_get_returns_a_copy_of_params(make_store: MakeStore) -> None:
    store = make_store()
    record = make_record()
    await store.create(record)
    (await store.get(record.session_id)).params["temperature"] = 99  # type: ignore[index]
    assert (await store.get(record.session_id)).params["temperature"] == 0.7


async def test_commit_appends_exactly_and_replaces_counters(make_store: MakeStore) -> None:
    store = make_store()
    record = make_record()
    await store.create(record)
    blocks = [[10, 11, 12], [], [INT32_MAX], [-1, 0], list(range(5000))]
    for i, block in enumerate(blocks):
        counters = SpecCounters(drafts=i + 1, draft_tokens=4 * (i + 1), accepted_tokens=i, verify_steps=i + 1)
        await store.commit(record.session_id, block, counters, step_ks=(i, 64) if i % 2 else (i,))
    got = await store.get(record.session_id)
    assert got.output_ids == tuple(x for block in blocks for x in block)
    assert got.step_ks == (0, 1, 64, 2, 3, 64, 4)  # the speculation length of every step, in order
    assert got.counters == counters  # the last totals, not a sum
    assert got.prompt_ids == record.prompt_ids
    assert got.status is SessionStatus.RUNNING and got.finish_reason == ""
    assert got.created_at == record.created_at <= got.updated_at


@pytest.mark.parametrize("ks", [(65,), (-1,), (1.5,)])
async def test_commit_refuses_a_speculation_length_outside_0_64(make_store: MakeStore, ks) -> None:
    store = make_store()
    record = make_record()
    await store.create(record)
    with pytest.raises(InvalidRequest, match="speculation lengths"):
        await store.commit(record.session_id, [1], SpecCounters(), step_ks=ks)
    got = await store.get(record.session_id)
    assert got.output_ids == () and got.step_ks == ()  # a refused commit changes nothing


async def test_concurrent_commits_lose_nothing(make_store: MakeStore) -> None:
    store = make_store()
    record = make_record()
    await store.create(record)
    await asyncio.gather(*(store.commit(record.session_id, [i, i], SpecCounters()) for i in range(50)))
    output = (await store.get(record.session_id)).output_ids
    assert sorted(output) == sorted(list(range(50)) * 2)
    assert all(output[j] == output[j + 1] for j in range(0, 100, 2))  # each block appended whole


async def test_finish_sets_status_and_reason(make_store: MakeStore) -> None:
    store = make_store()
    record = make_record()
    await store.create(record)
    await store.commit(record.session_id, [4, 5], SpecCounters(drafts=1, draft_tokens=2, accepted_tokens=1))
    await store.finish(record.session_id, SessionStatus.CANCELLED, "client cancelled")
    got = await store.get(record.session_id)
    assert (got.status, got.finish_reason, got.output_ids) == (SessionStatus.CANCELLED, "client cancelled", (4, 5))
    with pytest.raises(InvalidRequest):
        await store.finish(record.session_id, SessionStatus.RUNNING, "")


async def test_writes_are_fenced_by_the_holder_that_claimed_last(make_store: MakeStore) -> None:
    """A claim hands the session to a new holder at once; the old holder's commit and finish are
    refused (SessionTakenOver) and change nothing; a finished session cannot be claimed; a claim
    at a stale length is refused (SessionMoved) and changes nothing."""
    store = make_store()
    record = make_record()
    await store.create(record, "old")
    await store.commit(record.session_id, [4], SpecCounters(verify_steps=1), (1,), holder="old")
    with pytest.raises(SessionMoved):
        await store.claim(record.session_id, 0, "new")
    await store.commit(record.session_id, [5], SpecCounters(verify_steps=2), (1,), holder="old")  # still old's
    await store.claim(record.session_id, 2, "new")
    before = await store.get(record.session_id)
    for write in (store.commit(record.session_id, [6], SpecCounters(verify_steps=9), (2,), holder="old"),
                  store.finish(record.session_id, SessionStatus.FAILED, "", holder="old")):
        with pytest.raises(SessionTakenOver):
            await write
    after = await store.get(record.session_id)
    assert (after.output_ids, after.step_ks, after.counters, after.status) == (
        before.output_ids, before.step_ks, before.counters, SessionStatus.RUNNING)
    await store.commit(record.session_id, [7], SpecCounters(verify_steps=3), (0,), holder="new")
    await store.finish(record.session_id, SessionStatus.FINISHED, "length", holder="new")
    got = await store.get(record.session_id)
    assert (got.output_ids, got.step_ks, got.status) == ((4, 5, 7), (1, 1, 0), SessionStatus.FINISHED)
    with pytest.raises(SessionOutOfSync, match="has finished"):
        await store.claim(record.session_id, 3, "newer")


async def test_a_commit_naming_the_length_it_extends_lands_once(make_store: MakeStore) -> None:
    """A retry of a commit that landed (its reply lost) changes nothing; a commit extending another
    length than the output has is refused and changes nothing."""
    store = make_store()
    record = make_record()
    await store.create(record, "h")
    await store.commit(record.session_id, [4, 5], SpecCounters(verify_steps=1), (1,), holder="h", after=0)
    await store.commit(record.session_id, [4, 5], SpecCounters(verify_steps=1), (1,), holder="h", after=0)  # the retry
    await store.commit(record.session_id, [6], SpecCounters(verify_steps=2), (0,), holder="h", after=2)
    with pytest.raises(SessionOutOfSync, match="another number of tokens"):
        await store.commit(record.session_id, [7], SpecCounters(verify_steps=9), (3,), holder="h", after=1)
    got = await store.get(record.session_id)
    assert (got.output_ids, got.step_ks, got.counters.verify_steps) == ((4, 5, 6), (1, 0), 2)


async def test_unknown_session(make_store: MakeStore) -> None:
    store = make_store()
    sid = new_session_id()
    with pytest.raises(SessionNotFound):
        await store.get(sid)
    with pytest.raises(SessionNotFound):
        await store.commit(sid, [1], SpecCounters())
    with pytest.raises(SessionNotFound):
        await store.finish(sid, SessionStatus.FINISHED, "stop")
    await store.delete(sid)  # no error
    with pytest.raises(SessionNotFound):  # and the failed writes created nothing
        await store.get(sid)


async def test_create_twice_is_an_error(make_store: MakeStore) -> None:
    store = make_store()
    record = make_record()
    await store.create(record)
    await store.commit(record.session_id, [1, 2], SpecCounters())
    with pytest.raises(InvalidRequest, match="already exists"):
        await store.create(make_record(session_id=record.session_id, seed=1))
    got = await store.get(record.session_id)
    assert (got.seed, got.output_ids) == (record.seed, (1, 2))


async def test_a_retried_create_of_its_own_holder_changes_nothing(make_store: MakeStore) -> None:
    """A create whose reply was lost in a failover is retried: by the stream that made it, it lands
    once; by anyone else (another holder, or none), it is still an error."""
    store = make_store()
    record = make_record()
    await store.create(record, holder="h1")
    await store.commit(record.session_id, [1, 2], SpecCounters(), holder="h1")
    await store.create(record, holder="h1")
    for other in ("h2", ""):
        with pytest.raises(InvalidRequest, match="already exists"):
            await store.create(record, holder=other)
    assert (await store.get(record.session_id)).output_ids == (1, 2)


async def test_delete_then_recreate(make_store: MakeStore) -> None:
    store = make_store()
    record = make_record()
    await store.create(record)
    await store.commit(record.session_id, [1, 2], SpecCounters())
    await store.delete(record.session_id)
    with pytest.raises(SessionNotFound):
        await store.get(record.session_id)
    await store.create(record)
    assert (await store.get(record.session_id)).output_ids == ()


async def test_bad_input_is_rejected(make_store: MakeStore) -> None:
    store = make_store()
    for bad in [make_record(params={"x": float("nan")}), make_record(params={"x": object()}),
                make_record(prompt_ids=(INT32_MAX + 1,)), make_record(session_id="a}b")]:
        with pytest.raises(InvalidRequest):
            await store.create(bad)
    record = make_record()
    await store.create(record)
    with pytest.raises(InvalidRequest):
        await store.commit(record.session_id, [1, 2**40], SpecCounters())
    with pytest.raises(InvalidRequest):
        await store.get("not/an/id")
    assert (await store.get(record.session_id)).output_ids == ()


async def test_short_ttl_expires(make_store: MakeStore) -> None:
    store = make_store(ttl_s=0.3)
    record = make_record()
    await store.create(record)
    await asyncio.sleep(0.7)
    with pytest.raises(SessionNotFound):
        await store.get(record.session_id)
    with pytest.raises(SessionNotFound):
        await store.commit(record.session_id, [1], SpecCounters())


# --- in-memory specifics ------------------------------------------------------------------------


async def test_in_memory_ttl_is_refreshed_by_writes_only() -> None:
    now = [0.0]
    store = InMemorySessionStore(ttl_s=10, clock=lambda: now[0])
    record = make_record()
    await store.create(record)
    now[0] = 8.0
    await store.commit(record.session_id, [1], SpecCounters())  # expires at 18 now
    now[0] = 17.0
    await store.get(record.session_id)  # a read does not refresh
    now[0] = 18.0
    with pytest.raises(SessionNotFound):
        await store.get(record.session_id)


async def test_in_memory_sweeps_sessions_nobody_reads() -> None:
    now = [0.0]
    store = InMemorySessionStore(ttl_s=10, clock=lambda: now[0])
    for _ in range(5):
        await store.create(make_record())
    now[0] = 25.0
    await store.create(make_record())
    assert len(store._entries) == 1


# --- Redis specifics ----------------------------------------------------------------------------


async def test_redis_key_layout(redis_store: RedisSessionStore, raw: aioredis.Redis, any_redis_prefix: str) -> None:
    redis_prefix = any_redis_prefix
    record = make_record()
    await redis_store.create(record)
    await redis_store.commit(record.session_id, [1, -1], SpecCounters(), step_ks=(1,))
    await redis_store.commit(record.session_id, [], SpecCounters(), step_ks=(0,))
    key = f"{redis_prefix}:sess:{{{record.session_id}}}"
    assert (redis_store.session_key(record.session_id), redis_store.output_key(record.session_id)) == (
        key, key + ":out")
    assert key_slot(key.encode()) == key_slot((key + ":out").encode())  # the hash tag works
    assert await raw.type(key) == b"hash" and await raw.type(key + ":out") == b"string"
    assert await raw.hget(key, "v") == b"1"
    assert await raw.hget(key, "prompt") == pack_ids(record.prompt_ids)
    assert await raw.get(key + ":out") == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert await raw.get(key + ":k") == b"\x01\x00"  # one byte per step: its speculation length
    assert key_slot(key.encode()) == key_slot((key + ":k").encode())
    # The running index is sharded: the session is in one of RUNNING_BUCKETS hash-tagged buckets.
    bucket = f"{redis_prefix}:running:{{{zlib.crc32(record.session_id.encode()) % RUNNING_BUCKETS}}}"
    assert redis_store.running_key(record.session_id) == bucket and bucket in redis_store.running_keys
    stored = sorted([k async for k in raw.scan_iter(match=f"{redis_prefix}*")])  # SCAN: every node of a cluster
    assert stored == sorted([key.encode(), (key + ":k").encode(), (key + ":out").encode(), bucket.encode()])
    assert await raw.zscore(bucket, record.session_id) is not None  # where the reaper looks
    for k in (key, key + ":out", key + ":k", bucket):
        assert 0 < await raw.pttl(k) <= redis_store._ttl_ms  # every key expires
    await redis_store.finish(record.session_id, SessionStatus.FINISHED, "length")
    assert await raw.zscore(bucket, record.session_id) is None
    assert (await redis_store.get(record.session_id)).step_ks == (1, 0)


async def test_redis_failed_writes_create_no_keys(
    redis_store: RedisSessionStore, raw: aioredis.Redis, any_redis_prefix: str
) -> None:
    redis_prefix = any_redis_prefix
    sid = new_session_id()
    with pytest.raises(SessionNotFound):
        await redis_store.commit(sid, [1, 2, 3], SpecCounters(drafts=1))
    with pytest.raises(SessionNotFound):
        await redis_store.finish(sid, SessionStatus.FAILED, "boom")
    with pytest.raises(InvalidRequest):
        await redis_store.create(make_record(params={"x": object()}))
    assert [k async for k in raw.scan_iter(match=f"{redis_prefix}*")] == []


async def test_redis_ttl_on_both_keys_refreshed_by_writes(any_redis_url: str, any_redis_prefix: str, raw) -> None:
    """Each write moves every key's expiry to now + TTL; a read does not. Compared as absolute
    expiry times (PEXPIRETIME), which only writes move: nothing here depends on how long the steps
    between took (remaining TTLs compared across a sleep did, on a loaded machine)."""
    store = RedisSessionStore.from_url(any_redis_url, ttl_s=60, prefix=any_redis_prefix)

    async def expiries() -> list[int]:
        return [await raw.pexpiretime(k) for k in keys]

    try:
        record = make_record()
        await store.create(record)
        keys = [store.session_key(record.session_id), store.output_key(record.session_id)]
        assert all(0 < ms <= 60_000 for ms in [await raw.pttl(k) for k in keys])
        created = await expiries()
        await asyncio.sleep(0.01)  # the clock moves on: an expiry set now is later
        await store.commit(record.session_id, [1], SpecCounters())
        committed = await expiries()
        assert all(b > a for a, b in zip(created, committed))
        await asyncio.sleep(0.01)
        await store.finish(record.session_id, SessionStatus.FINISHED, "stop")
        finished = await expiries()
        assert all(b > a for a, b in zip(committed, finished))
        await asyncio.sleep(0.01)
        await store.get(record.session_id)  # a read does not refresh
        assert await expiries() == finished
    finally:
        await store.close()


Tamper = Callable[[aioredis.Redis, str, str], Awaitable[object]]


async def _output_key_a_hash(r: aioredis.Redis, key: str, out: str) -> None:
    await r.delete(out)
    await r.hset(out, "a", "b")


CORRUPTIONS: dict[str, Tamper] = {
    "wrong version": lambda r, k, o: r.hset(k, "v", "2"),
    "no version": lambda r, k, o: r.hdel(k, "v"),
    "missing field": lambda r, k, o: r.hdel(k, "params"),
    "unexpected field": lambda r, k, o: r.hset(k, "pickle", b"\x80\x04"),
    "odd-length prompt": lambda r, k, o: r.hset(k, "prompt", b"\x01\x02\x03"),
    "odd-length output": lambda r, k, o: r.set(o, b"\x00" * 5),
    "output key missing": lambda r, k, o: r.delete(o),
    "non-JSON params": lambda r, k, o: r.hset(k, "params", b"{not json"),
    "params not an object": lambda r, k, o: r.hset(k, "params", b"[1, 2]"),
    "params not UTF-8": lambda r, k, o: r.hset(k, "params", b"\xff\xfe"),
    "deeply nested params": lambda r, k, o: r.hset(k, "params", b"[" * 100_000),
    "non-JSON counters": lambda r, k, o: r.hset(k, "counters", b"nope"),
    "negative counter": lambda r, k, o: r.hset(k, "counters", b'{"drafts": -1}'),
    "string counter": lambda r, k, o: r.hset(k, "counters", b'{"drafts": "3"}'),
    "unknown counter": lambda r, k, o: r.hset(k, "counters", b'{"bogus": 1}'),
    "unknown status": lambda r, k, o: r.hset(k, "status", b"paused"),
    "status not ASCII": lambda r, k, o: r.hset(k, "status", b"\xff"),
    "finish_reason not UTF-8": lambda r, k, o: r.hset(k, "finish_reason", b"\xff"),
    "seed not an int": lambda r, k, o: r.hset(k, "seed", b"1.5"),
    "seed with underscores": lambda r, k, o: r.hset(k, "seed", b"1_000"),
    "timestamp not a number": lambda r, k, o: r.hset(k, "created_at", b"yesterday"),
    "timestamp nan": lambda r, k, o: r.hset(k, "updated_at", b"nan"),
    "session key a string": lambda r, k, o: r.set(k, b"hello"),
    "output key a hash": _output_key_a_hash,
}


@pytest.mark.parametrize("tamper", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
async def test_redis_corrupt_value_is_an_error(redis_store: RedisSessionStore, raw, tamper: Tamper) -> None:
    record = make_record()
    await redis_store.create(record)
    key, out = redis_store.session_key(record.session_id), redis_store.output_key(record.session_id)
    await tamper(raw, key, out)
    with pytest.raises(CorruptRecord):
        await redis_store.get(record.session_id)


async def _contents(raw: aioredis.Redis, key: str) -> object:
    kind = await raw.type(key)
    return kind, await raw.hgetall(key) if kind == b"hash" else await raw.get(key) if kind == b"string" else None


@pytest.mark.parametrize("name", ["wrong version", "no version", "output key missing", "session key a string", "output key a hash"])
async def test_redis_writes_leave_foreign_values_alone(redis_store: RedisSessionStore, raw, name: str) -> None:
    record = make_record()
    await redis_store.create(record)
    key, out = redis_store.session_key(record.session_id), redis_store.output_key(record.session_id)
    await CORRUPTIONS[name](raw, key, out)
    snapshot = [await _contents(raw, k) for k in (key, out)]
    with pytest.raises(CorruptRecord):
        await redis_store.commit(record.session_id, [1, 2], SpecCounters())
    with pytest.raises(CorruptRecord):
        await redis_store.finish(record.session_id, SessionStatus.FINISHED, "stop")
    assert [await _contents(raw, k) for k in (key, out)] == snapshot


# --- pure helpers -------------------------------------------------------------------------------


def test_session_ids() -> None:
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(s) == 32 and all(c in "0123456789abcdef" for c in s) for s in ids)
    for bad in ["", "x" * 129, "a{b}", "a:b", "a*", "a b", 42]:
        with pytest.raises(InvalidRequest):
            check_session_id(bad)  # type: ignore[arg-type]


def test_pack_unpack() -> None:
    ids = [0, 1, -1, 42, INT32_MAX, INT32_MIN]
    assert unpack_ids(pack_ids(ids)) == tuple(ids)
    assert pack_ids([]) == b"" and unpack_ids(b"") == ()
    assert pack_ids([1, -2]) == b"\x01\x00\x00\x00\xfe\xff\xff\xff"  # little-endian int32
    assert unpack_ids(memoryview(pack_ids(range(10_000)))) == tuple(range(10_000))
    for bad in [[INT32_MAX + 1], [INT32_MIN - 1], [1.0], ["1"]]:
        with pytest.raises(InvalidRequest):
            pack_ids(bad)
    for n in [1, 2, 3, 5]:
        with pytest.raises(CorruptRecord):
            unpack_ids(b"\x00" * n)


def test_spec_counters() -> None:
    a = SpecCounters(drafts=2, draft_tokens=8, accepted_tokens=6, verify_steps=3)
    b = SpecCounters(drafts=1, draft_tokens=4, accepted_tokens=0, verify_steps=1)
    assert a.plus(b) == SpecCounters(drafts=3, draft_tokens=12, accepted_tokens=6, verify_steps=4)
    assert a.mean_accepted_length == 4.0 and a.acceptance_rate == 0.75
    assert SpecCounters().mean_accepted_length == 1.0 and SpecCounters().acceptance_rate == 0.0
    assert SpecCounters.from_dict(a.to_dict()) == a
    assert SpecCounters.from_dict({}) == SpecCounters()
    for bad in [{"bogus": 1}, {"drafts": -1}, {"drafts": True}, {"drafts": 1.0}]:
        with pytest.raises(ValueError):
            SpecCounters.from_dict(bad)


def test_sessions_module_is_pure() -> None:
    code = (
        "import sys, specdec.core.sessions\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'grpc', 'torch'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
