"""The gRPC Drafter: decode -> call the engine -> encode. Nothing else lives here."""
from __future__ import annotations

import grpc

from specdec.draft.engine import AsyncDraftEngine
from specdec.rpc import wire
from specdec.rpc.status import rpc_errors
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: AsyncDraftEngine) -> None:
        self.engine = engine

    @rpc_errors
    async def OpenSession(self, request: common_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext) -> common_pb2.OpenSessionResponse:
        return common_pb2.OpenSessionResponse(prefill_time_ns=await self.engine.open(wire.spec_from_pb(request)))

    @rpc_errors
    async def Draft(self, request: drafter_pb2.DraftRequest, context: grpc.aio.ServicerContext) -> drafter_pb2.DraftResponse:
        proposal = await self.engine.draft(request.session_id, wire.sync_from_pb(request.sync), request.num_speculative_tokens)
        return wire.proposal_to_pb(proposal)

    @rpc_errors
    async def CloseSession(self, request: common_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext) -> common_pb2.CloseSessionResponse:
        return common_pb2.CloseSessionResponse(existed=await self.engine.close(request.session_id))

    @rpc_errors
    async def GetWorkerStatus(self, request: common_pb2.WorkerStatusRequest, context: grpc.aio.ServicerContext) -> common_pb2.WorkerStatus:
        return wire.worker_info_to_pb(await self.engine.status())


def register(engine: AsyncDraftEngine):
    return lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(engine), server)
