"""Orchestrator failover: a client whose stream broke resumes it on another orchestrator replica,
from the last token it received, and gets exactly the rest (real gRPC servers, a real Redis)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from specdec.core.errors import InvalidRequest, SessionNotFound, SessionTakenOver
from specdec.orchestrator.loop import Orchestrator, collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.orchestrator.servicer import register
from specdec.rpc.server import start_server
from specdec.v1 import common_pb2, generation_pb2 as pb, generation_pb2_grpc

from cluster import LOOPBACK
from test_e2e import reference_greedy

PROMPT = "def f():"
LEASE_S = 0.5


@pytest_asyncio.fixture
async def replicas(cluster):
    """Two orchestrators (A and B) over the cluster's workers and Redis, as two pods of one Deployment."""
    live = cluster.orchestrator
    config = OrchestratorConfig(max_new_tokens_limit=256, resume_lease_s=LEASE_S)
    orchs = [Orchestrator(live.target, live.verifier, cluster.store, config, live.drafter_address) for _ in range(2)]
    servers = [await start_server(LOOPBACK, register(o), ["specdec.v1.Generation"]) for o in orchs]
    channels = [grpc.aio.insecure_channel(s.address) for s in servers]
    yield orchs, servers, [generation_pb2_grpc.GenerationStub(c) for c in channels]
    for c in channels:
        await c.close()
    for s in servers:
        await s.stop(0)


def stream_request(max_new: int = 120, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, max_new_tokens=max_new, drafter="model",
                              sampling=common_pb2.SamplingParams(**sampling),
                              speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED,
                                                                       num_speculative_tokens=3))


async def read_until_broken(call, stop_after: int, kill) -> tuple[str, list[int], str]:
    """Read ``stop_after`` messages, kill the orchestrator, read on until the stream breaks."""
    session_id, ids, text, n = "", [], "", 0
    with pytest.raises(grpc.aio.AioRpcError):
        async for msg in call:
            session_id = msg.session_id
            ids.extend(msg.token_ids)
            text += msg.text
            n += 1
            if n == stop_after:
                await kill()
    return session_id, ids, text


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 99}], ids=["greedy", "coupled-seeded"])
async def test_a_stream_broken_by_its_orchestrator_resumes_on_another(replicas, cluster, tiny_pair, sampling):
    orchs, servers, (to_a, to_b) = replicas
    whole = await to_b.Generate(stream_request(**sampling), timeout=60)  # the uninterrupted run, for comparison
    if not sampling:
        assert tuple(whole.token_ids) == reference_greedy(tiny_pair[0], PROMPT, 120)
    session_id, ids, text = await read_until_broken(to_a.GenerateStream(stream_request(**sampling), timeout=60), 3,
                                                    lambda: servers[0].stop(0))
    assert session_id and 0 < len(ids) < 120
    rest_ids, rest_text, last = [], "", None
    async for msg in to_b.ResumeStream(pb.ResumeRequest(session_id=session_id, received_tokens=len(ids)), timeout=60):
        rest_ids.extend(msg.token_ids)
        rest_text += msg.text
        last = msg
    assert ids + rest_ids == list(whole.token_ids)  # exactly the rest: nothing lost, nothing twice
    assert text + rest_text == whole.text
    assert last.finish_reason == whole.finish_reason and last.usage.completion_tokens == 120
    record = await cluster.store.get(session_id)
    assert record.status.value == "finished" and list(record.output_ids) == list(whole.token_ids)


class PausableStore:
    """The shared store, with commits that wait at a gate once it is shut: an orchestrator paused
    mid-session (SIGSTOP, a long GC) as seen from Redis."""

    def __init__(self, store) -> None:
        self._store = store
        self.gate = asyncio.Event()
        self.gate.set()
        self.paused = asyncio.Event()  # set when a commit is held at the gate

    def __getattr__(self, name):
        return getattr(self._store, name)

    async def commit(self, *args, **kwargs):
        if not self.gate.is_set():
            self.paused.set()
            await self.gate.wait()
        return await self._store.commit(*args, **kwargs)


async def test_resuming_a_session_still_held_elsewhere_fences_the_old_stream_off(cluster):
    """The client resumes at once (no lease to wait out); the paused stream, when it wakes, can
    write nothing more to the session and ends with ABORTED; the record holds exactly one run."""
    live = cluster.orchestrator
    config = OrchestratorConfig(max_new_tokens_limit=256)
    paused_store = PausableStore(cluster.store)
    a = Orchestrator(live.target, live.verifier, paused_store, config, live.drafter_address)
    b = Orchestrator(live.target, live.verifier, cluster.store, config, live.drafter_address)
    request = GenerationRequest(prompt_text=PROMPT, max_new_tokens=60, drafter="ngram")
    _, whole, _ = await collect(b.generate(request))
    chunks = a.generate(request)
    first = await anext(chunks)
    paused_store.gate.clear()  # A's next commit hangs, as its process would
    second = asyncio.ensure_future(anext(chunks))
    await asyncio.wait_for(paused_store.paused.wait(), 60)
    _, rest, _ = await collect(b.resume(first.session_id, "", len(first.token_ids)))
    assert first.token_ids + rest == whole
    paused_store.gate.set()  # A wakes up and tries to commit its step
    with pytest.raises(SessionTakenOver, match="resumed by a newer stream"):
        await second
    await chunks.aclose()
    record = await cluster.store.get(first.session_id)
    assert record.output_ids == whole and record.status.value == "finished"


async def test_a_stream_taken_over_ends_with_aborted_on_the_wire(replicas, cluster):
    orchs, _, (to_a, to_b) = replicas
    call = to_a.GenerateStream(stream_request(200), timeout=60)
    first = await anext(aiter(call))
    rest = [t async for msg in to_b.ResumeStream(pb.ResumeRequest(session_id=first.session_id,
                                                                  received_tokens=len(first.token_ids)), timeout=60)
            for t in msg.token_ids]
    whole = await to_b.Generate(stream_request(200), timeout=60)
    assert list(first.token_ids) + rest == list(whole.token_ids)
    try:  # A either finished before B took over (its tokens are the same) or was fenced off
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.ABORTED and "resumed by a newer stream" in err.details()
    assert list((await cluster.store.get(first.session_id)).output_ids) == list(whole.token_ids)


async def test_only_the_owner_may_resume_and_the_count_must_fit(replicas):
    orchs, _, _ = replicas
    last, ids, _ = await collect(orchs[0].generate(GenerationRequest(prompt_text=PROMPT, max_new_tokens=8, drafter="ngram",
                                                                     owner="kalice")))
    with pytest.raises(SessionNotFound):
        await collect(orchs[1].resume(last.session_id, "kbob", 0))
    with pytest.raises(InvalidRequest, match="received_tokens is 9 but the session committed 8"):
        await collect(orchs[1].resume(last.session_id, "kalice", 9))
    again, rest, _ = await collect(orchs[1].resume(last.session_id, "kalice", 5))  # finished: the rest, no generation
    assert rest == ids[5:] and again.finish_reason == last.finish_reason


async def test_a_session_whose_orchestrator_vanished_does_not_stay_running(cluster):
    """Nobody resumes it: within a lease or two some orchestrator's reaper marks it failed; a session
    still within its lease is left alone."""
    import dataclasses
    import time

    from specdec.core.sessions import SessionRecord, SessionStatus, new_session_id

    def left_running() -> SessionRecord:  # as an orchestrator that died would leave it
        return SessionRecord.new((1, 2, 3), {"owner": ""}, 5, new_session_id())

    # Its last write an hour ago, rather than a sleep past a short lease: a fresh session must not
    # fall out of its lease just because the machine was slow between two lines.
    hour_ago = time.time() - 3600
    stale = dataclasses.replace(left_running(), created_at=hour_ago, updated_at=hour_ago)
    await cluster.store.create(stale)
    fresh = left_running()
    await cluster.store.create(fresh)
    marked = await cluster.store.abandon_stale(60.0)
    assert stale.session_id in marked and fresh.session_id not in marked
    assert (await cluster.store.get(fresh.session_id)).status is SessionStatus.RUNNING
    lost = await cluster.store.get(stale.session_id)
    assert lost.status is SessionStatus.FAILED and lost.finish_reason == "orchestrator lost"

    live = cluster.orchestrator
    reaper = Orchestrator(live.target, live.verifier, cluster.store, OrchestratorConfig(resume_lease_s=LEASE_S),
                          live.drafter_address)
    reaper.start_reaper()  # the loop every orchestrator runs
    try:
        deadline = time.monotonic() + 60  # a ceiling: it ends as soon as the reaper has marked it
        while (await cluster.store.get(fresh.session_id)).status is SessionStatus.RUNNING and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await reaper.aclose()
    assert (await cluster.store.get(fresh.session_id)).finish_reason == "orchestrator lost"


async def test_an_adaptive_session_resumes_at_the_speculation_length_it_had_reached(cluster):
    """Its verifier's controller is gone; the new one starts from the session's last recorded k,
    not from the request's starting point (fixed k is left as it was)."""
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy

    live = cluster.orchestrator
    runs = []

    class Recording:  # the cluster's verifier, noting what each session is run with
        async def status(self):
            return await live.verifier.status()

        def run(self, run):
            runs.append(run)
            return live.verifier.run(run)

    orch = Orchestrator(live.target, Recording(), cluster.store, OrchestratorConfig(), live.drafter_address)
    policy = SpeculationPolicy(SpeculationMode.ADAPTIVE, num_speculative_tokens=1, max_speculative_tokens=6)
    chunks = orch.generate(GenerationRequest(prompt_text=PROMPT, max_new_tokens=80, drafter="model", policy=policy))
    got = [await anext(chunks) for _ in range(6)]
    await chunks.aclose()
    record = await cluster.store.get(got[0].session_id)
    assert record.step_ks and len(record.step_ks) == len(got)  # one k per step, as streamed
    # As if its controller had got to 5 by the time its orchestrator died (the request started at 1).
    await cluster.store.commit(record.session_id, [], record.counters, (5,))
    rest = orch.resume(record.session_id, "", len(record.output_ids))
    await anext(rest)
    await rest.aclose()
    assert runs[-1].policy.num_speculative_tokens == 5
    assert runs[-1].policy.max_speculative_tokens == 6 and runs[-1].policy.mode is SpeculationMode.ADAPTIVE
