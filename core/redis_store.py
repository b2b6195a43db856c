"""`SessionStore` on Redis (redis.asyncio): sessions shared by every replica, so any can resume one.

Layout, format version 1 (docs/architecture.md, "Where state lives"):
  {prefix}:sess:{<id>}      hash: v="1", prompt (packed int32), params (JSON), seed, status,
                            finish_reason, counters (JSON), created_at, updated_at
  {prefix}:sess:{<id>}:out  string: committed output tokens, packed little-endian int32
  {prefix}:sess:{<id>}:k    string: the speculation length of every step, one byte each (0-64),
                            so a seeded request can be replayed step for step
  {prefix}:running:{<b>}    sorted sets: the ids of running sessions (by start time), so a reaper
                            can find those whose orchestrator died (abandon_stale); sharded into
                            RUNNING_BUCKETS buckets (b = CRC32 of the id mod RUNNING_BUCKETS), so on a
                            Redis Cluster no one key takes every session's writes
The braces are literal: `{<id>}` is a Redis Cluster hash tag, so a session's keys share a slot and
one Lua script may touch them all; every script and pipeline here touches one session's keys or
one key, so each works on a cluster (core/redis_connect.py builds the client from the URL).
Output lives in its own key so a commit is an O(1) APPEND, not a rewrite.
Each write is one Lua script (one round trip, atomic), checks that the session exists and is ours
before touching anything, and refreshes the TTL of both keys. Never pickle: values are validated
on read and anything corrupt or foreign raises CorruptRecord.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import re
import time
import zlib
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TimeoutError as RedisTimeout,
)

from specdec.core.errors import CorruptRecord, InvalidRequest, SessionNotFound, StoreUnavailable
from specdec.core.redis_batch import ScriptBatcher
from specdec.core.redis_connect import ReplicaAckMissing, RetryBudget, connect, eval_acked, parse_redis_url, retry_budget
from specdec.core.sessions import (
    SessionRecord,
    SessionStatus,
    SpecCounters,
    check_claim,
    check_finish,
    check_record,
    check_session_id,
    commit_out_of_sync,
    json_object,
    pack_ids,
    pack_ks,
    short_id,
    params_from_json,
    params_to_json,
    taken_over,
    unpack_ids,
    unpack_ks,
)

FORMAT_VERSION = "1"
_FIELDS = frozenset(
    {b"v", b"prompt", b"params", b"seed", b"status", b"finish_reason", b"counters", b"created_at", b"updated_at"}
)
# Buckets of the running-sessions index: enough that the busiest bucket is a small share of all
# writes on a cluster, few enough that the reaper reads them all in one pipeline.
RUNNING_BUCKETS = 64
_INT_RE = re.compile(rb"-?[0-9]{1,40}")
_PREFIX_RE = re.compile(r"[0-9A-Za-z_.:-]{1,64}")

# Script results: 1 done, 0 no such session, -1 the key holds something that is not our session,
# -2 another stream holds the session (see SessionStore: writes are fenced by a holder token), -3 the
# output is not the length the commit extends.
_OK, _MISSING, _FOREIGN, _TAKEN, _MOVED = 1, 0, -1, -2, -3
_OPTIONAL_FIELDS = frozenset({b"holder"})  # records written before fencing have none

# A common guard: the hash exists, is a version-ARGV[2] session, and its output key is a string.
# Checked before any write because Redis does not roll a script back when a later command fails.
_GUARD = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return 0 end
if t ~= 'hash' or redis.call('HGET', KEYS[1], 'v') ~= ARGV[2] then return -1 end
if redis.call('TYPE', KEYS[2])['ok'] ~= 'string' then return -1 end
"""
# After _GUARD, for writes by a stream: ARGV[n] is its holder token ('' = not checked).
_FENCE = """
if ARGV[{n}] ~= '' and redis.call('HGET', KEYS[1], 'holder') ~= ARGV[{n}] then return -2 end
"""

# KEYS: hash, out, k. ARGV: ttl_ms, version, packed output, then field/value pairs for the hash (holder among them).
# A retry of a create that landed (its reply lost in a failover) finds its own holder (ARGV[5], unique
# per stream) and succeeds, refreshing the TTL so that a WAIT after it covers the first write.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[5] ~= '' and redis.call('HGET', KEYS[1], 'holder') == ARGV[5] then
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
    return 1
  end
  return 0
end
redis.call('HSET', KEYS[1], 'v', ARGV[2], unpack(ARGV, 4))
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[1])
redis.call('SET', KEYS[3], '', 'PX', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS: hash, out, k. ARGV: ttl_ms, version, packed new tokens, counters JSON, updated_at, step k bytes, holder,
# output bytes the commit extends (-1: any). Idempotent when that is given: a retry of a commit that
# landed (its reply lost with the connection) finds the output already extended and changes nothing.
_COMMIT = _GUARD + _FENCE.format(n=7) + """
local before = tonumber(ARGV[8])
if before >= 0 then
  local now = redis.call('STRLEN', KEYS[2])
  if now == before + string.len(ARGV[3]) and now > before then
    redis.call('PEXPIRE', KEYS[1], ARGV[1])  -- a write, so a WAIT after this retry covers the commit that landed
    return 1
  end
  if now ~= before then return -3 end
end
redis.call('APPEND', KEYS[2], ARGV[3])
redis.call('APPEND', KEYS[3], ARGV[6])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[1], 'counters', ARGV[4], 'updated_at', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""

# KEYS: hash, out, k. ARGV: ttl_ms, version, status, finish_reason, updated_at, holder.
_FINISH = _GUARD + _FENCE.format(n=6) + """
redis.call('PEXPIRE', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finish_reason', ARGV[4], 'updated_at', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 1
"""

# KEYS: hash, out, k. ARGV: ttl_ms, version, updated_at, new holder, expected output bytes. Takes
# a session over, atomically (the new holder fences off whoever wrote before): 2 finished, 4 its
# output moved since the caller read it.
_CLAIM = _GUARD + """
if redis.call('HGET', KEYS[1], 'status') == 'finished' then return 2 end
if redis.call('STRLEN', KEYS[2]) ~= tonumber(ARGV[5]) then return 4 end
redis.call('HSET', KEYS[1], 'status', 'running', 'finish_reason', '', 'updated_at', ARGV[3], 'holder', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
return 1
"""

# KEYS: hash, out, k. ARGV: ttl_ms, version, cutoff (updated_at at or before it: abandoned), now.
# Marks a running session whose orchestrator stopped committing as failed: 1 marked, 2 not running,
# 3 still committing.
_ABANDON = _GUARD + """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 2 end
if tonumber(redis.call('HGET', KEYS[1], 'updated_at')) > tonumber(ARGV[3]) then return 3 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'finish_reason', 'orchestrator lost', 'updated_at', ARGV[4])
return 1
"""
ABANDONED_REASON = "orchestrator lost"

# KEYS: hash, out, k. The three read at one instant (a script runs alone), never mid-commit. A script,
# not MULTI/EXEC: a cluster client follows ASK with a script and not with a transaction.
_GET = """
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3])}
"""


log = logging.getLogger(__name__)


def _store_errors(method):
    """Redis down, slow or refusing writes (OOM, READONLY) is StoreUnavailable, never a stray redis error.

    The caller (possibly a client) hears only that the store is unavailable; the address and Redis's
    own words go to this process's log, for the operator."""

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except ReplicaAckMissing as exc:
            log.warning("session store write not replicated: %s", exc)
            raise StoreUnavailable("the session store could not replicate the write (a Redis primary without a "
                                   "live replica, or failing over); retry shortly") from None
        except (RedisConnectionError, RedisTimeout, OSError) as exc:
            log.warning("session store unreachable: %s", exc)
            raise StoreUnavailable("the session store is unavailable (Redis unreachable or failing over); retry shortly") from None
        except ResponseError as exc:  # READONLY, OOM, CLUSTERDOWN, MOVED past the client's retries, ...
            log.warning("session store refused a command: %s", exc)
            raise StoreUnavailable("the session store refused the write; retry shortly") from None
        except (RedisError, RedisClusterException) as exc:  # a cluster slot nobody serves, ...
            log.warning("session store error: %r", exc)
            raise StoreUnavailable("the session store failed (Redis unreachable, or a cluster shard down); retry shortly") from None

    return wrapper


class RedisSessionStore:
    """Sessions in Redis under `prefix`, each expiring `ttl_s` after its last write.

    Owns its client (one connection pool per store); `close` releases it. ``replica_acks``: replicas
    every session write must reach before it counts as done (WAIT; 0 for a single server), so a
    promoted replica holds every token a client was sent.
    """

    def __init__(self, client: aioredis.Redis, *, ttl_s: float = 3600, prefix: str = "specdec",
                 replica_acks: int = 0, replica_ack_timeout_ms: int = 500) -> None:
        if not ttl_s > 0 or not math.isfinite(ttl_s):
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"prefix {prefix!r} must be 1-64 characters of [0-9A-Za-z_.:-]")
        self._redis = client
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._prefix = prefix
        self._replica_acks, self._replica_ack_timeout_ms = replica_acks, replica_ack_timeout_ms
        self._create = client.register_script(_CREATE)
        self._commit = client.register_script(_COMMIT)
        self._finish = client.register_script(_FINISH)
        self._claim = client.register_script(_CLAIM)
        self._abandon = client.register_script(_ABANDON)
        self._read = client.register_script(_GET)
        self._retry_budget: RetryBudget | None = None
        # The writes of every stream in one turn (each step's commits) in one pipeline; not where each
        # write waits for its replicas (WAIT acks a connection's writes), nor over a cluster (each key's shard apart).
        self._batch = ScriptBatcher(client) if isinstance(client, aioredis.Redis) and not replica_acks else None

    @classmethod
    def from_url(cls, url: str, ttl_s: float = 3600, prefix: str = "specdec") -> RedisSessionStore:
        """A store with its own connection pool, e.g. `from_url("redis://127.0.0.1:6379/0")`, a cluster
        (`redis+cluster://h:7000,h:7001`) or a Sentinel-managed primary (`redis+sentinel://h:26379/mymaster`);
        see core/redis_connect.py. A URL of no accepted form is a RedisUrlError (a ValueError)."""
        target = parse_redis_url(url)
        return cls(connect(target), ttl_s=ttl_s, prefix=prefix, replica_acks=target.replica_acks,
                   replica_ack_timeout_ms=target.replica_ack_timeout_ms)

    async def retry_budget(self) -> RetryBudget:
        """How long a failed call is worth trying again on this deployment (a cluster's failover
        time, read from the cluster: core/redis_connect.py), read once."""
        if self._retry_budget is None:
            self._retry_budget = await retry_budget(self._redis)
        return self._retry_budget

    async def _write(self, script, keys: list[str], args: list) -> int:
        """Run a write script: in this turn's pipeline (one server), alone (a cluster), or with
        ``replica_acks``, done only once that many replicas have it."""
        if self._replica_acks:
            return await eval_acked(self._redis, script.script, keys, args, self._replica_acks, self._replica_ack_timeout_ms)
        if self._batch is not None:
            return await self._batch.call(script, keys, args)
        return await script(keys=keys, args=args)

    def session_key(self, session_id: str) -> str:
        return f"{self._prefix}:sess:{{{check_session_id(session_id)}}}"

    def output_key(self, session_id: str) -> str:
        return self.session_key(session_id) + ":out"

    def _keys(self, session_id: str) -> list[str]:
        key = self.session_key(session_id)
        return [key, key + ":out", key + ":k"]

    def _check_result(self, result: int, session_id: str) -> None:
        if result == _TAKEN:
            raise taken_over(session_id)
        if result == _MOVED:
            raise commit_out_of_sync(session_id)
        if result == _MISSING:
            raise SessionNotFound(f"no session {short_id(session_id)} in Redis (unknown or expired)")
        if result == _FOREIGN:
            raise CorruptRecord(
                f"Redis key {self.session_key(session_id)!r} is not a version-{FORMAT_VERSION} specdec session"
            )

    @_store_errors
    async def create(self, record: SessionRecord, holder: str = "") -> None:
        check_record(record)
        fields = {
            "holder": holder,
            "prompt": pack_ids(record.prompt_ids),
            "params": params_to_json(record.params),
            "seed": str(record.seed),
            "status": record.status.value,
            "finish_reason": record.finish_reason,
            "counters": json.dumps(record.counters.to_dict()),
            "created_at": repr(float(record.created_at)),
            "updated_at": repr(float(record.updated_at)),
        }
        args: list[str | bytes | int] = [self._ttl_ms, FORMAT_VERSION, pack_ids(record.output_ids)]
        for name, value in fields.items():
            args += [name, value]
        if not await self._write(self._create, self._keys(record.session_id), args):
            raise InvalidRequest(f"session {short_id(record.session_id)} already exists")
        if record.status is SessionStatus.RUNNING:
            await self._index_running(record.session_id)

    async def _index_running(self, session_id: str) -> None:
        # A bucket lives as long as the newest session in it: no key without a TTL. Both commands
        # touch one key, so the pipeline goes to one node on a cluster too.
        key = self.running_key(session_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {session_id: time.time()})
            pipe.pexpire(key, self._ttl_ms)
            await pipe.execute()

    def running_key(self, session_id: str) -> str:
        """The bucket of the running-sessions index (a sorted set by start time) that holds this session."""
        return self.running_bucket_key(zlib.crc32(check_session_id(session_id).encode()) % RUNNING_BUCKETS)

    def running_bucket_key(self, bucket: int) -> str:
        return f"{self._prefix}:running:{{{bucket}}}"

    @property
    def running_keys(self) -> list[str]:
        """Every bucket of the running-sessions index, where the reaper looks."""
        return [self.running_bucket_key(b) for b in range(RUNNING_BUCKETS)]

    @_store_errors
    async def abandon_stale(self, lease_s: float, limit: int = 256) -> list[str]:
        """Mark running sessions that committed nothing for ``lease_s`` failed ("orchestrator lost"),
        so no record stays running after its orchestrator died; returns their ids. Sessions that
        ended or expired leave the index."""
        async with self._redis.pipeline(transaction=False) as pipe:  # one key per command: fine on a cluster
            for key in self.running_keys:
                pipe.zrange(key, 0, limit - 1, withscores=True)
            buckets = await pipe.execute()
        oldest = sorted((score, member.decode()) for bucket in buckets for member, score in bucket)[:limit]
        ids = [session_id for _, session_id in oldest]
        marked, gone = [], []
        now = time.time()
        for session_id in ids:
            result = await self._abandon(keys=self._keys(session_id), args=[self._ttl_ms, FORMAT_VERSION, repr(now - lease_s),
                                                                             repr(now)])
            if result == _OK:
                marked.append(session_id)
            if result in (_OK, _MISSING, _FOREIGN, 2):
                gone.append(session_id)
        if gone:
            async with self._redis.pipeline(transaction=False) as pipe:
                for session_id in gone:
                    pipe.zrem(self.running_key(session_id), session_id)
                await pipe.execute()
        return marked

    @_store_errors
    async def commit(self, session_id: str, new_output_ids: Sequence[int], counters: SpecCounters,
                     step_ks: Sequence[int] = (), holder: str = "", after: int | None = None) -> None:
        if not isinstance(counters, SpecCounters):
            raise InvalidRequest(f"counters must be SpecCounters, got {counters!r}")
        packed, counters_json = pack_ids(new_output_ids), json.dumps(counters.to_dict())
        args = [self._ttl_ms, FORMAT_VERSION, packed, counters_json, repr(time.time()), pack_ks(step_ks), holder,
                -1 if after is None else 4 * after]
        self._check_result(await self._write(self._commit, self._keys(session_id), args), session_id)

    @_store_errors
    async def finish(self, session_id: str, status: SessionStatus, finish_reason: str, holder: str = "") -> None:
        check_finish(status, finish_reason)
        args = [self._ttl_ms, FORMAT_VERSION, status.value, finish_reason, repr(time.time()), holder]
        self._check_result(await self._write(self._finish, self._keys(session_id), args), session_id)
        await self._redis.zrem(self.running_key(session_id), session_id)

    @_store_errors
    async def claim(self, session_id: str, output_len: int, holder: str) -> None:
        """Take a session over to continue it (see SessionStore.claim)."""
        args = [self._ttl_ms, FORMAT_VERSION, repr(time.time()), holder, 4 * output_len]
        result = await self._write(self._claim, self._keys(session_id), args)
        self._check_result(result, session_id)
        check_claim(result, session_id)
        await self._index_running(session_id)

    @_store_errors
    async def get(self, session_id: str) -> SessionRecord:
        key, out_key, k_key = self._keys(session_id)
        try:
            flat, out, ks = await self._read(keys=[key, out_key, k_key])
            raw = dict(zip(flat[::2], flat[1::2]))
        except ResponseError as e:
            if "WRONGTYPE" in str(e):
                raise CorruptRecord(f"Redis key {key!r} or {out_key!r} has the wrong type: {e}") from None
            raise
        if not raw:
            raise SessionNotFound(f"no session {short_id(session_id)} in Redis (unknown or expired)")
        try:
            return _decode(session_id, raw, out, ks)
        except CorruptRecord as e:
            raise CorruptRecord(f"session {key!r} in Redis: {e}") from None

    @_store_errors
    async def delete(self, session_id: str) -> None:
        await self._redis.delete(*self._keys(session_id))

    async def close(self) -> None:
        await self._redis.aclose()


def _decode(session_id: str, raw: dict[bytes, bytes], out: bytes | None, ks: bytes | None) -> SessionRecord:
    """A SessionRecord from HGETALL and GET replies; CorruptRecord for anything unexpected.

    ``ks`` may be missing: records written before the schedule was kept have none."""
    if raw.get(b"v") != FORMAT_VERSION.encode():
        raise CorruptRecord(f"format version {raw.get(b'v')!r}, expected {FORMAT_VERSION!r}")
    if set(raw) - _OPTIONAL_FIELDS != _FIELDS:
        missing, extra = sorted(_FIELDS - set(raw)), sorted(set(raw) - _FIELDS - _OPTIONAL_FIELDS)
        raise CorruptRecord(f"fields missing {missing}, unexpected {extra}")
    if out is None:
        raise CorruptRecord("the output key is missing")
    try:
        counters = SpecCounters.from_dict(json_object(raw[b"counters"], "counters"))
    except (TypeError, ValueError) as e:  # CorruptRecord from json_object passes through
        raise CorruptRecord(f"bad counters: {e}") from None
    try:
        status = SessionStatus(raw[b"status"].decode("ascii"))
        finish_reason = raw[b"finish_reason"].decode("utf-8")
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptRecord(f"bad status or finish_reason: {e}") from None
    if not _INT_RE.fullmatch(raw[b"seed"]):
        raise CorruptRecord(f"seed {raw[b'seed'][:50]!r} is not an integer")
    return SessionRecord(
        session_id=session_id,
        prompt_ids=unpack_ids(raw[b"prompt"]),
        output_ids=unpack_ids(out),
        params=params_from_json(raw[b"params"]),
        seed=int(raw[b"seed"]),
        status=status,
        finish_reason=finish_reason,
        counters=counters,
        created_at=_timestamp(raw[b"created_at"]),
        updated_at=_timestamp(raw[b"updated_at"]),
        step_ks=unpack_ks(ks or b""),
    )


def _timestamp(data: bytes) -> float:
    try:
        value = float(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise CorruptRecord(f"timestamp {data[:50]!r} is not a number") from None
    if not math.isfinite(value):
        raise CorruptRecord(f"timestamp {value!r} is not finite")
    return value
