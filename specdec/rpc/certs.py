"""``specdec certs``: a development CA and one certificate for every role of a deployment.

For trying TLS and for tests, not for production (use your cluster's issuer, e.g. cert-manager).
Writes, in the layout of a Kubernetes TLS Secret plus its CA:
  ca.crt, ca.key    the CA (keep ca.key away from the cluster)
  tls.crt, tls.key  a certificate for the names given (plus localhost and 127.0.0.1), valid both as a
                    server and as a client: each role serves with it and calls the others with it.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specdec development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # keep order, drop repeats
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_dev_certs(out_dir: str | os.PathLike, names: Sequence[str] = (), days: int = 30) -> dict[str, Path]:
    """Write ca.crt/ca.key and tls.crt/tls.key to ``out_dir``; returns the paths by file name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    valid_from, valid_to = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = _key()
    ca_cert = (x509.CertificateBuilder().subject_name(_name("specdec development CA")).issuer_name(_name("specdec development CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(valid_from).not_valid_after(valid_to)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))

    key = _key()
    all_names = (*names, *DEFAULT_NAMES)
    cert = (x509.CertificateBuilder().subject_name(_name(all_names[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid_from).not_valid_after(valid_to)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(all_names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    files = {"ca.crt": ca_cert.public_bytes(serialization.Encoding.PEM), "ca.key": pem_key(ca_key),
             "tls.crt": cert.public_bytes(serialization.Encoding.PEM), "tls.key": pem_key(key)}
    paths = {}
    for file_name, data in files.items():
        path = out / file_name
        # Keys readable by their owner only, from the moment they exist.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if file_name.endswith(".key") else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        paths[file_name] = path
    return paths
