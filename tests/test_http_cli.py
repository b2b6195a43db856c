"""`specdec up` serves the OpenAI-compatible HTTP API by default and says where, and warns when
the client API is open to anyone; `up` hands each orchestrator its HTTP port."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from test_cli import free_port_block

ENV = {**os.environ, "SPECDEC_TARGET_MODEL": "", "SPECDEC_DRAFT_MODEL": "", "SPECDEC_API_KEYS_FILE": ""}


def test_up_gives_each_orchestrator_an_http_port():
    from specdec.cli import up_commands, up_http_ports, up_ports

    assert up_http_ports(50051, 1, None) == [50054]  # the port after the gRPC ones
    assert up_http_ports(50051, 2, 8000) == [8000, 8001]
    assert up_http_ports(50051, 2, -1) == []
    two = up_commands(["specdec", "serve"], "127.0.0.1", up_ports(9000, 2), "redis://r", up_http_ports(9000, 2, None))
    assert two["orchestrator-0"][-2:] == ["--http-port", "9006"] and two["orchestrator-1"][-2:] == ["--http-port", "9007"]
    assert "--http-port" not in two["target-0"] + two["draft-0"]


def test_up_serves_http_prints_its_url_and_warns_without_keys(tiny_pair, redis_url):
    target, draft = tiny_pair
    base = free_port_block(4)
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "up", "--target", target, "--draft", draft, "--base-port", str(base),
                             "--redis-url", redis_url], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        url = None
        deadline = time.time() + 120
        while url is None:
            line = proc.stdout.readline()
            assert line and time.time() < deadline, "".join(lines)
            lines.append(line)
            if "OpenAI-compatible HTTP API on " in line:
                url = line.split(" on ", 1)[1].strip()
        assert url == f"http://127.0.0.1:{base + 3}/v1"
        warnings = [line for line in lines if "warning" in line]
        assert len(warnings) == 1 and "open to anyone" in warnings[0] and "--api-keys-file" in warnings[0]
        reply = None
        while time.time() < deadline:  # the orchestrator binds HTTP just after gRPC turns healthy
            try:
                reply = httpx.post(url + "/completions", json={"prompt": "import os\n", "max_tokens": 6, "temperature": 0}, timeout=60)
                break
            except httpx.ConnectError:
                time.sleep(0.2)
        assert reply is not None and reply.status_code == 200, reply and reply.text
        assert reply.json()["usage"]["completion_tokens"] == 6
        assert reply.json()["model"] == os.path.basename(target)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
