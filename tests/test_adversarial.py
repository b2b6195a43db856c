"""An attacker's view, over real gRPC with TLS on (the session's ``cluster``): bytes that are no
message, messages over the size limit, inputs built to be echoed back, a store that is down, a bug
in a handler, a huge request beside a live stream, and a barrage of refusals beside a seeded
session. Each refusal: its status (never UNKNOWN), a bounded reply time, no worker session left
open, and no other session changed. The field-by-field tables are in test_bad_input.py."""
from __future__ import annotations

import asyncio
import logging
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.core.redis_store import RedisSessionStore
from specdec.orchestrator.loop import Orchestrator
from specdec.orchestrator.servicer import register
from specdec.rpc.server import MAX_MESSAGE_BYTES, ServerConfig, start_server
from specdec.v1 import common_pb2, drafter_pb2, generation_pb2 as pb

from test_bad_input import BAD_REQUESTS, REPLY_BOUND_S, wait_for_no_sessions

GARBAGE = b"\xff\xff\xff\xff\x0f\x00"  # a varint that never ends: no protobuf message parses from it

# (service role, method, request streaming, response streaming)
METHODS = [
    ("orchestrator", "/specdec.v1.Generation/Generate", False, False),
    ("orchestrator", "/specdec.v1.Generation/GenerateStream", False, True),
    ("orchestrator", "/specdec.v1.Generation/GetSession", False, False),
    ("orchestrator", "/specdec.v1.Generation/ResumeStream", False, True),
    ("target", "/specdec.v1.Verifier/Generate", False, True),
    ("target", "/specdec.v1.Verifier/GetWorkerStatus", False, False),
    ("draft", "/specdec.v1.Drafter/Speculate", True, True),
    ("draft", "/specdec.v1.Drafter/GetWorkerStatus", False, False),
]


def channel_for(cluster, role: str) -> grpc.aio.Channel:
    if role == "orchestrator":
        return cluster.client_channel()
    return cluster.worker_channel(cluster.servers[0 if role == "draft" else 1].address)


async def raw_call(channel: grpc.aio.Channel, method: str, streams_in: bool, streams_out: bool, payload: bytes) -> None:
    """Send ``payload`` as the request's bytes, unparsed; read the whole reply."""
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[(streams_in, streams_out)]
    call_ = kind(method)  # no serializers: bytes in, bytes out

    async def one():
        yield payload

    call = call_(one() if streams_in else payload, timeout=REPLY_BOUND_S * 2)
    if streams_out:
        async for _ in call:
            pass
    else:
        await call


@pytest.mark.parametrize("role, method, streams_in, streams_out", METHODS, ids=[m[1].rsplit(".", 1)[1] for m in METHODS])
async def test_bytes_that_are_no_message_are_invalid_argument(cluster, role, method, streams_in, streams_out):
    async with channel_for(cluster, role) as channel:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw_call(channel, method, streams_in, streams_out, GARBAGE)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "not a valid protobuf message" in err.value.details()
    assert time.monotonic() - started < REPLY_BOUND_S
    assert await wait_for_no_sessions(cluster) == (0, 0)


@pytest.mark.parametrize("role, method, streams_in, streams_out", [METHODS[0], METHODS[3], METHODS[5]],
                         ids=["Generation.Generate", "Verifier.Generate", "Drafter.Speculate"])
async def test_a_message_over_the_size_limit_is_resource_exhausted(cluster, role, method, streams_in, streams_out):
    async with channel_for(cluster, role) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw_call(channel, method, streams_in, streams_out, b"\x00" * (MAX_MESSAGE_BYTES + 1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await wait_for_no_sessions(cluster) == (0, 0)


async def test_what_an_error_echoes_back_is_bounded(cluster):
    """Inputs made to be echoed: a 100 KB drafter name on the internal hop, a 100 KB session id."""
    huge = "x" * 100_000
    async with cluster.worker_channel(cluster.servers[0].address) as channel:
        from specdec.v1 import drafter_pb2_grpc

        async def opening():
            yield drafter_pb2.SpeculateRequest(open=common_pb2.OpenSessionRequest(
                session_id="ab" * 16, prompt_token_ids=[1, 2, 3], drafter=huge, sampling=common_pb2.SamplingParams(seed=1)))

        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in drafter_pb2_grpc.DrafterStub(channel).Speculate(opening(), timeout=10):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown drafter" in err.value.details()
    assert len(err.value.details()) <= 600
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.stub.GetSession(pb.GetSessionRequest(session_id=huge), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.value.details()) <= 600


async def test_a_store_that_is_down_is_unavailable_with_what_to_do(cluster):
    live = cluster.orchestrator
    dead = RedisSessionStore.from_url("redis://127.0.0.1:1/0")  # nothing listens on port 1
    orch = Orchestrator(live.target, live.verifier, dead, live.config, live.drafter_address)
    server = await start_server(ServerConfig("127.0.0.1", 0), register(orch), ["specdec.v1.Generation"])
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            from specdec.v1 import generation_pb2_grpc

            stub = generation_pb2_grpc.GenerationStub(channel)
            for attempt in (lambda: stub.Generate(pb.GenerateRequest(text="def f():", max_new_tokens=3), timeout=10),
                            lambda: stub.GetSession(pb.GetSessionRequest(session_id="ab" * 16), timeout=10)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await attempt()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                assert "session store is unavailable" in err.value.details() and "127.0.0.1:1" not in err.value.details()
    finally:
        await server.stop(0)
        await dead.close()
    assert await wait_for_no_sessions(cluster) == (0, 0)


async def test_a_bug_in_a_handler_is_internal_with_a_request_id_in_the_log(cluster, monkeypatch, caplog):
    async def broken(session_id, owner):
        raise RuntimeError("a detail the client must not see")

    monkeypatch.setattr(cluster.orchestrator, "session", broken)
    with caplog.at_level(logging.ERROR, logger="specdec.rpc.last_resort"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cluster.stub.GetSession(pb.GetSessionRequest(session_id="ab" * 16), timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "must not see" not in err.value.details()
    request_id = re.search(r"request id ([0-9a-f]{12})", err.value.details()).group(1)
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback is in the log under that id


async def test_a_huge_request_does_not_stall_another_stream_or_health(cluster):
    """While one client streams, another sends prompts at the byte cap and an id list at its cap;
    the stream's largest gap between chunks and a health check's latency stay small."""
    cap = cluster.orchestrator.config.max_prompt_bytes
    huge_text = ("def f(x):\n    return x\n" * (cap // 24))[:cap]
    huge_ids = pb.GenerateRequest(max_new_tokens=4, token_ids=pb.TokenIds(ids=[7] * cluster.orchestrator.config.max_prompt_token_ids))

    async def stream_gaps() -> float:
        gaps, last = [], time.monotonic()
        request = pb.GenerateRequest(text="def f():", max_new_tokens=120, drafter="ngram",
                                     speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED,
                                                                              num_speculative_tokens=1))
        async for _ in cluster.stub.GenerateStream(request, timeout=60):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        return max(gaps[1:])  # the first chunk waits for the prefill

    async def attack() -> list[grpc.StatusCode]:
        codes = []
        async with cluster.client_channel() as channel:
            from specdec.v1 import generation_pb2_grpc

            stub = generation_pb2_grpc.GenerationStub(channel)
            for request in (pb.GenerateRequest(text=huge_text, max_new_tokens=4), huge_ids) * 2:
                try:
                    await stub.Generate(request, timeout=60)
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code())
        return codes

    async def health_latency() -> float:
        worst = 0.0
        async with cluster.client_channel() as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(20):
                started = time.monotonic()
                await health.Check(health_pb2.HealthCheckRequest(service="specdec.v1.Generation"), timeout=5)
                worst = max(worst, time.monotonic() - started)
                await asyncio.sleep(0.05)
        return worst

    quiet_gap = await stream_gaps()
    gap, codes, health = await asyncio.gather(stream_gaps(), attack(), health_latency())
    print(f"largest gap between chunks: quiet {quiet_gap * 1e3:.1f} ms, beside huge requests {gap * 1e3:.1f} ms; "
          f"slowest health check {health * 1e3:.1f} ms")
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 4  # over the context: refused, after tokenizing off the loop
    assert gap < max(0.5, 5 * quiet_gap), f"largest gap {gap:.3f}s beside the huge requests (quiet: {quiet_gap:.3f}s)"
    assert health < 0.5, f"a health check took {health:.3f}s"


async def test_refusals_beside_a_seeded_session_leave_its_output_unchanged(cluster):
    seeded = pb.GenerateRequest(text="def fib(n):", max_new_tokens=24, drafter="model",
                                sampling=common_pb2.SamplingParams(temperature=1.0, seed=1234))
    alone = await cluster.stub.Generate(seeded, timeout=60)

    async def barrage() -> None:
        for _, make, _ in BAD_REQUESTS:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await cluster.stub.Generate(make(), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        async with cluster.worker_channel(cluster.servers[1].address) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await raw_call(channel, "/specdec.v1.Verifier/Generate", False, True, GARBAGE)

    beside, _ = await asyncio.gather(cluster.stub.Generate(seeded, timeout=60), barrage())
    assert list(beside.token_ids) == list(alone.token_ids)
    assert await wait_for_no_sessions(cluster) == (0, 0)


async def test_session_ids_stay_out_of_logs_and_worker_errors(cluster, caplog):
    """A session id is a capability: logs at INFO and above, and errors a worker sends (which a
    verifier logs as warnings), show at most its short hash."""
    from specdec.core.sessions import short_id
    from specdec.v1 import drafter_pb2_grpc

    with caplog.at_level(logging.INFO):
        reply = await cluster.stub.Generate(pb.GenerateRequest(text="def f():", max_new_tokens=6, drafter="model"), timeout=60)
        sid = reply.session_id
        taken = "cd" * 16
        async with cluster.worker_channel(cluster.servers[0].address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            first = stub.Speculate(timeout=10)
            await first.write(drafter_pb2.SpeculateRequest(open=common_pb2.OpenSessionRequest(
                session_id=taken, prompt_token_ids=[1, 2, 3], drafter="ngram", sampling=common_pb2.SamplingParams(seed=1))))
            await first.write(drafter_pb2.SpeculateRequest(outcome=drafter_pb2.StepOutcome(committed_len=3, num_speculative_tokens=2)))
            await first.read()  # open on the drafter
            second = stub.Speculate(timeout=10)
            await second.write(drafter_pb2.SpeculateRequest(open=common_pb2.OpenSessionRequest(
                session_id=taken, prompt_token_ids=[1, 2, 3], drafter="ngram", sampling=common_pb2.SamplingParams(seed=1))))
            with pytest.raises(grpc.aio.AioRpcError) as err:  # the second open supersedes the first
                while await first.read() is not grpc.aio.EOF:
                    pass
            second.cancel()
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "newer stream" in err.value.details() and taken not in err.value.details() and short_id(taken) in err.value.details()
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert sid not in logged and taken not in logged
    assert await wait_for_no_sessions(cluster) == (0, 0)
