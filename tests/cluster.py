"""Real specdec roles for end-to-end tests: gRPC servers on loopback ports and a real Redis.

Each role is started the way ``specdec serve`` starts it (specdec.roles), inside the test's event
loop; only the process boundary is missing (tests/test_cli.py covers ``specdec up`` processes).
"""
from __future__ import annotations

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
from specdec.target.worker import LocalVerifier
from specdec.v1 import generation_pb2_grpc

LOOPBACK = ServerConfig("127.0.0.1", 0)


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
                        service_token: str | None = None, tls: TlsFiles | None = None, metrics: bool = False) -> Cluster:
    """``api_keys``: the client API's keys; ``service_token``: the internal hops' (none: open);
    ``tls``: TLS on every hop, mutual between roles (none: plaintext); ``metrics``: a registry per role."""
    registries = {role: CollectorRegistry() for role in ("draft", "target", "orchestrator")} if metrics else {}
    internal = replace(LOOPBACK, credentials=Credentials((service_token,) if service_token else ()), tls=tls,
                       require_client_cert=tls is not None)
    draft_server, draft = await roles.start_draft(DraftConfig(draft_path, target_path), internal, registries.get("draft"))
    target_server, target = await roles.start_target(TargetConfig(target_path), internal, service_token=service_token,
                                                     registry=registries.get("target"))
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    upstreams = roles.Upstreams(draft_server.address, target_server.address, target_path, service_token=service_token, tls=tls)
    orch_server, orch = await roles.start_orchestrator(config or OrchestratorConfig(max_new_tokens_limit=256), upstreams, store,
                                                       replace(LOOPBACK, credentials=Credentials(api_keys), tls=tls),
                                                       registry=registries.get("orchestrator"))
    channel = open_channel(orch_server.address, client_tls(tls.ca_file) if tls else None)
    return Cluster([draft_server, target_server, orch_server], draft, target, orch, store, orch_server.address, channel,
                   generation_pb2_grpc.GenerationStub(channel), tls, registries or None)
