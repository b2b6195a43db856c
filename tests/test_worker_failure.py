"""A worker that cannot be reached: the client gets UNAVAILABLE (retryable), never UNKNOWN, and no session leaks."""
from __future__ import annotations

import grpc
import pytest

from specdec.core.errors import WorkerUnavailable
from specdec.orchestrator.loop import Orchestrator, collect
from specdec.orchestrator.remote import RemoteDraftWorker
from specdec.orchestrator.request import GenerationRequest
from specdec.orchestrator.servicer import register
from specdec.rpc.server import start_server
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

from cluster import LOOPBACK


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_drafter_is_unavailable_and_frees_the_verifier(cluster):
    live = cluster.orchestrator
    dead = RemoteDraftWorker(f"127.0.0.1:{free_port()}", timeout_s=2)  # nothing listens there
    orch = Orchestrator(live.target, dead, live.verifier, cluster.store, live.config)
    with pytest.raises(WorkerUnavailable, match="DraftWorker at 127.0.0.1"):
        await collect(orch.generate(GenerationRequest(prompt_text="x = 1", max_new_tokens=4, drafter="ngram")))
    assert await cluster.active_sessions() == (0, 0)

    # Over gRPC the same failure is UNAVAILABLE with the worker named.
    server = await start_server(LOOPBACK, register(orch), ["specdec.v1.Generation"])
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generation_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text="x = 1", max_new_tokens=4, drafter="ngram"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "DraftWorker" in err.value.details()
    finally:
        await server.stop(0)
        await dead.aclose()
    assert await cluster.active_sessions() == (0, 0)
