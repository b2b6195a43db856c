"""`SessionStore` on Redis (redis.asyncio): sessions shared by every replica, so any can resume one.

Layout, format version 1 (DESIGN.md, "Redis layout"):
  {prefix}:sess:{<id>}      hash: v="1", prompt (packed int32), params (JSON), seed, status,
                            finish_reason, counters (JSON), created_at, updated_at
  {prefix}:sess:{<id>}:out  string: committed output tokens, packed little-endian int32
  {prefix}:sess:{<id>}:k    string: the speculation length of every step, one byte each (0-64),
                            so a seeded request can be replayed step for step
  {prefix}:running          sorted set: the ids of running sessions (by start time), so a reaper
                            can find those whose orchestrator died (abandon_stale)
The braces are literal: `{<id>}` is a Redis Cluster hash tag, so both keys share a slot and one
Lua script may touch both. Output lives in its own key so a commit is an O(1) APPEND, not a rewrite.
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
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError, RedisError, ResponseError, TimeoutError as RedisTimeout

from specdec.core.errors import CorruptRecord, InvalidRequest, SessionNotFound, StoreUnavailable
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
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
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
  if now == before + string.len(ARGV[3]) and now > before then return 1 end
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


log = logging.getLogger(__name__)


def _store_errors(method):
    """Redis down, slow or refusing writes (OOM, READONLY) is StoreUnavailable, never a stray redis error.

    The caller (possibly a client) hears only that the store is unavailable; the address and Redis's
    own words go to this process's log, for the operator."""

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except (RedisConnectionError, RedisTimeout, OSError) as exc:
            log.warning("session store unreachable: %s", exc)
            raise StoreUnavailable("the session store is unavailable (Redis unreachable); retry shortly") from None
        except ResponseError as exc:
            log.warning("session store refused a command: %s", exc)
            raise StoreUnavailable("the session store refused the write; retry shortly") from None
        except RedisError as exc:
            log.warning("session store error: %r", exc)
            raise StoreUnavailable("the session store failed; retry shortly") from None

    return wrapper


class RedisSessionStore:
    """Sessions in Redis under `prefix`, each expiring `ttl_s` after its last write.

    Owns its client (one connection pool per store); `close` releases it.
    """

    def __init__(self, client: aioredis.Redis, *, ttl_s: float = 3600, prefix: str = "specdec") -> None:
        if not ttl_s > 0 or not math.isfinite(ttl_s):
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"prefix {prefix!r} must be 1-64 characters of [0-9A-Za-z_.:-]")
        self._redis = client
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._prefix = prefix
        self._create = client.register_script(_CREATE)
        self._commit = client.register_script(_COMMIT)
        self._finish = client.register_script(_FINISH)
        self._claim = client.register_script(_CLAIM)
        self._abandon = client.register_script(_ABANDON)

    @classmethod
    def from_url(cls, url: str, ttl_s: float = 3600, prefix: str = "specdec") -> RedisSessionStore:
        """A store with its own connection pool, e.g. `from_url("redis://127.0.0.1:6379/0")`."""
        return cls(aioredis.Redis.from_url(url, decode_responses=False), ttl_s=ttl_s, prefix=prefix)

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
        if not await self._create(keys=self._keys(record.session_id), args=args):
            raise InvalidRequest(f"session {short_id(record.session_id)} already exists")
        if record.status is SessionStatus.RUNNING:
            await self._index_running(record.session_id)

    async def _index_running(self, session_id: str) -> None:
        # The index lives as long as the newest session in it: no key without a TTL.
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.running_key, {session_id: time.time()})
            pipe.pexpire(self.running_key, self._ttl_ms)
            await pipe.execute()

    @property
    def running_key(self) -> str:
        """The ids of running sessions (a sorted set by start time), where the reaper looks."""
        return f"{self._prefix}:running"

    @_store_errors
    async def abandon_stale(self, lease_s: float, limit: int = 256) -> list[str]:
        """Mark running sessions that committed nothing for ``lease_s`` failed ("orchestrator lost"),
        so no record stays running after its orchestrator died; returns their ids. Sessions that
        ended or expired leave the index."""
        ids = [i.decode() for i in await self._redis.zrange(self.running_key, 0, limit - 1)]
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
            await self._redis.zrem(self.running_key, *gone)
        return marked

    @_store_errors
    async def commit(self, session_id: str, new_output_ids: Sequence[int], counters: SpecCounters,
                     step_ks: Sequence[int] = (), holder: str = "", after: int | None = None) -> None:
        if not isinstance(counters, SpecCounters):
            raise InvalidRequest(f"counters must be SpecCounters, got {counters!r}")
        packed, counters_json = pack_ids(new_output_ids), json.dumps(counters.to_dict())
        args = [self._ttl_ms, FORMAT_VERSION, packed, counters_json, repr(time.time()), pack_ks(step_ks), holder,
                -1 if after is None else 4 * after]
        self._check_result(await self._commit(keys=self._keys(session_id), args=args), session_id)

    @_store_errors
    async def finish(self, session_id: str, status: SessionStatus, finish_reason: str, holder: str = "") -> None:
        check_finish(status, finish_reason)
        args = [self._ttl_ms, FORMAT_VERSION, status.value, finish_reason, repr(time.time()), holder]
        self._check_result(await self._finish(keys=self._keys(session_id), args=args), session_id)
        await self._redis.zrem(self.running_key, session_id)

    @_store_errors
    async def claim(self, session_id: str, output_len: int, holder: str) -> None:
        """Take a session over to continue it (see SessionStore.claim)."""
        args = [self._ttl_ms, FORMAT_VERSION, repr(time.time()), holder, 4 * output_len]
        result = await self._claim(keys=self._keys(session_id), args=args)
        self._check_result(result, session_id)
        check_claim(result, session_id)
        await self._index_running(session_id)

    @_store_errors
    async def get(self, session_id: str) -> SessionRecord:
        key, out_key, k_key = self._keys(session_id)
        try:
            # MULTI/EXEC: the hash and the output are read at the same instant, never mid-commit.
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(key)
                pipe.get(out_key)
                pipe.get(k_key)
                raw, out, ks = await pipe.execute()
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
