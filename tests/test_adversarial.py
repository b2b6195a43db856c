"""An attacker's view, over real gRPC with TLS on (the session's ``cluster``): bytes that are no
message, messages over the size limit, inputs built to be echoed back, a store that is down, a bug
in a handler, a huge request beside a live stream, and a barrage of refusals beside a seeded
session. Each refusal: its status (never UNKNOWN), a bounded reply time, no worker session left
open, and no other session changed. The field-by-field tables are in test_bad_input.py."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import threading

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

    call = call_(one() if streams_in else payload, timeout=REPLY_BOUND_S)
    if streams_out:
        async for _ in call:
            pass
    else:
        await call


@pytest.mark.parametrize("role, method, streams_in, streams_out", METHODS, ids=[m[1].rsplit(".", 1)[1] for m in METHODS])
async def test_bytes_that_are_no_message_are_invalid_argument(cluster, role, method, streams_in, streams_out):
    async with channel_for(cluster, role) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw_call(channel, method, streams_in, streams_out, GARBAGE)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()  # before the call's deadline
    assert "not a valid protobuf message" in err.value.details()
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
    # (a short retry budget: how long a stream waits for a store is tests/test_store_retry.py's)
    orch = Orchestrator(live.target, live.verifier, dead, dataclasses.replace(live.config, store_retry_s=0.5), live.drafter_address)
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


async def test_a_huge_request_does_not_stall_another_stream_or_health(cluster, monkeypatch):
    """A prompt at the byte cap and an id list at its cap are held inside their tokenizing (on
    purpose, until the test lets go); meanwhile another client's stream runs from its first token to
    its last and health checks answer. Had the tokenizing run on the event loop, nothing else could
    run while it was held and the stream would never end. (How long such requests take is for the
    benchmarks; this asserts only what runs where.)"""
    orch = cluster.orchestrator
    cap = orch.config.max_prompt_bytes
    huge_text = ("def f(x):\n    return x\n" * (cap // 24))[:cap]
    huge_ids = pb.GenerateRequest(max_new_tokens=4, token_ids=pb.TokenIds(ids=[7] * orch.config.max_prompt_token_ids))
    release = threading.Event()
    held: list[str] = []
    real = orch.tokenize

    def held_tokenize(request):
        if len(request.prompt_text or "") >= cap // 2 or len(request.prompt_ids or ()) >= 1000:
            held.append("text" if request.prompt_text else "ids")
            assert release.wait(timeout=120), "never released"
        return real(request)

    monkeypatch.setattr(orch, "tokenize", held_tokenize)

    async def attack() -> list[grpc.StatusCode]:
        async with cluster.client_channel() as channel:
            from specdec.v1 import generation_pb2_grpc

            stub = generation_pb2_grpc.GenerationStub(channel)

            async def send(request) -> grpc.StatusCode:
                try:
                    await stub.Generate(request, timeout=180)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as err:
                    return err.code()

            return list(await asyncio.gather(send(pb.GenerateRequest(text=huge_text, max_new_tokens=4)), send(huge_ids)))

    attacking = asyncio.ensure_future(attack())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while len(held) < 2 and not attacking.done() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert sorted(held) == ["ids", "text"], f"the huge requests did not reach their tokenizing: {held}"
        request = pb.GenerateRequest(text="def f():", max_new_tokens=120, drafter="ngram",
                                     speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED,
                                                                              num_speculative_tokens=1))
        chunks = [c async for c in cluster.stub.GenerateStream(request, timeout=120)]
        assert sum(len(c.token_ids) for c in chunks) == 120 and chunks[-1].finish_reason
        async with cluster.client_channel() as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(5):
                reply = await health.Check(health_pb2.HealthCheckRequest(service="specdec.v1.Generation"), timeout=60)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert not attacking.done() and len(held) == 2, "the huge requests were not held all along"
    finally:
        release.set()
    codes = await attacking
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 2  # over the context: refused, after tokenizing off the loop


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
