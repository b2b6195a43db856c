"""TLS on every hop: the client API over TLS, workers admitting only holders of a certificate of the
deployment's CA (mutual TLS), ``specdec certs`` for a development CA. The session's ``cluster``
fixture runs with TLS on, so every end-to-end test goes through it too."""
from __future__ import annotations

import stat
from pathlib import Path

import grpc
import pytest

from specdec import cli
from specdec.rpc.certs import make_dev_certs
from specdec.rpc.tls import TlsFiles, client_tls, open_channel
from specdec.v1 import common_pb2, drafter_pb2_grpc, generation_pb2 as pb, verifier_pb2_grpc

from cluster import held_at_drain


@pytest.fixture(scope="module")
def foreign_ca(tmp_path_factory) -> TlsFiles:
    """A certificate from some other CA: valid TLS, not the deployment's."""
    paths = make_dev_certs(tmp_path_factory.mktemp("foreign"))
    return TlsFiles(str(paths["tls.crt"]), str(paths["tls.key"]), str(paths["ca.crt"]))


def test_certs_command_writes_a_ca_and_a_certificate_with_private_keys(tmp_path, capsys):
    assert cli.main(["certs", "--out", str(tmp_path), "--name", "specdec-target", "--name", "10.0.0.7"]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
    for key in ("ca.key", "tls.key"):
        assert stat.S_IMODE((tmp_path / key).stat().st_mode) == 0o600  # keys never world-readable
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"specdec-target", "localhost"} <= set(san.get_values_for_type(x509.DNSName))
    assert "--tls-cert" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "x.crt"], "both --tls-cert and --tls-key"),
    (["--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"], "--tls-cert /nonexistent.crt"),
])
def test_serve_refuses_incomplete_or_missing_tls_files_before_loading_anything(flags, message, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the TLS flags were checked")

    for module in ("specdec.core.models", "specdec.target.engine", "specdec.draft.model_drafter"):
        monkeypatch.setattr(f"{module}.load_causal_lm", no_loading)
    assert cli.main(["serve", "target", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_file_that_is_not_pem_is_named(tmp_path):
    junk = tmp_path / "junk.crt"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="not a PEM file"):
        TlsFiles.from_flags(str(junk), str(junk), None)


async def test_client_api_serves_tls_and_refuses_plaintext(cluster):
    reply = await cluster.stub.Generate(pb.GenerateRequest(text="def f():", max_new_tokens=3), timeout=30)
    assert reply.usage.completion_tokens == 3  # a client with only the CA (no certificate of its own) is served
    async with grpc.aio.insecure_channel(cluster.address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_stub(plain).Generate(pb.GenerateRequest(text="def f():", max_new_tokens=3), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_that_does_not_trust_the_ca_is_refused(cluster, foreign_ca):
    async with open_channel(cluster.address, client_tls(foreign_ca.ca_file)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_stub(channel).Generate(pb.GenerateRequest(text="def f():", max_new_tokens=3), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def pb_stub(channel):
    from specdec.v1 import generation_pb2_grpc

    return generation_pb2_grpc.GenerationStub(channel)


def _worker_calls(channel):
    return [drafter_pb2_grpc.DrafterStub(channel).GetWorkerStatus, verifier_pb2_grpc.VerifierStub(channel).GetWorkerStatus]


@pytest.mark.parametrize("caller", ["plaintext", "tls-without-certificate", "certificate-of-another-ca"])
async def test_workers_admit_only_certificates_of_the_deployment_ca(cluster, foreign_ca, caller):
    for index in (0, 1):  # draft worker, target worker
        address = cluster.servers[index].address
        if caller == "plaintext":
            channel = grpc.aio.insecure_channel(address)
        elif caller == "tls-without-certificate":
            channel = open_channel(address, client_tls(cluster.tls.ca_file))
        else:  # trusts our CA, but presents a certificate the deployment's CA never signed
            creds = grpc.ssl_channel_credentials(Path(cluster.tls.ca_file).read_bytes(), Path(foreign_ca.key_file).read_bytes(),
                                                 Path(foreign_ca.cert_file).read_bytes())
            channel = open_channel(address, creds)
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _worker_calls(channel)[index](common_pb2.WorkerStatusRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # refused, not left to its deadline
    async with cluster.worker_channel(cluster.servers[1].address) as channel:  # the deployment's own certificate is admitted
        assert (await _worker_calls(channel)[1](common_pb2.WorkerStatusRequest(), timeout=30)).vocab_size > 0


async def test_health_port_answers_probes_in_plaintext_and_serves_nothing_else(cluster, dev_tls):
    """Probes that cannot do TLS (Kubernetes' gRPC probes) use --health-port; the workers' API stays behind mutual TLS."""
    from dataclasses import replace

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.rpc.server import start_server

    server = await start_server(replace(cluster.worker_server(), health_port=0), lambda s: None, ["specdec.v1.Verifier"])
    try:
        async with grpc.aio.insecure_channel(server.health_address) as channel:
            check = health_pb2.HealthCheckRequest(service="specdec.v1.Verifier")
            assert (await health_pb2_grpc.HealthStub(channel).Check(check, timeout=30)).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verifier_pb2_grpc.VerifierStub(channel).GetWorkerStatus(common_pb2.WorkerStatusRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            async with held_at_drain(server, grace_s=0.5):  # draining: the probe port says so before it goes away
                status = (await health_pb2_grpc.HealthStub(channel).Check(check, timeout=30)).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await server.stop(0)
