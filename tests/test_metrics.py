"""specdec.metrics over real HTTP: what each role records is what a Prometheus scrape reads."""
from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from specdec import metrics as m


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scrape(server: m.MetricsServer) -> dict[str, dict[tuple, float]]:
    """GET /metrics and index the samples: name -> {sorted label items: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


@pytest.fixture
def served():
    registry = CollectorRegistry()
    server = m.start_metrics_server(registry, "127.0.0.1", 0)
    yield registry, server
    server()


def test_verifier_round_counters_and_positions(served):
    registry, server = served
    clock = FakeClock()
    verifier = m.VerifierMetrics(registry, clock=clock)
    verifier.observe_round(4, 2, draft_wait_s=0.003, drafter="model")
    verifier.observe_round(4, 4, draft_wait_s=0.0, drafter="tree")
    verifier.observe_round(0, 0, drafter="tree")  # plain decoding: a round, not a draft
    with verifier.busy():
        clock.now += 0.25
    verifier.set_queued_steps(3)

    got = scrape(server)
    assert got[m.VERIFY_ROUNDS][()] == 3
    assert got[m.SPEC_DECODE_NUM_DRAFTS][()] == 2
    assert got[m.SPEC_DECODE_NUM_DRAFT_TOKENS][()] == 8
    assert got[m.SPEC_DECODE_NUM_ACCEPTED_TOKENS][()] == 6
    per_pos = got[m.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS]
    assert per_pos == {(("position", "0"),): 2, (("position", "1"),): 2, (("position", "2"),): 1, (("position", "3"),): 1}
    assert got[m.SPEC_DECODE_DRAFTER_ROUNDS] == {(("drafter", "model"),): 1, (("drafter", "tree"),): 1}
    assert got[m.SPEC_DECODE_DRAFTER_DRAFT_TOKENS] == {(("drafter", "model"),): 4, (("drafter", "tree"),): 4}
    assert got[m.SPEC_DECODE_DRAFTER_ACCEPTED_TOKENS] == {(("drafter", "model"),): 2, (("drafter", "tree"),): 4}
    assert got[m.VERIFIER_BUSY_SECONDS][()] == pytest.approx(0.25)
    assert got[m.VERIFIER_QUEUED_STEPS][()] == 3
    assert got[m.VERIFY_DRAFT_WAIT + "_count"][()] == 2
    assert got[m.VERIFY_DRAFT_WAIT + "_sum"][()] == pytest.approx(0.003)
    assert got[m.VERIFY_DRAFT_WAIT + "_bucket"][(("le", "0.0"),)] == 1  # the pre-drafted block did not wait


def test_accepted_more_than_drafted_is_refused():
    verifier = m.VerifierMetrics(CollectorRegistry())
    with pytest.raises(ValueError):
        verifier.observe_round(2, 3)


def test_busy_clock_counts_overlapping_work_once_and_includes_work_in_progress():
    clock = FakeClock()
    busy = m.BusyClock("x_busy_seconds_total", "x", clock)
    with busy.busy():
        clock.now += 1.0
        with busy.busy():  # a second forward at the same time: still one busy worker
            clock.now += 1.0
        clock.now += 1.0
    assert busy.seconds() == pytest.approx(3.0)
    clock.now += 10.0  # idle
    with busy.busy():
        clock.now += 0.5
        assert busy.seconds() == pytest.approx(3.5)  # a scrape mid-forward sees it
    busy.add(0.5)
    assert busy.seconds() == pytest.approx(4.0)


def test_busy_clock_from_threads():
    busy = m.BusyClock("y_busy_seconds_total", "y")
    barrier = threading.Barrier(4)

    def work():
        barrier.wait()
        for _ in range(200):
            with busy.busy():
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    started = time.perf_counter()  # the clock BusyClock reads
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Busy time is wall time with something running (overlaps counted once): never more than elapsed.
    assert 0 <= busy.seconds() <= time.perf_counter() - started
    assert busy._in_progress == 0  # every entry was matched by an exit


def test_drafter_and_worker_gauges(served):
    registry, server = served
    clock = FakeClock()
    drafter = m.DrafterMetrics(registry, clock=clock)
    with drafter.busy():
        clock.now += 0.04
        drafter.observe_drafted(12)
    sessions = [1, 2, 3]
    drafter.watch(sessions=lambda: len(sessions), kv_bytes=lambda: 4096)

    got = scrape(server)
    assert got[m.DRAFTER_DRAFT_TOKENS][()] == 12
    assert got[m.DRAFTER_BUSY_SECONDS][()] == pytest.approx(0.04)
    assert got[m.WORKER_SESSIONS][(("role", "draft"),)] == 3
    assert got[m.WORKER_KV_BYTES][(("role", "draft"),)] == 4096
    sessions.pop()
    assert scrape(server)[m.WORKER_SESSIONS][(("role", "draft"),)] == 2  # read at scrape time


def test_both_workers_in_one_registry_share_the_worker_gauges(served):
    registry, server = served
    worker = m.WorkerMetrics(registry)
    m.VerifierMetrics(registry, worker).watch(sessions=lambda: 5)
    m.DrafterMetrics(registry, worker).watch(sessions=lambda: 7)
    got = scrape(server)[m.WORKER_SESSIONS]
    assert got == {(("role", "target"),): 5, (("role", "draft"),): 7}


def test_orchestrator_request_latencies(served):
    registry, server = served
    clock = FakeClock()
    orch = m.OrchestratorMetrics(registry, clock=clock)
    request = orch.start_request()
    assert scrape(server)[m.NUM_REQUESTS_RUNNING][()] == 1
    clock.now += 0.25
    request.tokens(2)  # TTFT 0.25 s; the second token of the chunk came with it (a gap of 0)
    clock.now += 0.375
    request.tokens(3)  # three tokens 375 ms later: 125 ms per token
    clock.now += 0.125
    request.finish()
    request.finish()  # a finally block after a normal end: counted once

    got = scrape(server)
    assert got[m.NUM_REQUESTS_RUNNING][()] == 0
    assert got[m.GENERATION_TOKENS][()] == 5
    assert got[m.TIME_TO_FIRST_TOKEN + "_count"][()] == 1
    assert got[m.TIME_TO_FIRST_TOKEN + "_sum"][()] == pytest.approx(0.25)
    assert got[m.TIME_TO_FIRST_TOKEN + "_bucket"][(("le", "0.1"),)] == 0
    assert got[m.TIME_TO_FIRST_TOKEN + "_bucket"][(("le", "0.25"),)] == 1
    assert got[m.INTER_TOKEN_LATENCY + "_count"][()] == 4
    assert got[m.INTER_TOKEN_LATENCY + "_sum"][()] == pytest.approx(0.375)
    assert got[m.INTER_TOKEN_LATENCY + "_bucket"][(("le", "0.001"),)] == 1  # the gap of 0
    assert got[m.INTER_TOKEN_LATENCY + "_bucket"][(("le", "0.1"),)] == 1
    assert got[m.INTER_TOKEN_LATENCY + "_bucket"][(("le", "0.15"),)] == 4
    assert got[m.E2E_REQUEST_LATENCY + "_sum"][()] == pytest.approx(0.75)


def test_waiting_gauge_tracks_admission(served):
    registry, server = served
    orch = m.OrchestratorMetrics(registry)
    with orch.waiting():
        assert scrape(server)[m.NUM_REQUESTS_WAITING][()] == 1
    assert scrape(server)[m.NUM_REQUESTS_WAITING][()] == 0


def test_buckets_span_llm_serving():
    assert m.TTFT_BUCKETS_S[0] <= 0.005 and m.TTFT_BUCKETS_S[-1] >= 20
    assert m.ITL_BUCKETS_S[0] <= 0.001 and m.ITL_BUCKETS_S[-1] >= 2
    for buckets in (m.TTFT_BUCKETS_S, m.ITL_BUCKETS_S, m.E2E_BUCKETS_S, m.DRAFT_WAIT_BUCKETS_S):
        assert list(buckets) == sorted(set(buckets))


def test_registries_are_separate_and_the_server_stops():
    first, second = CollectorRegistry(), CollectorRegistry()
    m.VerifierMetrics(first).observe_round(1, 1)
    m.VerifierMetrics(second)  # the same names again: fine, another registry
    server = m.start_metrics_server(second, "127.0.0.1", 0)
    try:
        assert scrape(server)[m.VERIFY_ROUNDS][()] == 0
    finally:
        server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=1)
