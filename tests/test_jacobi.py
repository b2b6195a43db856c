"""Drafters ``jacobi`` and ``lookahead`` (services/draft/jacobi.py): the target's row guesses as the
next Jacobi iterate, an n-gram pool, and the token tree of both; lossless in one process and over gRPC."""
from __future__ import annotations

import asyncio

import pytest

from specdec import roles
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.core.steps import StepOutcome
from specdec.core.tree import DraftTree
from specdec.draft.drafters import DraftConfig
from specdec.draft.jacobi import JacobiSession, LookaheadSession, NgramPool, _Trie
from specdec.orchestrator.loop import collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.rpc import wire
from specdec.target.engine import TargetConfig

from cluster import PATIENT
from test_e2e import MAX_NEW, prompts, reference_greedy, request

# (drafter, k): Jacobi windows of 3 and 5; lookahead trees of 6 and 12 nodes, and adaptive budgets
SETTINGS = (("jacobi", 3), ("jacobi", 5), ("lookahead", 6), ("lookahead", 12), ("lookahead", None))


def test_a_chain_blocks_rows_past_the_accepted_prefix_are_the_next_guesses():
    session = JacobiSession()
    # Block (7, 8, 9, 10) verified after 10 committed tokens: two accepted, then the target's 50. Row j
    # is the target's guess after draft j, for position 10 + j + 1.
    session.add_row_tokens(10, (7, 8, 50), (7, 8, 9, 10), (), (8, 50, 61, 62))
    committed = list(range(10)) + [7, 8, 50]
    assert session.propose(committed, 2).token_ids == (61, 62)  # rows 2 and 3: positions 13 and 14
    assert session.propose(committed + [61], 1).token_ids == (62,)  # a pre-draft that assumed the first guess
    assert session.propose(list(range(5)), 3).token_ids == (4, 4, 4)  # another sequence: padding only


def test_the_trie_merges_prefixes_and_keeps_its_budget():
    trie = _Trie()
    assert trie.add((1, 2, 3), 5) == [0, 1, 2]
    assert trie.add((1, 2, 4), 5) == [0, 1, 3]  # shares two nodes
    assert trie.add((5, 6), 5) is None  # three nodes past a budget of five: nothing added
    assert trie.add((5,), 5) == [4]
    tree = DraftTree(tuple(trie.tokens), tuple(trie.parents))  # valid: parents first, siblings distinct
    assert tree.children[-1] == (0, 4)


def test_the_pool_keeps_the_newest_continuations_per_token():
    pool = NgramPool(3, 2)
    pool.add_sequence([1, 2, 3, 1, 4, 5, 1, 6, 7])
    assert pool.after(1) == [(6, 7), (4, 5)]  # (2, 3) was the oldest of three
    pool.add(1, (2, 3))
    assert pool.after(1) == [(2, 3), (6, 7)]


def root_paths(proposal) -> set[tuple[int, ...]]:
    tree = proposal.tree
    return {tuple(proposal.token_ids[j] for j in tree.path_to(leaf)) for leaf in range(len(tree)) if leaf not in tree.children}


def test_lookahead_verifies_pooled_ngrams_and_iterates_its_window_in_one_tree():
    session = LookaheadSession(window=3, ngram=3, candidates=2)
    committed = [5, 6, 7, 9, 9, 5, 6, 8, 9, 5]  # after 5 came (6, 7) and (6, 8)
    proposal = session.propose(committed, 12)
    paths = root_paths(proposal)
    assert {(6, 8, 9), (6, 7)} <= paths  # the verification branch (6, 8), (6, 7), and the window (6, 8, 9) by lookup
    # The target accepts nothing and guesses 100 + t after each node of token t.
    rows = tuple(100 + t for t in proposal.token_ids)
    session.add_row_tokens(10, (6,), proposal.token_ids, proposal.parents, rows)
    assert (session._window, session._base) == ([106, 108, 109], 11)  # the iterate, for positions 11, 12, 13
    assert (106, 108, 109) in root_paths(session.propose(committed + [6], 12))
    assert (8, 108) in session.pool.after(6)  # a trajectory became an n-gram
    small = session.propose(committed + [6], 2)
    assert len(small.token_ids) == 2  # a small budget: the verification branch first


def test_row_tokens_cross_the_wire_and_bad_ones_are_refused():
    out = StepOutcome(12, (3, 4), 2, True, None, (4, 9, 9), (3, 5, 6), ())
    pb = wire.outcome_to_pb(out).outcome
    assert wire.outcome_from_pb(pb) == out
    pb.verified_ids.append(1)
    with pytest.raises(Exception, match="one length"):
        wire.outcome_from_pb(pb)


def policy(k: int | None) -> SpeculationPolicy:
    """None: adaptive (a tree drafter's budget chosen by measurement, core/speculation.py)."""
    return SpeculationPolicy(max_speculative_tokens=15) if k is None else SpeculationPolicy(SpeculationMode.FIXED, k, max(k, 8))


@pytest.fixture(scope="module")
def embedded(tiny_pair):
    target, draft = tiny_pair
    return roles.embedded(TargetConfig(target), DraftConfig(draft, target), OrchestratorConfig(), loop_config=PATIENT)


JACOBI, LOOKAHEAD = SETTINGS[:2], SETTINGS[2:]
CASES = [(p, *JACOBI[i % 2]) for i, p in enumerate(prompts(20))] + \
        [(p, *LOOKAHEAD[i % 3]) for i, p in enumerate(prompts(20))]  # every prompt under both drafters


async def test_greedy_equals_target_only_in_one_process_and_over_grpc(tiny_pair, embedded, cluster):
    target, _ = tiny_pair
    tok = embedded.target.tokenizer

    def local(prompt, drafter, k):
        return collect(embedded.generate(GenerationRequest(prompt_ids=tuple(tok(prompt)["input_ids"]), max_new_tokens=MAX_NEW,
                                                           drafter=drafter, policy=policy(k))))
    here = await asyncio.gather(*(local(*case) for case in CASES))
    there = await asyncio.gather(*(cluster.stub.Generate(request(p, k, d), timeout=120) for p, d, k in CASES))
    accepted = 0
    for (prompt, drafter, k), (last, out, _), reply in zip(CASES, here, there):
        expected = reference_greedy(target, prompt, MAX_NEW)
        assert out == expected and tuple(reply.token_ids) == expected, (prompt, drafter, k)
        accepted += last.counters.accepted_tokens + reply.stats.accepted_tokens
    assert accepted > 0, "no guess was ever accepted: the test would not test speculation"


async def test_coupled_sampling_is_seed_exact(embedded, cluster):
    tok = embedded.target.tokenizer
    for i, prompt in enumerate(prompts(6)):
        drafter, k = SETTINGS[i % len(SETTINGS)]
        params = SamplingParams(seed=7 + i, temperature=0.9, rule=VerificationRule.COUPLED)

        def one(d: str, kk: int):
            return collect(embedded.generate(GenerationRequest(prompt_ids=tuple(tok(prompt)["input_ids"]), max_new_tokens=MAX_NEW,
                                                               drafter=d, policy=policy(kk), sampling=params, seed_given=True)))
        (_, plain, _), (_, spec, _) = await asyncio.gather(one("ngram", 0), one(drafter, k))
        reply = await cluster.stub.Generate(request(prompt, k, drafter, temperature=0.9, seed=7 + i), timeout=120)
        assert spec == plain and tuple(reply.token_ids) == plain, (prompt, drafter, k)


def test_a_requests_lookahead_shape_reaches_its_session_and_bad_ones_are_refused():
    from specdec.core.errors import InvalidRequest
    from specdec.core.sessions import SessionRecord
    from specdec.core.steps import LookaheadParams, SessionSpec
    from specdec.draft.jacobi import LookaheadDrafter
    from specdec.orchestrator.request import params_json, request_from_record

    spec = SessionSpec("e" * 32, (1, 2, 3), SamplingParams(), "lookahead", LookaheadParams(2, 5, 0))
    assert wire.spec_from_pb(wire.spec_to_pb(spec)) == spec
    session = LookaheadDrafter(4, 4, 4).open_for(spec)
    assert (session.W, session.N, session.G) == (2, 5, 4)  # G unset: the deployment's
    request = GenerationRequest(prompt_ids=(1, 2, 3), drafter="lookahead", lookahead=LookaheadParams(2, 5, 1))
    record = SessionRecord.new((1, 2, 3), params_json(request, "lookahead"), 7, "f" * 32)
    assert request_from_record(record).lookahead == LookaheadParams(2, 5, 1)  # a resumed session keeps it
    for bad in ((0, 1, 0), (17, 0, 0), (0, 0, 99)):
        with pytest.raises(InvalidRequest, match="lookahead"):
            LookaheadParams(*bad)


async def test_lookahead_per_request_over_grpc(tiny_pair, cluster):
    import grpc

    from specdec.v1 import common_pb2

    target, _ = tiny_pair
    for i, prompt in enumerate(prompts(4)):
        req = request(prompt, 8, "lookahead")
        req.lookahead.CopyFrom(common_pb2.LookaheadParams(window=(2, 6)[i % 2], ngram=(3, 5)[i % 2], candidates=2))
        reply = await cluster.stub.Generate(req, timeout=120)
        assert tuple(reply.token_ids) == reference_greedy(target, prompt, MAX_NEW), prompt
    bad = request(prompts(1)[0], 8, "lookahead")
    bad.lookahead.ngram = 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.stub.Generate(bad, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ngram" in err.value.details()
