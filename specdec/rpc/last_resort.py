"""The last line of error handling: nothing leaves a server as UNKNOWN.

Servicers map the errors they expect (specdec.rpc.status); anything else, a bug, reaches this
interceptor, which logs it with its traceback under a fresh request id and answers INTERNAL with
that id, so an operator can find the log line without the client learning the server's internals.
Bytes that do not decode as the method's request message (grpc would answer UNKNOWN with a Python
exception name) are INVALID_ARGUMENT, before any handler runs.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import secrets

import grpc

from specdec.core.errors import InvalidRequest, SpecdecError
from specdec.rpc.status import abort_for

log = logging.getLogger(__name__)

# What must pass through untouched: an abort a handler chose, and cancellation.
_PASS_THROUGH = (grpc.aio.AbortError, asyncio.CancelledError)


class _Undecodable:
    """What a request that failed to decode is handed on as (a deserializer cannot abort the call)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _decoding(deserializer):
    if deserializer is None:
        return None

    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError and friends: the bytes are not that message
            return _Undecodable(str(exc)[:200])

    return decode


def _undecodable_message(request: _Undecodable) -> str:
    return f"the request is not a valid protobuf message of this method ({request.why}); send the message the proto defines"


async def _checked_stream(requests):
    """The client's stream, refusing a message that did not decode (handlers map InvalidRequest)."""
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise InvalidRequest(_undecodable_message(request))
        yield request


async def _unexpected(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    if context.cancelled() or context.done():
        # The caller went away first (a verifier closing a link it no longer needs): there is no one
        # to answer, and an abort on a finished call fails. Not a bug in the handler.
        log.debug("call to %s ended by its caller before the handler's error could be sent: %r", method, exc)
        return
    if isinstance(exc, SpecdecError):  # a known error a handler let through: still its own status
        await abort_for(context, exc)
    await _internal(context, method, exc)


async def _internal(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    request_id = secrets.token_hex(6)
    log.error("request %s to %s failed unexpectedly", request_id, method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal error (request id {request_id}); the server log has the details under that id")


def _guard(behavior, method: str, streaming_request: bool, streaming_response: bool):
    async def check(request, context):
        if streaming_request:
            return _checked_stream(request)
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(request))
        return request

    if streaming_response and inspect.isasyncgenfunction(behavior):
        async def guarded_stream(request, context):
            try:
                async for item in behavior(await check(request, context), context):
                    yield item
            except _PASS_THROUGH:
                raise
            except Exception as exc:
                await _unexpected(context, method, exc)

        return guarded_stream

    async def guarded(request, context):
        try:
            return await behavior(await check(request, context), context)
        except _PASS_THROUGH:
            raise
        except Exception as exc:
            await _unexpected(context, method, exc)

    return guarded


class LastResortInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler: an unexpected exception becomes INTERNAL with a request id, logged with its traceback."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        kinds = {
            (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
            (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
            (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
            (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
        }
        attribute, make = kinds[(handler.request_streaming, handler.response_streaming)]
        behavior = _guard(getattr(handler, attribute), details.method, handler.request_streaming, handler.response_streaming)
        return make(behavior, request_deserializer=_decoding(handler.request_deserializer),
                    response_serializer=handler.response_serializer)
