"""The gRPC Verifier: decode -> call the engine -> encode. Nothing else lives here."""
from __future__ import annotations

import grpc

from specdec.rpc import wire
from specdec.rpc.status import rpc_errors
from specdec.target.engine import AsyncVerifierEngine
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: AsyncVerifierEngine) -> None:
        self.engine = engine

    @rpc_errors
    async def OpenSession(self, request: common_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext) -> common_pb2.OpenSessionResponse:
        return common_pb2.OpenSessionResponse(prefill_time_ns=await self.engine.open(wire.spec_from_pb(request)))

    @rpc_errors
    async def Verify(self, request: verifier_pb2.VerifyRequest, context: grpc.aio.ServicerContext) -> verifier_pb2.VerifyResponse:
        return wire.outcome_to_pb(await self.engine.verify(*wire.verify_request_from_pb(request)))

    @rpc_errors
    async def CloseSession(self, request: common_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext) -> common_pb2.CloseSessionResponse:
        return common_pb2.CloseSessionResponse(existed=await self.engine.close(request.session_id))

    @rpc_errors
    async def GetWorkerStatus(self, request: common_pb2.WorkerStatusRequest, context: grpc.aio.ServicerContext) -> common_pb2.WorkerStatus:
        return wire.worker_info_to_pb(await self.engine.status())


def register(engine: AsyncVerifierEngine):
    return lambda server: verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(engine), server)
