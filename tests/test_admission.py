"""Admission control and graceful shutdown."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.orchestrator.loop import Orchestrator
from specdec.orchestrator.request import OrchestratorConfig
from specdec.orchestrator.servicer import register
from specdec.rpc.server import start_server
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

from cluster import LOOPBACK


async def test_over_capacity_is_resource_exhausted_not_queued(cluster):
    live = cluster.orchestrator
    orch = Orchestrator(live.target, live.verifier, cluster.store, OrchestratorConfig(max_concurrent_requests=1), live.drafter_address)
    server = await start_server(LOOPBACK, register(orch), ["specdec.v1.Generation"])
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            first = stub.GenerateStream(pb.GenerateRequest(text="def f():", max_new_tokens=200, drafter="ngram"))
            await first.read()  # the first request is admitted and running
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(text="x = 1", max_new_tokens=4, drafter="ngram"))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry" in err.value.details()
            first.cancel()
    finally:
        await server.stop(0)
    for _ in range(50):
        if await cluster.active_sessions() == (0, 0):
            break
        await asyncio.sleep(0.1)
    assert await cluster.active_sessions() == (0, 0)


async def test_stop_turns_health_not_serving_before_draining(cluster):
    live = cluster.orchestrator
    server = await start_server(LOOPBACK, register(live), ["specdec.v1.Generation"])
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="specdec.v1.Generation")
        assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.ensure_future(server.stop(grace_s=1.0))
        await asyncio.sleep(0.05)
        try:
            status = (await health.Check(check, timeout=1)).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        except grpc.aio.AioRpcError as err:  # already past the grace period on a slow machine
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        await stopping


async def test_prompts_are_tokenized_off_the_event_loop(cluster, monkeypatch):
    import threading

    orch = cluster.orchestrator
    seen = []
    real = orch.tokenize

    def recording(request):
        seen.append(threading.current_thread())
        return real(request)

    monkeypatch.setattr(orch, "tokenize", recording)
    reply = await cluster.stub.Generate(pb.GenerateRequest(text="def f():", max_new_tokens=2, drafter="ngram"), timeout=30)
    assert len(reply.token_ids) == 2
    assert seen and all(t is not threading.main_thread() for t in seen), "tokenizing ran on the event loop's thread"
