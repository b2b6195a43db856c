"""DraftWorker / VerifyWorker over gRPC: the orchestrator's side of the internal hops."""
from __future__ import annotations

import contextvars
import time

import grpc

from specdec.core.steps import DraftProposal, SequenceSync, SessionSpec, VerifyOutcome, WorkerInfo
from specdec.rpc import wire
from specdec.rpc.server import CHANNEL_OPTIONS
from specdec.rpc.status import raise_for
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2_grpc


# Absolute deadline (time.monotonic) of the client request being served, set by the Generation
# servicer; worker calls made on its behalf get no more time than the client has left.
request_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_deadline", default=None)


class _Remote:
    """What both workers share: OpenSession, CloseSession, GetWorkerStatus (subclasses set ``_stub``)."""

    _stub: drafter_pb2_grpc.DrafterStub | verifier_pb2_grpc.VerifierStub

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self._timeout = timeout_s
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)

    async def _call(self, method, request, within_deadline: bool = True):
        timeout = self._timeout
        deadline = request_deadline.get() if within_deadline else None
        if deadline is not None:
            timeout = min(timeout, max(0.001, deadline - time.monotonic()))
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise_for(err, f"{type(self).__name__.removeprefix('Remote')} at {self.address}")

    async def open(self, spec: SessionSpec) -> int:
        return (await self._call(self._stub.OpenSession, wire.spec_to_pb(spec))).prefill_time_ns

    async def close(self, session_id: str) -> bool:
        # Cleanup outlives the request: an expired client deadline must not stop the release.
        req = common_pb2.CloseSessionRequest(session_id=session_id)
        return (await self._call(self._stub.CloseSession, req, within_deadline=False)).existed

    async def status(self) -> WorkerInfo:
        return wire.worker_info_from_pb(await self._call(self._stub.GetWorkerStatus, common_pb2.WorkerStatusRequest()))

    async def aclose(self) -> None:
        await self._channel.close()


class RemoteDraftWorker(_Remote):
    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        super().__init__(address, timeout_s)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)

    async def draft(self, session_id: str, sync: SequenceSync, num_speculative_tokens: int) -> DraftProposal:
        req = drafter_pb2.DraftRequest(session_id=session_id, sync=wire.sync_to_pb(sync), num_speculative_tokens=num_speculative_tokens)
        return wire.proposal_from_pb(await self._call(self._stub.Draft, req))


class RemoteVerifyWorker(_Remote):
    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        super().__init__(address, timeout_s)
        self._stub = verifier_pb2_grpc.VerifierStub(self._channel)

    async def verify(self, session_id: str, sync: SequenceSync, proposal: DraftProposal) -> VerifyOutcome:
        return wire.outcome_from_pb(await self._call(self._stub.Verify, wire.verify_request_to_pb(session_id, sync, proposal)))
