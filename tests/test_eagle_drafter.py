"""Drafter ``eagle`` (services/draft/eagle_drafter.py): the demo target's EAGLE head, fed the
target's features by the verifier (core/features.py), in one process and over real gRPC servers.

The demo pair and its trained head (models/demo) rather than the tiny random pair: a random head
agrees with nothing, and these tests want accepted drafts, not only correct output.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import uuid
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from scipy import stats
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import roles
from specdec.core import features
from specdec.core.errors import InvalidRequest
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.core.steps import DraftProposal, SessionSpec, StepOutcome
from specdec.draft.drafters import DraftConfig, build_drafters
from specdec.orchestrator.loop import collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.rpc import wire
from specdec.target.engine import TargetConfig, VerifierEngine

from cluster import PATIENT, start_cluster
from redis_server import delete_prefix
from test_e2e import prompts, request

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
TARGET, DRAFT, HEAD = (str(DEMO / name) for name in ("target", "draft", "eagle"))
MAX_NEW = 16
N = 320  # seeds of the distribution test
pytestmark = pytest.mark.skipif(not (DEMO / "eagle" / "config.json").is_file(), reason="no demo EAGLE head (models/demo/eagle)")


@functools.lru_cache(maxsize=1)
def hf_target():
    tok = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    return tok, AutoModelForCausalLM.from_pretrained(TARGET, local_files_only=True, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def reference_greedy(prompt: str) -> tuple[int, ...]:
    tok, model = hf_target()
    ids = tok(prompt)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tok.eos_token_id)
    return tuple(out[0, len(ids):].tolist())


def post_norm_features(ids) -> torch.Tensor:
    """The target's final-norm hidden states [len(ids), hidden], by transformers."""
    _, model = hf_target()
    with torch.no_grad():
        return model.model(torch.tensor([list(ids)])).last_hidden_state[0]


# ------------------------------------------------------------------------------------------ wire

def test_a_chunk_crosses_the_wire_as_bfloat16_and_bad_ones_are_refused():
    values = torch.randn(5, 12)
    chunk = next(features.to_chunks(3, values))
    pb = wire.outcome_to_pb(StepOutcome(9, (1, 2), 4, True, chunk)).outcome
    assert len(pb.features.bfloat16) == 5 * 12 * 2  # width × 2 bytes a position
    back = wire.outcome_from_pb(pb).features
    assert back.first_position == 3 and torch.equal(back.values, values.to(torch.bfloat16))
    pb.committed_len = 7  # features of position 7 before the token after it exists
    with pytest.raises(InvalidRequest, match="past the 7 committed"):
        wire.outcome_from_pb(pb)
    for width, data, match in ((0, b"\0\0", "width"), (12, b"\0" * 7, "multiple"), (12, b"", "multiple"),
                               (1, b"\0" * (features.MAX_CHUNK_BYTES + 2), "at most"),
                               (1, torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes(), "finite")):
        with pytest.raises(InvalidRequest, match=match):
            features.decode(0, width, data)


def test_a_long_prompt_is_split_into_bounded_chunks():
    width = 4096
    rows = torch.zeros(features.positions_per_chunk(width) * 2 + 1, width)
    chunks = list(features.to_chunks(0, rows))
    assert len(chunks) == 3 and all(c.nbytes <= features.MAX_CHUNK_BYTES for c in chunks)
    assert [c.first_position for c in chunks] == [0, chunks[0].end, chunks[1].end] and chunks[-1].end == rows.shape[0]


# ------------------------------------------------------------------------------------- verifier

@pytest.fixture(scope="module")
def engine():
    return VerifierEngine.from_config(TargetConfig(TARGET, max_sessions=16))


def test_the_verifier_sends_the_true_features_of_committed_pairs_and_only_to_feature_drafters(engine):
    tok, _ = hf_target()
    ids = tuple(tok("def mean(values):\n    return")["input_ids"])
    engine.open(SessionSpec("e" * 32, ids, SamplingParams(), "eagle"))
    engine.open(SessionSpec("d" * 32, ids, SamplingParams(), "model"))
    eagle, plain = engine.sessions.get("e" * 32), engine.sessions.get("d" * 32)
    (prompt_chunk,) = eagle.features_out
    assert prompt_chunk.first_position == 0 and prompt_chunk.end == len(ids) - 1  # each with the token after it
    torch.testing.assert_close(prompt_chunk.values.float(), post_norm_features(ids)[: len(ids) - 1], atol=0.05, rtol=0.02)
    eagle.features_out.clear()
    greedy = reference_greedy(tok.decode(ids))  # (decode round-trips these ids)
    drafts = (greedy[0], greedy[1], (greedy[2] + 1) % 100)  # two right, one wrong
    out = engine.verify_batch([("e" * 32, DraftProposal(drafts)), ("d" * 32, DraftProposal(drafts))])
    assert out[0].num_accepted == 2 and out[0].token_ids == greedy[:3]
    (step_chunk,) = eagle.features_out
    n = len(ids)
    assert (step_chunk.first_position, step_chunk.end) == (n - 1, n + 2)  # positions n-1 .. n-1+accepted
    torch.testing.assert_close(step_chunk.values.float(), post_norm_features(ids + greedy[:3])[n - 1 : n + 2], atol=0.05, rtol=0.02)
    assert not plain.features_out, "a drafter that reads no features got some"
    engine.verify_batch([("d" * 32, DraftProposal(()))])
    assert engine.runner.last_features is None  # nothing computed or kept when nobody asks
    for sid in ("e" * 32, "d" * 32):
        engine.close(sid)


def test_the_transformers_runner_sends_no_features():
    """Its forward keeps no hidden states: an eagle session there gets none (and so drafts nothing)."""
    hf = VerifierEngine.from_config(TargetConfig(TARGET, runner="hf", max_sessions=2))
    tok, _ = hf_target()
    ids = tuple(tok("def f(x):\n")["input_ids"])
    hf.open(SessionSpec("a" * 32, ids, SamplingParams(), "eagle"))
    hf.verify("a" * 32, DraftProposal(()))
    assert not hf.sessions.get("a" * 32).features_out


# -------------------------------------------------------------------------------------- drafter

@pytest.fixture(scope="module")
def eagle():
    return build_drafters(DraftConfig(None, TARGET, eagle_head_path=HEAD))["eagle"]


def feed_all(session, ids):
    session.add_features(next(features.to_chunks(0, post_norm_features(ids)[: len(ids) - 1])))


def test_the_heads_state_after_a_block_is_what_a_fresh_session_computes(eagle):
    """Exact rollback: chained guesses (drafts, a pre-draft's assumed tokens) leave nothing behind,
    and features arriving step by step give what a session given them all at once gives."""
    tok, _ = hf_target()
    ids = tuple(tok("import os\n\ndef walk(path):\n")["input_ids"]) + reference_greedy("import os\n\ndef walk(path):\n")[:6]
    greedy = SamplingParams()
    stepwise = eagle.open(ids[:8], greedy)
    feats = post_norm_features(ids)
    for end in range(8, len(ids) + 1, 3):  # a prefill, then steps (each chunk repeating one position)
        start = max(0, end - 4) if end > 8 else 0
        stepwise.add_features(next(features.to_chunks(start, feats[start : end - 1])))
        stepwise.propose(ids[:end], 5)
        stepwise.propose(ids[:end] + (1, 2, 3), 5)  # a pre-draft after assumed tokens
    stepwise.add_features(next(features.to_chunks(len(ids) - 4, feats[len(ids) - 4 : len(ids) - 1])))
    fresh = eagle.open(ids, greedy)
    feed_all(fresh, ids)
    a, b = stepwise.propose(ids, 6), fresh.propose(ids, 6)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6
    assert stepwise.ingested_end == fresh.ingested_end == len(ids) - 1
    length = stepwise._cache.length
    assert length == fresh._cache.length
    torch.testing.assert_close(stepwise._cache.keys[:, :length], fresh._cache.keys[:, :length], atol=1e-5, rtol=1e-4)
    assert stepwise.propose(ids, 6).token_ids == a.token_ids  # proposing changed nothing


def test_the_fast_path_computes_what_the_heads_modules_compute(eagle):
    """core/eagle_fast.py against core/eagle_head.py: a multi-row ingest, a cached step, a masked
    tree; and the draft vocabulary leaves every other token at -inf."""
    from specdec.core.eagle_fast import FastHead
    from specdec.core.eagle_head import HeadCache
    from specdec.core.tree import feed_mask, feed_positions

    head, fast = eagle.head, FastHead(eagle.head)
    gen = torch.Generator().manual_seed(0)
    feats, tokens = torch.randn(9, head.config.hidden_size, generator=gen), torch.randint(0, 6000, (9,), generator=gen)
    slow_cache, cache = HeadCache(), fast.new_cache()
    with torch.no_grad():
        want = head(feats[None, :6], tokens[None, :6], start=0, cache=slow_cache)[0]
        torch.testing.assert_close(fast.forward(feats[:6], tokens[:6], torch.arange(6), cache), want, atol=1e-5, rtol=1e-4)
        want = head(feats[None, 6:7], tokens[None, 6:7], start=6, cache=slow_cache)[0]
        torch.testing.assert_close(fast.forward(feats[6:7], tokens[6:7], torch.tensor([6]), cache), want, atol=1e-5, rtol=1e-4)
        parents = (-1, -1)
        mask, positions = feed_mask(7, 2, parents), torch.tensor(feed_positions(7, 2, parents))
        want = head(feats[None, 7:], tokens[None, 7:], cache=slow_cache, positions=positions, mask=mask)[0]
        torch.testing.assert_close(fast.forward(feats[7:], tokens[7:], positions, cache, mask), want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fast.logits(want), head.logits(want).float())
    assert eagle.fast.draft_vocab is not None, "the demo head ships a draft vocabulary"
    restricted = eagle.fast.logits(want)
    outside = torch.ones(restricted.shape[-1], dtype=torch.bool)
    outside[eagle.fast.draft_vocab] = False
    assert torch.isneginf(restricted[:, outside]).all() and torch.isfinite(restricted[:, ~outside]).all()


def test_features_of_another_width_are_refused_and_change_nothing(eagle):
    from specdec.draft.speculator import SessionSpeculator

    tok, _ = hf_target()
    ids = tuple(tok("x = 1\n")["input_ids"])
    speculator = SessionSpeculator(eagle.open(ids, SamplingParams()), ids, eagle.vocab_size, 512, lambda block: None)
    wrong = next(features.to_chunks(0, torch.zeros(len(ids) - 1, 128)))
    with pytest.raises(InvalidRequest, match="width 128"):
        speculator.on_outcome(StepOutcome(len(ids) + 1, (5,), 4, True, wrong))
    assert speculator.committed == list(ids) and speculator.k == 0


def test_without_features_the_head_proposes_nothing_and_a_gap_restarts_it(eagle):
    tok, _ = hf_target()
    ids = tuple(tok("class Stack:\n    def push(self, item):\n")["input_ids"])
    session = eagle.open(ids, SamplingParams())
    assert session.propose(ids, 4).token_ids == ()  # nothing to draft from: an empty block, plain decoding
    feats = post_norm_features(ids)
    session.add_features(next(features.to_chunks(5, feats[5 : len(ids) - 1])))  # positions 0..4 never came
    assert len(session.propose(ids, 4).token_ids) == 4 and session.ingested_end == len(ids) - 1


def test_rejection_sampling_with_the_heads_proposals_keeps_the_targets_distribution(engine, eagle):
    """The first committed token over N seeds against the target's own distribution at that
    position (top-k 4, so every cell is well filled); control: the head's proposals are not
    distributed so (some fall outside the target's top 4), yet what is committed is."""
    tok, _ = hf_target()
    ids = tuple(tok("for line in open(path):\n   ")["input_ids"])
    sampling = dict(temperature=1.0, top_k=4, rule=VerificationRule.REJECTION)
    _, model = hf_target()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    target = torch.softmax(torch.topk(logits, 4).values.double(), -1)
    expected = (target / target.sum() * N).tolist()
    support = torch.topk(logits, 4).indices.tolist()
    counts, head_firsts = collections.Counter(), collections.Counter()
    for first in range(0, N, 16):  # sixteen sessions a batch: one prefill and one verify forward
        seeds = range(first, first + 16)
        specs = [SessionSpec(f"{seed:032x}", ids, SamplingParams(seed=seed, **sampling), "eagle") for seed in seeds]
        engine.open_batch([(spec, None, ()) for spec in specs])
        steps = []
        for spec in specs:
            session = eagle.open(ids, spec.sampling)
            for chunk in engine.sessions.get(spec.session_id).features_out:
                session.add_features(chunk)
            proposal = session.propose(ids, 3)
            assert proposal.distributions is not None and len(proposal.distributions) == 3
            head_firsts[proposal.token_ids[0]] += 1
            steps.append((spec.session_id, proposal))
        for outcome in engine.verify_batch(steps):
            counts[outcome.token_ids[0]] += 1
        for spec in specs:
            engine.close(spec.session_id)
    observed = [counts[t] for t in support]
    assert sum(observed) == N, "a token outside the target's top-k was committed"
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    head = [head_firsts[t] for t in support]  # control: what the head proposed is not the target's distribution
    assert sum(head) < N or stats.chisquare(head, expected).pvalue < 1e-3, "the head alone already samples the target"



# ------------------------------------------------------------------------------ end to end paths

def policy(k: int) -> SpeculationPolicy:
    return SpeculationPolicy(SpeculationMode.FIXED, k, max(k, 8))


@pytest.fixture(scope="module")
def embedded():
    return roles.embedded(TargetConfig(TARGET), DraftConfig(DRAFT, TARGET, eagle_head_path=HEAD), OrchestratorConfig(),
                          loop_config=PATIENT)


@pytest_asyncio.fixture(scope="module")
async def eagle_cluster(redis_url):
    c = await start_cluster(TARGET, DRAFT, redis_url, prefix=f"specdec-test-{uuid.uuid4().hex[:8]}", eagle_head=HEAD)
    yield c
    await c.stop()
    delete_prefix(redis_url, c.store._prefix)


CASES = [(prompt, drafter, (3, 5)[i % 2] if drafter == "eagle" else (7, 15)[i % 2])
         for i, prompt in enumerate(prompts(20)) for drafter in ("eagle", "eagle_tree")]  # chains of k, trees of k nodes


async def test_greedy_in_one_process_equals_target_only(embedded):
    tok, _ = hf_target()

    def one(prompt: str, drafter: str, k: int):
        return collect(embedded.generate(GenerationRequest(prompt_ids=tuple(tok(prompt)["input_ids"]), max_new_tokens=MAX_NEW,
                                                           drafter=drafter, policy=policy(k))))
    results = await asyncio.gather(*(one(*case) for case in CASES))  # concurrent sessions, one batch
    accepted = collections.Counter()
    for (prompt, drafter, k), (last, out, _) in zip(CASES, results):
        assert out == reference_greedy(prompt), (prompt, drafter, k)
        accepted[drafter] += last.counters.accepted_tokens
    for drafter in ("eagle", "eagle_tree"):
        assert accepted[drafter] > 20 * MAX_NEW // 4, f"{drafter}: drafts hardly accepted: is the head reading the right features?"


async def test_greedy_over_grpc_equals_target_only(eagle_cluster):
    replies = await asyncio.gather(*(eagle_cluster.stub.Generate(request(prompt, k, drafter, max_new=MAX_NEW), timeout=120)
                                     for prompt, drafter, k in CASES))
    accepted = collections.Counter()
    for (prompt, drafter, k), reply in zip(CASES, replies):
        assert tuple(reply.token_ids) == reference_greedy(prompt), (prompt, drafter, k)
        accepted[drafter] += reply.stats.accepted_tokens
    assert min(accepted["eagle"], accepted["eagle_tree"]) > 20 * MAX_NEW // 4


def test_trees_branch_where_the_head_is_unsure_and_leave_its_state_as_it_was(eagle):
    from specdec.draft.drafters import build_drafters as build

    trees = build(DraftConfig(None, TARGET, eagle_head_path=HEAD))["eagle_tree"]
    tok, _ = hf_target()
    ids = tuple(tok("    for key, value in items:\n")["input_ids"])
    session = trees.open(ids, SamplingParams())
    feed_all(session, ids)
    chain = session._session.propose(ids, 8)
    state = (session._session.ingested_end, session._session._cache.length)
    tree = session.propose(ids, 15)
    assert (session._session.ingested_end, session._session._cache.length) == state  # rolled back
    assert len(tree.token_ids) == 15 and tree.parents and not tree.tree.is_chain
    assert tree.token_ids[tree.tree.children[-1][0]] == chain.token_ids[0]  # its likeliest root child is the chain's draft
    main = [tree.token_ids[j] for j in tree.tree.main_chain]
    assert main == list(chain.token_ids[: len(main)])  # greedy: the first-child path is the chain


async def test_coupled_sampling_is_seed_exact_in_one_process_and_over_grpc(embedded, eagle_cluster):
    tok, _ = hf_target()
    accepted = 0
    for i, prompt in enumerate(prompts(6)):
        ids = tuple(tok(prompt)["input_ids"])
        params = SamplingParams(seed=100 + i, temperature=0.8, rule=VerificationRule.COUPLED)

        def one(drafter: str, k: int):
            return collect(embedded.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=MAX_NEW, drafter=drafter,
                                                               policy=policy(k) if k else SpeculationPolicy(SpeculationMode.FIXED, 0, 8),
                                                               sampling=params, seed_given=True)))
        drafter, k = ("eagle", 5) if i % 2 else ("eagle_tree", 7)
        (_, plain, _), (last, spec, _) = await asyncio.gather(one("model", 0), one(drafter, k))
        assert spec == plain, (prompt, drafter)
        reply = await eagle_cluster.stub.Generate(request(prompt, k, drafter, max_new=MAX_NEW, temperature=0.8, seed=100 + i), timeout=120)
        assert tuple(reply.token_ids) == plain, (prompt, drafter)
        accepted += last.counters.accepted_tokens + reply.stats.accepted_tokens
    assert accepted > 0


async def test_the_head_inside_the_verifier_needs_no_draft_worker(redis_url):
    """In-verifier drafting: the verifier runs eagle itself and advertises it; the draft worker
    serves only the draft model, yet sessions asking for eagle speculate, with target-only output."""
    c = await start_cluster(TARGET, DRAFT, redis_url, prefix=f"specdec-test-{uuid.uuid4().hex[:8]}", eagle_head=HEAD,
                            in_verifier=("eagle", "eagle_tree"))
    try:
        assert "eagle" not in c.draft.drafters and set(c.orchestrator.target.drafters) >= {"model", "eagle", "eagle_tree"}
        cases = CASES[:8]
        replies = await asyncio.gather(*(c.stub.Generate(request(prompt, k, drafter, max_new=MAX_NEW), timeout=120)
                                         for prompt, drafter, k in cases))
        for (prompt, drafter, k), reply in zip(cases, replies):
            assert tuple(reply.token_ids) == reference_greedy(prompt), (prompt, drafter, k)
        assert sum(r.stats.accepted_tokens for r in replies) > 8 * MAX_NEW // 4
        model = await c.stub.Generate(request(prompts(1)[0], 4, "model", max_new=MAX_NEW), timeout=120)
        assert tuple(model.token_ids) == reference_greedy(prompts(1)[0]) and model.stats.draft_tokens > 0  # still remote
    finally:
        await c.stop()
        delete_prefix(redis_url, c.store._prefix)
