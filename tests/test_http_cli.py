"""`up` hands each orchestrator its HTTP port. That a running `specdec up` serves the
OpenAI-compatible HTTP API there, says where and warns when the client API is open to anyone is
checked on the one `up` of tests/test_cli.py::test_up_serves_against_redis_and_restarts_a_process_that_dies."""
from __future__ import annotations


def test_up_gives_each_orchestrator_an_http_port():
    from specdec.up import up_commands, up_http_ports, up_ports

    assert up_http_ports(50051, 1, None) == [50054]  # the port after the gRPC ones
    assert up_http_ports(50051, 2, 8000) == [8000, 8001]
    assert up_http_ports(50051, 2, -1) == []
    two = up_commands(["specdec", "serve"], "127.0.0.1", up_ports(9000, 2), "redis://r", up_http_ports(9000, 2, None))
    assert two["orchestrator-0"][-2:] == ["--http-port", "9006"] and two["orchestrator-1"][-2:] == ["--http-port", "9007"]
    assert "--http-port" not in two["target-0"] + two["draft-0"]
