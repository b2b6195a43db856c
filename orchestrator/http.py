"""The OpenAI-compatible HTTP API, beside gRPC on the same orchestrator (docs/http-api.md).

``POST /v1/completions``, ``POST /v1/chat/completions`` (unary, or server-sent events with
``stream: true``), ``GET /v1/models``, ``GET /health``. A thin edge, as the gRPC servicer is: check
the key, read the body within its limit, convert (http_convert.py), run the very same Orchestrator
(one validation, one admission line, one session store, one set of limits), encode. Errors are
OpenAI's error JSON with the matching status, never a traceback.

Streams resume: every event carries ``id: <session id>:<tokens so far>``; the same request sent again
to any orchestrator with a ``Last-Event-ID`` header continues it after those tokens (the rule of
``ResumeStream``: only for the key that made the session; the newest stream wins).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specdec.core import errors
from specdec.core.sessions import check_session_id
from specdec.orchestrator.http_convert import (ApiRequest, InvalidText, PositionStats, ResponseShape, check_text, request_from_json,
                                               spec_decode_json)
from specdec.orchestrator.loop import Chunk, Orchestrator
from specdec.rpc.auth import Credentials, authenticate, bearer
from specdec.rpc.status import details_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP API of one orchestrator. Built once, passed explicitly."""

    model_name: str  # what /v1/models lists and requests name (the target's)
    max_body_bytes: int = 4 << 20  # a request body over this is refused before it is parsed: 413
    retry_after_s: int = 1  # told to a client refused for capacity (429) or while draining (503)


# (status, OpenAI error type, code) per core error, the most specific first (as specdec.rpc.status).
_ERRORS: dict[type[errors.SpecdecError], tuple[int, str, str]] = {
    errors.InvalidRequest: (400, "invalid_request_error", "invalid_request"),
    errors.SessionNotFound: (404, "not_found_error", "session_not_found"),
    errors.SessionOutOfSync: (409, "conflict_error", "resume_again"),
    errors.SessionTakenOver: (409, "conflict_error", "taken_over"),
    errors.Overloaded: (429, "rate_limit_error", "over_capacity"),
    errors.WorkerUnavailable: (503, "server_error", "workers_unavailable"),
    errors.StoreUnavailable: (503, "server_error", "session_store_unavailable"),
    errors.DeadlineExceeded: (504, "server_error", "deadline_exceeded"),
}


class ApiError(Exception):
    """An HTTP error answer: status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type_: str, code: str, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(self.body(), self.status, headers=headers)


def api_error(exc: errors.SpecdecError, retry_after_s: int = 1) -> ApiError:
    """The HTTP answer for a core error (an unmapped one is a 500 whose message says what, not where)."""
    param = exc.field if isinstance(exc, InvalidText) else None
    for cls in type(exc).__mro__:
        if cls in _ERRORS:
            status, type_, code = _ERRORS[cls]
            return ApiError(status, details_for(exc), type_, code, param=param,
                            retry_after_s=retry_after_s if status in (429, 503) else None)
    return ApiError(500, details_for(exc), "server_error", "internal_error")


def _sse(event_id: str, data: str) -> bytes:
    return f"id: {event_id}\ndata: {data}\n\n".encode()


class HttpApi:
    """The routes, over one Orchestrator. ``credentials``: the API keys (the gRPC API's own)."""

    def __init__(self, orchestrator: Orchestrator, config: HttpConfig, credentials: Credentials = Credentials()) -> None:
        self.orch, self.config, self.credentials = orchestrator, config, credentials
        self.draining = False  # set when the orchestrator drains: new requests get 503
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_exception, Exception: self._unexpected})

    # ------------------------------------------------------------------ edges
    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error",
                        code).response()

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        request_id = secrets.token_hex(8)
        log.error("HTTP %s %s failed (request id %s)", request.method, request.url.path, request_id, exc_info=exc)
        return ApiError(500, f"internal error (request id {request_id}, in the server's log)", "server_error",
                        "internal_error").response()

    def _owner(self, request: Request) -> str:
        """The caller's principal; 401 without an accepted key (the same keys and hashing as gRPC)."""
        header = request.headers.get("authorization")
        metadata = [("authorization", header)] if header is not None else []
        owner = authenticate(metadata, self.credentials)
        if owner is None:
            why = ("missing API key: send the header `Authorization: Bearer <key>`" if bearer(metadata) is None
                   else "invalid API key: the key is not accepted here")
            raise ApiError(401, why, "authentication_error", "invalid_api_key")
        return owner

    def _open(self) -> None:
        if self.draining:
            raise ApiError(503, "this orchestrator is draining: send the request to another replica", "server_error",
                           "draining", retry_after_s=self.config.retry_after_s)

    async def _body(self, request: Request):
        """The JSON body, refused with 413 past the limit before it is parsed: by its declared
        Content-Length, and by counting the bytes as they arrive (chunked bodies declare none)."""
        limit = self.config.max_body_bytes
        too_large = ApiError(413, f"the request body is over {limit} bytes, this server's limit", "invalid_request_error",
                             "request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, "Content-Length is not a number", "invalid_request_error", "invalid_request")
            if int(declared) > limit:
                raise too_large
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
        if not parts:
            return {}  # no body: each field's own check says what is missing
        raw = b"".join(parts)
        encoding = json.detect_encoding(raw)  # UTF-8, or the UTF-16/32 that json.loads reads too
        escaped = False
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError as exc:
            if not encoding.startswith("utf-8"):
                raise ApiError(400, f"the body is not valid {encoding}: {details_for(exc)}; send UTF-8 JSON",
                               "invalid_request_error", "invalid_json") from None
            # Parsed all the same, so that the 400 can name the field that holds the bytes (check_text).
            text, escaped = raw.decode(encoding, "surrogateescape"), True
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise ApiError(400, f"the body is not JSON: {details_for(exc)}", "invalid_request_error", "invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the body is not JSON this server reads: it nests too deeply", "invalid_request_error",
                           "invalid_json") from None
        if escaped:
            check_text(body, bytes_escaped=True)
        return body

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise ApiError(404, f"model {model[:64]!r} is not served here; this server serves {self.config.model_name!r}",
                           "not_found_error", "model_not_found", param="model")

    # ------------------------------------------------------------------ routes
    async def health(self, request: Request) -> Response:
        if self.draining:
            return ApiError(503, "draining", "server_error", "draining", retry_after_s=self.config.retry_after_s).response()
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        try:
            self._open()
            self._owner(request)
        except ApiError as exc:
            return exc.response()
        target = self.orch.target
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": 0, "owned_by": "specdec",
            "max_model_len": target.context_length, "drafters": list(target.drafters)}]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            self._open()
            owner = self._owner(request)
            body = await self._body(request)
            resume = request.headers.get("last-event-id")
            if resume is not None:
                return await self._resume(resume, owner, body, chat)
            api = request_from_json(body, self.orch.config, chat)
            self._check_model(api.model)
            generation = replace(api.generation, owner=owner)
            if chat:
                generation = replace(generation, prompt_ids=await self._template(api))
            shape = ResponseShape(chat, self.config.model_name)
            drafter = generation.drafter or self.orch.config.default_drafter
            chunks = self.orch.generate(generation)
            if api.stream:
                return await self._stream(chunks, shape, drafter, api.include_usage)
            whole = await self._whole(request, chunks, shape, drafter)
            return JSONResponse(whole) if whole is not None else Response(status_code=499)  # nobody is listening
        except ApiError as exc:
            return exc.response()
        except errors.SpecdecError as exc:
            return api_error(exc, self.config.retry_after_s).response()
        except Exception as exc:  # a bug: answered here (the app-level handler would re-raise it into uvicorn)
            return await self._unexpected(request, exc)

    async def _template(self, api: ApiRequest) -> tuple[int, ...]:
        """The chat prompt, built with the tokenizer's chat template off the event loop."""
        tokenizer = self.orch.target.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"model {self.config.model_name!r} has no chat template: use /v1/completions with a prompt",
                           "invalid_request_error", "no_chat_template", param="messages")

        def render() -> tuple[int, ...]:
            try:
                text = tokenizer.apply_chat_template(list(api.messages), add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # jinja's TemplateError (raise_exception in the template), a type error, ...
                raise errors.InvalidRequest(f"the chat template refused the messages: {exc}") from None
            if len(text.encode("utf-8", "surrogatepass")) > self.orch.config.max_prompt_bytes:
                raise errors.InvalidRequest(f"the templated prompt is over {self.orch.config.max_prompt_bytes} bytes, "
                                            "this server's limit: send shorter messages")
            # The template writes its special tokens as text: do not add them a second time.
            return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

        return await asyncio.to_thread(render)

    async def _whole(self, request: Request, chunks: AsyncIterator[Chunk], shape: ResponseShape, drafter: str) -> dict | None:
        """Run a unary request to its end; a client that hangs up cancels it (as gRPC's cancellation does)."""
        async def run() -> dict:
            ids: list[int] = []
            text: list[str] = []
            positions = PositionStats()
            last = None
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    ids.extend(chunk.token_ids)
                    text.append(chunk.text)
                    positions.add(chunk)
                    last = chunk
            assert last is not None and last.finish_reason is not None
            shape.session_id = last.session_id
            stats = spec_decode_json(last.counters, positions, drafter, last.last_num_speculative_tokens)
            return shape.whole(last, tuple(ids), "".join(text), stats)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(run()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        if not work.done() or work.cancelled():  # the client went away: the request is cancelled, as over gRPC
            await asyncio.gather(work, return_exceptions=True)
            return None
        return work.result()

    async def _stream(self, chunks: AsyncIterator[Chunk], shape: ResponseShape, drafter: str, include_usage: bool,
                      received: int = 0) -> Response:
        """Server-sent events. The first chunk is awaited here, so a request refused before it
        streams anything (bad input, over capacity) gets its own status, not a 200 and an error event."""
        try:
            first = await anext(chunks)
        except BaseException:
            await chunks.aclose()
            raise
        shape.session_id = first.session_id

        async def events() -> AsyncIterator[bytes]:
            positions = PositionStats()
            chunk, event_id = first, f"{first.session_id}:{received}"
            try:
                is_first = True
                while True:
                    positions.add(chunk)
                    event_id = f"{chunk.session_id}:{chunk.completion_tokens}"
                    stats = None
                    if chunk.finish_reason is not None:
                        stats = spec_decode_json(chunk.counters, positions, drafter, chunk.last_num_speculative_tokens)
                    yield _sse(event_id, json.dumps(shape.chunk(chunk, is_first, stats)))
                    is_first = False
                    if chunk.finish_reason is not None:
                        await chunks.aclose()  # the admission slot is free before the client hears [DONE]
                        if include_usage:
                            yield _sse(event_id, json.dumps(shape.usage_chunk(chunk, stats)))
                        yield _sse(event_id, "[DONE]")
                        return
                    chunk = await anext(chunks)
            except errors.SpecdecError as exc:  # mid-stream: the status is sent; say why in an event, no [DONE]
                yield _sse(event_id, json.dumps(api_error(exc, self.config.retry_after_s).body()))
            except StopAsyncIteration:
                return
            except Exception as exc:  # a bug: logged with its traceback, the client gets a request id
                request_id = secrets.token_hex(8)
                log.error("HTTP stream failed (request id %s)", request_id, exc_info=exc)
                yield _sse(event_id, json.dumps(ApiError(500, f"internal error (request id {request_id})", "server_error",
                                                         "internal_error").body()))
            finally:
                await chunks.aclose()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _resume(self, last_event_id: str, owner: str, body, chat: bool) -> Response:
        """The rest of a stream after ``Last-Event-ID`` (``<session id>:<tokens received>``)."""
        session_id, _, count = last_event_id.strip().rpartition(":")
        if not count.isdigit() or len(count) > 9:
            raise ApiError(400, "Last-Event-ID must be <session id>:<tokens received>, as the stream's events name it",
                           "invalid_request_error", "invalid_last_event_id")
        check_session_id(session_id)
        options = body.get("stream_options") if isinstance(body, dict) else None
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        record = await self.orch.session(session_id, owner)  # 404 for anyone but its owner
        drafter = str(record.params.get("drafter", ""))
        shape = ResponseShape(chat, self.config.model_name, session_id)
        return await self._stream(self.orch.resume(session_id, owner, int(count)), shape, drafter, include_usage, int(count))
