"""The gRPC Verifier: decode a SessionRequest -> run the session -> encode each step. Nothing else lives here."""
from __future__ import annotations

import grpc

from specdec.rpc import wire
from specdec.rpc.status import rpc_errors, stream_errors
from specdec.target.worker import LocalVerifier
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, verifier: LocalVerifier) -> None:
        self.verifier = verifier

    @stream_errors
    async def Generate(self, request: verifier_pb2.SessionRequest, context: grpc.aio.ServicerContext):
        async for commit in self.verifier.run(wire.run_from_pb(request)):
            yield wire.commit_to_pb(commit)

    @rpc_errors
    async def GetWorkerStatus(self, request: common_pb2.WorkerStatusRequest, context: grpc.aio.ServicerContext) -> common_pb2.WorkerStatus:
        return wire.worker_info_to_pb(await self.verifier.status())


def register(verifier: LocalVerifier):
    return lambda server: verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(verifier), server)
