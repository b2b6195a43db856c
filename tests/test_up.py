"""What `specdec up` starts in each topology (the processes themselves serve in tests/test_cli.py)."""
from __future__ import annotations

from specdec.cli import build_parser
from specdec.up import plan, up_http_ports, up_ports

COMMON = ["python", "-m", "specdec", "serve"]


def planned(*flags: str):
    args = build_parser().parse_args(["up", *flags])
    return plan(args, list(COMMON), "127.0.0.1", up_ports(9000, args.replicas), up_http_ports(9000, args.replicas, None))


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_colocated_is_the_default_and_runs_no_draft_worker():
    topology = planned()
    assert topology.name == "colocated"
    assert sorted(topology.commands) == ["orchestrator", "target"]
    target, orchestrator = topology.commands["target"], topology.commands["orchestrator"]
    assert flag(target, "--in-verifier-drafters") == "all"  # the verifier drafts every session itself
    assert flag(orchestrator, "--drafter-address") == ""  # and the orchestrator places none on a worker
    assert "--threads" not in target  # measured per forward over every core
    assert "no draft worker" in topology.summary and "cores" in topology.summary


def test_colocated_keeps_explicit_threads_and_drafters():
    target = planned("--threads", "2", "--in-verifier-drafters", "model,ngram").commands["target"]
    assert flag(target, "--threads") == "2" and flag(target, "--in-verifier-drafters") == "model,ngram"


def test_split_runs_a_draft_worker_beside_each_verifier_with_one_thread_each():
    topology = planned("--topology", "split", "--replicas", "2")
    assert sorted(topology.commands) == ["draft-0", "draft-1", "orchestrator-0", "orchestrator-1", "target-0", "target-1"]
    assert all(flag(argv, "--threads") == "1" for argv in topology.commands.values())
    assert flag(topology.commands["orchestrator-1"], "--drafter-address") == "127.0.0.1:9001,127.0.0.1:9004"
    assert "--in-verifier-drafters" not in topology.commands["target-0"]
    assert "draft hop" in topology.summary


async def test_an_orchestrator_without_a_draft_worker_needs_a_verifier_that_drafts(tiny_pair):
    """`--drafter-address ''` (the colocated topology's orchestrator) over a verifier that drafts
    nothing itself: start-up stops with what to do, instead of serving requests that cannot speculate."""
    import pytest

    from specdec import roles
    from specdec.core.errors import SpecdecError
    from specdec.core.sessions import InMemorySessionStore
    from specdec.orchestrator.request import OrchestratorConfig
    from specdec.rpc.server import ServerConfig
    from specdec.target.engine import TargetConfig

    target, _ = tiny_pair
    loopback = ServerConfig("127.0.0.1", 0)
    server, _ = await roles.start_target(TargetConfig(target, threads=1), loopback)
    try:
        upstreams = roles.Upstreams("", server.address, target, timeout_s=30.0)
        with pytest.raises(SpecdecError, match="--in-verifier-drafters"):
            await roles.start_orchestrator(OrchestratorConfig(), upstreams, InMemorySessionStore(), loopback, wait_s=30.0)
    finally:
        await server.stop(0)
