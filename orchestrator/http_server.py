"""Serving the HTTP API with uvicorn inside the orchestrator's own event loop.

The socket is bound here (a port taken is an OSError at start-up, not uvicorn's sys.exit), TLS uses
the gRPC server's certificate and key, and the process's signals stay with the caller (specdec's
serve_forever drains gRPC and HTTP together).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from specdec.orchestrator.http import HttpApi
from specdec.rpc.tls import TlsFiles

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def capture_signals(self):  # the orchestrator's loop owns SIGINT/SIGTERM
        return contextlib.nullcontext()


class HttpServer:
    """A started HTTP server: its URL, and how to drain and stop it."""

    def __init__(self, api: HttpApi, server: _Server, task: asyncio.Task, url: str) -> None:
        self.api, self._server, self._task, self.url = api, server, task, url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def begin_drain(self) -> None:
        """New requests get 503 (with Retry-After); those in flight go on."""
        self.api.draining = True

    async def stop(self, grace_s: float = 5.0) -> None:
        """Drain: refuse new requests, give streams in flight ``grace_s`` to end, then close."""
        self.begin_drain()
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await self._task


async def start_http(api: HttpApi, host: str, port: int, tls: TlsFiles | None = None) -> HttpServer:
    """Bind ``host:port`` (0: a free port) and serve ``api`` there, with TLS when ``tls`` is given."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"could not bind the HTTP port {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    ssl = dict(ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file) if tls is not None else {}
    config = uvicorn.Config(api.app, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            **ssl)
    server = _Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:  # startup is quick: the socket is bound already
        if task.done():
            sock.close()
            task.result()  # raises what failed
            raise OSError(f"the HTTP server on {host}:{port} did not start")
        await asyncio.sleep(0.01)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"{'https' if tls is not None else 'http'}://{shown}:{bound}"
    log.info("HTTP API on %s", url)
    return HttpServer(api, server, task, url)
