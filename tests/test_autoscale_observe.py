"""Scrapes of real /metrics servers (specdec.metrics) into the loads the autoscaling policy reads."""
from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry

from specdec import metrics as m
from specdec.autoscale import observe as o


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Pod:
    """One role's process, as far as metrics go: a registry, its role's metrics and a /metrics server."""

    def __init__(self, role: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        make = {"target": m.VerifierMetrics, "draft": m.DrafterMetrics, "orchestrator": m.OrchestratorMetrics}[role]
        self.metrics = make(self.registry)
        self.server = m.start_metrics_server(self.registry, host, port)
        self.host, self.port = host, self.server.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def restart(self) -> None:
        """A new process on the same address: every counter starts again from zero."""
        self.server.stop()
        self.__init__(self.role, self.host, self.port)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def pods():
    started: list[Pod] = []

    def start(role: str, host: str = "127.0.0.1", port: int = 0) -> Pod:
        pod = Pod(role, host, port)
        started.append(pod)
        return pod

    yield start
    for pod in started:
        pod.stop()


def targets(*pods: Pod) -> tuple[tuple[str, int], ...]:
    return tuple((p.host, p.port) for p in pods)


def test_two_scrapes_give_rates_fractions_and_costs(pods):
    clock = FakeClock()
    v1, v2 = pods("target"), pods("target")
    d1, d2 = pods("draft"), pods("draft")
    orch = pods("orchestrator")
    observer = o.Observer(o.MetricsTargets(targets(v1, v2), targets(d1, d2), targets(orch)), clock=clock)
    v1.metrics.observe_round(4, 4)  # before the window: must not count
    first = observer.observe()
    assert first.window_s == 0.0 and first.target is None and first.draft is None

    for _ in range(10):
        v1.metrics.observe_round(4, 2)
    for _ in range(30):
        v2.metrics.observe_round(2, 1)
    v1.metrics.busy_clock.add(5.0)
    v2.metrics.busy_clock.add(8.0)
    v2.metrics.set_queued_steps(3)
    d1.metrics.observe_drafted(200)
    d1.metrics.busy_clock.add(0.4)
    d2.metrics.observe_drafted(120)
    d2.metrics.busy_clock.add(0.2)
    clock.now += 10.0
    obs = observer.observe()

    assert obs.window_s == pytest.approx(10.0)
    t = obs.target
    assert t.pods == 2
    assert t.busy_fraction == pytest.approx((0.5 + 0.8) / 2)
    assert t.verify_rounds_per_s == pytest.approx(4.0)  # 40 rounds in 10 s
    assert t.queued_steps == 3
    assert t.draft_tokens_per_round == pytest.approx(320 / 40)
    d = obs.draft
    assert d.pods == 2
    assert d.busy_fraction == pytest.approx((0.04 + 0.02) / 2)
    assert d.draft_cost_s_per_token == pytest.approx(0.6 / 320)
    r = obs.requests
    assert (r.running, r.waiting, r.ttft_s, r.itl_s) == (0, 0, None, None)  # no requests: no latency, not zero

    snap = obs.snapshot(target_replicas=2, draft_replicas=2)
    assert (snap.target_replicas, snap.draft_replicas, snap.target) == (2, 2, t)


def test_latency_quantiles_come_from_the_window_only(pods):
    clock = FakeClock()
    orch = pods("orchestrator")
    hist = orch.metrics.time_to_first_token
    for _ in range(50):
        hist.observe(30.0)  # an old storm: before the window
    observer = o.Observer(o.MetricsTargets(orchestrator=targets(orch)), latency_quantile=0.5, clock=clock)
    observer.observe()
    for value in (0.03, 0.03, 0.03, 0.3):  # bucket (0.02, 0.04] three times, (0.25, 0.5] once
        hist.observe(value)
    with orch.metrics.waiting():
        orch.metrics.start_request()
        clock.now += 15.0
        obs = observer.observe()
    # The median's rank is 2 of 4, inside (0.02, 0.04] holding 3: 0.02 + 0.02 * 2/3.
    assert obs.requests.ttft_s == pytest.approx(0.02 + 0.02 * 2 / 3)
    assert obs.requests.itl_s is None
    assert (obs.requests.running, obs.requests.waiting) == (1, 1)


def test_a_restarted_pod_counts_in_gauges_not_in_rates(pods):
    clock = FakeClock()
    steady, restarting = pods("target"), pods("target")
    observer = o.Observer(o.MetricsTargets(target=targets(steady, restarting)), clock=clock)
    for _ in range(100):
        restarting.metrics.observe_round(1, 1)
    observer.observe()
    restarting.restart()
    for _ in range(3):  # fewer rounds than before: the counter went backwards
        restarting.metrics.observe_round(1, 1)
    restarting.metrics.set_queued_steps(5)
    for _ in range(20):
        steady.metrics.observe_round(1, 1)
    clock.now += 10.0
    obs = observer.observe()
    assert obs.target.pods == 1
    assert obs.target.verify_rounds_per_s == pytest.approx(2.0)  # the steady pod only, never negative
    assert obs.target.queued_steps == 5
    # One window later the restarted pod is back in the rates.
    for _ in range(10):
        restarting.metrics.observe_round(1, 1)
    clock.now += 10.0
    obs = observer.observe()
    assert obs.target.pods == 2
    assert obs.target.verify_rounds_per_s == pytest.approx(1.0)


def test_a_restart_that_outgrew_the_old_counts_is_caught_by_created_times(pods):
    clock = FakeClock()
    pod = pods("target")
    observer = o.Observer(o.MetricsTargets(target=targets(pod)), clock=clock)
    pod.metrics.observe_round(1, 1)
    observer.observe()
    pod.restart()
    for _ in range(50):  # more than before: no counter went backwards
        pod.metrics.observe_round(1, 1)
    clock.now += 10.0
    assert observer.observe().target is None


def test_headless_service_name_resolves_to_every_pod_and_pods_come_and_go(pods):
    """A Kubernetes headless Service: one DNS name, one A record per ready pod, all on one port."""
    clock = FakeClock()
    try:  # Linux answers on all of 127/8; elsewhere these addresses may not exist
        a = pods("target", "127.0.0.2")
        b = pods("target", "127.0.0.3", a.port)  # every pod of a Service listens on the same port
        c = pods("target", "127.0.0.4", a.port)
    except OSError as exc:
        pytest.skip(f"no 127.0.0.2-4 loopback addresses here: {exc}")
    ready = [a, b]

    def dns(host, port, type=0, **_):
        if host != "verifiers.specdec.svc.cluster.local":
            return socket.getaddrinfo(host, port, type=type)
        if not ready:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (p.host, port)) for p in ready]

    service = (("verifiers.specdec.svc.cluster.local", a.port),)
    assert o.resolve(service, dns) == [a.address, b.address]
    observer = o.Observer(o.MetricsTargets(target=service), resolver=dns, clock=clock)
    observer.observe()

    ready[:] = [b, c]  # a went away, c is new
    for pod, rounds in ((a, 100), (b, 20), (c, 50)):
        for _ in range(rounds):
            pod.metrics.observe_round(0, 0)
    c.metrics.set_queued_steps(2)
    clock.now += 10.0
    obs = observer.observe()
    assert obs.target.pods == 1  # b, the only pod seen at both ends
    assert obs.target.verify_rounds_per_s == pytest.approx(2.0)
    assert obs.target.queued_steps == 2  # c counts in the gauges already

    ready[:] = []  # no ready pod: the name does not resolve; no load rather than zero load
    clock.now += 10.0
    assert observer.observe().target is None


def test_unreachable_and_garbage_pods_are_skipped(pods):
    clock = FakeClock()
    good = pods("target")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    observer = o.Observer(o.MetricsTargets(target=targets(good) + (("127.0.0.1", dead_port),)), timeout_s=1.0,
                          clock=clock)
    observer.observe()
    good.metrics.observe_round(2, 2)
    clock.now += 5.0
    obs = observer.observe()
    assert obs.target.pods == 1
    assert obs.target.verify_rounds_per_s == pytest.approx(0.2)
    with pytest.raises(ValueError):
        o.parse_scrape("x", 0.0, "this is { not prometheus text")


def test_parse_targets_and_ipv6_addresses():
    assert o.parse_targets(["a:1,b:2", "[::1]:9100"]) == [("a", 1), ("b", 2), ("::1", 9100)]
    with pytest.raises(ValueError):
        o.parse_targets(["no-port"])
    assert o.resolve([("::1", 9100)]) == ["[::1]:9100"]
    assert o.resolve([("127.0.0.1", 9100)]) == ["127.0.0.1:9100"]


@pytest.mark.parametrize("q, buckets, expected", [
    (0.5, [(0.1, 0.0), (0.2, 10.0), (float("inf"), 10.0)], 0.15),  # the middle of the bucket holding all
    (0.9, [(0.1, 5.0), (0.2, 5.0), (0.4, 10.0), (float("inf"), 10.0)], 0.36),
    (0.99, [(1.0, 1.0), (float("inf"), 10.0)], 1.0),  # in +Inf: the highest finite bound, like Prometheus
    (0.5, [(0.1, 0.0), (float("inf"), 0.0)], None),  # nothing observed
    (0.5, [], None),
])
def test_histogram_quantile(q, buckets, expected):
    got = o.histogram_quantile(q, buckets)
    assert got == (pytest.approx(expected) if expected is not None else None)
