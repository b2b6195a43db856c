"""Where the drafter shares the verifier's model thread (one process, in-verifier drafting), a
session's first token comes before its drafter opens: the first step drafts nothing, and the
drafter, opened over the prompt and that token, drafts from the second step on. Only where a
step's k cannot change a token (greedy, the coupled rule); the output is the same either way."""
from __future__ import annotations

import pytest_asyncio

from cluster import PATIENT
from specdec import roles
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.draft.drafters import DraftConfig
from specdec.orchestrator.loop import collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.target.engine import TargetConfig

K = 3


@pytest_asyncio.fixture(scope="module")
async def embedded(tiny_pair):
    target, draft = tiny_pair
    orch = roles.embedded(TargetConfig(target), DraftConfig(draft, target), OrchestratorConfig(), loop_config=PATIENT)
    yield orch
    await orch.aclose()


def request(k: int, sampling: SamplingParams = SamplingParams(), drafter: str = "model") -> GenerationRequest:
    return GenerationRequest(prompt_ids=(5, 9, 14, 3, 8, 21, 4), max_new_tokens=24, sampling=sampling, drafter=drafter,
                             policy=SpeculationPolicy(SpeculationMode.FIXED, k, max(k, 8)))


async def chunks_of(orch, req: GenerationRequest) -> list:
    return [chunk async for chunk in orch.generate(req)]


async def test_greedy_first_step_drafts_nothing_then_the_drafter_drafts_and_the_tokens_are_target_only(embedded):
    chunks = await chunks_of(embedded, request(K))
    assert chunks[0].token_ids and chunks[0].num_draft_tokens == 0  # the first token, before any drafting
    assert any(c.num_draft_tokens == K for c in chunks[1:])  # the drafter, opened late, drafts from then on
    _, want, _ = await collect(embedded.generate(request(0)))
    assert tuple(t for c in chunks for t in c.token_ids) == want


async def test_coupled_sampling_keeps_its_seed_exact_tokens(embedded):
    coupled = SamplingParams(temperature=0.9, top_p=0.95, seed=11, rule=VerificationRule.COUPLED)
    chunks = await chunks_of(embedded, request(K, coupled))
    assert chunks[0].num_draft_tokens == 0
    _, want, _ = await collect(embedded.generate(request(0, coupled)))
    assert tuple(t for c in chunks for t in c.token_ids) == want


async def test_the_rejection_rule_drafts_from_the_first_step(embedded):
    """Under the rejection rule the drafts decide which tokens come: its first step keeps its k."""
    rejection = SamplingParams(temperature=0.9, seed=11, rule=VerificationRule.REJECTION)
    chunks = await chunks_of(embedded, request(K, rejection))
    assert chunks[0].num_draft_tokens == K
