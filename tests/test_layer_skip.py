"""Drafter ``layer_skip`` (services/draft/layer_skip.py): the target's own layers as its drafter,
chosen by measurement; lossless in one process and over gRPC."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec import roles
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.draft.drafters import DraftConfig
from specdec.draft.layer_skip import build, candidates, speedup_bound
from specdec.orchestrator.loop import collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.target.engine import TargetConfig

from cluster import PATIENT, start_cluster
from redis_server import delete_prefix
from test_e2e import MAX_NEW, prompts, reference_greedy, request


def test_the_candidates_are_every_early_exit_and_every_inner_skip():
    subsets = candidates(8)
    assert [list(range(n)) for n in range(1, 8)] == subsets[:7]
    assert [[i for i in range(8) if i != s] for s in range(1, 7)] == subsets[7:]
    assert speedup_bound(0.0, 0.5) == 1.0 and speedup_bound(0.9, 0.1) > 2.0  # k = 0 is always an option


def test_the_drafter_runs_exactly_the_chosen_layers(tiny_pair):
    target, _ = tiny_pair
    drafter = build(DraftConfig(None, target, layer_skip="0"))
    assert drafter.layers == [0] and len(drafter.loaded.model.model.layers) == 1
    full = AutoModelForCausalLM.from_pretrained(target, local_files_only=True, dtype=torch.float32).eval()
    full.model.layers = full.model.layers[:1]
    full.config.num_hidden_layers = 1
    ids = [5, 9, 14, 3, 7]
    with torch.no_grad():
        want = int(full(torch.tensor([ids])).logits[0, -1].argmax())
    assert drafter.open(ids, SamplingParams()).propose(ids, 1).token_ids == (want,)
    auto = build(DraftConfig(None, target, layer_skip="auto"))
    assert auto.layers == [0] and set(auto.scores) == {"0"}  # a 2-layer target has one candidate
    with pytest.raises(ValueError, match="layers in"):
        build(DraftConfig(None, target, layer_skip="0,5"))


def policy(k: int) -> SpeculationPolicy:
    return SpeculationPolicy(SpeculationMode.FIXED, k, max(k, 8))


async def test_greedy_and_coupled_equal_target_only_in_one_process_and_over_grpc(tiny_pair, redis_url):
    target, draft = tiny_pair
    config = DraftConfig(draft, target, layer_skip="auto")
    local = roles.embedded(TargetConfig(target), config, OrchestratorConfig(), loop_config=PATIENT)
    remote = await start_cluster(target, draft, redis_url, prefix=f"specdec-test-{uuid.uuid4().hex[:8]}", layer_skip="auto")
    tok = local.target.tokenizer
    try:
        def here(prompt: str, k: int, sampling: SamplingParams = SamplingParams()):
            return collect(local.generate(GenerationRequest(prompt_ids=tuple(tok(prompt)["input_ids"]), max_new_tokens=MAX_NEW,
                                                            drafter="layer_skip", policy=policy(k), sampling=sampling,
                                                            seed_given=sampling.seed is not None)))
        cases = [(p, (2, 4)[i % 2]) for i, p in enumerate(prompts(20))]
        mine = await asyncio.gather(*(here(p, k) for p, k in cases))
        theirs = await asyncio.gather(*(remote.stub.Generate(request(p, k, "layer_skip"), timeout=120) for p, k in cases))
        drafted = 0
        for (prompt, k), (last, out, _), reply in zip(cases, mine, theirs):
            expected = reference_greedy(target, prompt, MAX_NEW)
            assert out == expected and tuple(reply.token_ids) == expected, (prompt, k)
            drafted += last.counters.draft_tokens + reply.stats.draft_tokens
        assert drafted > 0
        for i, prompt in enumerate(prompts(4)):
            sampled = SamplingParams(seed=3 + i, temperature=0.8, rule=VerificationRule.COUPLED)
            (_, plain, _), (_, spec, _) = await asyncio.gather(here(prompt, 0, sampled), here(prompt, 3, sampled))
            assert spec == plain, prompt
    finally:
        await remote.stop()
        delete_prefix(redis_url, remote.store._prefix)


def test_inside_the_verifier_it_drafts_over_the_sessions_own_cache_and_never_changes_it(tiny_pair):
    """The shared cache's exact rollback: drafts (and a pre-draft past assumed tokens) write only past
    the committed positions, and the session then verifies exactly as one nobody drafted over."""
    from specdec.core.steps import SessionSpec
    from specdec.draft.layer_skip import SharedLayerSkipDrafter, shared_in_verifier
    from specdec.target.engine import VerifierEngine

    target, _ = tiny_pair
    engine = VerifierEngine.from_config(TargetConfig(target, max_sessions=4))
    drafter = shared_in_verifier(engine, DraftConfig(None, target, layer_skip="auto"))
    assert isinstance(drafter, SharedLayerSkipDrafter) and drafter.layers == [0]  # the one early exit of 2 layers
    ids = (5, 9, 14, 3, 7, 22, 8)
    spec, twin = SessionSpec("c" * 32, ids, SamplingParams()), SessionSpec("d" * 32, ids, SamplingParams())
    engine.open(spec)
    engine.open(twin)
    session = drafter.open_for(spec)
    state, other = engine.sessions.get(spec.session_id), engine.sessions.get(twin.session_id)
    for _ in range(4):
        committed = list(state.committed)
        kept = engine.runner.read_kv(state.cache, 0, state.valid_len).clone()
        proposal = session.propose(committed, 4)
        session.propose(committed + list(proposal.token_ids[:2]), 3)  # drafting ahead, past assumed tokens
        assert torch.equal(engine.runner.read_kv(state.cache, 0, state.valid_len), kept)
        mine = engine.verify(spec.session_id, proposal)
        theirs = engine.verify(twin.session_id, proposal)  # the same step, nobody drafted over its cache
        assert mine.token_ids == theirs.token_ids and state.committed == other.committed
        assert torch.equal(engine.runner.read_kv(state.cache, 0, state.valid_len),
                           engine.runner.read_kv(other.cache, 0, other.valid_len))
    assert len(proposal.token_ids) == 4
    # A block planned before the last step (the verifier has moved on) drafts nothing and writes nothing.
    kept = engine.runner.read_kv(state.cache, 0, state.valid_len).clone()
    stale = list(state.committed[:-3]) + [(state.committed[-3] + 1) % 50]
    assert session.propose(stale, 4).token_ids == () and session.propose(state.committed[:-2], 4).token_ids == ()
    assert torch.equal(engine.runner.read_kv(state.cache, 0, state.valid_len), kept)


async def test_inside_the_verifier_greedy_equals_target_only(tiny_pair, redis_url):
    target, draft = tiny_pair
    c = await start_cluster(target, draft, redis_url, prefix=f"specdec-test-{uuid.uuid4().hex[:8]}", in_verifier=("layer_skip",))
    try:
        assert "layer_skip" not in c.draft.drafters and "layer_skip" in c.orchestrator.target.drafters
        cases = [(p, (2, 4)[i % 2]) for i, p in enumerate(prompts(8))]
        replies = await asyncio.gather(*(c.stub.Generate(request(p, k, "layer_skip"), timeout=120) for p, k in cases))
        for (prompt, k), reply in zip(cases, replies):
            assert tuple(reply.token_ids) == reference_greedy(target, prompt, MAX_NEW), (prompt, k)
        assert sum(r.stats.draft_tokens for r in replies) > 0
    finally:
        await c.stop()
        delete_prefix(redis_url, c.store._prefix)
