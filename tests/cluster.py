"""Real specdec roles for end-to-end tests: gRPC servers on loopback ports and a real Redis.

Each role is started the way ``specdec serve`` starts it (specdec.roles), inside the test's event
loop; only the process boundary is missing (tests/test_cli.py covers ``specdec up`` processes).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc
from prometheus_client import CollectorRegistry

from specdec import roles
from specdec.core.redis_store import RedisSessionStore
from specdec.draft.drafters import DraftConfig
from specdec.draft.engine import DraftEngine
from specdec.orchestrator.loop import Orchestrator
from specdec.orchestrator.request import OrchestratorConfig
from specdec.rpc.auth import Credentials
from specdec.rpc.server import RunningServer, ServerConfig
from specdec.rpc.tls import TlsFiles, client_tls, internal_channel, open_channel
from specdec.target.engine import TargetConfig
from specdec.target.loop import LoopConfig
from specdec.target.worker import LocalVerifier
from specdec.v1 import generation_pb2_grpc

LOOPBACK = ServerConfig("127.0.0.1", 0)
# A step waits for its draft block as long as it takes (a deployment gives up after 0.2 s and
# decodes that step alone). Which steps carry drafts then follows from the tokens, not from how busy
# the machine is, so "the request did speculate" holds on a loaded machine too. Only a drafter that
# fails (its stream ends) makes a step go without one, as the failure tests need.
PATIENT = LoopConfig(draft_wait_s=120.0)


@dataclass
class Cluster:
    servers: list[RunningServer]
    draft: DraftEngine
    target: LocalVerifier
    orchestrator: Orchestrator
    store: RedisSessionStore
    address: str  # the orchestrator's Generation service
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub
    tls: TlsFiles | None = None
    registries: dict | None = None  # role -> its Prometheus registry, when started with metrics

    def worker_server(self) -> ServerConfig:
        """How another worker of this deployment serves (mutual TLS when on)."""
        return replace(LOOPBACK, tls=self.tls, require_client_cert=self.tls is not None)

    def worker_channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a worker as the deployment's orchestrator opens it (mutual TLS when on)."""
        return internal_channel(address, self.tls)

    def client_channel(self) -> grpc.aio.Channel:
        """Another client's channel to the orchestrator."""
        return open_channel(self.address, client_tls(self.tls.ca_file) if self.tls else None)

    async def active_sessions(self) -> tuple[int, int]:
        """Open sessions on (draft worker, target worker)."""
        return self.draft.status().active_sessions, (await self.target.status()).active_sessions

    async def stop(self) -> None:
        await self.orchestrator.aclose()
        await self.channel.close()
        for s in reversed(self.servers):
            await s.stop(0)
        await self.store.close()


async def start_cluster(target_path: str, draft_path: str, redis_url: str, prefix: str,
                        config: OrchestratorConfig | None = None, api_keys: tuple[str, ...] = (),
                        service_token: str | None = None, tls: TlsFiles | None = None, metrics: bool = False,
                        target_dtype: str = "float32", target_numerics: str = "fast", eagle_head: str | None = None,
                        in_verifier: tuple[str, ...] = (), layer_skip: str = "") -> Cluster:
    """``api_keys``: the client API's keys; ``service_token``: the internal hops' (none: open);
    ``tls``: TLS on every hop, mutual between roles (none: plaintext); ``metrics``: a registry per role;
    ``target_dtype``, ``target_numerics``: the verifier's precision and numerics (TargetConfig);
    ``eagle_head``: the drafter also serves ``eagle`` with this head; ``in_verifier``: drafters the
    verifier runs itself (with that head), which the draft worker then does not serve; ``layer_skip``:
    the drafter also serves ``layer_skip`` (DraftConfig.layer_skip)."""
    registries = {role: CollectorRegistry() for role in ("draft", "target", "orchestrator")} if metrics else {}
    internal = replace(LOOPBACK, credentials=Credentials((service_token,) if service_token else ()), tls=tls,
                       require_client_cert=tls is not None)
    draft_server, draft = await roles.start_draft(DraftConfig(draft_path, target_path, eagle_head_path=None if in_verifier else eagle_head,
                                                                   layer_skip=layer_skip), internal, registries.get("draft"))
    target_config = TargetConfig(target_path, dtype=target_dtype, numerics=target_numerics)
    own = DraftConfig(None, target_path, eagle_head_path=eagle_head) if in_verifier else None
    target_server, target = await roles.start_target(target_config, internal, loop_config=PATIENT, service_token=service_token,
                                                     registry=registries.get("target"), in_verifier=own, in_verifier_drafters=in_verifier)
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    # Ceilings, not detection times: no test here freezes a worker and waits to see it noticed.
    upstreams = roles.Upstreams(draft_server.address, target_server.address, target_path, timeout_s=120.0, step_timeout_s=120.0,
                                service_token=service_token, tls=tls)
    orch_server, orch = await roles.start_orchestrator(config or OrchestratorConfig(max_new_tokens_limit=256), upstreams, store,
                                                       replace(LOOPBACK, credentials=Credentials(api_keys), tls=tls),
                                                       registry=registries.get("orchestrator"))
    channel = open_channel(orch_server.address, client_tls(tls.ca_file) if tls else None)
    return Cluster([draft_server, target_server, orch_server], draft, target, orch, store, orch_server.address, channel,
                   generation_pb2_grpc.GenerationStub(channel), tls, registries or None)


@contextlib.asynccontextmanager
async def drafts_settle_before_each_verify(cluster: Cluster, ceiling_s: float = 60.0) -> AsyncIterator[list[str]]:
    """Overlap made deterministic, for tests that assert what it did.

    Normally the drafter drafts ahead while the verifier verifies, and which pre-drafted blocks are
    ready when an outcome arrives depends on which thread the OS ran first (on 2 busy cores, a test
    that counted "steps that used a block drafted ahead" failed by chance). Inside this context:

    - before each verification, the verifier waits until the drafter has applied every outcome sent
      to it and has drafted everything it planned: its block in flight and every pre-draft for that
      block's outcomes (the draft thread idle, nothing left in the session's plan);
    - a step waits for its block as long as it takes (``draft_wait_s`` = ``ceiling_s``), never
      decoding without one because the drafter was a moment late.

    Which blocks exist, and which one each step uses, then follows from the tokens alone. Yields
    the session ids whose wait hit ``ceiling_s`` (the caller asserts there are none). Touches the
    engines' internals on purpose: test scaffolding, not an API.
    """
    draft, verifier = cluster.draft, cluster.target
    running = [0]  # jobs the draft thread has picked and not finished (under draft._lock)
    late: list[str] = []
    loop = asyncio.get_running_loop()
    job_done = asyncio.Event()  # set (from the draft thread) whenever a job ends: time to look again
    real_next_job = draft._next_job  # called under draft._lock, on the draft thread
    real_step = verifier.scheduler.step
    real_config = verifier.config

    def next_job():
        job = real_next_job()
        if job is None:
            return None
        running[0] += 1

        def run() -> None:
            try:
                job()
            finally:
                with draft._lock:
                    running[0] -= 1
                loop.call_soon_threadsafe(job_done.set)
        return run

    def settled(session_id: str) -> bool:
        target_session = verifier.scheduler.engine.sessions.peek(session_id)
        with draft._lock:
            speculator = draft.sessions.peek(session_id)
            if speculator is None or target_session is None or running[0]:
                return False
            if len(speculator.committed) != len(target_session.committed):
                return False  # an outcome is still on its way to the drafter
            # Nothing left to draft: k = 0, or the block in flight is out and every pre-draft planned for it is drafted.
            return speculator.k <= 0 or (speculator._in_flight is not None and not speculator._plan)

    async def step(plan, ticket):
        session_id = plan.run.spec.session_id
        deadline = loop.time() + ceiling_s
        while True:
            job_done.clear()
            if settled(session_id):
                break
            if loop.time() > deadline:
                late.append(session_id)
                break
            try:  # woken by the next job's end; an outcome arriving sets nothing, hence the short timeout
                await asyncio.wait_for(job_done.wait(), 0.005)
            except asyncio.TimeoutError:
                pass
        return await real_step(plan, ticket)

    draft._next_job = next_job
    verifier.scheduler.step = step
    verifier.config = replace(real_config, draft_wait_s=ceiling_s)
    try:
        yield late
    finally:
        del draft._next_job, verifier.scheduler.step  # back to the classes' own methods
        verifier.config = real_config


@contextlib.asynccontextmanager
async def held_at_drain(server: RunningServer, grace_s: float) -> AsyncIterator[None]:
    """``server.stop(grace_s)`` started and held just as it begins to drain (everything before the
    drain, health turning NOT_SERVING included, done); it goes on when the block ends. What a probe
    asks inside is asked during the drain, however slow the machine (a fixed sleep made it a race)."""
    reached, release = asyncio.Event(), asyncio.Event()
    real_stop = server.server.stop

    async def stop(grace):
        reached.set()
        await release.wait()
        return await real_stop(grace)

    server.server.stop = stop
    stopping = asyncio.ensure_future(server.stop(grace_s))
    try:
        await asyncio.wait_for(asyncio.shield(reached.wait()), 60)
        yield
    finally:
        release.set()
        await stopping
