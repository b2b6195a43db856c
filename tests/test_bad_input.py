"""Bad input over real gRPC: every mistake gets its exact status code and a message that says what to fix.

Client API (Generation) through the orchestrator, then the internal hops (Drafter, Verifier) called
directly. Nothing here may leave a session open on a worker.
"""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import grpc
import pytest
import pytest_asyncio

from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, generation_pb2 as pb, verifier_pb2, verifier_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

VOCAB = 384  # tests/tiny_models.VOCAB; checked against the verifier in test_tiny_model_limits
CONTEXT = 256  # tiny models' max_position_embeddings
LIMIT = 256  # the cluster's max_new_tokens_limit (tests/cluster.py)


def req(*, text: str | None = "def f():", ids: list[int] | None = None, max_new: int = 4, fixed_k: int | None = 2,
        stop: list[str] = (), drafter: str = "ngram", **sampling) -> pb.GenerateRequest:
    """A request that is valid unless a keyword makes it bad."""
    msg = pb.GenerateRequest(max_new_tokens=max_new, stop=list(stop), drafter=drafter,
                             sampling=common_pb2.SamplingParams(**sampling))
    if ids is not None:
        msg.token_ids.SetInParent()  # present even when empty
        msg.token_ids.ids.extend(ids)
    elif text is not None:
        msg.text = text
    if fixed_k is not None:
        msg.speculation.CopyFrom(pb.SpeculationPolicy(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=fixed_k))
    return msg


LONG_TEXT = "def f(x):\n    return x + 1\n\n" * 80  # well over 256 tokens

# (id, request, the word the message must contain, so the caller knows what to fix)
BAD_REQUESTS: list[tuple[str, Callable[[], pb.GenerateRequest], str]] = [
    ("empty-text", lambda: req(text=""), "prompt"),
    ("no-prompt", lambda: req(text=None), "as text or as token ids"),
    ("empty-token-ids", lambda: req(ids=[]), "token id"),
    ("max-new-tokens-0", lambda: req(max_new=0), "max_new_tokens"),
    ("max-new-tokens-over-limit", lambda: req(max_new=LIMIT + 1), "max_new_tokens"),
    ("negative-temperature", lambda: req(temperature=-0.5), "temperature"),
    ("nan-temperature", lambda: req(temperature=float("nan")), "temperature"),
    ("inf-temperature", lambda: req(temperature=float("inf")), "temperature"),
    ("top-p-above-1", lambda: req(temperature=1.0, top_p=1.5), "top_p"),
    ("top-p-negative", lambda: req(temperature=1.0, top_p=-0.1), "top_p"),
    ("unknown-drafter", lambda: req(drafter="no-such-drafter"), "drafter"),
    ("prompt-ids-fill-context", lambda: req(ids=[7] * CONTEXT), "context"),
    ("prompt-ids-over-context", lambda: req(ids=[7] * (CONTEXT + 50)), "context"),
    ("prompt-text-over-context", lambda: req(text=LONG_TEXT), "context"),
    ("prompt-id-too-large", lambda: req(ids=[1, 2, VOCAB]), "vocabulary"),
    ("prompt-id-negative", lambda: req(ids=[1, -1, 2]), "vocabulary"),
    ("too-many-stop-strings", lambda: req(stop=[f"s{i}" for i in range(9)]), "stop"),
    ("stop-string-too-long", lambda: req(stop=["x" * 65]), "stop"),
    ("empty-stop-string", lambda: req(stop=[""]), "stop"),
    ("fixed-k-above-max", lambda: req(fixed_k=65), "num_speculative_tokens"),
    ("adaptive-max-k-above-max", lambda: pb.GenerateRequest(
        text="def f():", max_new_tokens=4,
        speculation=pb.SpeculationPolicy(mode=pb.SPECULATION_MODE_ADAPTIVE, max_speculative_tokens=65)), "max_speculative_tokens"),
    ("adaptive-start-above-its-max", lambda: pb.GenerateRequest(
        text="def f():", max_new_tokens=4, speculation=pb.SpeculationPolicy(
            mode=pb.SPECULATION_MODE_ADAPTIVE, num_speculative_tokens=6, max_speculative_tokens=3)), "max_speculative_tokens"),
    ("unknown-speculation-mode", lambda: pb.GenerateRequest(
        text="def f():", max_new_tokens=4, speculation=pb.SpeculationPolicy(mode=7)), "speculation.mode"),
]


async def call(stub, method: str, request: pb.GenerateRequest) -> None:
    """Run a Generate or a whole GenerateStream; the error, if any, propagates."""
    if method == "Generate":
        await stub.Generate(request, timeout=30)
    else:
        async for _ in stub.GenerateStream(request, timeout=30):
            pass


async def wait_for_no_sessions(cluster, timeout_s: float = 5.0) -> tuple[int, int]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (active := await cluster.active_sessions()) != (0, 0) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return active


# ----------------------------------------------------------------------------- client API


async def test_tiny_model_limits(cluster):
    """The constants above describe the cluster under test."""
    status = await cluster.target.status()
    assert (status.vocab_size, status.context_length) == (VOCAB, CONTEXT)
    assert cluster.orchestrator.config.max_new_tokens_limit == LIMIT


async def test_valid_baseline_request_succeeds(cluster):
    """The requests below are bad only by the one thing each changes."""
    reply = await cluster.stub.Generate(req(), timeout=30)
    assert 1 <= len(reply.token_ids) <= 4


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("make, word", [pytest.param(m, w, id=i) for i, m, w in BAD_REQUESTS])
async def test_bad_request_is_invalid_argument(cluster, method, make, word):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(cluster.stub, method, make())
    assert info.value.code() == INVALID, info.value.details()
    assert word in info.value.details(), info.value.details()


async def test_prompt_one_token_short_of_context_is_accepted(cluster):
    """255 prompt tokens leave room for exactly one generated token: the context ends the request."""
    reply = await cluster.stub.Generate(req(ids=[7] * (CONTEXT - 1), max_new=8), timeout=30)
    assert len(reply.token_ids) == 1
    assert reply.finish_reason in (pb.FINISH_REASON_CONTEXT_FULL, pb.FINISH_REASON_STOP)


async def test_get_session_unknown_id_is_not_found(cluster):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.GetSession(pb.GetSessionRequest(session_id=secrets.token_hex(16)), timeout=10)
    assert info.value.code() == NOT_FOUND
    assert "no session" in info.value.details()


@pytest.mark.parametrize("session_id", ["", "not a session id", "a" * 129, "{abc}", "../x"])
async def test_get_session_malformed_id_is_invalid_argument(cluster, session_id):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=10)
    assert info.value.code() == INVALID
    assert "session id" in info.value.details()


# ----------------------------------------------------------------------------- internal hops


@pytest_asyncio.fixture
async def hops(cluster):
    """Stubs on the draft (cluster.servers[0]) and target (cluster.servers[1]) workers themselves."""
    draft_channel = grpc.aio.insecure_channel(cluster.servers[0].address)
    target_channel = grpc.aio.insecure_channel(cluster.servers[1].address)
    yield drafter_pb2_grpc.DrafterStub(draft_channel), verifier_pb2_grpc.VerifierStub(target_channel)
    await draft_channel.close()
    await target_channel.close()


PROMPT = [10, 20, 30, 40, 50]


def open_request(session_id: str, drafter: str = "", prompt: list[int] = PROMPT, **sampling) -> common_pb2.OpenSessionRequest:
    return common_pb2.OpenSessionRequest(session_id=session_id, prompt_token_ids=prompt, drafter=drafter,
                                         sampling=common_pb2.SamplingParams(seed=sampling.pop("seed", 1), **sampling))


def verify(session_id: str, base_len: int, drafts: list[int] = (), dists: list[tuple[list[int], list[float]]] = (),
           append: list[int] = ()) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(
        session_id=session_id, sync=common_pb2.SequenceSync(base_len=base_len, append_ids=list(append)),
        draft_token_ids=list(drafts),
        draft_distributions=[common_pb2.DraftDistribution(token_ids=t, probs=p) for t, p in dists])


async def expect(code: grpc.StatusCode, word: str, coro) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    assert word in info.value.details(), info.value.details()


async def test_unknown_session_is_not_found_on_both_workers(hops):
    drafter, verifier = hops
    sid = secrets.token_hex(16)
    sync = common_pb2.SequenceSync(base_len=3)
    await expect(NOT_FOUND, sid, drafter.Draft(drafter_pb2.DraftRequest(session_id=sid, sync=sync, num_speculative_tokens=2), timeout=10))
    await expect(NOT_FOUND, sid, verifier.Verify(verify(sid, 3), timeout=10))


async def test_close_unknown_session_is_not_an_error(hops):
    drafter, verifier = hops
    sid = secrets.token_hex(16)
    assert not (await drafter.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=10)).existed
    assert not (await verifier.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=10)).existed


@pytest.mark.parametrize("session_id", ["", "ABCDEF" + "0" * 26, "0" * 31, "0" * 33, "g" * 32, "{x}"])
async def test_open_session_malformed_id_is_invalid_argument(hops, session_id):
    drafter, verifier = hops
    await expect(INVALID, "session id", drafter.OpenSession(open_request(session_id, "ngram"), timeout=10))
    await expect(INVALID, "session id", verifier.OpenSession(open_request(session_id), timeout=10))


async def test_open_session_bad_input_is_invalid_argument(hops):
    drafter, verifier = hops
    sid = secrets.token_hex(16)
    await expect(INVALID, "drafter", drafter.OpenSession(open_request(sid, "no-such-drafter"), timeout=10))
    await expect(INVALID, "prompt", drafter.OpenSession(open_request(sid, "model", prompt=[]), timeout=10))
    await expect(INVALID, "prompt", verifier.OpenSession(open_request(sid, prompt=[]), timeout=10))
    await expect(INVALID, "vocabulary", verifier.OpenSession(open_request(sid, prompt=[1, VOCAB]), timeout=10))
    await expect(INVALID, "vocabulary", drafter.OpenSession(open_request(sid, "model", prompt=[1, VOCAB]), timeout=10))
    await expect(INVALID, "context", verifier.OpenSession(open_request(sid, prompt=[1] * CONTEXT), timeout=10))
    await expect(INVALID, "temperature", verifier.OpenSession(open_request(sid, temperature=-1.0), timeout=10))
    await expect(INVALID, "top_p", drafter.OpenSession(open_request(sid, "model", temperature=1.0, top_p=2.0), timeout=10))
    # None of the failed opens left a session behind.
    for stub in hops:
        assert not (await stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=10)).existed


async def test_verify_bad_input_on_a_real_session(hops):
    _, verifier = hops
    sid = secrets.token_hex(16)
    await verifier.OpenSession(open_request(sid), timeout=30)
    try:
        n = len(PROMPT)
        await expect(INVALID, "already open", verifier.OpenSession(open_request(sid), timeout=10))
        await expect(INVALID, "vocabulary", verifier.Verify(verify(sid, n, drafts=[5, VOCAB]), timeout=10))
        await expect(INVALID, "vocabulary", verifier.Verify(verify(sid, n, drafts=[-3]), timeout=10))
        await expect(INVALID, "distributions", verifier.Verify(
            verify(sid, n, drafts=[5, 6], dists=[([5], [1.0])]), timeout=10))
        await expect(INVALID, "sum to 1", verifier.Verify(
            verify(sid, n, drafts=[5], dists=[([5, 6], [0.5, 0.2])]), timeout=10))
        await expect(INVALID, "positive", verifier.Verify(
            verify(sid, n, drafts=[5], dists=[([5, 6], [float("nan"), 1.0])]), timeout=10))
        await expect(INVALID, "distinct", verifier.Verify(
            verify(sid, n, drafts=[5], dists=[([5, 5], [0.5, 0.5])]), timeout=10))
        await expect(INVALID, "zero probability", verifier.Verify(
            verify(sid, n, drafts=[5], dists=[([6], [1.0])]), timeout=10))
        await expect(INVALID, "context", verifier.Verify(verify(sid, n, drafts=[5] * CONTEXT), timeout=10))
        await expect(PRECONDITION, "base_len", verifier.Verify(verify(sid, n + 1), timeout=10))
        await expect(PRECONDITION, "base_len", verifier.Verify(verify(sid, 1000), timeout=10))
        # Tokens synced in must be valid too: they are fed to the model.
        await expect(INVALID, "vocabulary", verifier.Verify(verify(sid, n, append=[VOCAB]), timeout=10))
        await expect(INVALID, "context", verifier.Verify(verify(sid, n, append=[1] * CONTEXT), timeout=10))
        # No failed step changed the session: a plain decoding step commits exactly one token after the prompt.
        ok = await verifier.Verify(verify(sid, n), timeout=30)
        assert ok.committed_len == n + 1 and len(ok.token_ids) == 1 and ok.num_accepted == 0
    finally:
        assert (await verifier.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=10)).existed


@pytest.mark.parametrize("which", ["model", "ngram"])
async def test_draft_bad_input_on_a_real_session(hops, which):
    drafter, _ = hops
    sid = secrets.token_hex(16)
    n = len(PROMPT)
    await drafter.OpenSession(open_request(sid, which), timeout=30)

    def draft(base_len: int = n, k: int = 2, append: list[int] = ()):
        sync = common_pb2.SequenceSync(base_len=base_len, append_ids=list(append))
        return drafter.Draft(drafter_pb2.DraftRequest(session_id=sid, sync=sync, num_speculative_tokens=k), timeout=10)

    try:
        await expect(INVALID, "num_speculative_tokens", draft(k=65))
        await expect(PRECONDITION, "base_len", draft(base_len=n + 1))
        await expect(INVALID, "vocabulary", draft(append=[-1]))
        if which == "model":  # the n-gram drafter has no vocabulary to check against
            await expect(INVALID, "vocabulary", draft(append=[VOCAB]))
        ok = await draft(k=2)
        assert len(ok.draft_token_ids) <= 2
    finally:
        assert (await drafter.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=10)).existed


async def test_no_session_leaked(cluster):
    """Runs last in this module: every failed request and every directly opened session was closed."""
    assert await wait_for_no_sessions(cluster) == (0, 0)
