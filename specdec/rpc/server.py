"""Serving a role: grpc.aio server with grpc.health.v1, reflection and graceful shutdown.

Shutdown follows grpc's async_greeter_server_with_graceful_shutdown example: health goes
NOT_SERVING first (load balancers stop sending), then in-flight RPCs get ``grace_s`` to finish.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.rpc.auth import BearerInterceptor, Credentials
from specdec.rpc.last_resort import LastResortInterceptor
from specdec.rpc.options import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES, SERVER_OPTIONS  # noqa: F401 (re-exported)
from specdec.rpc.tls import TlsFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (tests)
    grace_s: float = 5.0
    credentials: Credentials = field(default_factory=Credentials)  # accepted bearer secrets; empty: open
    tls: TlsFiles | None = None  # None: plaintext (loopback development)
    require_client_cert: bool = False  # workers: only callers holding a certificate of the deployment's CA
    # A second, plaintext port serving grpc.health.v1 only: probes (Kubernetes' native gRPC probes
    # cannot speak TLS, let alone present a client certificate) reach health and nothing else.
    health_port: int | None = None


class RunningServer:
    """A started server: its bound address, and how to stop it."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, address: str, names: Sequence[str],
                 health_server: grpc.aio.Server | None = None, health_address: str | None = None) -> None:
        self.server, self.health, self.address, self._names = server, health_servicer, address, names
        self.health_server, self.health_address = health_server, health_address

    async def stop(self, grace_s: float = 5.0) -> None:
        for name in (*self._names, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)
        if self.health_server is not None:  # probes see NOT_SERVING while the main port drains
            await self.health_server.stop(0)


async def start_server(config: ServerConfig, register: Callable[[grpc.aio.Server], None], service_names: Sequence[str]) -> RunningServer:
    """Bind to exactly what the config says; register the role's servicers; turn health to SERVING."""
    # Outermost first: authentication refuses before anything runs; the last resort wraps what does.
    interceptors = [BearerInterceptor(config.credentials)] if config.credentials.required else []
    interceptors.append(LastResortInterceptor())
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if config.tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, config.tls.server_credentials(config.require_client_cert))
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    await server.start()
    host = f"[{config.host}]" if ":" in config.host else config.host
    health_server = health_address = None
    if config.health_port is not None:
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)  # the same statuses, no other service
        health_bound = health_server.add_insecure_port(f"{config.host}:{config.health_port}")
        if health_bound == 0:
            await server.stop(0)
            raise OSError(f"could not bind the health port {config.host}:{config.health_port}")
        await health_server.start()
        health_address = f"{host}:{health_bound}"
    for name in (*service_names, ""):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, health_servicer, f"{host}:{port}", service_names, health_server, health_address)


async def serve_forever(running: RunningServer, grace_s: float, on_stop: Callable[[], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM, then drain gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving on %s", running.address)
    await stop.wait()
    log.info("draining (%.1fs grace)", grace_s)
    await running.stop(grace_s)
    if on_stop:
        on_stop()
