"""A DraftLink over gRPC: the verifier's end of one session's Speculate stream to a draft worker."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from specdec.core.errors import SpecdecError, WorkerUnavailable
from specdec.core.overlap import BlockInbox
from specdec.core.steps import DraftBlock, SessionSpec, StepOutcome
from specdec.rpc import wire
from specdec.rpc.auth import call_metadata
from specdec.rpc.tls import TlsFiles, internal_channel
from specdec.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)


class DraftChannels:
    """One channel per draft worker address, shared by every session of this verifier."""

    def __init__(self, service_token: str | None = None, tls: TlsFiles | None = None) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, drafter_pb2_grpc.DrafterStub]] = {}
        self.metadata = call_metadata(service_token)  # sent on every stream: drafters admit only the deployment
        self._tls = tls  # mutual TLS: our certificate is how a drafter with a CA knows us

    def stub(self, address: str, server_name: str = "") -> drafter_pb2_grpc.DrafterStub:
        key = f"{address}|{server_name}"
        if key not in self._stubs:
            channel = internal_channel(address, self._tls, server_name or None)
            self._stubs[key] = (channel, drafter_pb2_grpc.DrafterStub(channel))
        return self._stubs[key][1]

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


class RemoteDraftLink:
    def __init__(self, channels: DraftChannels, address: str, server_name: str = "") -> None:
        self.address = address
        self._stub = channels.stub(address, server_name)
        self._metadata = channels.metadata
        self._inbox = BlockInbox()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call = None
        self._tasks: list[asyncio.Task] = []

    async def open(self, spec: SessionSpec) -> None:
        # No reply to wait for: a drafter that refuses the session ends the stream with a status,
        # which the reader turns into a failed link (and the loop into plain decoding).
        self._call = self._stub.Speculate(metadata=self._metadata)
        self._outbox.put_nowait(drafter_pb2.SpeculateRequest(open=wire.spec_to_pb(spec)))
        self._tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    def send(self, outcome: StepOutcome) -> None:
        if self.up:
            self._outbox.put_nowait(wire.outcome_to_pb(outcome))

    async def next_block(self, committed: Sequence[int], timeout_s: float) -> DraftBlock | None:
        return await self._inbox.next_block(committed, timeout_s)

    @property
    def up(self) -> bool:
        return self._call is not None and self._inbox.failed is None

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()  # the drafter frees the session when its stream ends
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._inbox.fail(WorkerUnavailable("link closed"))

    async def _write(self) -> None:
        try:
            while True:
                await self._call.write(await self._outbox.get())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._inbox.fail(WorkerUnavailable(f"drafter at {self.address}: {exc}"))

    async def _read(self) -> None:
        try:
            async for msg in self._call:
                self._inbox.add(wire.block_from_pb(msg))
            self._inbox.fail(WorkerUnavailable(f"drafter at {self.address} ended the stream"))
        except SpecdecError as exc:  # an oversized block: this drafter is not to be trusted for the session
            log.warning("drafter at %s sent a bad block: %s", self.address, exc)
            self._call.cancel()
            self._inbox.fail(WorkerUnavailable(f"drafter at {self.address} sent a bad block: {exc}"))
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                log.warning("drafter at %s: %s: %s", self.address, err.code().name, err.details())
            self._inbox.fail(WorkerUnavailable(f"drafter at {self.address}: {err.code().name}: {err.details()}"))
