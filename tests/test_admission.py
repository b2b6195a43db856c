"""Admission control and graceful shutdown."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.orchestrator.loop import Orchestrator
from specdec.orchestrator.request import OrchestratorConfig
from specdec.orchestrator.servicer import register
from specdec.rpc.server import start_server
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

from cluster import LOOPBACK, held_at_drain
from test_bad_input import wait_for_no_sessions


async def test_over_capacity_with_a_full_line_is_resource_exhausted(cluster):
    live = cluster.orchestrator
    orch = Orchestrator(live.target, live.verifier, cluster.store, OrchestratorConfig(max_concurrent_requests=1, max_waiting_requests=0),
                        live.drafter_address)
    server = await start_server(LOOPBACK, register(orch), ["specdec.v1.Generation"])
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            first = stub.GenerateStream(pb.GenerateRequest(text="def f():", max_new_tokens=200, drafter="ngram"))
            await first.read()  # the first request is admitted and running
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(text="x = 1", max_new_tokens=4, drafter="ngram"))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1 requests running and 0 waiting" in err.value.details() and "retry" in err.value.details()
            first.cancel()
    finally:
        await server.stop(0)
    assert await wait_for_no_sessions(cluster) == (0, 0)


async def test_stop_turns_health_not_serving_before_draining(cluster):
    live = cluster.orchestrator
    server = await start_server(LOOPBACK, register(live), ["specdec.v1.Generation"])
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="specdec.v1.Generation")
        assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
        async with held_at_drain(server, grace_s=1.0):  # stopping, just before the drain
            assert (await health.Check(check, timeout=30)).status == health_pb2.HealthCheckResponse.NOT_SERVING


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


# ----------------------------------------------------------------------------- per-worker memory caps


def test_verifier_kv_budget_refuses_what_does_not_fit_and_frees_on_close(tiny_pair):
    import secrets

    from specdec.core.errors import Overloaded
    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import SessionSpec
    from specdec.target.engine import TargetConfig, VerifierEngine

    engine = VerifierEngine.from_config(TargetConfig(tiny_pair[0], max_kv_tokens=100))
    spec = lambda: SessionSpec(secrets.token_hex(16), (1, 2, 3, 4), SamplingParams(seed=1), "ngram")  # noqa: E731
    first = spec()
    engine.open(first, max_new_tokens=60)  # reserves 64 of 100
    refused = spec()
    with pytest.raises(Overloaded, match="KV budget is 100 tokens and 64 are reserved") as err:
        engine.open(refused, max_new_tokens=40)  # 44 more would make 108
    assert "fewer tokens" in str(err.value)
    assert len(engine.sessions) == 1 and engine.kv_reserved_tokens() == 64  # the refusal changed nothing
    engine.open(spec(), max_new_tokens=30)  # 34 fits beside the first
    engine.close(first.session_id)
    engine.open(refused, max_new_tokens=40)  # the first's reservation is free again
    assert engine.kv_reserved_tokens() == 34 + 44


def test_model_free_drafter_keeps_at_most_its_session_cap():
    import queue
    import secrets

    from specdec.core.errors import InvalidRequest
    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import SessionSpec, StepOutcome
    from specdec.draft.drafters import DraftConfig
    from specdec.draft.engine import DraftEngine
    from specdec.draft.ngram import NgramDrafter

    engine = DraftEngine({"ngram": NgramDrafter(3, 1)}, DraftConfig(max_session_tokens=8))
    sid = secrets.token_hex(16)
    try:
        with pytest.raises(InvalidRequest, match="context"):  # a prompt over the cap is refused at open
            engine.open(SessionSpec(secrets.token_hex(16), tuple(range(9)), SamplingParams(seed=1), "ngram"), print)
        engine.open(SessionSpec(sid, (1, 2, 3, 4, 5), SamplingParams(seed=1), "ngram"), queue.Queue().put).result(timeout=10)
        engine.outcome(sid, StepOutcome(7, (1, 2), 0, False))
        with pytest.raises(InvalidRequest, match="at most 8 per session"):
            engine.outcome(sid, StepOutcome(9, (3, 4), 0, False))
        assert engine.sessions.get(sid).committed == [1, 2, 3, 4, 5, 1, 2]  # the refused outcome changed nothing
    finally:
        engine.close(sid)
        engine.shutdown()


# ----------------------------------------------------------------------------- the waiting line


@contextlib.asynccontextmanager
async def slot_taken(cluster, max_waiting: int):
    """An orchestrator allowing one running request, served over gRPC, whose one slot is held
    until the test sets the yielded event: a request that never finishes on its own, so the
    tests do not depend on how fast the machine generates. Yields (orchestrator, stub, release)."""
    live = cluster.orchestrator
    orch = Orchestrator(live.target, live.verifier, cluster.store,
                        OrchestratorConfig(max_concurrent_requests=1, max_waiting_requests=max_waiting), live.drafter_address)
    server = await start_server(LOOPBACK, register(orch), ["specdec.v1.Generation"])
    release, held = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with orch.admission.slot():
            held.set()
            await release.wait()

    holder = asyncio.ensure_future(hold())
    try:
        await held.wait()
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield orch, generation_pb2_grpc.GenerationStub(channel), release
    finally:
        release.set()
        await holder
        await server.stop(0)


async def until(probe, timeout_s: float = 60.0) -> None:
    """Poll ``probe()`` until it is true or the time is up (a ceiling: the caller asserts what it needs)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not probe() and loop.time() < deadline:
        await asyncio.sleep(0.02)


async def test_requests_over_the_limit_wait_in_line_first_come_first_served(cluster):
    async with slot_taken(cluster, max_waiting=2) as (orch, stub, release):
        done: list[str] = []

        async def waiter(name: str) -> None:
            reply = await stub.Generate(pb.GenerateRequest(text="x = 1", max_new_tokens=3, drafter="ngram"), timeout=60)
            assert len(reply.token_ids) == 3
            done.append(name)

        second = asyncio.ensure_future(waiter("second"))
        await until(lambda: orch.admission.waiting == 1)
        third = asyncio.ensure_future(waiter("third"))
        await until(lambda: orch.admission.waiting == 2)
        assert orch.admission.waiting == 2 and orch.running == 1  # both wait; neither failed
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the line is full
            await stub.Generate(pb.GenerateRequest(text="y = 2", max_new_tokens=3, drafter="ngram"), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 waiting" in err.value.details()
        release.set()
        await asyncio.gather(second, third)
        assert done == ["second", "third"]  # first come, first served
        assert orch.running == 0 and orch.admission.waiting == 0


async def test_a_deadline_that_passes_in_line_leaves_the_line(cluster):
    async with slot_taken(cluster, max_waiting=4) as (orch, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(pb.GenerateRequest(text="x = 1", max_new_tokens=3, drafter="ngram"), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: orch.admission.waiting == 0)
        assert orch.admission.waiting == 0 and orch.running == 1  # it left the line and took no slot
    assert orch.running == 0


async def test_the_line_hands_slots_over_in_order_and_skips_who_left():
    from specdec.orchestrator.admission import AdmissionQueue

    line = AdmissionQueue(max_running=1, max_waiting=3)
    order: list[str] = []
    release_first = asyncio.Event()

    async def request(name: str, hold: asyncio.Event | None = None) -> None:
        async with line.slot():
            order.append(name)
            if hold is not None:
                await hold.wait()

    first = asyncio.ensure_future(request("a", release_first))
    await asyncio.sleep(0)
    b, c, d = (asyncio.ensure_future(request(n)) for n in "bcd")
    await asyncio.sleep(0)
    assert line.running == 1 and line.waiting == 3
    c.cancel()  # gave up while waiting
    await asyncio.sleep(0)
    release_first.set()
    await asyncio.gather(first, b, d)
    assert order == ["a", "b", "d"] and line.running == 0 and line.waiting == 0


async def test_over_the_kv_budget_a_new_session_waits_for_room_instead_of_failing(tiny_pair):
    import secrets

    from specdec.core.errors import Overloaded
    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import SessionSpec
    from specdec.target.engine import TargetConfig, VerifierEngine
    from specdec.target.scheduler import VerifierScheduler

    # kv_wait_s long, so "still waiting" below cannot turn into "gave up" on a slow machine.
    engine = VerifierScheduler(VerifierEngine.from_config(TargetConfig(tiny_pair[0], max_kv_tokens=100, kv_wait_s=120.0)))
    spec = lambda: SessionSpec(secrets.token_hex(16), (1, 2, 3, 4), SamplingParams(seed=1), "ngram")  # noqa: E731
    first = spec()
    await engine.open(first, max_new_tokens=60)  # 64 of 100
    refusals = []
    real_open_batch = engine.engine.open_batch
    engine.engine.open_batch = lambda opens: refusals.append(1) or real_open_batch(opens)
    waiting = asyncio.ensure_future(engine.open(spec(), max_new_tokens=40))  # 44 more: does not fit yet
    await until(lambda: refusals or waiting.done())  # its first try was made (and refused: it did not fit)
    await asyncio.sleep(0.05)
    assert not waiting.done()  # waiting, not failed
    await engine.close(first.session_id)
    await asyncio.wait_for(waiting, 60)  # opened once the first one's room was free
    with pytest.raises(Overloaded, match="whole budget of 100"):  # can never fit: refused at once, not after kv_wait_s
        await asyncio.wait_for(engine.open(spec(), max_new_tokens=200), 60)
