"""A pool of verifiers (real gRPC servers, TLS on): sessions go to the least-loaded replica, and one
whose verifier dies mid-stream resumes on another from its committed tokens, giving exactly the
tokens an uninterrupted run gives (greedy, and seeded sampling under the coupled rule)."""
from __future__ import annotations


import asyncio

import pytest
import pytest_asyncio

from specdec import roles
from specdec.core.errors import WorkerUnavailable
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.orchestrator.loop import Orchestrator, collect
from specdec.orchestrator.pool import VerifierPool
from specdec.orchestrator.remote import RemoteVerifyWorker
from specdec.orchestrator.request import GenerationRequest
from specdec.target.engine import TargetConfig

from cluster import PATIENT
from test_e2e import reference_greedy

PROMPT = "def f():"


@pytest_asyncio.fixture
async def two_verifiers(cluster, tiny_pair):
    """Two fresh verifier servers (killing one must not touch the shared cluster) and an
    orchestrator over a pool of both, streaming drafts from the cluster's drafter."""
    target_path, _ = tiny_pair
    # Patient for the drafter, as the shared cluster's verifier: a seeded run under the rejection rule
    # gives its tokens for its speculation schedule, and a step that gave up on a late block (0.2 s on
    # a busy machine) changed the schedule.
    started = [await roles.start_target(TargetConfig(target_path), cluster.worker_server(), loop_config=PATIENT)
               for _ in range(2)]
    pool = VerifierPool([server.address for server, _ in started], replica_maker(cluster), status_ttl_s=0.0)
    live = cluster.orchestrator
    orch = Orchestrator(live.target, pool, cluster.store, live.config, live.drafter_address)
    yield orch, pool, started
    for server, _ in started:
        await server.stop(0)
    await pool.aclose()


def replica_maker(cluster):
    # Generous: a stopped verifier ends its streams at once; these only bound a step on a busy machine.
    return lambda address, server_name: RemoteVerifyWorker(address, timeout_s=120, tls=cluster.tls, step_timeout_s=120,
                                                           server_name=server_name)


def request(max_new: int, **sampling) -> GenerationRequest:
    return GenerationRequest(prompt_text=PROMPT, max_new_tokens=max_new, drafter="model",
                             sampling=SamplingParams(**sampling), policy=SpeculationPolicy(SpeculationMode.FIXED, 3))


async def run_killing_after(orch, started, req: GenerationRequest, chunks_before_kill: int,
                            grace_s: float = 0.0) -> tuple[list[int], int]:
    """Stream ``req``; after some chunks, stop the verifier holding the session (``grace_s`` > 0: a
    drain, as on SIGTERM: health NOT_SERVING, then streams cut after the grace). (tokens, which was stopped)."""
    ids: list[int] = []
    killed = None
    n = 0
    stopping: list[asyncio.Future] = []
    async for chunk in orch.generate(req):
        ids.extend(chunk.token_ids)
        n += 1
        if killed is None and n == chunks_before_kill:
            for i, (server, verifier) in enumerate(started):
                if (await verifier.status()).active_sessions:
                    killed = i
                    stopping.append(asyncio.ensure_future(server.stop(grace_s)))  # 0: its streams end at once, as on a crash
                    break
    await asyncio.gather(*stopping)
    return ids, killed


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 31, "rule": VerificationRule.COUPLED},
                                      {"temperature": 1.0, "seed": 31, "rule": VerificationRule.REJECTION}],
                         ids=["greedy", "coupled-seeded", "rejection-seeded-fixed-k"])
async def test_a_verifier_dying_mid_stream_costs_only_a_pause(two_verifiers, tiny_pair, sampling):
    orch, pool, started = two_verifiers
    req = request(120, **sampling)
    if sampling:  # the uninterrupted run of the same seed, on the same pool
        _, expected, _ = await collect(orch.generate(req))
    else:
        expected = reference_greedy(tiny_pair[0], PROMPT, 120)
    ids, killed = await run_killing_after(orch, started, req, chunks_before_kill=4)
    assert killed is not None, "no verifier held the session"
    assert tuple(ids) == tuple(expected)
    assert pool.failovers == 1
    assert orch.running == 0


async def test_new_sessions_go_to_the_least_loaded_replica(two_verifiers):
    orch, pool, started = two_verifiers
    long_runs = [orch.generate(request(200)) for _ in range(2)]
    first = [await anext(run) for run in long_runs]  # both sessions open now
    assert all(c.token_ids for c in first)
    assert [(await v.status()).active_sessions for _, v in started] == [1, 1]  # one on each, not both on one
    for run in long_runs:
        await run.aclose()


async def test_when_every_replica_is_gone_the_client_hears_unavailable(two_verifiers):
    orch, pool, started = two_verifiers
    for server, _ in started:
        await server.stop(0)
    with pytest.raises(WorkerUnavailable):
        await collect(orch.generate(request(8)))
    assert orch.running == 0


def test_names_expand_to_every_address_and_ip_literals_to_themselves():
    from specdec.orchestrator.pool import expand

    assert expand("127.0.0.1:5000") == [("127.0.0.1:5000", None)]
    assert ("127.0.0.1:5000", "localhost") in expand("localhost:5000")  # dialled by IP, verified as "localhost"
    assert expand("no-such-host.invalid:5000") == []  # no pod yet: looked up again later


async def test_replicas_that_appear_behind_a_name_get_sessions(cluster, tiny_pair):
    """A headless Service's name resolves to more pods after a scale-up: the pool follows it."""
    target_path, _ = tiny_pair
    # Patient for the drafter, as the shared cluster's verifier: a seeded run under the rejection rule
    # gives its tokens for its speculation schedule, and a step that gave up on a late block (0.2 s on
    # a busy machine) changed the schedule.
    started = [await roles.start_target(TargetConfig(target_path), cluster.worker_server(), loop_config=PATIENT)
               for _ in range(2)]
    behind_the_name = [started[0][0].address]
    resolve = lambda name: [(a, "localhost") for a in behind_the_name]  # noqa: E731 (the name's A records, as DNS would say)
    pool = VerifierPool(["specdec-target:50053"], replica_maker(cluster), status_ttl_s=0.0, resolve_every_s=0.0,
                        resolve=resolve)
    live = cluster.orchestrator
    orch = Orchestrator(live.target, pool, cluster.store, live.config, live.drafter_address)
    try:
        one = orch.generate(request(200))
        await anext(one)
        behind_the_name.append(started[1][0].address)  # the Service scaled up
        two = orch.generate(request(200))
        await anext(two)
        assert [(await v.status()).active_sessions for _, v in started] == [1, 1]
        await one.aclose()
        await two.aclose()
    finally:
        for server, _ in started:
            await server.stop(0)
        await pool.aclose()


async def test_the_replica_that_takes_over_reads_the_kv_prefix_from_redis(cluster, tiny_pair, redis_url, redis_prefix):
    """With KV blocks in Redis, the verifier a session moves to recomputes only the tail."""
    target_path, _ = tiny_pair
    config = TargetConfig(target_path, kv_redis_url=redis_url, kv_prefix=redis_prefix, kv_block_tokens=16)
    started = [await roles.start_target(config, cluster.worker_server()) for _ in range(2)]
    # KV blocks are written by a task of their own, a moment after the step that filled them; the
    # session's new verifier starts only once every block offered so far is written, so what it
    # finds in Redis follows from the tokens, not from how far that task had got when the first died.
    unwritten = [written_when_asked(verifier.scheduler.kv_store) for _, verifier in started]

    async def blocks_written() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while any(left() for left in unwritten) and loop.time() < deadline:
            await asyncio.sleep(0.01)

    maker = replica_maker(cluster)
    pool = VerifierPool([server.address for server, _ in started],
                        lambda address, server_name: AfterBlocksWritten(maker(address, server_name), blocks_written), status_ttl_s=0.0)
    live = cluster.orchestrator
    orch = Orchestrator(live.target, pool, cluster.store, live.config, live.drafter_address)
    try:
        req = request(150)
        ids, killed = await run_killing_after(orch, started, req, chunks_before_kill=20)
        assert killed is not None and pool.failovers == 1
        assert tuple(ids) == reference_greedy(target_path, PROMPT, 150)
        survivor = started[1 - killed][1].scheduler
        stored = survivor.kv_store
        assert stored.rejected == 0
        taken_over = survivor.engine.last_prefill_tokens
        assert 0 < taken_over <= 16, f"the new verifier recomputed {taken_over} positions, not just the tail"
    finally:
        for server, verifier in started:
            await server.stop(0)
            if verifier.scheduler.kv_store is not None:
                await verifier.scheduler.kv_store.aclose()
        await pool.aclose()


def written_when_asked(store):
    """Count the KV blocks ``store`` is offered; the returned callable gives how many are not written (or dropped) yet."""
    offered = [0]
    real = store.offer

    def offer(session_id, blocks):
        offered[0] += sum(index < store._max_blocks for index, _ in blocks)  # (past the cap: never queued)
        real(session_id, blocks)

    store.offer = offer
    return lambda: offered[0] - store.written - store.dropped


class AfterBlocksWritten:
    """A pool's replica whose sessions start only once ``before()`` returns."""

    def __init__(self, replica, before) -> None:
        self._replica, self._before = replica, before

    def __getattr__(self, name):
        return getattr(self._replica, name)

    async def run(self, run):
        await self._before()
        async for step in self._replica.run(run):
            yield step


async def test_a_draining_verifier_hands_its_session_over_without_loss(two_verifiers, tiny_pair):
    """Scale-in: the pod gets SIGTERM, drains for its grace, and the session its stream still
    carried goes on at another replica; the client's tokens are exactly target-only greedy's."""
    orch, pool, started = two_verifiers
    ids, killed = await run_killing_after(orch, started, request(250), chunks_before_kill=3, grace_s=0.2)
    assert killed is not None and pool.failovers == 1
    assert tuple(ids) == reference_greedy(tiny_pair[0], PROMPT, 250)


async def test_sessions_draft_on_the_least_loaded_drafter_of_a_pool(cluster, tiny_pair):
    """A draft pool (several addresses, or a headless Service name): each new session streams its
    drafts from the replica with the fewest open sessions; a dead replica gets none."""
    from specdec.draft.drafters import DraftConfig
    from specdec.orchestrator.pool import DrafterPool
    from specdec.orchestrator.remote import RemoteWorker

    from test_worker_failure import free_port

    target_path, draft_path = tiny_pair
    started = [await roles.start_draft(DraftConfig(draft_path, target_path), cluster.worker_server()) for _ in range(2)]
    dead = f"127.0.0.1:{free_port()}"
    pool = DrafterPool([dead, *(server.address for server, _ in started)],
                       lambda a, n: RemoteWorker(a, "draft", 5, tls=cluster.tls, server_name=n), status_ttl_s=0.0)
    live = cluster.orchestrator
    orch = Orchestrator(live.target, live.verifier, cluster.store, live.config, drafters=pool)
    try:
        runs = [orch.generate(request(200)) for _ in range(2)]
        firsts = [await anext(run) for run in runs]
        assert all(chunk.token_ids for chunk in firsts)
        assert [engine.status().active_sessions for _, engine in started] == [1, 1]  # one each; none on the dead one
        for run in runs:
            await run.aclose()
        _, ids, _ = await collect(orch.generate(request(40)))
        assert ids == reference_greedy(target_path, PROMPT, 40)  # the output is the target's whatever drafts it
    finally:
        for server, engine in started:
            await server.stop(0)
            engine.shutdown()
        await pool.aclose()


async def test_a_failover_goes_on_from_the_prompt_the_tokens_and_the_k_reached():
    """The pool's own bookkeeping, with two stand-in replicas: the first commits two steps at k = 3
    and dies; the second is asked for exactly the rest, from the prompt plus those tokens, and an
    adaptive session starts there at k = 3 (the request started at 1)."""
    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import SessionRun, SessionSpec, StepCommit, WorkerInfo

    asked = []

    class Replica:
        def __init__(self, dies: bool) -> None:
            self.dies = dies

        async def status(self):
            return WorkerInfo(0, "m", 10, 100, ())

        async def run(self, run):
            asked.append(run)
            base = len(run.spec.prompt_ids)
            if self.dies:
                yield StepCommit((7, 8), 3, 1, base + 2)
                yield StepCommit((9,), 3, 0, base + 3)
                raise WorkerUnavailable("gone")
            yield StepCommit(tuple(range(run.max_new_tokens)), 2, 2, base + run.max_new_tokens, finished=True)

    replicas = {"a:1": Replica(True), "b:1": Replica(False)}
    pool = VerifierPool(list(replicas), lambda address, _: replicas[address], status_ttl_s=0.0, resolve=lambda a: [(a, None)])
    policy = SpeculationPolicy(SpeculationMode.ADAPTIVE, num_speculative_tokens=1, max_speculative_tokens=6)
    run = SessionRun(SessionSpec("ab" * 16, (1, 2), SamplingParams(), "model"), "", 10, policy)
    steps = [s async for s in pool.run(run)]  # equal loads: "a:1" first, then the one not failed
    assert [t for s in steps for t in s.token_ids] == [7, 8, 9, *range(7)]
    resumed = asked[1]
    assert resumed.spec.prompt_ids == (1, 2, 7, 8, 9) and resumed.max_new_tokens == 7
    assert resumed.policy.num_speculative_tokens == 3 and resumed.policy.max_speculative_tokens == 6
    assert pool.failovers == 1
