"""One mapping from core errors to gRPC status codes, applied by every servicer."""
from __future__ import annotations

import functools
import logging

import grpc

from specdec.core import errors

log = logging.getLogger(__name__)

STATUS: dict[type[errors.SpecdecError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.SessionNotFound: grpc.StatusCode.NOT_FOUND,
    errors.SessionOutOfSync: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SessionTakenOver: grpc.StatusCode.ABORTED,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.CorruptRecord: grpc.StatusCode.DATA_LOSS,
    errors.ModelMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ModelNotFound: grpc.StatusCode.FAILED_PRECONDITION,
    errors.UnsupportedModel: grpc.StatusCode.FAILED_PRECONDITION,
    errors.WorkerUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


MAX_DETAILS_CHARS = 512  # an error message never echoes back more of the caller's input than this


def details_for(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= MAX_DETAILS_CHARS else text[: MAX_DETAILS_CHARS - 1] + "…"


async def abort_for(context: grpc.aio.ServicerContext, exc: errors.SpecdecError):
    """End the call with the error's status and its (bounded) message."""
    await context.abort(status_for(exc), details_for(exc))


def status_for(exc: errors.SpecdecError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


def rpc_errors(method):
    """Decorate a unary servicer method: a SpecdecError aborts with its status and message."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except errors.SpecdecError as exc:
            await abort_for(context, exc)

    return wrapper


def stream_errors(method):
    """Decorate a server-streaming servicer method (an async generator) the same way."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            async for item in method(self, request, context):
                yield item
        except errors.SpecdecError as exc:
            await abort_for(context, exc)

    return wrapper


def raise_for(err: grpc.aio.AioRpcError, worker: str) -> None:
    """Client side: turn a worker's status back into the core error, so it propagates with meaning.

    Anything the worker did not report as a caller's mistake (its own crash, a lost connection)
    becomes WorkerUnavailable: the client sees UNAVAILABLE, which it may retry, never UNKNOWN.
    """
    code = err.code()
    for cls in (errors.InvalidRequest, errors.SessionNotFound, errors.SessionOutOfSync, errors.SessionTakenOver, errors.Overloaded,
                errors.DeadlineExceeded):
        if STATUS[cls] == code:
            raise cls(err.details() or code.name) from err
    raise errors.WorkerUnavailable(f"{worker}: {code.name}: {err.details()}") from err
