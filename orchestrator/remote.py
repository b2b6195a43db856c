"""The orchestrator's side of the internal hops over gRPC: run sessions on a verifier, ask workers about themselves."""
from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator

import grpc

from specdec.core.errors import WorkerUnavailable
from specdec.core.steps import SessionRun, StepCommit, WorkerInfo
from specdec.rpc import wire
from specdec.rpc.auth import call_metadata
from specdec.rpc.tls import TlsFiles, internal_channel
from specdec.rpc.status import raise_for
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

# Absolute deadline (time.monotonic) of the client request being served, set by the Generation
# servicer; worker calls made on its behalf get no more time than the client has left.
request_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_deadline", default=None)


def _timeout(limit_s: float | None) -> float | None:
    deadline = request_deadline.get()
    if deadline is None:
        return limit_s
    left = max(0.001, deadline - time.monotonic())
    return left if limit_s is None else min(limit_s, left)


class RemoteWorker:
    """GetWorkerStatus of a draft or target worker (``kind`` picks the stub)."""

    def __init__(self, address: str, kind: str, timeout_s: float = 30.0, service_token: str | None = None,
                 tls: TlsFiles | None = None, server_name: str | None = None) -> None:
        self.address = address
        self._timeout = timeout_s
        self._metadata = call_metadata(service_token)
        self._channel = internal_channel(address, tls, server_name)
        stub = drafter_pb2_grpc.DrafterStub if kind == "draft" else verifier_pb2_grpc.VerifierStub
        self._stub = stub(self._channel)
        self._name = "Drafter" if kind == "draft" else "Verifier"

    async def status(self) -> WorkerInfo:
        try:
            reply = await self._stub.GetWorkerStatus(common_pb2.WorkerStatusRequest(), timeout=_timeout(self._timeout),
                                                     metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise_for(err, f"{self._name} at {self.address}")
        return wire.worker_info_from_pb(reply)

    async def aclose(self) -> None:
        await self._channel.close()


class RemoteVerifyWorker(RemoteWorker):
    """The VerifyWorker protocol over the Verifier's Generate stream."""

    def __init__(self, address: str, timeout_s: float = 30.0, service_token: str | None = None,
                 tls: TlsFiles | None = None, step_timeout_s: float | None = None, server_name: str | None = None) -> None:
        """``timeout_s``: for the first step (it includes the prefill, and a wait for KV room);
        ``step_timeout_s``: for every later one (default: the same)."""
        super().__init__(address, "target", timeout_s, service_token, tls, server_name)
        self._step_timeout = step_timeout_s or timeout_s

    async def run(self, run: SessionRun) -> AsyncIterator[StepCommit]:
        call = self._stub.Generate(wire.run_to_pb(run), timeout=_timeout(None), metadata=self._metadata)
        limit = self._timeout
        try:
            while True:
                # A worker that stops answering is as good as gone (a pool moves the session on).
                try:
                    msg = await asyncio.wait_for(call.read(), limit)
                except asyncio.TimeoutError:
                    raise WorkerUnavailable(f"Verifier at {self.address}: no step within {limit:g}s") from None
                limit = self._step_timeout
                if msg is grpc.aio.EOF:
                    return
                yield wire.commit_from_pb(msg)
        except grpc.aio.AioRpcError as err:
            raise_for(err, f"Verifier at {self.address}")
        finally:
            call.cancel()  # no-op once the stream ended; frees the session when we stop early
