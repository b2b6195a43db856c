"""TLS on every hop: the client API is TLS; the internal hops are mutual TLS under the deployment's CA.

One certificate and key per process (``--tls-cert``, ``--tls-key``) serve both as its server identity
and, where it calls another role (orchestrator → workers, verifier → drafter), as its client
identity; ``--tls-ca`` is the CA that signed the deployment's certificates. A worker given a CA
accepts only callers that present a certificate the CA signed (mutual TLS), so a foreign pod
cannot even open a stream; the client API never asks clients for a certificate (they send API keys).
``specdec certs`` makes a development CA and certificate (specdec/rpc/certs.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.rpc.options import CHANNEL_OPTIONS


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one process: its certificate chain and key, and the deployment's CA."""

    cert_file: str
    key_file: str
    ca_file: str | None = None

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None) -> "TlsFiles | None":
        """None when no flag is given; a clear error when only some are, or a file is unreadable."""
        if not (cert or key or ca):
            return None
        if not (cert and key):
            raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-ca for mutual TLS between roles)")
        files = cls(cert, key, ca)
        files._read()  # fail at start-up, not on the first call
        return files

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        def read(path: str, flag: str) -> bytes:
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from exc
            if b"-----BEGIN" not in data:
                raise ValueError(f"{flag} {path}: not a PEM file")
            return data

        return (read(self.cert_file, "--tls-cert"), read(self.key_file, "--tls-key"),
                read(self.ca_file, "--tls-ca") if self.ca_file else None)

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        if require_client_cert and ca is None:
            raise ValueError("mutual TLS needs --tls-ca: the CA whose certificates callers must present")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca if require_client_cert else None,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verifies the server against the CA (the system roots without one) and presents our certificate."""
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def client_tls(ca_file: str | None) -> grpc.ChannelCredentials | None:
    """A client of the public API: verify the orchestrator against ``ca_file`` (no client certificate)."""
    if ca_file is None:
        return None
    try:
        ca = Path(ca_file).read_bytes()
    except OSError as exc:
        raise ValueError(f"--tls-ca {ca_file}: {exc.strerror or exc}") from exc
    return grpc.ssl_channel_credentials(root_certificates=ca)


def open_channel(address: str, credentials: grpc.ChannelCredentials | None, server_name: str | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``address``: TLS with ``credentials``, plaintext without.

    ``server_name``: the name the server's certificate must carry, when ``address`` is one of the
    IPs a name resolved to (a pod behind a headless Service is dialled by IP, verified by name)."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", server_name)] if server_name else [])
    return grpc.aio.secure_channel(address, credentials, options=options)


def internal_channel(address: str, tls: TlsFiles | None, server_name: str | None = None) -> grpc.aio.Channel:
    """A channel from one role to another: mutual TLS when the process has TLS files."""
    return open_channel(address, tls.channel_credentials() if tls else None, server_name)
