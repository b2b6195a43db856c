"""Authentication and session ownership over real servers: API keys on the client API, the service
token on the internal hops, health checks open, nobody acting on a session that is not theirs."""
from __future__ import annotations

import secrets
import uuid

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.auth import Credentials, authenticate, bearer, principal
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, generation_pb2 as pb, verifier_pb2, verifier_pb2_grpc

from cluster import Cluster, start_cluster
from redis_server import delete_prefix

ALICE, BOB, TOKEN = secrets.token_urlsafe(24), secrets.token_urlsafe(24), secrets.token_urlsafe(32)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def auth(secret: str | None):
    return None if secret is None else (("authorization", f"Bearer {secret}"),)


@pytest_asyncio.fixture(scope="module")
async def locked(tiny_pair, redis_url) -> Cluster:
    target, draft = tiny_pair
    c = await start_cluster(target, draft, redis_url, prefix=f"specdec-test-{uuid.uuid4().hex[:8]}", api_keys=(ALICE, BOB),
                            service_token=TOKEN)
    yield c
    await c.stop()
    delete_prefix(redis_url, c.store._prefix)


def request(max_new: int = 6) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="def f():", max_new_tokens=max_new, drafter="model",
                              speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=3))


@pytest.mark.parametrize("metadata, word", [
    (None, "missing credentials"),
    (auth("x" * 24), "invalid credentials"),
    ((("authorization", f"Basic {ALICE}"),), "missing credentials"),  # only Bearer counts
    (auth(TOKEN), "invalid credentials"),  # the service token is not an API key
])
async def test_client_api_refuses_missing_or_wrong_keys(locked, metadata, word):
    for call in (locked.stub.Generate(request(), metadata=metadata, timeout=10),
                 locked.stub.GetSession(pb.GetSessionRequest(session_id="0" * 32), metadata=metadata, timeout=10)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == UNAUTHENTICATED and word in err.value.details()
        assert ALICE not in err.value.details() and TOKEN not in err.value.details()
    stream = locked.stub.GenerateStream(request(), metadata=metadata, timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stream:
            pass
    assert err.value.code() == UNAUTHENTICATED
    assert await locked.active_sessions() == (0, 0)


async def test_secrets_never_reach_the_logs(locked, caplog):
    import logging

    with caplog.at_level(logging.DEBUG):
        await locked.stub.Generate(request(), metadata=auth(ALICE), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError):
            await locked.stub.Generate(request(), metadata=auth(BOB[:-1]), timeout=10)
    assert caplog.records, "nothing was logged: this test would not test anything"
    for secret in (ALICE, BOB, BOB[:-1], TOKEN):
        assert secret not in caplog.text


async def test_a_session_belongs_to_the_key_that_made_it(locked):
    reply = await locked.stub.Generate(request(), metadata=auth(ALICE), timeout=30)
    assert len(reply.token_ids) == 6  # the deployment works end to end with keys and the service token
    mine = await locked.stub.GetSession(pb.GetSessionRequest(session_id=reply.session_id), metadata=auth(ALICE), timeout=10)
    assert list(mine.output_token_ids) == list(reply.token_ids)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # Bob holds a valid key and the id, and still sees nothing
        await locked.stub.GetSession(pb.GetSessionRequest(session_id=reply.session_id), metadata=auth(BOB), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and reply.session_id not in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:  # nor may Bob resume it
        async for _ in locked.stub.ResumeStream(pb.ResumeRequest(session_id=reply.session_id), metadata=auth(BOB), timeout=10):
            pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    resumed = [t async for m in locked.stub.ResumeStream(pb.ResumeRequest(session_id=reply.session_id, received_tokens=2),
                                                         metadata=auth(ALICE), timeout=10) for t in m.token_ids]
    assert resumed == list(reply.token_ids)[2:]  # Alice may: the rest of her finished session
    record = await locked.store.get(reply.session_id)
    assert record.params["owner"] == principal(ALICE) and ALICE not in str(record.params)  # the key itself is never stored


@pytest.mark.parametrize("metadata", [None, auth(ALICE), auth("y" * 32)], ids=["none", "api-key", "wrong"])
async def test_workers_admit_only_the_service_token(locked, metadata):
    draft_addr, target_addr = locked.servers[0].address, locked.servers[1].address
    async with grpc.aio.insecure_channel(draft_addr) as dc, grpc.aio.insecure_channel(target_addr) as tc:
        drafter, verifier = drafter_pb2_grpc.DrafterStub(dc), verifier_pb2_grpc.VerifierStub(tc)
        sid = secrets.token_hex(16)
        opening = drafter_pb2.SpeculateRequest(open=common_pb2.OpenSessionRequest(
            session_id=sid, prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(seed=1), drafter="ngram"))
        calls = {
            "Drafter.GetWorkerStatus": lambda: drafter.GetWorkerStatus(common_pb2.WorkerStatusRequest(), metadata=metadata, timeout=10),
            "Verifier.GetWorkerStatus": lambda: verifier.GetWorkerStatus(common_pb2.WorkerStatusRequest(), metadata=metadata, timeout=10),
        }
        for name, make in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await make()
            assert err.value.code() == UNAUTHENTICATED, name
        run = verifier_pb2.SessionRequest(session=opening.open, max_new_tokens=4,
                                          speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in verifier.Generate(run, metadata=metadata, timeout=10):
                pass
        assert err.value.code() == UNAUTHENTICATED
        # The stream is refused before any message: writing one would race the refusal (gRPC's core then
        # reports the failed write as INTERNAL), so this call writes nothing and reads the status.
        stream = drafter.Speculate(metadata=metadata, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.read()
        assert err.value.code() == UNAUTHENTICATED
        # With the token the same calls are served; and health stays open to probes without one.
        assert (await drafter.GetWorkerStatus(common_pb2.WorkerStatusRequest(), metadata=auth(TOKEN), timeout=10)).drafters
        for channel in (dc, tc):
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert await locked.active_sessions() == (0, 0)


def test_bearer_parsing_and_constant_time_check():
    creds = Credentials((ALICE, BOB))
    assert bearer([("authorization", f"Bearer {ALICE}")]) == ALICE
    assert bearer([("authorization", f"bearer  {ALICE} ")]) == ALICE
    assert bearer([("authorization", ALICE)]) is None and bearer([]) is None and bearer(None) is None
    assert authenticate([("authorization", f"Bearer {BOB}")], creds) == principal(BOB) != principal(ALICE)
    assert authenticate([("authorization", f"Bearer {ALICE[:-1]}")], creds) is None
    assert authenticate([], Credentials()) == ""  # no keys configured: open, everyone the same owner
    with pytest.raises(ValueError, match="at least 16"):
        Credentials(("short",))
