"""The autoscaler's loop end to end: real /metrics servers, the real kubernetes client, a FAKE API server."""
from __future__ import annotations

import argparse
import socket

import pytest
from prometheus_client import CollectorRegistry

from fake_kube_api import FakeKubeApi
from specdec import metrics as m
from specdec.autoscale import kube, run
from specdec.autoscale.observe import MetricsTargets, Observer
from specdec.autoscale.policy import PolicyConfig, PoolLimits

NS = "specdec"
CONFIG = PolicyConfig(target_limits=PoolLimits(1, 8), draft_limits=PoolLimits(1, 8), scale_up_cooldown_s=60,
                      scale_down_cooldown_s=300)


class FakeClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """Two verifiers, one drafter and one orchestrator exporting metrics; Deployments at 2 and 1 replicas."""

    def __init__(self) -> None:
        self.api = FakeKubeApi({(NS, "specdec-target"): 2, (NS, "specdec-draft"): 1}).start()
        self.servers = []
        self.verifiers = [m.VerifierMetrics(self._registry()) for _ in range(2)]
        self.drafter = m.DrafterMetrics(self._registry())
        self.orchestrator = m.OrchestratorMetrics(self._registry())

    def _registry(self) -> CollectorRegistry:
        registry = CollectorRegistry()
        self.servers.append(m.start_metrics_server(registry, "127.0.0.1", 0))
        return registry

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.servers[i].port}"

    def targets(self) -> MetricsTargets:
        ports = [(("127.0.0.1", s.port),) for s in self.servers]
        return MetricsTargets(target=ports[0] + ports[1], draft=ports[2], orchestrator=ports[3])

    def busy_window(self, seconds: float = 10.0, queued: int = 0) -> None:
        """A window of hot verifiers (0.95 busy) and a drafter 0.9 busy at 7.5 ms a token."""
        for v in self.verifiers:
            for _ in range(100):
                v.observe_round(6, 4)
            v.busy_clock.add(0.95 * seconds)
            v.set_queued_steps(queued)
        self.drafter.observe_drafted(1200)
        self.drafter.busy_clock.add(0.9 * seconds)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.api.stop()


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.stop()


@pytest.fixture
def scaler(cluster):
    client = kube.api_client(host=cluster.api.url)
    yield kube.DeploymentScaler(client, NS, request_timeout_s=5)
    client.close()


def autoscaler(cluster: Cluster, scaler, dry_run: bool, clock: FakeClock, lines: list[str]) -> run.Autoscaler:
    return run.Autoscaler(Observer(cluster.targets(), clock=clock), scaler, CONFIG, dry_run=dry_run,
                          report=lines.append, clock=clock)


def test_dry_run_says_what_it_would_do_and_patches_nothing(cluster, scaler):
    clock, lines = FakeClock(), []
    loop = autoscaler(cluster, scaler, True, clock, lines)
    first = loop.step()
    assert not first.target.changed and not first.draft.changed  # one scrape: no window yet
    assert "no measurement window yet" in lines[0]
    cluster.busy_window()
    clock.now += 10
    decision = loop.step()
    # 2 verifiers 0.95 busy / 0.7 = 2.71 -> 3; drafts: 20 rounds/s x 6 tokens x 7.5 ms = 0.9 draft-s/s / 0.7 -> 2.
    assert (decision.target.desired, decision.draft.desired) == (3, 2)
    assert lines[2].startswith("dry-run: target: 2 -> 3: scale up")
    assert lines[3].startswith("dry-run: draft: 1 -> 2: scale up")
    assert "20.0 rounds/s x 6.00 draft tokens/round x 7.500 ms/token" in lines[3]
    assert cluster.api.patches() == []
    assert cluster.api.deployments == {(NS, "specdec-target"): 2, (NS, "specdec-draft"): 1}


def test_patch_mode_scales_then_respects_the_cooldown(cluster, scaler):
    clock, lines = FakeClock(), []
    loop = autoscaler(cluster, scaler, False, clock, lines)
    loop.step()
    cluster.busy_window()
    clock.now += 10
    loop.step()
    patches = cluster.api.patches()
    assert [(p.path.split("/")[-2], p.body) for p in patches] == [
        ("specdec-target", {"spec": {"replicas": 3}}), ("specdec-draft", {"spec": {"replicas": 2}})]
    assert "scaled specdec-target from 2 to 3" in lines
    # Still hot, and now a queue (the new pods are loading): it wants more, but the cooldown holds.
    cluster.busy_window(queued=6)
    clock.now += 10
    decision = loop.step()
    assert decision.target.current == 3 and not decision.target.changed  # the replicas came from the API
    assert "cooldown" in decision.target.reason
    assert len(cluster.api.patches()) == 2
    # After the cooldown it goes on.
    cluster.busy_window(queued=6)
    clock.now += 60
    assert loop.step().target.desired == 6
    assert cluster.api.deployments[(NS, "specdec-target")] == 6


def test_a_failed_patch_is_retried_next_step(cluster, scaler):
    clock, lines = FakeClock(), []
    loop = autoscaler(cluster, scaler, False, clock, lines)
    loop.step()
    cluster.api.fail_patches = True
    cluster.busy_window()
    clock.now += 10
    loop.step()
    assert cluster.api.deployments[(NS, "specdec-target")] == 2
    cluster.api.fail_patches = False
    cluster.busy_window()
    clock.now += 10
    loop.step()  # no cooldown: the failed scale-up was never recorded as done
    assert cluster.api.deployments == {(NS, "specdec-target"): 3, (NS, "specdec-draft"): 2}
    assert len(cluster.api.patches()) == 4


def test_an_unreachable_api_server_holds(cluster):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = kube.api_client(host=dead)
    try:
        loop = run.Autoscaler(Observer(cluster.targets()), kube.DeploymentScaler(client, NS, 2), CONFIG, report=print)
        assert loop.step() is None
    finally:
        client.close()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_main_dry_run_from_the_command_line(cluster, capsys):
    args = parse("--namespace", NS, "--kube-api", cluster.api.url, "--dry-run", "--iterations", "2",
                 "--interval-s", "0.05", "--target-metrics", f"{cluster.address(0)},{cluster.address(1)}",
                 "--draft-metrics", cluster.address(2), "--orchestrator-metrics", cluster.address(3))
    assert run.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4  # two decisions, two pools each
    assert all(line.startswith("dry-run: ") for line in out)
    assert out[0].startswith("dry-run: target: 2 -> 2: hold")
    assert cluster.api.patches() == []


def test_main_patches_into_the_limits(cluster, capsys):
    cluster.api.deployments[(NS, "specdec-target")] = 9
    args = parse("--namespace", NS, "--kube-api", cluster.api.url, "--iterations", "1", "--max-target", "5",
                 "--target-metrics", cluster.address(0), "--draft-metrics", cluster.address(2))
    assert run.main(args) == 0
    assert [p.body for p in cluster.api.patches()] == [{"spec": {"replicas": 5}}]
    assert "scaled specdec-target from 9 to 5" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [(), ("--target-metrics", "a:1", "--draft-metrics", "no-port"),
                                  ("--target-metrics", "a:1", "--draft-metrics", "b:2", "--min-draft", "3", "--max-draft", "2")])
def test_main_refuses_a_bad_command_line(argv, capsys):
    assert run.main(parse(*argv)) == 2
    assert "specdec autoscale:" in capsys.readouterr().err
