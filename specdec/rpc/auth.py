"""Who may call a server: bearer secrets in gRPC metadata (`authorization: Bearer <secret>`).

The client API accepts API keys; the workers accept the deployment's service token, which only its
orchestrators (and a verifier calling its drafter) hold. Secrets are compared in constant time and
never logged; a session records its owner as a short hash of the key (``principal``), never the key.
Health checks and server reflection stay open, so load balancers and probes need no secret.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                           "grpc.reflection.v1.ServerReflection"})
MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class Credentials:
    """The secrets a server accepts. Empty: no authentication (a development setup on loopback)."""

    secrets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for s in self.secrets:
            if len(s) < MIN_SECRET_CHARS or any(c.isspace() for c in s):
                raise ValueError(f"a key or token must be at least {MIN_SECRET_CHARS} characters without spaces")

    @property
    def required(self) -> bool:
        return bool(self.secrets)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Credentials":
        """One secret per line; blank lines and lines starting with # are skipped."""
        lines = Path(path).read_text().splitlines()
        return cls(tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")))


def principal(secret: str) -> str:
    """A stable, non-reversible name for whoever holds ``secret`` (what a session records as its owner)."""
    return "k" + hashlib.sha256(secret.encode()).hexdigest()[:16]


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            scheme, _, secret = value.partition(" ")
            return secret.strip() if scheme.lower() == "bearer" else None
    return None


def authenticate(metadata, credentials: Credentials) -> str | None:
    """The caller's principal, or None when the secret is missing or wrong ("" when none is required).

    Every configured secret is compared, in constant time, so timing says nothing about which is near."""
    if not credentials.required:
        return ""
    presented = bearer(metadata)
    if presented is None:
        return None
    matched = False
    for secret in credentials.secrets:
        matched |= hmac.compare_digest(presented.encode(), secret.encode())
    return principal(presented) if matched else None


def call_metadata(secret: str | None) -> tuple[tuple[str, str], ...] | None:
    """What a client sends with each call."""
    return (("authorization", f"Bearer {secret}"),) if secret else None


class BearerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection unless it carries an accepted secret: UNAUTHENTICATED."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service = details.method.strip("/").split("/")[0]
        if handler is None or service in OPEN_SERVICES or authenticate(details.invocation_metadata, self.credentials) is not None:
            return handler
        why = ("missing credentials: send metadata `authorization: Bearer <key>`" if bearer(details.invocation_metadata) is None
               else "invalid credentials: the key or token is not accepted here")
        return _denying(handler, why)


def _denying(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    async def deny(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
