"""The roles export what they do: a request through real servers (TLS on) moves each role's
Prometheus metrics by exactly what its stats say, and `serve --metrics-port` serves them."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import pytest_asyncio

from specdec import metrics as m
from specdec.v1 import common_pb2, generation_pb2 as pb

from cluster import start_cluster
from redis_server import delete_prefix


@pytest_asyncio.fixture(scope="module")
async def measured(tiny_pair, redis_url, dev_tls):
    target, draft = tiny_pair
    c = await start_cluster(target, draft, redis_url, prefix=f"specdec-test-{uuid.uuid4().hex[:8]}", tls=dev_tls, metrics=True)
    yield c
    await c.stop()
    delete_prefix(redis_url, c.store._prefix)


def value(registry, name: str, **labels) -> float:
    got = registry.get_sample_value(name, labels or None)
    return 0.0 if got is None else got


async def test_a_request_moves_every_role_by_what_its_stats_say(measured):
    orch, target, draft = (measured.registries[r] for r in ("orchestrator", "target", "draft"))
    request = pb.GenerateRequest(text="def f():", max_new_tokens=24, drafter="model",
                                 speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED,
                                                                          num_speculative_tokens=3))
    reply = await measured.stub.Generate(request, timeout=60)
    stats = reply.stats
    assert stats.draft_tokens > 0
    # Orchestrator: tokens, one TTFT and one end-to-end latency, nothing left running.
    assert value(orch, m.GENERATION_TOKENS) == reply.usage.completion_tokens
    assert value(orch, m.TIME_TO_FIRST_TOKEN + "_count") == 1 and value(orch, m.E2E_REQUEST_LATENCY + "_count") == 1
    assert value(orch, m.INTER_TOKEN_LATENCY + "_count") == reply.usage.completion_tokens - 1
    assert value(orch, m.NUM_REQUESTS_RUNNING) == 0
    # Verifier: one round per verify step; drafts and acceptance as the stats count them.
    assert value(target, m.VERIFY_ROUNDS) == stats.verify_steps
    assert value(target, m.SPEC_DECODE_NUM_DRAFT_TOKENS) == stats.draft_tokens
    assert value(target, m.SPEC_DECODE_NUM_ACCEPTED_TOKENS) == stats.accepted_tokens
    assert value(target, m.SPEC_DECODE_NUM_DRAFTS) == stats.drafts
    per_pos = sum(value(target, m.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, position=str(p)) for p in range(3))
    assert per_pos == stats.accepted_tokens
    # The same by drafter: all of it the model drafter's.
    assert value(target, m.SPEC_DECODE_DRAFTER_DRAFT_TOKENS, drafter="model") == stats.draft_tokens
    assert value(target, m.SPEC_DECODE_DRAFTER_ACCEPTED_TOKENS, drafter="model") == stats.accepted_tokens
    assert value(target, m.SPEC_DECODE_DRAFTER_ROUNDS, drafter="model") == stats.drafts
    assert value(target, m.SPEC_DECODE_DRAFTER_DRAFT_TOKENS, drafter="ngram") == 0
    assert value(target, m.VERIFIER_BUSY_SECONDS) > 0
    # Drafter: at least the tokens the verifier saw were drafted (pre-drafted branches count too).
    assert value(draft, m.DRAFTER_DRAFT_TOKENS) >= stats.draft_tokens
    assert value(draft, m.DRAFTER_BUSY_SECONDS) > 0
    # Gauges read at scrape time: the session is closed on both workers once the stream has ended.
    await measured_sessions_closed(measured)
    assert value(target, m.WORKER_SESSIONS, role="target") == 0 and value(draft, m.WORKER_SESSIONS, role="draft") == 0
    assert value(target, m.WORKER_KV_BYTES, role="target") == 0


async def measured_sessions_closed(cluster) -> None:
    from test_bad_input import wait_for_no_sessions

    assert await wait_for_no_sessions(cluster) == (0, 0)


async def test_kv_bytes_follow_an_open_session(measured):
    import asyncio

    target = measured.registries["target"]
    call = measured.stub.GenerateStream(pb.GenerateRequest(text="def f():", max_new_tokens=200, drafter="ngram"), timeout=60)
    await call.read()
    per_token = measured.target.scheduler.engine.kv_bytes_per_token
    held = value(target, m.WORKER_KV_BYTES, role="target")
    assert held > 0 and held % per_token == 0  # whole tokens of K and V for every layer
    assert value(target, m.WORKER_SESSIONS, role="target") == 1
    call.cancel()
    await asyncio.sleep(0)
    await measured_sessions_closed(measured)


async def test_the_autoscaler_reads_real_running_roles_and_decides(measured):
    """The whole chain: real roles serve /metrics, the autoscaler's observer scrapes them around a
    request, and the policy sizes the pools from what it measured."""
    from specdec.autoscale import observe as o
    from specdec.autoscale.policy import PolicyConfig, PolicyState, decide
    from specdec.metrics import start_metrics_server

    servers = {role: start_metrics_server(registry, "127.0.0.1", 0) for role, registry in measured.registries.items()}
    observer = o.Observer(o.MetricsTargets(target=(("127.0.0.1", servers["target"].port),),
                                           draft=(("127.0.0.1", servers["draft"].port),),
                                           orchestrator=(("127.0.0.1", servers["orchestrator"].port),)))
    try:
        await asyncio.to_thread(observer.observe)  # the window opens
        request = pb.GenerateRequest(text="def f():", max_new_tokens=48, drafter="model",
                                     speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED,
                                                                              num_speculative_tokens=3))
        reply = await measured.stub.Generate(request, timeout=60)
        await measured_sessions_closed(measured)  # both workers are done with it: all it counted is counted
        seen = await asyncio.to_thread(observer.observe)
    finally:
        observer.close()
        for server in servers.values():
            server.stop()
    assert seen.window_s > 0
    assert seen.target.pods == 1 and seen.target.verify_rounds_per_s * seen.window_s == pytest.approx(reply.stats.verify_steps, rel=0.02)
    assert 0 < seen.target.busy_fraction <= 1 and seen.draft.busy_fraction > 0
    assert seen.target.draft_tokens_per_round > 0 and seen.draft.draft_cost_s_per_token > 0
    decision = decide(seen.snapshot(target_replicas=1, draft_replicas=1), PolicyState(), PolicyConfig())
    assert decision.target.desired >= 1 and decision.draft.desired >= 1
    assert "rounds/s" in decision.draft.reason  # sized from the measured draft demand
