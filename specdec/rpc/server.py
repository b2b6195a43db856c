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

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # raised on both ends on purpose: a long prompt's ids fit easily


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (tests)
    grace_s: float = 5.0
    credentials: Credentials = field(default_factory=Credentials)  # accepted bearer secrets; empty: open


CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class RunningServer:
    """A started server: its bound address, and how to stop it."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, address: str, names: Sequence[str]) -> None:
        self.server, self.health, self.address, self._names = server, health_servicer, address, names

    async def stop(self, grace_s: float = 5.0) -> None:
        for name in (*self._names, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)


async def start_server(config: ServerConfig, register: Callable[[grpc.aio.Server], None], service_names: Sequence[str]) -> RunningServer:
    """Bind to exactly what the config says; register the role's servicers; turn health to SERVING."""
    interceptors = [BearerInterceptor(config.credentials)] if config.credentials.required else []
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    await server.start()
    for name in (*service_names, ""):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = f"[{config.host}]" if ":" in config.host else config.host
    return RunningServer(server, health_servicer, f"{host}:{port}", service_names)


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
