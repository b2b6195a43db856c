"""Errors the core raises; each servicer maps them to one gRPC status (see specdec.core.errors.STATUS)."""
from __future__ import annotations


class SpecdecError(Exception):
    """Base class: every error a caller can act on. The message says what to fix."""


class InvalidRequest(SpecdecError):
    """Bad input from the caller (maps to INVALID_ARGUMENT)."""


class SessionAlreadyOpen(InvalidRequest):
    """A worker already holds a session with this id (maps to INVALID_ARGUMENT)."""


class SessionNotFound(SpecdecError):
    """No session with that id on this worker or in the store (maps to NOT_FOUND)."""


class SessionOutOfSync(SpecdecError):
    """The caller's view of a session's committed tokens disagrees with the worker's (FAILED_PRECONDITION)."""


class SessionMoved(SessionOutOfSync):
    """The session committed more while it was being resumed: read it again (FAILED_PRECONDITION)."""


class SessionTakenOver(SpecdecError):
    """The session was resumed by a newer stream (another orchestrator or worker holds it now): this
    one must stop writing to it (maps to ABORTED)."""


class CorruptRecord(SpecdecError):
    """A stored value is corrupt or was not written by this format version (maps to DATA_LOSS)."""


class Overloaded(SpecdecError):
    """Over this process's admission limit; retry later or elsewhere (RESOURCE_EXHAUSTED)."""


class ModelMismatch(SpecdecError):
    """Two models that must share a tokenizer do not (raised at start-up)."""


class ModelNotFound(SpecdecError):
    """A model path is missing or holds no loadable model."""


class UnsupportedModel(SpecdecError):
    """A model the engine cannot serve exactly (e.g. a sliding-window cache that cannot roll back); refused at load."""


class WorkerUnavailable(SpecdecError):
    """A draft or target worker could not be reached or did not answer in time (maps to UNAVAILABLE)."""


class DeadlineExceeded(SpecdecError):
    """The request's deadline passed while it waited on a worker (maps to DEADLINE_EXCEEDED)."""


class StoreUnavailable(SpecdecError):
    """The session store (Redis) could not be reached or refused the write (maps to UNAVAILABLE)."""
