"""The `specdec` command as a user runs it: real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.ports import free_ports
from specdec.core.llama_decode import native_bf16
from specdec.v1 import common_pb2, generation_pb2 as pb, generation_pb2_grpc

ENV = {**os.environ, "SPECDEC_TARGET_MODEL": "", "SPECDEC_DRAFT_MODEL": "", "SPECDEC_API_KEYS_FILE": ""}


def specdec(*args: str, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True, timeout=timeout, env=env or ENV)


def in_process(*args: str, capsys) -> tuple[int, str, str]:
    """``specdec ARGS`` through the same entry point in this process (no interpreter to start): (exit code, stdout, stderr)."""
    from specdec import cli

    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_in_one_process(tiny_pair, capsys):
    target, draft = tiny_pair
    out = specdec("generate", "def add(a, b):", "--target", target, "--draft", draft, "--max-new-tokens", "12", "-k", "3", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["usage"]["completion_tokens"] == len(result["token_ids"]) == 12
    assert result["finish_reason"] == "length"
    assert result["stats"]["draft_tokens"] > 0 and result["stats"]["verify_steps"] >= 1
    # The reference HF forward gives the same greedy tokens as the default lean forward (the same
    # command, run in this process: one real process above is enough to show the command works).
    common = ("generate", "def add(a, b):", "--target", target, "--draft", draft, "--max-new-tokens", "12", "-k", "3", "--json")
    code, stdout, stderr = in_process(*common, "--reference-forward", capsys=capsys)
    assert code == 0, stderr
    assert json.loads(stdout)["token_ids"] == result["token_ids"]
    # So does a bf16 draft, where the CPU has native bf16: the draft's precision changes how much is
    # accepted, never what.
    if native_bf16():
        code, stdout, stderr = in_process(*common, "--draft-dtype", "bfloat16", capsys=capsys)
        assert code == 0, stderr
        assert json.loads(stdout)["token_ids"] == result["token_ids"]


def test_an_unknown_draft_dtype_is_refused_by_name(capsys):
    from specdec.draft.model_drafter import resolve_draft_dtype

    with pytest.raises(ValueError, match="float32, bfloat16"):
        resolve_draft_dtype("fp8")
    code, _, err = in_process("generate", "x", "--draft-dtype", "fp8", capsys=capsys)
    assert code == 2 and "--draft-dtype" in err


def test_generate_without_models_says_how_to_pass_one(tmp_path, monkeypatch):
    from specdec import cli_common

    monkeypatch.setattr(cli_common, "DEMO_DIR", tmp_path)  # as on an install without the demo pair
    with pytest.raises(cli_common.UsageError, match="--target PATH"):
        cli_common.model_path(None, cli_common.ENV_TARGET, "target")


def test_draft_with_another_tokenizer_is_refused(tiny_pair, tmp_path, capsys):
    from tiny_models import build_model, build_tokenizer

    target, _ = tiny_pair
    other = build_model(tmp_path / "other", build_tokenizer(tmp_path, vocab_size=300), hidden=32, layers=1, seed=3)
    code, _, err = in_process("generate", "x = 1", "--target", target, "--draft", str(other), "--max-new-tokens", "2", capsys=capsys)
    assert code == 2
    assert "different tokenizer" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- --drafter, as --help offers it
def test_help_offers_every_registered_drafter_and_nothing_else(capsys):
    from specdec.cli_common import DRAFTERS
    from specdec.draft.drafters import NAMES

    assert sorted(DRAFTERS) == sorted(NAMES)  # --help's list is DRAFTERS
    code, out, _ = in_process("generate", "--help", capsys=capsys)
    assert code == 0
    text = " ".join(out.split())  # argparse wraps lines
    offered = text[text.index("--drafter DRAFTER ") + len("--drafter DRAFTER "):].split(" (default: model)")[0]
    assert sorted(part.split(":")[0].strip() for part in offered.split(";")) == sorted(NAMES), offered


def test_an_unknown_drafter_is_refused_with_every_drafter_there_is(tiny_pair, capsys):
    """Before any model loads, and naming all of them: `model` and `tree` too, which this process
    loads only when they are asked for."""
    from specdec.draft.drafters import NAMES

    target, _ = tiny_pair
    code, _, err = in_process("generate", "x", "--target", target, "--drafter", "nope", "--threads", "1", capsys=capsys)
    assert code == 2 and "unknown drafter 'nope'" in err
    assert all(f" {name}" in err for name in NAMES), err
    assert "model" in NAMES and "tree" in NAMES


def test_every_drafter_works_as_help_offers_it(tiny_pair, capsys, monkeypatch):
    """`--drafter NAME` alone, for every name: greedy output equals the default drafter's (lossless),
    or, for the EAGLE drafters (which need a head trained on the target: the tiny pair has none),
    the refusal says which flag gives one. `layer_skip` alone means `--layer-skip auto`."""
    from specdec.draft.drafters import NAMES

    monkeypatch.delenv("SPECDEC_EAGLE_HEAD", raising=False)
    target, draft = tiny_pair
    common = ("generate", "def add(a, b):", "--target", target, "--draft", draft, "--max-new-tokens", "8", "-k", "3",
              "--json", "--threads", "1")
    code, stdout, stderr = in_process(*common, capsys=capsys)
    assert code == 0, stderr
    expected = json.loads(stdout)["token_ids"]
    for name in NAMES:
        code, stdout, stderr = in_process(*common, "--drafter", name, capsys=capsys)
        if name in ("eagle", "eagle_tree"):
            assert code == 2 and f"--drafter {name} needs" in stderr and "--eagle-head PATH" in stderr, stderr
            continue
        assert code == 0, f"{name}: {stderr}"
        assert json.loads(stdout)["token_ids"] == expected, name
    # A drafter the flags given rule out says which flag: trees need the lean draft forward.
    code, _, stderr = in_process(*common, "--drafter", "tree", "--reference-forward", capsys=capsys)
    assert code == 2 and "--drafter tree needs" in stderr and "--reference-forward" in stderr, stderr


def free_port_block(n: int = 3) -> int:
    """A base port with n consecutive free ports (outside the ephemeral range: specdec/ports.py)."""
    return free_ports(n)


def wait_healthy(address: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.time() + timeout_s
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(service="specdec.v1.Generation"), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            assert time.time() < deadline and proc.poll() is None, f"{address} did not become healthy"
            time.sleep(0.3)


def test_up_starts_one_process_per_role_each_over_every_worker():
    """What `specdec up` runs (the processes themselves: the test below)."""
    from specdec.up import up_commands, up_ports

    common = ["python", "-m", "specdec", "serve"]
    one = up_commands(common, "127.0.0.1", up_ports(9000, 1), "redis://r")
    assert sorted(one) == ["draft", "orchestrator", "target"]
    assert one["orchestrator"][len(common):] == ["orchestrator", "--port", "9000", "--drafter-address", "127.0.0.1:9001",
                                                 "--verifier-address", "127.0.0.1:9002", "--redis-url", "redis://r"]
    two = up_commands(common, "127.0.0.1", up_ports(9000, 2), "redis://r")
    assert sorted(two) == ["draft-0", "draft-1", "orchestrator-0", "orchestrator-1", "target-0", "target-1"]
    assert all("127.0.0.1:9001,127.0.0.1:9004" in argv for argv in two.values())  # every one over both drafters


@pytest.mark.timeout(900)  # four processes, the verifiers loading both models, twice two of them
def test_up_serves_against_redis_and_restarts_a_process_that_dies(tiny_pair, redis_url, capsys):
    """`specdec up --replicas 2` (colocated, the default): four processes against Redis, each verifier
    drafting its own sessions. Greedy and seeded requests through it
    give what one process gives; its HTTP API answers on the ports after the gRPC ones, and it prints
    their URLs and one warning for running without keys; kill -9 one verifier and one orchestrator,
    and a client given both orchestrators still gets the whole greedy completion; `up` restarts the
    two. (One `up` for all of it: each start costs seconds of model loading per process.)"""
    import signal

    from specdec.up import up_ports

    target, draft = tiny_pair
    base = free_port_block(6)
    ports = up_ports(base, 2)
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "up", "--target", target, "--draft", draft, "--replicas", "2",
                             "--base-port", str(base), "--redis-url", redis_url], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for port in ports["orchestrator"]:
            wait_healthy(f"127.0.0.1:{port}", proc)
        address = f"127.0.0.1:{ports['orchestrator'][0]}"
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            reply = stub.Generate(pb.GenerateRequest(text="import os\n", max_new_tokens=10,
                                                     sampling=common_pb2.SamplingParams(temperature=0)), timeout=60)
            assert len(reply.token_ids) == 10
            info = stub.GetSession(pb.GetSessionRequest(session_id=reply.session_id), timeout=10)
            assert list(info.output_token_ids) == list(reply.token_ids)
        # The OpenAI-compatible HTTP API of orchestrator 0, after the gRPC ports (base + 3 x replicas).
        http_url = f"http://127.0.0.1:{base + 6}/v1"
        completion = None
        deadline = time.time() + 60
        while completion is None and time.time() < deadline:  # HTTP binds just after gRPC turns healthy
            try:
                completion = httpx.post(http_url + "/completions", json={"prompt": "import os\n", "max_tokens": 6,
                                                                         "temperature": 0}, timeout=60)
            except httpx.ConnectError:
                time.sleep(0.2)
        assert completion is not None and completion.status_code == 200, completion and completion.text
        assert completion.json()["usage"]["completion_tokens"] == 6
        assert completion.json()["model"] == os.path.basename(target)
        # Seed-exact: the same seed gives the same text through `specdec up` (adaptive k, model
        # drafter) as in one process without speculation, and with another drafter and k.
        seeded = ("--seed", "5", "--temperature", "0.8", "--top-p", "0.95", "--max-new-tokens", "12", "--json")
        remote = specdec("generate", "def add(a, b):", "--server", address, *seeded)
        assert remote.returncode == 0, remote.stderr
        remote_ids = [int(t) for t in json.loads(remote.stdout)["token_ids"]]
        for extra in (("-k", "0"), ("--drafter", "ngram", "-k", "3")):
            code, stdout, stderr = in_process("generate", "def add(a, b):", "--target", target, "--draft", draft, *seeded, *extra,
                                              capsys=capsys)
            assert code == 0, stderr
            assert json.loads(stdout)["token_ids"] == remote_ids, f"seeded output changed with {extra}"

        servers = ",".join(f"127.0.0.1:{p}" for p in ports["orchestrator"])
        code, stdout, stderr = in_process("generate", "def f():", "--server", servers, "--max-new-tokens", "40", "--json", capsys=capsys)
        assert code == 0, stderr
        before = json.loads(stdout)["token_ids"]
        # Four processes: every orchestrator and verifier is a separate child of `up`, and no draft worker.
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 4

        def child_on(port: int) -> int:
            for pid in children:
                cmdline = open(f"/proc/{pid}/cmdline").read().split("\0")
                if "--port" in cmdline and cmdline[cmdline.index("--port") + 1] == str(port):
                    return int(pid)
            raise AssertionError(f"no child serves port {port}")

        for port in (ports["target"][0], ports["orchestrator"][0]):
            os.kill(child_on(port), signal.SIGKILL)
        code, stdout, stderr = in_process("generate", "def f():", "--server", servers, "--max-new-tokens", "40", "--json", capsys=capsys)
        assert code == 0, stderr
        assert json.loads(stdout)["token_ids"] == before
        wait_healthy(f"127.0.0.1:{ports['orchestrator'][0]}", proc)  # restarted
        restarted = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(restarted) == 4 and len(set(restarted) - set(children)) == 2
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert out.count("restarting it") == 2, out
    for port in (base + 6, base + 7):
        assert f"OpenAI-compatible HTTP API on http://127.0.0.1:{port}/v1" in out, out
    warnings = [line for line in out.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "open to anyone" in warnings[0] and "--api-keys-file" in warnings[0], warnings


async def test_servers_offer_health_and_reflection(cluster):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channels = [cluster.worker_channel(cluster.servers[0].address), cluster.worker_channel(cluster.servers[1].address),
                cluster.client_channel()]
    for channel, service in zip(channels, ["specdec.v1.Drafter", "specdec.v1.Verifier", "specdec.v1.Generation"]):
        async with channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = [r async for r in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
            names = {s.name for s in replies[0].list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names


def test_exact_numerics_keep_greedy_output_equal_to_k0_in_the_target_dtype(tiny_pair, capsys):
    """--dtype/--numerics reach the target: speculative greedy output equals specdec's own k = 0 in
    the same dtype (bfloat16 where the CPU has it natively), and impossible combinations are refused."""
    target, draft = tiny_pair
    dtype = "bfloat16" if native_bf16() else "float32"
    common = ("generate", "def add(a, b):", "--target", target, "--draft", draft, "--max-new-tokens", "16", "--json",
              "--numerics", "exact", "--dtype", dtype, "--threads", "1")
    outputs = {}
    for k in ("0", "3"):
        code, stdout, stderr = in_process(*common, "-k", k, capsys=capsys)
        assert code == 0, stderr
        outputs[k] = json.loads(stdout)["token_ids"]
    assert outputs["3"] == outputs["0"] and len(outputs["0"]) == 16
    code, _, stderr = in_process(*common, "--reference-forward", capsys=capsys)
    assert code == 2 and "--numerics exact needs specdec's lean forward" in stderr
