"""Client cancellation and deadlines free the session on every worker; idle sessions expire on workers.

The cluster's tiny random-weight target does not emit end-of-sequence within 200 tokens of these
prompts (a 200-token request takes about a second here), so every request below is still running
when it is cancelled.
"""
from __future__ import annotations

import asyncio
import queue
import secrets

import grpc
import pytest

from specdec.core.errors import SessionNotFound
from specdec.core.sampling import SamplingParams
from specdec.core.session_table import SessionTable
from specdec.core.sessions import SessionStatus
from specdec.core.steps import DraftBlock, DraftProposal, SessionSpec, StepOutcome
from specdec.draft.drafters import DraftConfig
from specdec.draft.engine import DraftEngine
from specdec.draft.ngram import NgramDrafter
from specdec.target.engine import TargetConfig, VerifierEngine
from specdec.v1 import common_pb2, generation_pb2 as pb

LONG = 200


def long_request(prompt: str = "def f():", drafter: str = "ngram", k: int = 2) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=prompt, max_new_tokens=LONG, drafter=drafter, sampling=common_pb2.SamplingParams(seed=7),
        speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=k),
    )


async def eventually(probe, want, timeout_s: float = 60.0):
    """Poll ``await probe()`` until it equals ``want`` or the time is up; return the last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (got := await probe()) != want and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return got


async def record_status(cluster, session_id: str):
    return (await cluster.store.get(session_id)).status


async def assert_all_freed(cluster) -> None:
    assert await eventually(cluster.active_sessions, (0, 0)) == (0, 0), "a worker still holds a session"

    async def running():
        return cluster.orchestrator.running

    assert await eventually(running, 0) == 0, "the orchestrator still counts a request as running"


async def read_then_cancel(cluster, num_messages: int, request: pb.GenerateRequest) -> tuple[str | None, list[int]]:
    """Start a stream, read ``num_messages`` messages, cancel. Returns (session id or None, tokens received)."""
    call = cluster.stub.GenerateStream(request, timeout=60)
    session_id, tokens = None, []
    for _ in range(num_messages):
        msg = await call.read()
        assert msg is not grpc.aio.EOF and msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED, "finished before the cancel"
        session_id = session_id or msg.session_id
        assert msg.session_id == session_id
        tokens.extend(msg.token_ids)
    assert call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    assert (await call.code()) == grpc.StatusCode.CANCELLED
    return session_id, tokens


async def assert_cancelled_record(cluster, session_id: str, received: list[int]) -> None:
    """Marked cancelled, and holding at least every token the client saw (committed before streamed)."""
    assert await eventually(lambda: record_status(cluster, session_id), SessionStatus.CANCELLED) is SessionStatus.CANCELLED
    record = await cluster.store.get(session_id)
    assert len(record.output_ids) >= len(received)
    assert list(record.output_ids[: len(received)]) == received
    assert record.finish_reason == ""


async def test_cancelled_stream_frees_sessions_and_marks_the_record(cluster):
    session_id, received = await read_then_cancel(cluster, 2, long_request())
    assert session_id and received
    await assert_all_freed(cluster)
    await assert_cancelled_record(cluster, session_id, received)
    info = await cluster.stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=10)
    assert info.status == "cancelled"
    assert list(info.output_token_ids[: len(received)]) == received


async def test_cancelled_model_drafter_stream_frees_sessions(cluster):
    session_id, received = await read_then_cancel(cluster, 3, long_request(drafter="model", k=3))
    await assert_all_freed(cluster)
    await assert_cancelled_record(cluster, session_id, received)


async def test_unary_deadline_frees_sessions(cluster):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.Generate(long_request(), timeout=0.05)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await assert_all_freed(cluster)


async def test_stream_deadline_frees_sessions(cluster):
    # A fast machine may finish the whole request before a deadline: shorter ones until one passes mid-stream.
    for deadline_s in (0.5, 0.15, 0.05, 0.01):
        call = cluster.stub.GenerateStream(long_request("import os\n"), timeout=deadline_s)
        received, session_id, finished = [], None, False
        try:
            async for msg in call:
                session_id = msg.session_id
                received.extend(msg.token_ids)
                finished = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if not finished:
                break  # the deadline passed mid-stream: the case under test
            # (it passed after the last step but before the stream closed: try a shorter one)
        assert finished
        await assert_all_freed(cluster)
    else:
        pytest.fail("every request finished before its deadline")
    await assert_all_freed(cluster)
    if session_id is not None:  # on a loaded machine the deadline may pass before the first message
        await assert_cancelled_record(cluster, session_id, received)


async def test_concurrent_streams_cancelled_at_different_points(cluster):
    prompts = ["def f():", "import os\n", "x = 1\n", "class A:\n    pass\n", "for i in range(3):"]
    points = [0, 1, 2, 4, 7]  # messages read before the cancel; 0: cancelled before anything arrives
    results = await asyncio.gather(*(read_then_cancel(cluster, n, long_request(p, drafter=d))
                                     for n, p, d in zip(points, prompts, ["ngram", "model"] * 3)))
    await assert_all_freed(cluster)
    for session_id, received in results:
        if session_id is not None:
            await assert_cancelled_record(cluster, session_id, received)
    assert len({sid for sid, _ in results if sid}) == sum(1 for n in points if n)


async def test_after_cancellations_requests_still_run(cluster):
    reply = await cluster.stub.Generate(pb.GenerateRequest(text="def f():", max_new_tokens=5), timeout=30)
    assert len(reply.token_ids) == 5
    await assert_all_freed(cluster)


# ----------------------------------------------------------------------------- idle expiry on a worker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_session_table_expires_idle_sessions():
    clock = FakeClock()
    table: SessionTable[str] = SessionTable(max_sessions=4, idle_timeout_s=30, clock=clock)
    a, b = secrets.token_hex(16), secrets.token_hex(16)
    table.add(a, "A")
    table.add(b, "B")
    clock.now += 20
    assert table.get(a) == "A"  # use refreshes a
    clock.now += 20  # a idle 20 s, b idle 40 s
    assert table.reap_idle() == [b]
    assert len(table) == 1
    clock.now += 31  # a idle 31 s, not reaped yet: get() itself refuses an expired session
    with pytest.raises(SessionNotFound, match="expired after 30s idle"):
        table.get(a)
    assert len(table) == 0 and table.pop(a) is None


def test_draft_worker_reaps_a_session_never_closed():
    engine = DraftEngine({"ngram": NgramDrafter(3, 1)}, DraftConfig(idle_timeout_s=30))
    clock = FakeClock()
    engine.sessions = SessionTable(8, 30, clock=clock)
    blocks: queue.Queue[DraftBlock] = queue.Queue()
    kept, abandoned = secrets.token_hex(16), secrets.token_hex(16)
    prompt = (1, 2, 3, 1, 2)
    try:
        for sid in (kept, abandoned):
            engine.open(SessionSpec(sid, prompt, SamplingParams(seed=1), "ngram"), blocks.put).result(timeout=10)
        assert engine.status().active_sessions == 2
        clock.now += 25
        engine.outcome(kept, StepOutcome(len(prompt), (), 2, overlap=False))  # an outcome is use: kept is refreshed
        assert blocks.get(timeout=10).proposal.token_ids == (3, 1)
        clock.now += 10  # abandoned: idle 35 s > 30 s; kept: 10 s
        assert engine.status().active_sessions == 1
        with pytest.raises(SessionNotFound, match="expired"):
            engine.outcome(abandoned, StepOutcome(len(prompt), (), 2, overlap=False))
        assert not engine.close(abandoned)
        assert engine.close(kept)
        assert engine.status().active_sessions == 0
    finally:
        engine.shutdown()


def test_verify_worker_reaps_a_session_never_closed(tiny_pair):
    target_path, _ = tiny_pair
    engine = VerifierEngine.from_config(TargetConfig(target_path, idle_timeout_s=30))
    clock = FakeClock()
    engine.sessions = SessionTable(8, 30, clock=clock)
    sid = secrets.token_hex(16)
    engine.open(SessionSpec(sid, (1, 2, 3), SamplingParams(seed=1)))
    assert engine.status().active_sessions == 1
    clock.now += 29
    assert engine.verify(sid, DraftProposal(())).committed_len == 4  # a step is use: idle time starts again
    clock.now += 29
    assert engine.status().active_sessions == 1
    clock.now += 2
    assert engine.status().active_sessions == 0
    with pytest.raises(SessionNotFound):
        engine.verify(sid, DraftProposal(()))
