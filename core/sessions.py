"""Session records and the store that keeps them: what a replica needs to resume a request.

A session is one generation request: its prompt, parameters and seed (enough to redo every random
draw, see rng.py) plus the tokens committed so far and the speculation counters. The orchestrator
commits each verified block to the store before streaming it (docs/guarantees.md, "Nothing
lost"), so a replica that picks the session up elsewhere continues from exactly the committed
tokens.

This module is pure (no redis, no grpc): `InMemorySessionStore` is the embedded default and
`specdec.core.redis_store.RedisSessionStore` the distributed one; both follow `SessionStore`.
Stored bytes are never pickled: token ids are packed little-endian int32, the rest is JSON.
"""
from __future__ import annotations

import array
import enum
import hashlib
import json
import math
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, runtime_checkable

from specdec.core.errors import (CorruptRecord, InvalidRequest, SessionMoved, SessionNotFound, SessionOutOfSync,
                                 SessionTakenOver)

# Session ids end up inside Redis keys (as a Cluster hash tag), so no braces, colons or globs.
_SESSION_ID_RE = re.compile(r"[0-9a-f]{32}")

_INT32_CODE = "i"
assert array.array(_INT32_CODE).itemsize == 4, "this platform's C int is not 32 bits"


def new_session_id() -> str:
    """A fresh session id: 128 random bits as 32 lowercase hex characters."""
    return secrets.token_hex(16)


def short_id(session_id: str) -> str:
    """What logs show of a session: 8 hex characters of its hash, useless for acting on the session."""
    return hashlib.sha256(str(session_id).encode()).hexdigest()[:8]


def check_session_id(session_id: str) -> str:
    """Return `session_id` if it is what new_session_id makes (32 lowercase hex); raise InvalidRequest if not."""
    if not isinstance(session_id, str) or not _SESSION_ID_RE.fullmatch(session_id):
        raise InvalidRequest(f"session id {str(session_id)[:40]!r} is not 32 lowercase hex characters (a 128-bit random id)")
    return session_id


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian int32 bytes. Raises InvalidRequest for a non-int or out-of-range id."""
    try:
        packed = array.array(_INT32_CODE, ids)
    except OverflowError as e:
        raise InvalidRequest(f"token id outside the int32 range: {e}") from None
    except TypeError as e:
        raise InvalidRequest(f"token ids must be integers: {e}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(data: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """Inverse of `pack_ids`. Raises CorruptRecord when the length is not a multiple of 4."""
    if len(data) % 4:
        raise CorruptRecord(f"packed token ids are {len(data)} bytes, not a multiple of 4")
    unpacked = array.array(_INT32_CODE)
    unpacked.frombytes(data)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return tuple(unpacked)


MAX_STEP_K = 64


def pack_ks(ks: Iterable[int]) -> bytes:
    """Speculation lengths of steps, one byte each; InvalidRequest outside [0, 64]."""
    ks = tuple(ks)
    if any(not isinstance(k, int) or not 0 <= k <= MAX_STEP_K for k in ks):
        raise InvalidRequest(f"speculation lengths must be ints in [0, {MAX_STEP_K}], got {ks[:8]}")
    return bytes(ks)


def unpack_ks(data: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """Inverse of `pack_ks`; CorruptRecord for a byte over 64."""
    ks = tuple(bytes(data))
    if any(k > MAX_STEP_K for k in ks):
        raise CorruptRecord(f"a recorded speculation length is over {MAX_STEP_K}")
    return ks


def params_to_json(params: Mapping[str, Any]) -> str:
    """Request parameters as compact JSON; InvalidRequest if they are not a JSON-able str-keyed mapping."""
    if not isinstance(params, Mapping):
        raise InvalidRequest(f"session params must be a mapping, got {type(params).__name__}")
    try:
        return json.dumps(dict(params), separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"session params are not JSON-serialisable: {e}") from None


def params_from_json(text: str | bytes) -> dict[str, Any]:
    """Inverse of `params_to_json`. Raises CorruptRecord for anything but a JSON object."""
    return json_object(text, "session params")


def json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """Decode stored JSON that must be an object; CorruptRecord (naming `what`) otherwise."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptRecord(f"{what} are not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CorruptRecord(f"{what} are JSON {type(value).__name__}, expected an object")
    return value


@dataclass(frozen=True)
class SpecCounters:
    """Speculation totals for one session, in the words of the metrics (docs/operations.md, "Metrics").

    drafts: verification steps that had at least one draft token; draft_tokens: draft tokens
    proposed; accepted_tokens: draft tokens the verifier accepted; verify_steps: all verifier calls;
    predrafted_steps: steps whose block was drafted while the previous step was verified (overlap
    hits); verify_time_ns / draft_wait_ns: the target's time, and the time steps waited for blocks.
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    predrafted_steps: int = 0
    verify_time_ns: int = 0
    draft_wait_ns: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SpecCounters.{f.name} must be a non-negative int, got {value!r}")

    def plus(self, other: SpecCounters) -> SpecCounters:
        """Field-wise sum (of two checked counters: not checked again, as it runs for every step of every session)."""
        total = object.__new__(SpecCounters)
        for name in _COUNTER_FIELDS:
            object.__setattr__(total, name, getattr(self, name) + getattr(other, name))
        return total

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per draft: 1 + accepted/drafts (the 1 is the recovered or bonus token)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens; 0.0 before any draft."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpecCounters:
        """Missing fields are 0; unknown fields or bad values raise ValueError."""
        if not isinstance(data, Mapping):
            raise ValueError(f"counters must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown counter fields {sorted(unknown)}")
        return cls(**data)


_COUNTER_FIELDS = tuple(f.name for f in fields(SpecCounters))


class SessionStatus(str, enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class SessionRecord:
    """One session as the store returns it. Timestamps are wall-clock seconds since the epoch."""

    session_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # committed generated tokens, prompt excluded
    params: Mapping[str, Any]  # JSON-able request parameters
    seed: int
    status: SessionStatus
    finish_reason: str  # "" while running
    counters: SpecCounters
    created_at: float
    updated_at: float
    step_ks: tuple[int, ...] = ()  # the speculation length of every step so far, in order

    @classmethod
    def new(
        cls, prompt_ids: Sequence[int], params: Mapping[str, Any], seed: int, session_id: str | None = None
    ) -> SessionRecord:
        """A RUNNING record with no output yet, stamped now, under a fresh id unless one is given."""
        now = time.time()
        return cls(
            session_id=session_id if session_id is not None else new_session_id(),
            prompt_ids=tuple(prompt_ids),
            output_ids=(),
            params=dict(params),
            seed=seed,
            status=SessionStatus.RUNNING,
            finish_reason="",
            counters=SpecCounters(),
            created_at=now,
            updated_at=now,
        )


def check_record(record: SessionRecord) -> None:
    """Checks a store applies before writing a record; raises InvalidRequest."""
    check_session_id(record.session_id)
    if not isinstance(record.seed, int) or isinstance(record.seed, bool):
        raise InvalidRequest(f"session seed must be an int, got {record.seed!r}")
    if not isinstance(record.status, SessionStatus):
        raise InvalidRequest(f"session status must be a SessionStatus, got {record.status!r}")
    if not isinstance(record.counters, SpecCounters):
        raise InvalidRequest(f"session counters must be SpecCounters, got {record.counters!r}")
    if not isinstance(record.finish_reason, str):
        raise InvalidRequest(f"session finish_reason must be a str, got {record.finish_reason!r}")
    for name in ("created_at", "updated_at"):
        value = getattr(record, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise InvalidRequest(f"session {name} must be a finite number, got {value!r}")


def check_finish(status: SessionStatus, finish_reason: str) -> None:
    if not isinstance(status, SessionStatus) or status is SessionStatus.RUNNING:
        raise InvalidRequest(f"a session finishes as FINISHED, CANCELLED or FAILED, not {status!r}")
    if not isinstance(finish_reason, str):
        raise InvalidRequest(f"finish_reason must be a str, got {finish_reason!r}")


CLAIMED, CLAIM_FINISHED, CLAIM_MOVED = 1, 2, 4


def new_holder() -> str:
    """A fresh fencing token for one stream of a session (see SessionStore.claim)."""
    return secrets.token_hex(8)


def check_claim(result: int, session_id: str) -> None:
    """Why a claim was refused, as the error the caller acts on."""
    if result == CLAIM_FINISHED:
        raise SessionOutOfSync(f"session {short_id(session_id)} has finished: there is nothing to continue")
    if result == CLAIM_MOVED:
        raise SessionMoved(f"session {short_id(session_id)} moved on while it was being resumed: resume again")


def commit_out_of_sync(session_id: str) -> SessionOutOfSync:
    return SessionOutOfSync(f"session {short_id(session_id)} holds another number of tokens than this commit extends")


def taken_over(session_id: str) -> SessionTakenOver:
    return SessionTakenOver(f"session {short_id(session_id)} was resumed by a newer stream; this one has ended "
                            "(read the rest from the stream that resumed it)")


@runtime_checkable
class SessionStore(Protocol):
    """Where sessions live between steps. Every write refreshes the session's TTL; reads do not.

    Writes are fenced: the stream that creates or claims a session names itself by a ``holder``
    token (`new_holder`), and a commit or finish naming another holder is refused with
    SessionTakenOver, changing nothing. So an orchestrator that was paused (SIGSTOP, a long GC, a
    partition) and wakes after its session was resumed elsewhere can never append to it. An empty
    holder is not checked (single-writer callers: tests, tools).
    """

    async def create(self, record: SessionRecord, holder: str = "") -> None:
        """Store a new session, held by ``holder``; InvalidRequest if one with that id exists, unless
        ``holder`` (non-empty) holds it: a retried create whose first reply was lost changes nothing."""
        ...

    async def commit(self, session_id: str, new_output_ids: Sequence[int], counters: SpecCounters,
                     step_ks: Sequence[int] = (), holder: str = "", after: int | None = None) -> None:
        """Append `new_output_ids` to the output, `step_ks` (the speculation lengths of the steps that
        committed them) to the schedule, and replace the counters with these totals.

        ``after``: the output length this commit extends. Given, the commit is idempotent: repeated
        after it landed (a retry whose first reply was lost) it changes nothing; SessionOutOfSync if the
        output is any other length. SessionNotFound if the session is missing or expired;
        SessionTakenOver if another holds it.
        """
        ...

    async def finish(self, session_id: str, status: SessionStatus, finish_reason: str, holder: str = "") -> None:
        """Set the final status and reason; SessionNotFound if missing, SessionTakenOver if another holds it."""
        ...

    async def abandon_stale(self, lease_s: float, limit: int = 256) -> list[str]:
        """Mark running sessions that committed nothing for ``lease_s`` failed ("orchestrator lost"): a
        record never stays running after its orchestrator died. Returns their ids."""
        ...

    async def claim(self, session_id: str, output_len: int, holder: str) -> None:
        """Take a session over to continue it, atomically: ``holder`` holds it from now on and it is
        running again, unless it has finished or no longer holds ``output_len`` tokens (each refusal
        is SessionOutOfSync saying which). A stream still writing to it is fenced off: the newest
        stream of a session wins, so a client never waits for a lease to lapse to resume."""
        ...

    async def get(self, session_id: str) -> SessionRecord:
        """The session as last written; SessionNotFound if missing or expired."""
        ...

    async def delete(self, session_id: str) -> None:
        """Remove the session; no error if it is already gone."""
        ...

    async def close(self) -> None:
        """Release the store's resources."""
        ...


@dataclass
class _Entry:
    record: SessionRecord  # output_ids left empty: the tokens live in `output`
    params_json: str  # params as stored, decoded afresh on each get, as from Redis
    output: list[int]  # a list so commit appends in O(new tokens)
    step_ks: list[int]
    expires_at: float  # on the store's monotonic clock
    holder: str = ""


class InMemorySessionStore:
    """The embedded store: a dict in this process, TTL applied lazily on access.

    No method awaits between reading and writing the dict, so each call is atomic under asyncio.
    `clock` is monotonic seconds, injectable for tests.
    """

    def __init__(self, ttl_s: float = 3600, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        self._ttl_s = float(ttl_s)
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._next_sweep = clock() + self._ttl_s

    def _live(self, session_id: str) -> _Entry:
        entry = self._entries.get(check_session_id(session_id))
        if entry is None:
            raise SessionNotFound(f"no session {short_id(session_id)}")
        if entry.expires_at <= self._clock():
            del self._entries[session_id]
            raise SessionNotFound(f"session {short_id(session_id)} expired")
        return entry

    def _sweep(self, now: float) -> None:
        # Sessions nobody reads again would otherwise stay forever; sweep at most once per TTL.
        if now >= self._next_sweep:
            for sid in [sid for sid, e in self._entries.items() if e.expires_at <= now]:
                del self._entries[sid]
            self._next_sweep = now + self._ttl_s

    async def create(self, record: SessionRecord, holder: str = "") -> None:
        check_record(record)
        params_json = params_to_json(record.params)
        output = list(unpack_ids(pack_ids(record.output_ids)))  # validates the ids as Redis would
        pack_ids(record.prompt_ids)
        now = self._clock()
        self._sweep(now)
        try:
            existing = self._live(record.session_id)
        except SessionNotFound:
            pass
        else:
            if holder and existing.holder == holder:
                existing.expires_at = now + self._ttl_s
                return
            raise InvalidRequest(f"session {short_id(record.session_id)} already exists")
        self._entries[record.session_id] = _Entry(
            record=replace(record, prompt_ids=tuple(record.prompt_ids), output_ids=()),
            params_json=params_json,
            output=output,
            step_ks=list(unpack_ks(pack_ks(record.step_ks))),
            expires_at=now + self._ttl_s,
            holder=holder,
        )

    def _held(self, session_id: str, holder: str) -> _Entry:
        entry = self._live(session_id)
        if holder and entry.holder != holder:
            raise taken_over(session_id)
        return entry

    async def commit(self, session_id: str, new_output_ids: Sequence[int], counters: SpecCounters,
                     step_ks: Sequence[int] = (), holder: str = "", after: int | None = None) -> None:
        if not isinstance(counters, SpecCounters):
            raise InvalidRequest(f"counters must be SpecCounters, got {counters!r}")
        new_ids = unpack_ids(pack_ids(new_output_ids))
        new_ks = unpack_ks(pack_ks(step_ks))
        entry = self._held(session_id, holder)
        if after is not None:
            if new_ids and len(entry.output) == after + len(new_ids):
                return  # landed already
            if len(entry.output) != after:
                raise commit_out_of_sync(session_id)
        entry.output.extend(new_ids)
        entry.step_ks.extend(new_ks)
        entry.record = replace(entry.record, counters=counters, updated_at=time.time())
        entry.expires_at = self._clock() + self._ttl_s

    async def abandon_stale(self, lease_s: float, limit: int = 256) -> list[str]:
        cutoff, marked = time.time() - lease_s, []
        for session_id, entry in list(self._entries.items()):
            record = entry.record
            if record.status is SessionStatus.RUNNING and record.updated_at <= cutoff and entry.expires_at > self._clock():
                entry.record = replace(record, status=SessionStatus.FAILED, finish_reason="orchestrator lost",
                                       updated_at=time.time())
                marked.append(session_id)
                if len(marked) >= limit:
                    break
        return marked

    async def claim(self, session_id: str, output_len: int, holder: str) -> None:
        entry = self._live(session_id)
        if entry.record.status is SessionStatus.FINISHED:
            result = CLAIM_FINISHED
        elif len(entry.output) != output_len:
            result = CLAIM_MOVED
        else:
            entry.record = replace(entry.record, status=SessionStatus.RUNNING, finish_reason="", updated_at=time.time())
            entry.expires_at = self._clock() + self._ttl_s
            entry.holder = holder
            result = CLAIMED
        check_claim(result, session_id)

    async def finish(self, session_id: str, status: SessionStatus, finish_reason: str, holder: str = "") -> None:
        check_finish(status, finish_reason)
        entry = self._held(session_id, holder)
        entry.record = replace(entry.record, status=status, finish_reason=finish_reason, updated_at=time.time())
        entry.expires_at = self._clock() + self._ttl_s

    async def get(self, session_id: str) -> SessionRecord:
        entry = self._live(session_id)
        return replace(entry.record, output_ids=tuple(entry.output), params=params_from_json(entry.params_json),
                       step_ks=tuple(entry.step_ks))

    async def delete(self, session_id: str) -> None:
        self._entries.pop(check_session_id(session_id), None)

    async def close(self) -> None:
        self._entries.clear()
