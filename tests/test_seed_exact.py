"""Seed-exact sampling: under the coupled rule a seed gives the target's own tokens, whatever the
drafter, k, the path (one process or gRPC servers) or the speculation schedule.

The reference is target-only coupled sampling written out independently of the verifier: the target
scored from scratch at every position (no KV cache, no speculation), its distribution processed as the
request asks, plus the Gumbel noise of (seed, position), argmax. Every case runs under k in
{0, 1, 3, 5, adaptive} x drafters {model, ngram}, at once, in one process and over real gRPC servers.
The cases: 6 prompts, each under all 3 sampling configurations (T = 1.0; T = 0.7 with top-k;
T = 0.7 with top-p), the 3 seeds rotating so each seed meets each configuration; with
SPECDEC_FULL_GRID=1 (tests/conftest.py), every one of 30 prompts x 3 seeds x 3 configurations.
"""
from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from specdec import roles
from specdec.core.coupled import processed_logprobs
from specdec.core.llama_decode import LlamaDecoder
from specdec.core.models import load_causal_lm
from specdec.core.noise import gumbel_noise
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.draft.drafters import DraftConfig
from specdec.orchestrator.loop import collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.target.engine import TargetConfig
from specdec.v1 import common_pb2, generation_pb2 as pb

from cluster import PATIENT
from grid import FULL_GRID
from test_e2e import prompts

MAX_NEW = 8
SEEDS = (11, 22, 33)
SAMPLINGS = (dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=0.7, top_p=0.9))
KS = [0, 1, 3, 5, None]  # None: adaptive
DRAFTERS = ["model", "ngram"]


@functools.lru_cache(maxsize=1)
def target_decoder(target_path: str) -> tuple[LlamaDecoder, int]:
    loaded = load_causal_lm(target_path)
    return LlamaDecoder(loaded.model), loaded.tokenizer


def reference_coupled(target_path: str, prompt_ids: tuple[int, ...], seed: int, sampling: dict) -> tuple[int, ...]:
    """Target-only coupled sampling, every position scored from scratch."""
    decoder, _ = target_decoder(target_path)
    params = SamplingParams(seed=seed, rule=VerificationRule.COUPLED, **sampling)
    seq = list(prompt_ids)
    for _ in range(MAX_NEW):
        logits = decoder.forward(decoder.new_cache(), seq, 0, 1)[0]  # [vocab]
        noise = gumbel_noise(seed, (len(seq),), logits.shape[-1])[0]
        seq.append(int((processed_logprobs(logits, params) + noise).argmax()))
    return tuple(seq[len(prompt_ids):])


def policy(k: int | None) -> SpeculationPolicy:
    return SpeculationPolicy() if k is None else SpeculationPolicy(SpeculationMode.FIXED, k, max(k, 8))


def policy_pb(k: int | None) -> common_pb2.SpeculationPolicy:
    if k is None:
        return common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_ADAPTIVE)
    return common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=k)


@pytest.fixture(scope="module")
def embedded_orchestrator(tiny_pair):
    target, draft = tiny_pair
    # Patient, as the cluster: every step waits for its block, so "some draft was accepted" follows
    # from the tokens, never from a block that came a moment late (the output never depends on it).
    return roles.embedded(TargetConfig(target), DraftConfig(draft, target), OrchestratorConfig(), loop_config=PATIENT)


def grid() -> list[tuple[str, int, dict]]:
    """(prompt, seed, sampling) of every case (see the module's docstring)."""
    if FULL_GRID:
        return [(p, seed, sampling) for p in prompts(30) for seed in SEEDS for sampling in SAMPLINGS]
    return [(p, SEEDS[(i + j) % len(SEEDS)], sampling) for i, p in enumerate(prompts(30)[::5]) for j, sampling in enumerate(SAMPLINGS)]


def cases(tiny_pair):
    target, _ = tiny_pair
    _, tokenizer = target_decoder(target)
    for prompt, seed, sampling in grid():
        ids = tuple(tokenizer(prompt)["input_ids"])
        yield prompt, ids, seed, sampling, reference_coupled(target, ids, seed, sampling)


async def test_coupled_output_is_target_only_coupled_sampling_in_one_process(tiny_pair, embedded_orchestrator):
    accepted = 0

    async def one(ids, seed, sampling, k, drafter):
        req = GenerationRequest(prompt_ids=ids, max_new_tokens=MAX_NEW, drafter=drafter, policy=policy(k), seed_given=True,
                                sampling=SamplingParams(seed=seed, rule=VerificationRule.COUPLED, **sampling))
        return await collect(embedded_orchestrator.generate(req))

    for prompt, ids, seed, sampling, expected in cases(tiny_pair):
        runs = [(k, d) for k in KS for d in DRAFTERS]
        results = await asyncio.gather(*(one(ids, seed, sampling, k, d) for k, d in runs))  # concurrent sessions
        for (k, drafter), (last, out, _) in zip(runs, results):
            assert out == expected, f"prompt {prompt!r} seed {seed} {sampling} k={k} drafter={drafter}"
            accepted += last.counters.accepted_tokens
    assert accepted > 0, "no draft token was ever accepted: the test would not test speculation"


async def test_coupled_output_is_target_only_coupled_sampling_over_grpc(tiny_pair, cluster):
    accepted = 0

    async def one(ids, seed, sampling, k, drafter):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, drafter=drafter, speculation=policy_pb(k),
                                 sampling=common_pb2.SamplingParams(seed=seed, **sampling))  # rule unset: coupled by default
        return await cluster.stub.Generate(req, timeout=60)

    for prompt, ids, seed, sampling, expected in cases(tiny_pair):
        runs = [(k, d) for k in KS for d in DRAFTERS]
        replies = await asyncio.gather(*(one(ids, seed, sampling, k, d) for k, d in runs))
        for (k, drafter), reply in zip(runs, replies):
            assert tuple(reply.token_ids) == expected, f"prompt {prompt!r} seed {seed} {sampling} k={k} drafter={drafter}"
            accepted += reply.stats.accepted_tokens
    assert accepted > 0, "no draft token was ever accepted: the test would not test speculation"


async def test_rejection_rule_stays_available_and_lossless_for_greedy(cluster, tiny_pair):
    # Greedy ignores the rule; an explicit rejection rule with a seed is honoured (not coupled):
    # its output differs from the coupled one for some prompt at T = 1.
    target, _ = tiny_pair
    differs = False
    for prompt, ids, seed, sampling, expected in list(cases(tiny_pair))[:18]:  # the default grid, or the full one's first 18
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=MAX_NEW, speculation=policy_pb(3),
                                 sampling=common_pb2.SamplingParams(seed=seed, rule=common_pb2.VERIFICATION_RULE_REJECTION, **sampling))
        reply = await cluster.stub.Generate(req, timeout=60)
        differs |= tuple(reply.token_ids) != expected
    assert differs, "the rejection rule gave exactly the coupled tokens everywhere: is the rule field ignored?"


def test_noise_does_not_depend_on_the_vocabulary_size():
    # Draft and target may have output layers of different sizes; shared token ids must see the same noise.
    assert torch.equal(gumbel_noise(5, (3, 9), 100)[:, :37], gumbel_noise(5, (3, 9), 37))
