"""A session opened again on a worker that still runs an earlier stream of it (its orchestrator or
verifier died or paused, and the session was resumed) supersedes that stream: the earlier one ends
with ABORTED, the new one runs as if alone, and the worker holds the session once (real gRPC
servers, TLS on)."""
from __future__ import annotations

import secrets

import grpc

from test_bad_input import (N, drain, hops, opening, outcome, sessions_drop_to_zero, session_request,  # noqa: F401
                            wait_for_no_sessions)


async def ended_aborted(call) -> list:
    """Read ``call`` to its end, which must be ABORTED by a newer stream; the messages read."""
    messages = []
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            messages.append(msg)
    except grpc.aio.AioRpcError:
        pass
    assert await call.code() == grpc.StatusCode.ABORTED and "newer stream" in await call.details()
    return messages


async def test_a_drafter_stream_opened_again_supersedes_the_earlier_one(cluster, hops):
    drafter, _ = hops
    session_id = secrets.token_hex(16)
    earlier = drafter.Speculate(timeout=30)
    await earlier.write(opening(session_id=session_id))
    await earlier.write(outcome(N, k=3))
    assert (await earlier.read()).anchor_len == N
    later = drafter.Speculate(timeout=30)
    await later.write(opening(session_id=session_id))
    await later.write(outcome(N, k=3))
    assert list((await later.read()).draft_token_ids) == [3, 1, 2]  # drafts as a fresh session would
    await ended_aborted(earlier)
    assert cluster.draft.status().active_sessions == 1
    await later.done_writing()
    while await later.read() is not grpc.aio.EOF:
        pass
    assert await later.code() == grpc.StatusCode.OK
    assert await sessions_drop_to_zero(cluster.draft.status) == 0


async def test_a_verifier_session_opened_again_supersedes_the_earlier_stream(cluster, hops):
    _, verifier = hops
    first = session_request(cluster)
    first.max_new_tokens = 200
    earlier = verifier.Generate(first, timeout=60)
    got = await earlier.read()
    assert got.token_ids
    again = session_request(cluster, session_id=first.session.session_id)
    again.max_new_tokens = 8
    commits = await drain(verifier.Generate(again, timeout=60))
    assert sum(len(c.token_ids) for c in commits) == 8 and commits[-1].finished
    for msg in await ended_aborted(earlier):
        assert not msg.finished  # it never gets to run to its end
    assert await wait_for_no_sessions(cluster) == (0, 0)
