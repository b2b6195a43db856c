"""A client that rides out orchestrator failures: stream a generation from any of several
orchestrators and, when the stream breaks, continue it on another (or on the same one once it is
back) with ResumeStream, from the tokens already received. The caller sees every token once, in
order; a failover is only a pause.

The stream counts as broken on UNAVAILABLE (the orchestrator died, or stopped answering the
channel's keepalive pings: a frozen process is noticed within seconds), CANCELLED from the server
side (a drain that outlasted its grace), RESOURCE_EXHAUSTED (the orchestrator is at its admission
limit: the next one is asked, and once around them all, with a growing pause, bounded by
``retry_for_s``), and, once the session exists, INTERNAL or UNKNOWN (a transport reset). Anything
that says the request itself is wrong (INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, ...) is
raised at once; so is the caller's own deadline.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.rpc.auth import call_metadata
from specdec.rpc.tls import open_channel
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

log = logging.getLogger(__name__)

# Before the first message no session exists yet: only an orchestrator that is gone, going or full
# is tried again (a new Generate each time; an INTERNAL there is a server's bug, not worth repeating).
# RESOURCE_EXHAUSTED is the server's "retry later or on another replica": the next one is tried.
RETRY_START = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED})
# Once there is a session, resuming is idempotent: any break is resumed, as is a resume refused
# because a stream being fenced off still committed (read again; see SessionStore.claim).
RETRY_RESUME = RETRY_START | {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.FAILED_PRECONDITION}


@dataclass
class Failover:
    """One break of a stream and what it cost: the time from the break to the next message."""

    code: str
    received: int  # tokens received before the break
    attempts: int = 0  # resume calls until one streamed
    pause_s: float = 0.0


@dataclass
class StreamReport:
    """What happened to one stream: its session and every failover it rode out."""

    session_id: str = ""
    received: int = 0
    address: str = ""  # the orchestrator streaming it now
    failovers: list[Failover] = field(default_factory=list)


def _too_large(err: grpc.aio.AioRpcError) -> bool:
    """gRPC's own RESOURCE_EXHAUSTED for a message over its size limit: no replica would take it."""
    return err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (err.details() or "")


class ResumingClient:
    """``addresses``: orchestrators (replicas behind one API). ``retry_for_s``: how long one break
    may take to heal before the last error is raised."""

    def __init__(self, addresses: Sequence[str], credentials: grpc.ChannelCredentials | None = None,
                 api_key: str | None = None, retry_for_s: float = 60.0, backoff_s: float = 0.05) -> None:
        if not addresses:
            raise ValueError("a client needs at least one orchestrator address")
        self._channels = [open_channel(a, credentials) for a in addresses]
        self._stubs = [generation_pb2_grpc.GenerationStub(c) for c in self._channels]
        self.addresses = list(addresses)
        self._metadata = call_metadata(api_key)
        self._retry_for_s, self._backoff_s = retry_for_s, backoff_s
        self._next = 0

    def _stub(self, report: StreamReport) -> generation_pb2_grpc.GenerationStub:
        i = self._next % len(self._stubs)
        self._next += 1
        report.address = self.addresses[i]
        return self._stubs[i]

    async def stream(self, request: pb.GenerateRequest, report: StreamReport | None = None,
                     timeout_s: float | None = None) -> AsyncIterator[pb.GenerateStreamResponse]:
        """The request's messages, as GenerateStream gives them, across failovers. ``report``
        (optional) is filled in as it goes. ``timeout_s``: for the whole generation."""
        report = report if report is not None else StreamReport()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        broke: Failover | None = None
        broke_at = 0.0
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if report.session_id:
                call = self._stub(report).ResumeStream(pb.ResumeRequest(session_id=report.session_id, received_tokens=report.received),
                                                 metadata=self._metadata, timeout=left)
            else:
                call = self._stub(report).GenerateStream(request, metadata=self._metadata, timeout=left)
            try:
                async for msg in call:
                    if broke is not None:  # the first message after a break: the failover is over
                        broke.pause_s = time.monotonic() - broke_at
                        report.failovers.append(broke)
                        log.info("stream resumed after %.0f ms (%d attempts)", broke.pause_s * 1e3, broke.attempts)
                        broke = None
                    report.session_id = msg.session_id
                    report.received += len(msg.token_ids)
                    yield msg
                    if msg.finish_reason:
                        return
                return
            except grpc.aio.AioRpcError as err:
                code = err.code()
                retryable = RETRY_RESUME if report.session_id else RETRY_START
                own_deadline = deadline is not None and time.monotonic() >= deadline
                if code not in retryable or own_deadline or _too_large(err):
                    raise
                if broke is None:
                    broke, broke_at = Failover(code.name, report.received), time.monotonic()
                    log.info("stream broke after %d tokens (%s: %s); resuming", report.received, code.name, err.details())
                broke.attempts += 1
                if time.monotonic() - broke_at > self._retry_for_s:
                    raise
                # Straight to the next replica; once around all of them, wait a little (a restart).
                if broke.attempts % len(self._stubs) == 0:
                    await asyncio.sleep(min(1.0, self._backoff_s * broke.attempts))

    async def aclose(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> "ResumingClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
