"""The gRPC Drafter: a Speculate stream per session, decoded into DraftEngine calls.

A session opened again while an earlier stream of it is still open here (its verifier died or
paused and the session moved) supersedes that stream, which ends with ABORTED: only verifiers open
drafter sessions and ids are unguessable, so the newest stream is the session's rightful one."""
from __future__ import annotations

import asyncio
import logging

import grpc

from specdec.core.errors import InvalidRequest, SpecdecError
from specdec.core.sessions import taken_over
from specdec.draft.engine import DraftEngine
from specdec.rpc import wire
from specdec.rpc.status import abort_for, rpc_errors
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
log = logging.getLogger(__name__)
_END = object()


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self._streams: dict[str, asyncio.Queue] = {}  # session id -> the out-queue of its current stream

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext):
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Speculate message must be `open` (the session to draft for)")
        try:
            spec = wire.spec_from_pb(first.open)
        except SpecdecError as exc:  # e.g. bad sampling parameters
            await abort_for(context, exc)
        out: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        reader = None
        earlier = self._streams.pop(spec.session_id, None)
        if earlier is not None:
            earlier.put_nowait(taken_over(spec.session_id))
            self.engine.close(spec.session_id)
        self._streams[spec.session_id] = out
        try:
            try:
                opened = self.engine.open(spec, lambda block: loop.call_soon_threadsafe(out.put_nowait, block))
                await asyncio.wrap_future(opened)
            except SpecdecError as exc:
                await abort_for(context, exc)
            reader = asyncio.ensure_future(self._read(request_iterator, spec.session_id, out))
            while True:
                item = await out.get()
                if item is _END:
                    return
                if isinstance(item, SpecdecError):
                    await abort_for(context, item)
                yield wire.block_to_pb(item)
        finally:
            if self._streams.get(spec.session_id) is out:  # a superseded stream leaves its successor alone
                del self._streams[spec.session_id]
                self.engine.close(spec.session_id)
            if reader is not None:
                reader.cancel()

    async def _read(self, request_iterator, session_id: str, out: asyncio.Queue) -> None:
        try:
            async for msg in request_iterator:
                if self._streams.get(session_id) is not out:
                    return  # superseded: the session is another stream's now
                if msg.WhichOneof("kind") != "outcome":
                    raise InvalidRequest("after `open`, every Speculate message must be an `outcome`")
                self.engine.outcome(session_id, wire.outcome_from_pb(msg.outcome))
            out.put_nowait(_END)  # the verifier closed its side: the session is over
        except SpecdecError as exc:
            out.put_nowait(exc)

    @rpc_errors
    async def GetWorkerStatus(self, request: common_pb2.WorkerStatusRequest, context: grpc.aio.ServicerContext) -> common_pb2.WorkerStatus:
        return wire.worker_info_to_pb(self.engine.status())


def register(engine: DraftEngine):
    return lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(engine), server)
