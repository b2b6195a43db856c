"""Workers that fail.

A drafter is only ever a speed-up: unreachable, or killed mid-request, the verifier goes on as
plain decoding and the client gets exactly the target-only output. A verifier that cannot be
reached is UNAVAILABLE (retryable), never UNKNOWN. Either way no session leaks.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec import roles
from specdec.core.errors import WorkerUnavailable
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.draft.drafters import DraftConfig
from specdec.ports import free_ports
from specdec.orchestrator.loop import Chunk, FinishReason, Orchestrator, collect
from specdec.orchestrator.remote import RemoteVerifyWorker
from specdec.orchestrator.request import GenerationRequest
from specdec.orchestrator.servicer import register
from specdec.rpc.server import start_server
from specdec.v1 import generation_pb2 as pb, generation_pb2_grpc

from cluster import LOOPBACK
from test_e2e import reference_greedy

PROMPT = "def f():"  # the tiny target emits no end-of-sequence within 150 tokens of it


def free_port() -> int:
    return free_ports(1)


def greedy(max_new: int, k: int = 3, drafter: str = "model") -> GenerationRequest:
    return GenerationRequest(prompt_text=PROMPT, max_new_tokens=max_new, drafter=drafter,
                             policy=SpeculationPolicy(SpeculationMode.FIXED, k))


async def eventually(probe, want, timeout_s: float = 60.0):
    """Poll ``probe()`` (awaited if it returns an awaitable) until it equals ``want`` or the time is up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = probe()
        if asyncio.iscoroutine(got):
            got = await got
        if got == want or loop.time() >= deadline:
            return got
        await asyncio.sleep(0.05)


async def test_unreachable_drafter_costs_only_speed(cluster, tiny_pair):
    target_path, _ = tiny_pair
    live = cluster.orchestrator
    orch = Orchestrator(live.target, live.verifier, cluster.store, live.config,
                        drafter_address=f"127.0.0.1:{free_port()}")  # nothing listens there
    last, ids, text = await collect(orch.generate(greedy(32)))
    normal_last, normal_ids, normal_text = await collect(live.generate(greedy(32)))
    assert ids == normal_ids == reference_greedy(target_path, PROMPT, 32)
    assert text == normal_text
    assert normal_last.counters.draft_tokens > 0, "the normal run never speculated: the comparison would mean nothing"
    assert last.counters.draft_tokens == 0 and last.counters.verify_steps == len(ids)  # plain decoding
    assert last.finish_reason is FinishReason.LENGTH
    record = await cluster.store.get(last.session_id)
    assert record.status.value == "finished" and record.output_ids == ids
    assert await eventually(cluster.active_sessions, (0, 0)) == (0, 0)
    assert orch.running == 0


async def test_drafter_killed_mid_request_costs_only_speed(cluster, tiny_pair):
    target_path, draft_path = tiny_pair
    server, engine = await roles.start_draft(DraftConfig(draft_path, target_path), cluster.worker_server())
    live = cluster.orchestrator
    orch = Orchestrator(live.target, live.verifier, cluster.store, live.config, drafter_address=server.address)
    ids: list[int] = []
    before: list[Chunk] = []
    after: list[Chunk] = []
    held_at_kill = None
    try:
        async for chunk in orch.generate(greedy(150)):
            ids.extend(chunk.token_ids)
            (after if held_at_kill is not None else before).append(chunk)
            if held_at_kill is None and len(before) >= 3 and chunk.counters.draft_tokens > 0:
                held_at_kill = engine.status().active_sessions  # the verifier still streams from it
                await server.stop(0)
    finally:
        if held_at_kill is None:
            await server.stop(0)
    try:
        assert held_at_kill == 1, "the drafter was never killed mid-request (no draft tokens in the first steps?)"
        assert after and after[-1].finish_reason is FinishReason.LENGTH
        assert tuple(ids) == reference_greedy(target_path, PROMPT, 150)
        assert before[-1].counters.draft_tokens > 0  # drafts were verified before the kill
        # After the kill the verifier decoded alone: some step other than the last had no drafts.
        assert any(c.last_num_speculative_tokens == 0 for c in after[:-1])
        assert await eventually(lambda: engine.status().active_sessions, 0) == 0, "the stopped drafter kept the session"
        assert await eventually(cluster.active_sessions, (0, 0)) == (0, 0)
        assert orch.running == 0
    finally:
        engine.shutdown()


async def test_unreachable_verifier_is_unavailable_and_leaks_nothing(cluster):
    live = cluster.orchestrator
    dead = RemoteVerifyWorker(f"127.0.0.1:{free_port()}", timeout_s=2)  # nothing listens there
    orch = Orchestrator(live.target, dead, cluster.store, live.config, live.drafter_address)
    try:
        with pytest.raises(WorkerUnavailable, match="Verifier at 127.0.0.1"):
            await collect(orch.generate(greedy(4, drafter="ngram")))
        assert orch.running == 0

        # Over gRPC the same failure is UNAVAILABLE with the worker named.
        server = await start_server(LOOPBACK, register(orch), ["specdec.v1.Generation"])
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for call in (lambda r: stub.Generate(r, timeout=30), lambda r: _drain(stub.GenerateStream(r, timeout=30))):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(pb.GenerateRequest(text=PROMPT, max_new_tokens=4, drafter="ngram"))
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                    assert "Verifier at 127.0.0.1" in err.value.details()
        finally:
            await server.stop(0)
    finally:
        await dead.aclose()
    assert orch.running == 0
    assert await eventually(cluster.active_sessions, (0, 0)) == (0, 0)


async def _drain(call) -> None:
    async for _ in call:
        pass


async def test_a_session_whose_drafter_dies_drafts_on_another_of_its_pool(cluster, tiny_pair):
    """Two drafters in a pool; the session's own is killed mid-request: its verifier decodes alone
    for a moment, then opens its next draft stream on the other one and speculates again, with
    output still exactly target-only greedy."""
    from specdec.orchestrator.pool import DrafterPool
    from specdec.orchestrator.remote import RemoteWorker

    target_path, draft_path = tiny_pair
    started = [await roles.start_draft(DraftConfig(draft_path, target_path), cluster.worker_server()) for _ in range(2)]
    pool = DrafterPool([server.address for server, _ in started],
                       lambda a, n: RemoteWorker(a, "draft", 5, tls=cluster.tls, server_name=n), status_ttl_s=0.0)
    live = cluster.orchestrator
    orch = Orchestrator(live.target, live.verifier, cluster.store, live.config, drafters=pool)
    ids: list[int] = []
    after: list[Chunk] = []
    killed = survivor = None
    survivor_sessions = 0  # the most sessions the other drafter held after the kill
    try:
        async for chunk in orch.generate(greedy(200)):
            ids.extend(chunk.token_ids)
            if killed is not None:
                after.append(chunk)
                survivor_sessions = max(survivor_sessions, survivor.status().active_sessions)
            elif chunk.counters.draft_tokens > 0 and len(ids) >= 8:
                own = [i for i, (_, engine) in enumerate(started) if engine.status().active_sessions]
                assert len(own) == 1
                killed, survivor = started[own[0]][0], started[1 - own[0]][1]
                await killed.stop(0)
        assert killed is not None, "the session never drafted"
        assert tuple(ids) == reference_greedy(target_path, PROMPT, 200)
        assert survivor_sessions == 1, "the session never opened a draft stream on the other drafter"
        assert any(c.last_num_speculative_tokens > 0 for c in after[len(after) // 2:])  # speculating again
        assert await eventually(cluster.active_sessions, (0, 0)) == (0, 0)
        assert await eventually(lambda: survivor.status().active_sessions, 0) == 0
    finally:
        for server, engine in started:
            await server.stop(0)
            engine.shutdown()
        await pool.aclose()
