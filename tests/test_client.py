"""specdec.client.ResumingClient against real orchestrator servers (gRPC on loopback, a real Redis):
a stream whose orchestrator dies goes on on another with exactly the tokens an uninterrupted run
gives; a request that is wrong fails at once; nothing reachable fails after the retry budget."""
from __future__ import annotations

import time

import grpc
import pytest

from specdec.client import ResumingClient, StreamReport
from specdec.v1 import generation_pb2 as pb

from test_resume import replicas, stream_request  # noqa: F401  (the fixture: two orchestrators A and B)


async def collect(client: ResumingClient, request: pb.GenerateRequest, report: StreamReport, kill_after: int = 0, kill=None):
    ids, text, n = [], "", 0
    async for msg in client.stream(request, report, timeout_s=60):
        ids.extend(msg.token_ids)
        text += msg.text
        n += 1
        if n == kill_after:
            await kill()
    return ids, text, msg


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "coupled-seeded"])
async def test_a_stream_goes_on_when_its_orchestrator_dies(replicas, sampling):  # noqa: F811
    _, servers, (_, to_b) = replicas
    whole = await to_b.Generate(stream_request(**sampling), timeout=60)
    report = StreamReport()
    async with ResumingClient([s.address for s in servers]) as client:
        ids, text, last = await collect(client, stream_request(**sampling), report, 3, lambda: servers[0].stop(0))
    assert ids == list(whole.token_ids) and text == whole.text
    assert last.finish_reason == whole.finish_reason and last.usage.completion_tokens == 120
    assert len(report.failovers) == 1 and report.address == servers[1].address
    failover = report.failovers[0]
    # (How long the pause was is the benchmark's to measure: benchmarks/fault_inject.py.)
    assert failover.code == "UNAVAILABLE" and 0 < failover.received < 120


def counting_attempts(client: ResumingClient) -> list[str]:
    """The orchestrator address of every call the client makes (each attempt picks a stub)."""
    addresses: list[str] = []
    real = client._stub

    def stub(report):
        chosen = real(report)
        addresses.append(report.address)
        return chosen

    client._stub = stub
    return addresses


async def test_a_wrong_request_fails_at_once_without_retries(replicas):  # noqa: F811
    _, servers, _ = replicas
    report = StreamReport()
    async with ResumingClient([s.address for s in servers]) as client:
        attempts = counting_attempts(client)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(client, pb.GenerateRequest(text="", max_new_tokens=4), report)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(attempts) == 1 and not report.failovers  # one call: a wrong request is never retried


async def test_nothing_reachable_fails_after_the_retry_budget():
    from redis_server import free_port

    report = StreamReport()
    async with ResumingClient([f"127.0.0.1:{free_port()}"], retry_for_s=0.5) as client:
        attempts = counting_attempts(client)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(client, pb.GenerateRequest(text="x", max_new_tokens=4), report)  # (a 60 s deadline: no hang)
    # It kept trying for the whole budget (a lower bound the clock guarantees), then gave up with
    # the last error, not with its own deadline.
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started >= 0.5 and len(attempts) > 1
