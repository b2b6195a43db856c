"""Bad input: every mistake gets its exact status code and a message that says what to fix, never UNKNOWN.

Client API (Generation) through the orchestrator; then the internal hops over real gRPC, called
directly (Verifier.Generate, Drafter.Speculate); then the engines' own checks of what a step carries
(a refused step changes nothing); last, a drafter that sends bad blocks, which must not fail the
client. Nothing here may leave a session open on a worker.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import queue
import secrets
from collections.abc import Awaitable, Callable, Sequence

import grpc
import pytest
import pytest_asyncio

from specdec.core.errors import InvalidRequest, SessionOutOfSync
from specdec.core.sampling import SamplingParams
from specdec.core.sessions import InMemorySessionStore
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.core.steps import DraftBlock, DraftProposal, SessionSpec, SparseDistribution, StepOutcome, WorkerInfo
from specdec.draft.drafters import DraftConfig
from specdec.draft.engine import DraftEngine
from specdec.draft.ngram import NgramDrafter
from specdec.orchestrator.loop import Orchestrator, TargetInfo, collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.target.engine import TargetConfig, VerifierEngine
from specdec.target.scheduler import VerifierScheduler
from specdec.target.loop import LoopConfig
from specdec.target.worker import LocalVerifier
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, generation_pb2 as pb, verifier_pb2, verifier_pb2_grpc

from test_e2e import reference_greedy

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

VOCAB = 384  # tests/tiny_models.VOCAB; checked against the verifier in test_tiny_model_limits
CONTEXT = 256  # tiny models' max_position_embeddings
LIMIT = 256  # the cluster's max_new_tokens_limit (tests/cluster.py)
# The deadline of every call here: a refusal must beat it with its own status (one that waited on a
# worker's timeout would end DEADLINE_EXCEEDED instead). A ceiling for a loaded machine, not a
# latency claim: how fast refusals come back is measured by benchmarks/fuzz_servicers.py.
REPLY_BOUND_S = 30.0


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
        msg.speculation.CopyFrom(common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=fixed_k))
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
    ("unknown-verification-rule", lambda: req(temperature=1.0, rule=7), "sampling.rule"),
    ("prompt-over-byte-cap", lambda: req(text="x" * ((1 << 20) + 1)), "bytes"),  # refused before tokenizing
    ("prompt-over-byte-cap-multibyte", lambda: req(text="é" * ((1 << 19) + 1)), "bytes"),  # the cap is in bytes, not characters
    ("drafter-name-too-long", lambda: req(drafter="m" * 65), "drafter name"),
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
        speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_ADAPTIVE, max_speculative_tokens=65)), "max_speculative_tokens"),
    ("adaptive-start-above-its-max", lambda: pb.GenerateRequest(
        text="def f():", max_new_tokens=4, speculation=common_pb2.SpeculationPolicy(
            mode=common_pb2.SPECULATION_MODE_ADAPTIVE, num_speculative_tokens=6, max_speculative_tokens=3)), "max_speculative_tokens"),
    ("unknown-speculation-mode", lambda: pb.GenerateRequest(
        text="def f():", max_new_tokens=4, speculation=common_pb2.SpeculationPolicy(mode=7)), "speculation.mode"),
]


async def call(stub, method: str, request: pb.GenerateRequest) -> None:
    """Run a Generate or a whole GenerateStream; the error, if any, propagates."""
    if method == "Generate":
        await stub.Generate(request, timeout=REPLY_BOUND_S)
    else:
        async for _ in stub.GenerateStream(request, timeout=REPLY_BOUND_S):
            pass


async def wait_for_no_sessions(cluster, timeout_s: float = 60.0) -> tuple[int, int]:
    """Open sessions on (draft, target) worker, polled until none (or the ceiling): sessions are
    freed as streams and loops wind down, just after the caller has seen the end."""
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
    assert info.value.code() == INVALID, info.value.details()  # (not DEADLINE_EXCEEDED: it beat the call's deadline)
    assert word in info.value.details(), info.value.details()
    assert await cluster.active_sessions() == (0, 0), "a refused request opened a session on a worker"


async def test_prompt_one_token_short_of_context_is_accepted(cluster):
    """255 prompt tokens leave room for exactly one generated token: the context ends the request."""
    reply = await cluster.stub.Generate(req(ids=[7] * (CONTEXT - 1), max_new=8), timeout=30)
    assert len(reply.token_ids) == 1
    assert reply.finish_reason in (pb.FINISH_REASON_CONTEXT_FULL, pb.FINISH_REASON_STOP)


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("field", ["text", "stop", "drafter"])
async def test_a_string_that_is_not_utf8_is_invalid_argument(cluster, method, field):
    """protobuf refuses bytes that are not UTF-8 in a `string` field while decoding, before any
    handler runs: INVALID_ARGUMENT saying so, never UNKNOWN or INTERNAL (an encoded surrogate here)."""
    marker = "@@@@"
    message = {"text": req(text=marker), "stop": req(stop=[marker]), "drafter": req(drafter=marker)}[field]
    payload = message.SerializeToString().replace(marker.encode(), b"a\xed\xa0\x80")
    async with cluster.client_channel() as channel:
        call = getattr(channel, "unary_stream" if method == "GenerateStream" else "unary_unary")(
            f"/specdec.v1.Generation/{method}")  # no serializers: these bytes as they are
        with pytest.raises(grpc.aio.AioRpcError) as info:
            reply = call(payload, timeout=REPLY_BOUND_S)
            if method == "GenerateStream":
                async for _ in reply:
                    pass
            else:
                await reply
    assert info.value.code() == INVALID, info.value.details()
    assert "UTF-8" in info.value.details(), info.value.details()
    assert await cluster.active_sessions() == (0, 0)


async def test_get_session_unknown_id_is_not_found(cluster):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.GetSession(pb.GetSessionRequest(session_id=secrets.token_hex(16)), timeout=10)
    assert info.value.code() == NOT_FOUND
    assert "no session" in info.value.details()


@pytest.mark.parametrize("session_id", ["", "not a session id", "a" * 129, "{abc}", "../x"])
async def test_resume_malformed_or_unknown_id_is_refused(cluster, session_id):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in cluster.stub.ResumeStream(pb.ResumeRequest(session_id=session_id), timeout=10):
            pass
    assert info.value.code() == INVALID and "session id" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in cluster.stub.ResumeStream(pb.ResumeRequest(session_id=secrets.token_hex(16)), timeout=10):
            pass
    assert info.value.code() == NOT_FOUND


@pytest.mark.parametrize("session_id", ["", "not a session id", "a" * 129, "{abc}", "../x"])
async def test_get_session_malformed_id_is_invalid_argument(cluster, session_id):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=10)
    assert info.value.code() == INVALID
    assert "session id" in info.value.details()


# ----------------------------------------------------------------------------- internal hops over gRPC

PROMPT = [1, 2, 3, 1, 2]  # valid ids; the n-gram drafter continues them with 3, 1, 2
N = len(PROMPT)


@pytest_asyncio.fixture
async def hops(cluster):
    """Stubs on the draft (cluster.servers[0]) and target (cluster.servers[1]) workers themselves."""
    draft_channel = cluster.worker_channel(cluster.servers[0].address)
    target_channel = cluster.worker_channel(cluster.servers[1].address)
    yield drafter_pb2_grpc.DrafterStub(draft_channel), verifier_pb2_grpc.VerifierStub(target_channel)
    await draft_channel.close()
    await target_channel.close()


def open_request(session_id: str | None = None, drafter: str = "ngram", prompt: Sequence[int] = PROMPT,
                 **sampling) -> common_pb2.OpenSessionRequest:
    """A valid open (fresh session id, greedy, seed set) unless a keyword makes it bad."""
    return common_pb2.OpenSessionRequest(session_id=secrets.token_hex(16) if session_id is None else session_id,
                                         prompt_token_ids=list(prompt), drafter=drafter,
                                         sampling=common_pb2.SamplingParams(seed=sampling.pop("seed", 1), **sampling))


async def expect(code: grpc.StatusCode, word: str, coro) -> None:
    """``coro`` (a call with a deadline of REPLY_BOUND_S) fails with ``code``, its details naming ``word``."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    assert word in info.value.details(), info.value.details()


async def drain(call) -> list:
    return [msg async for msg in call]


async def sessions_drop_to_zero(status: Callable[[], WorkerInfo | Awaitable[WorkerInfo]], timeout_s: float = 60.0) -> int:
    """An engine's open sessions, polled until none (or the time is up): sessions are freed as
    streams and loops wind down, just after the caller has seen the end."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        info = status()
        active = (await info if inspect.isawaitable(info) else info).active_sessions
        if not active or loop.time() >= deadline:
            return active
        await asyncio.sleep(0.05)


# Verifier.Generate ------------------------------------------------------------


def session_request(cluster, **open_kw) -> verifier_pb2.SessionRequest:
    """A valid session (4 greedy tokens, k=2, drafts streamed from the cluster's drafter) unless a keyword or edit makes it bad."""
    return verifier_pb2.SessionRequest(
        session=open_request(**open_kw), drafter_address=cluster.servers[0].address, max_new_tokens=4,
        speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=2))


def _set(path: str, value) -> Callable[[verifier_pb2.SessionRequest], None]:
    """An edit that sets one field, e.g. ``_set("session.sampling.temperature", -1.0)``."""
    *parents, name = path.split(".")

    def edit(msg) -> None:
        for p in parents:
            msg = getattr(msg, p)
        setattr(msg, name, value)

    return edit


def _prompt(ids: list[int]) -> Callable[[verifier_pb2.SessionRequest], None]:
    def edit(msg) -> None:
        del msg.session.prompt_token_ids[:]
        msg.session.prompt_token_ids.extend(ids)

    return edit


# (id, edit of a valid SessionRequest, the word the message must contain)
BAD_SESSIONS: list[tuple[str, Callable[[verifier_pb2.SessionRequest], None], str]] = [
    ("no-session", lambda m: m.ClearField("session"), "session"),
    ("no-speculation", lambda m: m.ClearField("speculation"), "speculation"),
    ("empty-session-id", _set("session.session_id", ""), "session id"),
    ("malformed-session-id", _set("session.session_id", "not a session id"), "session id"),
    ("uppercase-session-id", _set("session.session_id", "ABCDEF" + "0" * 26), "session id"),
    ("empty-prompt", _prompt([]), "prompt"),
    ("prompt-id-too-large", _prompt([1, 2, VOCAB]), "vocabulary"),
    ("prompt-id-negative", _prompt([1, -1, 2]), "vocabulary"),
    ("prompt-fills-context", _prompt([7] * CONTEXT), "context"),
    ("negative-temperature", _set("session.sampling.temperature", -1.0), "temperature"),
    ("nan-temperature", _set("session.sampling.temperature", float("nan")), "temperature"),
    ("top-p-above-1", _set("session.sampling.top_p", 2.0), "top_p"),
    ("k-above-max", _set("speculation.num_speculative_tokens", 65), "num_speculative_tokens"),
    ("too-many-fallback-drafters", lambda m: m.fallback_drafters.extend(
        [verifier_pb2.DrafterEndpoint(address=f"127.0.0.1:{p}") for p in range(1, 10)]), "at most 8"),
    ("fallback-drafter-name-too-long", lambda m: m.fallback_drafters.append(
        verifier_pb2.DrafterEndpoint(address="127.0.0.1:1", server_name="x" * 254)), "server_name"),
]


async def test_generate_valid_session_runs_to_the_end(cluster, hops):
    """The baseline the bad sessions below differ from by one thing each."""
    _, verifier = hops
    commits = await drain(verifier.Generate(session_request(cluster), timeout=30))
    assert sum(len(c.token_ids) for c in commits) == 4
    assert commits[-1].finished and not any(c.finished for c in commits[:-1])
    assert commits[-1].committed_len == N + 4
    assert await wait_for_no_sessions(cluster) == (0, 0)


@pytest.mark.parametrize("edit, word", [pytest.param(e, w, id=i) for i, e, w in BAD_SESSIONS])
async def test_generate_bad_session_is_invalid_argument(cluster, hops, edit, word):
    _, verifier = hops
    msg = session_request(cluster)
    edit(msg)
    await expect(INVALID, word, drain(verifier.Generate(msg, timeout=30)))
    assert await wait_for_no_sessions(cluster) == (0, 0), "a refused session was left open on a worker"


# Drafter.Speculate ------------------------------------------------------------


def opening(**open_kw) -> drafter_pb2.SpeculateRequest:
    return drafter_pb2.SpeculateRequest(open=open_request(**open_kw))


def outcome(committed_len: int, token_ids: Sequence[int] = (), k: int = 3, overlap: bool = False) -> drafter_pb2.SpeculateRequest:
    return drafter_pb2.SpeculateRequest(outcome=drafter_pb2.StepOutcome(
        committed_len=committed_len, token_ids=list(token_ids), num_speculative_tokens=k, overlap=overlap))


async def speculate(drafter, messages: list[drafter_pb2.SpeculateRequest]) -> list[drafter_pb2.DraftBlock]:
    """Send ``messages``, close our side, read the stream to its end."""
    async def requests():
        for m in messages:
            yield m

    return await drain(drafter.Speculate(requests(), timeout=30))


# (id, the stream's messages, status, the word the message must contain[, marks])
BAD_STREAMS = [
    ("outcome-first", lambda: [outcome(N)], INVALID, "open"),
    ("unknown-drafter", lambda: [opening(drafter="no-such-drafter")], INVALID, "no-such-drafter"),
    ("empty-session-id", lambda: [opening(session_id="")], INVALID, "session id"),
    ("malformed-session-id", lambda: [opening(session_id="g" * 32)], INVALID, "session id"),
    ("empty-prompt", lambda: [opening(prompt=[])], INVALID, "prompt"),
    ("prompt-id-too-large", lambda: [opening(drafter="model", prompt=[1, VOCAB])], INVALID, "vocabulary"),
    ("prompt-fills-context", lambda: [opening(drafter="model", prompt=[1] * CONTEXT)], INVALID, "context"),
    ("negative-temperature", lambda: [opening(temperature=-1.0)], INVALID, "temperature"),  # found while decoding `open`
    ("top-p-above-1", lambda: [opening(drafter="model", temperature=1.0, top_p=2.0)], INVALID, "top_p"),
    ("second-open", lambda: [opening(), opening()], INVALID, "outcome"),
    # The worker holds N tokens: an outcome must extend a prefix of them.
    ("outcome-past-what-is-held", lambda: [opening(), outcome(N + 1)], PRECONDITION, f"holds {N}"),
    ("outcome-before-the-start", lambda: [opening(), outcome(2, [5, 6, 7])], PRECONDITION, f"holds {N}"),
    ("outcome-after-a-gap", lambda: [opening(), outcome(N + 3, [5])], PRECONDITION, f"holds {N}"),
    ("outcome-too-many-tokens", lambda: [opening(), outcome(N + 66, [1] * 66)], INVALID, "at most 65"),
    ("outcome-k-above-max", lambda: [opening(), outcome(N, k=65)], INVALID, "num_speculative_tokens"),
    ("ngram-outcome-id-negative", lambda: [opening(), outcome(N + 1, [-1])], INVALID, "vocabulary"),
    ("model-outcome-id-negative", lambda: [opening(drafter="model"), outcome(N + 1, [-1])], INVALID, "vocabulary"),
    # The n-gram drafter has no vocabulary: any non-negative int32 is a token to it.
    ("model-outcome-id-too-large", lambda: [opening(drafter="model"), outcome(N + 1, [VOCAB])], INVALID, "vocabulary"),
]


@pytest.mark.parametrize("messages, code, word", [pytest.param(m, c, w, id=i, marks=marks) for i, m, c, w, *marks in BAD_STREAMS])
async def test_speculate_bad_stream_gets_its_status(cluster, hops, messages, code, word):
    drafter, _ = hops
    await expect(code, word, speculate(drafter, messages()))
    assert await sessions_drop_to_zero(cluster.draft.status) == 0, "the stream ended but its session is still open"


@pytest.mark.parametrize("end", ["close", "cancel"])
@pytest.mark.parametrize("which", ["ngram", "model"])
async def test_speculate_streams_the_block_asked_for_and_frees_the_session(cluster, hops, which, end):
    drafter, _ = hops
    call = drafter.Speculate(timeout=30)
    await call.write(opening(drafter=which))
    await call.write(outcome(N, k=3, overlap=False))  # nothing committed yet; draft 3, no pre-drafts
    block = await call.read()
    assert block.anchor_len == N and list(block.assumed_ids) == []  # drafted just in time for the prompt
    assert 1 <= len(block.draft_token_ids) <= 3
    assert all(0 <= t < VOCAB for t in block.draft_token_ids)
    assert not block.draft_distributions  # greedy drafts are point masses
    if which == "ngram":
        assert list(block.draft_token_ids) == [3, 1, 2]  # what followed the earlier "1, 2"
    assert cluster.draft.status().active_sessions == 1
    if end == "close":
        await call.done_writing()
        while (msg := await call.read()) is not grpc.aio.EOF:  # no pre-drafts were asked for, but any block is fine
            assert msg.anchor_len == N
        assert await call.code() == grpc.StatusCode.OK
    else:
        call.cancel()
    assert await sessions_drop_to_zero(cluster.draft.status) == 0


# ----------------------------------------------------------------------------- the engines' own checks


def test_draft_engine_refused_outcome_changes_nothing():
    """Each refused outcome would have committed a token (and asked for 2 drafts) had any of it been applied."""
    engine = DraftEngine({"ngram": NgramDrafter(3, 1)}, DraftConfig())
    blocks: queue.Queue[DraftBlock] = queue.Queue()
    sid = secrets.token_hex(16)
    try:
        engine.open(SessionSpec(sid, tuple(PROMPT), SamplingParams(seed=1), "ngram"), blocks.put).result(timeout=10)
        refused = [
            (StepOutcome(N + 2, (3,), 2, False), SessionOutOfSync, f"holds {N}"),
            (StepOutcome(N + 1, (-1,), 2, False), InvalidRequest, "vocabulary"),
            (StepOutcome(N + 1, (3,), 65, False), InvalidRequest, "num_speculative_tokens"),
        ]
        for bad, error, word in refused:
            with pytest.raises(error, match=word):
                engine.outcome(sid, bad)
        assert blocks.empty()  # k is still 0: nothing drafted
        engine.outcome(sid, StepOutcome(N, (), 3, False))
        block = blocks.get(timeout=10)
        # Drafted for the prompt alone, 3 tokens long: no refused outcome left a trace.
        assert (block.anchor_len, block.assumed_ids, block.proposal.token_ids) == (N, (), (3, 1, 2))
    finally:
        engine.close(sid)
        engine.shutdown()


@pytest.fixture(scope="module")
def verifier_engine(tiny_pair) -> VerifierEngine:
    target_path, _ = tiny_pair
    return VerifierEngine.from_config(TargetConfig(target_path))


def dist(ids: list[int], probs: list[float]) -> SparseDistribution:
    return SparseDistribution(tuple(ids), tuple(probs))


SAMPLED = SamplingParams(temperature=1.0, seed=3)  # sampled, so the outcome depends on every position's random draw
GOOD = DraftProposal((5, 6), (dist([5, 6], [0.75, 0.25]), dist([6, 7], [0.5, 0.5])))

# (id, proposal, the word the message must contain)
BAD_PROPOSALS = [
    ("draft-id-too-large", DraftProposal((5, VOCAB)), "vocabulary"),
    ("draft-id-negative", DraftProposal((-3,)), "vocabulary"),
    ("too-few-distributions", DraftProposal((5, 6), (dist([5], [1.0]),)), "distributions"),
    ("too-many-distributions", DraftProposal((5,), (dist([5], [1.0]), dist([6], [1.0]))), "distributions"),
    ("probs-do-not-sum-to-1", DraftProposal((5,), (dist([5, 6], [0.5, 0.2]),)), "sum to 1"),
    ("nan-prob", DraftProposal((5,), (dist([5, 6], [math.nan, 1.0]),)), "positive"),
    ("zero-prob", DraftProposal((5,), (dist([5, 6], [1.0, 0.0]),)), "positive"),
    ("negative-prob", DraftProposal((5,), (dist([5, 6], [1.5, -0.5]),)), "positive"),
    ("duplicate-ids", DraftProposal((5,), (dist([5, 5], [0.5, 0.5]),)), "distinct"),
    ("distribution-id-outside-vocab", DraftProposal((5,), (dist([5, VOCAB], [0.5, 0.5]),)), "inside"),
    ("ids-and-probs-differ-in-length", DraftProposal((5,), (dist([5, 6], [1.0]),)), "equal length"),
    ("empty-distribution", DraftProposal((5,), (dist([], []),)), "non-empty"),
    # Drawn from a distribution that cannot give it: the rejection rule would divide by zero.
    ("draft-has-zero-probability", DraftProposal((5,), (dist([6], [1.0]),)), "zero probability"),
    ("more-drafts-than-the-context-holds", DraftProposal((5,) * CONTEXT), "context"),
]


def verify_on_fresh_session(engine: VerifierEngine, proposal: DraftProposal) -> tuple:
    sid = secrets.token_hex(16)
    engine.open(SessionSpec(sid, tuple(PROMPT), SAMPLED))
    try:
        out = engine.verify(sid, proposal)
        return out.token_ids, out.num_accepted, out.committed_len
    finally:
        engine.close(sid)


@pytest.mark.parametrize("proposal, word", [pytest.param(p, w, id=i) for i, p, w in BAD_PROPOSALS])
def test_verify_refuses_a_bad_proposal_and_changes_nothing(verifier_engine, proposal, word):
    engine = verifier_engine
    expected = verify_on_fresh_session(engine, GOOD)
    sid = secrets.token_hex(16)
    engine.open(SessionSpec(sid, tuple(PROMPT), SAMPLED))
    try:
        with pytest.raises(InvalidRequest, match=word):
            engine.verify(sid, proposal)
        out = engine.verify(sid, GOOD)
        assert (out.token_ids, out.num_accepted, out.committed_len) == expected
        assert out.committed_len == N + out.num_accepted + 1
    finally:
        assert engine.close(sid)
    assert engine.status().active_sessions == 0


# ----------------------------------------------------------------------------- a drafter that sends bad blocks


class FakeBadDrafterLink:
    """A fake, deliberately misbehaving drafter: every block continues the committed sequence but
    carries ``proposal``, which the verifier must refuse."""

    def __init__(self, proposal: DraftProposal, made: list["FakeBadDrafterLink"]) -> None:
        self.proposal = proposal
        self.blocks_sent = 0
        self.closed = False
        made.append(self)

    async def open(self, spec: SessionSpec) -> None:
        pass

    def send(self, outcome: StepOutcome) -> None:
        pass

    async def next_block(self, committed: Sequence[int], timeout_s: float) -> DraftBlock | None:
        self.blocks_sent += 1
        return DraftBlock(len(committed), (), self.proposal)

    @property
    def up(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("proposal", [
    pytest.param(DraftProposal((VOCAB + 7, 1, 2)), id="ids-outside-vocab"),
    pytest.param(DraftProposal((-1,)), id="negative-id"),
    pytest.param(DraftProposal((5, 6), (dist([5, 6], [0.9, 0.9]), dist([6], [1.0]))), id="probs-do-not-sum-to-1"),
])
async def test_bad_blocks_do_not_fail_the_request(tiny_pair, verifier_engine, proposal):
    """The drafter's fault, not the client's: the verifier drops it and decodes alone, output unchanged."""
    target_path, _ = tiny_pair
    loaded = verifier_engine.loaded
    made: list[FakeBadDrafterLink] = []
    engine = VerifierScheduler(verifier_engine)  # its own thread, as in a verifier server
    verifier = LocalVerifier(engine, lambda run: FakeBadDrafterLink(proposal, made),
                             LoopConfig(reconnect_s=0.0))  # reconnect at once: every new link is refused again
    info = TargetInfo(loaded.tokenizer, loaded.vocab_size, loaded.context_length, loaded.eos_token_id)
    orch = Orchestrator(info, verifier, InMemorySessionStore(), OrchestratorConfig())
    prompt, max_new = "def f():", 24
    last, ids, _ = await collect(orch.generate(GenerationRequest(
        prompt_text=prompt, max_new_tokens=max_new, drafter="model", policy=SpeculationPolicy(SpeculationMode.FIXED, 3))))
    assert ids == reference_greedy(target_path, prompt, max_new)
    assert last.counters.draft_tokens == 0, "a refused block was counted as drafted"
    assert last.counters.verify_steps == len(ids)  # plain decoding: one token a step
    assert sum(1 for link in made if link.blocks_sent) >= 2, "the verifier never tried the drafter again"
    assert await sessions_drop_to_zero(engine.status) == 0
    assert all(link.closed for link in made)


async def test_no_session_leaked(cluster):
    """Runs last in this module: every failed request and every directly opened session was closed."""
    assert await wait_for_no_sessions(cluster) == (0, 0)


@pytest.mark.parametrize("block, word", [
    (drafter_pb2.DraftBlock(anchor_len=5, draft_token_ids=[1] * 66), "at most 65 draft"),
    (drafter_pb2.DraftBlock(anchor_len=5, assumed_ids=[1] * 66, draft_token_ids=[1]), "assumed"),
    (drafter_pb2.DraftBlock(anchor_len=5, draft_token_ids=[1], draft_distributions=[
        common_pb2.DraftDistribution(token_ids=list(range(1025)), probs=[1 / 1025] * 1025)]), "1024 entries"),
    (drafter_pb2.DraftBlock(anchor_len=5, draft_token_ids=[1], draft_distributions=[
        common_pb2.DraftDistribution(token_ids=[1], probs=[1.0])] * 2), "one distribution per draft token"),
    (drafter_pb2.DraftBlock(anchor_len=5, draft_token_ids=[1, 2], parent_indices=[-1]), "one parent index per draft token"),
    (drafter_pb2.DraftBlock(anchor_len=5, draft_token_ids=[1, 2], parent_indices=[-1, 1]), "earlier node"),
    (drafter_pb2.DraftBlock(anchor_len=5, draft_token_ids=[1, 1], parent_indices=[-1, -1]), "siblings must differ"),
    (drafter_pb2.DraftBlock(anchor_len=5, draft_token_ids=[1], parent_indices=[-1], draft_distributions=[
        common_pb2.DraftDistribution(token_ids=[1], probs=[1.0])]), "point masses"),
], ids=["too-many-drafts", "too-many-assumed", "distribution-too-wide", "more-distributions-than-drafts",
        "parents-short", "parent-after-child", "same-token-siblings", "tree-with-distributions"])
def test_an_oversized_draft_block_is_refused_before_it_is_copied(block, word):
    """What a verifier takes from a drafter is bounded too: a bad block fails the link (the verifier
    then decodes alone, tests/test_worker_failure.py), never the verifier."""
    from specdec.rpc import wire

    with pytest.raises(InvalidRequest, match=word):
        wire.block_from_pb(block)
