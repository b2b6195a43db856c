"""A client-only install (`pip install specdec`: grpcio and protobuf) imports the client and the
stubs, runs `specdec generate --server` against a real orchestrator, and has every server command
say which packages are missing and how to get them (`pip install 'specdec[server]'`).

Each check runs in a fresh interpreter whose imports of the server extra's packages are refused by
a meta-path finder, as if they were not installed.
"""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from specdec.cli_common import SERVER_EXTRA_HINT, SERVER_PACKAGES
from specdec.v1 import common_pb2, generation_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
# The server extra's import names, plus what only development installs (grpc_tools) or the
# Kubernetes client (urllib3) bring.
BLOCKED = sorted({*SERVER_PACKAGES, "grpc_tools", "urllib3"})
BLOCKER_TEMPLATE = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: a client-only install)", name=name)
        return None
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], "imported before the blocker"
sys.meta_path.insert(0, _NotInstalled())
def heavy():
    return sorted({{m.split(".")[0] for m in sys.modules if m.split(".")[0] in BLOCKED}})
"""
BLOCKER = BLOCKER_TEMPLATE.format(blocked=BLOCKED)
CLIENT_IMPORTS = """
import specdec.client, specdec.cli
from specdec.v1 import common_pb2, common_pb2_grpc, generation_pb2, generation_pb2_grpc
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
specdec.cli.build_parser()  # every subcommand's flags, without their implementations
print(heavy())
"""


def blocked_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def specdec_argv(*args: str, blocked: list[str] = BLOCKED) -> list[str]:
    """`python -m specdec ARGS` in an interpreter without the server extra (or without ``blocked``)."""
    run = f"sys.argv = ['specdec', *{list(args)!r}]\nimport runpy\nrunpy.run_module('specdec', run_name='__main__')\n"
    return [sys.executable, "-c", BLOCKER_TEMPLATE.format(blocked=blocked) + run]


def test_the_blocker_blocks():
    out = blocked_python("import torch\n")
    assert out.returncode == 1 and "blocked: a client-only install" in out.stderr


def test_the_client_and_stubs_import_without_the_server_extra():
    out = blocked_python(CLIENT_IMPORTS)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_server_extra_in_pyproject_is_what_the_cli_checks_for():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower() for req in project["optional-dependencies"]["server"]}
    assert names == set(SERVER_PACKAGES.values())
    assert [re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0] for req in project["dependencies"]] == ["grpcio", "protobuf"]
    assert "specdec[server]" in project["optional-dependencies"]["dev"]
    # CUDA builds of torch 2.11 and later are admitted (a GPU machine keeps its own); CI installs the pinned CPU wheel.
    torch_req = next(Requirement(r) for r in project["optional-dependencies"]["server"] if r.startswith("torch"))
    assert all(torch_req.specifier.contains(v) for v in ("2.11.0", "2.11.0+cu130", "2.13.0", "2.13.0+cpu"))
    assert not torch_req.specifier.contains("2.10.0")
    assert "torch==2.13.0" in (ROOT / ".ci" / "run").read_text()


SERVER_COMMANDS = [  # (argv, a package the message must name)
    (("generate", "def f():"), "torch"),  # embedded: every role in this process
    (("serve", "draft"), "torch"),
    (("serve", "target"), "torch"),
    (("serve", "orchestrator"), "redis"),
    (("up",), "torch"),
    (("bench", "--skip-distributed"), "torch"),
    (("certs", "--out", "unused-certs"), "cryptography"),
    (("autoscale", "--dry-run"), "kubernetes"),
]


@pytest.mark.parametrize("args, names", SERVER_COMMANDS,
                         ids=["-".join(a[:2]) if a[0] == "serve" else a[0] for a, _ in SERVER_COMMANDS])
def test_a_server_command_without_the_extra_says_what_to_install(args, names, tmp_path):
    out = subprocess.run(specdec_argv(*args), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert SERVER_EXTRA_HINT in out.stderr and names in out.stderr, out.stderr
    assert not (tmp_path / "unused-certs").exists()


def test_a_missing_package_the_up_front_check_did_not_name_is_still_explained(tmp_path):
    """`up --tls` makes its CA before starting anything; cryptography is not among what `up`
    checks for, so the failed import itself is turned into the message."""
    out = subprocess.run(specdec_argv("up", "--tls", "--target", "t", "--draft", "d", blocked=["cryptography"]),
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "needs cryptography" in out.stderr and SERVER_EXTRA_HINT in out.stderr


async def test_generate_server_without_the_extra_talks_to_a_running_orchestrator(cluster):
    """`specdec generate --server` from a client-only interpreter, over TLS, equals the same
    greedy request made from here."""
    args = ["generate", "def add(a, b):", "--server", cluster.address, "--tls-ca", cluster.tls.ca_file,
            "--max-new-tokens", "8", "--temperature", "0", "--json"]
    run = (f"from specdec.cli import main\nrc = main({args!r})\n"
           "print('HEAVY', heavy(), file=sys.stderr)\nsys.exit(rc)\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", BLOCKER + run, cwd=ROOT,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=120)  # the servers run on this event loop
    assert proc.returncode == 0, stderr.decode()
    assert "HEAVY []" in stderr.decode()
    remote = json.loads(stdout)
    here = await cluster.stub.Generate(pb.GenerateRequest(text="def add(a, b):", max_new_tokens=8,
                                                          sampling=common_pb2.SamplingParams(temperature=0)), timeout=60)
    assert [int(t) for t in remote["token_ids"]] == list(here.token_ids) and len(here.token_ids) == 8
