"""The client-facing gRPC Generation service: decode -> run the loop -> encode."""
from __future__ import annotations

import time
from dataclasses import replace

import grpc

from specdec.core.sessions import check_session_id
from specdec.orchestrator import convert
from specdec.orchestrator.loop import Orchestrator, collect
from specdec.orchestrator.remote import request_deadline
from specdec.rpc.auth import Credentials, authenticate
from specdec.rpc.status import rpc_errors, stream_errors
from specdec.v1 import generation_pb2, generation_pb2_grpc

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, orchestrator: Orchestrator, credentials: Credentials = Credentials()) -> None:
        self.orch = orchestrator
        self.credentials = credentials  # the API keys; the server's interceptor has already checked the caller's

    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        return authenticate(context.invocation_metadata(), self.credentials) or ""

    @rpc_errors
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> generation_pb2.GenerateResponse:
        propagate_deadline(context)
        req = replace(convert.request_from_pb(request, self.orch.config), owner=self._owner(context))
        return convert.response_to_pb(*await collect(self.orch.generate(req)))

    @stream_errors
    async def GenerateStream(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        propagate_deadline(context)
        req = replace(convert.request_from_pb(request, self.orch.config), owner=self._owner(context))
        async for chunk in self.orch.generate(req):
            yield convert.chunk_to_pb(chunk)

    @stream_errors
    async def ResumeStream(self, request: generation_pb2.ResumeRequest, context: grpc.aio.ServicerContext):
        check_session_id(request.session_id)
        propagate_deadline(context)
        async for chunk in self.orch.resume(request.session_id, self._owner(context), request.received_tokens):
            yield convert.chunk_to_pb(chunk)

    @rpc_errors
    async def GetSession(self, request: generation_pb2.GetSessionRequest, context: grpc.aio.ServicerContext) -> generation_pb2.SessionInfo:
        check_session_id(request.session_id)
        return convert.record_to_pb(await self.orch.session(request.session_id, self._owner(context)))


def propagate_deadline(context: grpc.aio.ServicerContext) -> None:
    """Worker calls for this request get at most the client's remaining time (the handler's own task
    holds this context variable, so concurrent requests do not see each other's deadlines)."""
    remaining = context.time_remaining()
    request_deadline.set(None if remaining is None else time.monotonic() + remaining)


def register(orchestrator: Orchestrator, credentials: Credentials = Credentials()):
    return lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(orchestrator, credentials), server)
