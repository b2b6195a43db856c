"""Continuous batching at the verifier: many sessions' verify steps in one target forward, and not a
token different for it. Greedy sessions of a batch equal target-only `generate`; a seeded sampled
session gives the same tokens whatever shares its batch; a refused step in a batch changes nothing.
Sessions that open together are prefilled together, at the verifier and at the drafter."""
from __future__ import annotations

import asyncio
import secrets
import threading

import pytest
import torch

from specdec.core.errors import InvalidRequest, SessionAlreadyOpen, SessionNotFound
from specdec.core.llama_decode import LlamaDecoder
from specdec.core.models import load_causal_lm
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.steps import DraftProposal, SessionSpec, StepOutcome
from specdec.draft.drafters import DraftConfig
from specdec.draft.engine import DraftEngine
from specdec.target.engine import KVBudgetFull, TargetConfig, VerifierEngine
from specdec.target.scheduler import VerifierScheduler
from specdec.v1 import common_pb2, generation_pb2 as pb

from test_e2e import prompts, reference_greedy, request
from test_overlap import Blocks, fresh_block

MIXED_K = [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 3, 5, 8, 1, 4, 2]  # 16 sessions, k = 0..8


def test_batched_forward_matches_one_sequence_at_a_time(tiny_pair):
    model = load_causal_lm(tiny_pair[0]).model
    dec = LlamaDecoder(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 40, 17, 90)]
    feeds = [(s[: len(s) - m], s[len(s) - m :]) for s, m in zip(seqs, (1, 4, 9, 2))]  # (cached part, new rows)
    alone, batched = [], []
    caches = []
    for cached, new in feeds:
        one, many = dec.new_cache(), dec.new_cache()
        dec.forward(one, cached, 0, 1)
        dec.forward(many, cached, 0, 1)
        alone.append(dec.forward(one, new, len(cached)))
        caches.append(many)
    batched = dec.forward_batch(caches, [new for _, new in feeds], [len(c) for c, _ in feeds], [len(n) for _, n in feeds])
    for a, b in zip(alone, batched):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.fixture(scope="module")
def engine(tiny_pair) -> VerifierEngine:
    return VerifierEngine.from_config(TargetConfig(tiny_pair[0]))


def open_sessions(engine: VerifierEngine, n: int, sampling: SamplingParams = SamplingParams(seed=1)) -> list[str]:
    ids = []
    for i in range(n):
        sid = secrets.token_hex(16)
        engine.open(SessionSpec(sid, tuple(range(1, 4 + 7 * i % 60)), sampling, "ngram"), max_new_tokens=16)
        ids.append(sid)
    return ids


def test_a_refused_step_in_a_batch_changes_nothing_and_the_rest_go_on(engine):
    good, bad = open_sessions(engine, 2)
    before = list(engine.sessions.get(bad).committed)
    results = engine.verify_batch([(good, DraftProposal((5, 6))), (bad, DraftProposal((5, 10**6))),
                                   ("ab" * 16, DraftProposal(())), (good, DraftProposal(()))])
    assert len(results[0].token_ids) >= 1
    assert isinstance(results[1], InvalidRequest) and "vocabulary" in str(results[1])
    assert isinstance(results[2], SessionNotFound)
    assert isinstance(results[3], InvalidRequest) and "one step per batch" in str(results[3])
    assert engine.sessions.get(bad).committed == before
    for sid in (good, bad):
        engine.close(sid)


@pytest.mark.parametrize("rule", [VerificationRule.COUPLED, VerificationRule.REJECTION])
def test_a_sampled_session_gets_the_same_tokens_alone_and_in_a_batch(engine, rule):
    """Two copies of one seeded session: one verified alone, one beside 15 others, step for step."""
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=77, rule=rule)
    alone, together = open_sessions(engine, 1, sampling)[0], None
    others = open_sessions(engine, 15, SamplingParams(temperature=0.8, seed=5, rule=rule))
    together = secrets.token_hex(16)
    engine.open(SessionSpec(together, tuple(engine.sessions.get(alone).committed), sampling, "ngram"), max_new_tokens=16)
    drafts = [(11, 12, 13), (), (7,), (20, 21, 22, 23, 24)]
    for step in drafts:
        a = engine.verify(alone, DraftProposal(step))
        batch = engine.verify_batch([(together, DraftProposal(step))] + [(o, DraftProposal(step[:1])) for o in others])
        assert batch[0].token_ids == a.token_ids and batch[0].num_accepted == a.num_accepted
    for sid in (alone, together, *others):
        engine.close(sid)


async def test_steps_that_wait_together_are_verified_in_one_forward(tiny_pair):
    """Four sessions' steps queued before the batcher runs (one event-loop turn: no timing in it)
    go in one target forward, each with the tokens it gets alone."""
    verifier = VerifierScheduler(VerifierEngine.from_config(TargetConfig(tiny_pair[0])))
    ids = [secrets.token_hex(16) for _ in range(4)]
    for i, sid in enumerate(ids):
        await verifier.open(SessionSpec(sid, tuple(range(3, 9 + 5 * i)), SamplingParams()), 8)
    alone = [secrets.token_hex(16) for _ in ids]
    for i, sid in enumerate(alone):
        verifier.engine.open(SessionSpec(sid, tuple(range(3, 9 + 5 * i)), SamplingParams()), 8)
    expected = [verifier.engine.verify(sid, DraftProposal((5, 6))) for sid in alone]
    verifier.batch_sizes.clear()
    outcomes = await asyncio.gather(*(verifier.verify(sid, DraftProposal((5, 6))) for sid in ids))
    assert dict(verifier.batch_sizes) == {4: 1}
    assert [o.token_ids for o in outcomes] == [e.token_ids for e in expected]


async def test_sixteen_greedy_sessions_at_once_equal_target_only_generate(cluster, tiny_pair):
    """16 mixed-length prompts, k = 0..8 fixed and adaptive, both drafters, all at once through the
    distributed path: each equals transformers' generate. (How often they shared a forward depends on
    timing; that steps waiting together share one is the test above.)"""
    target_path, _ = tiny_pair
    texts = prompts(16)
    requests = [request(text, MIXED_K[i] if i % 4 else None, "model" if i % 2 else "ngram") for i, text in enumerate(texts)]
    replies = await asyncio.gather(*(cluster.stub.Generate(r, timeout=120) for r in requests))
    for text, reply in zip(texts, replies):
        assert tuple(reply.token_ids) == reference_greedy(target_path, text, len(reply.token_ids)), text


async def test_a_seeded_request_is_unchanged_by_what_shares_its_batches(cluster):
    seeded = pb.GenerateRequest(text="class Stack:", max_new_tokens=24, drafter="model",
                                sampling=common_pb2.SamplingParams(temperature=1.0, seed=4242))
    alone = await cluster.stub.Generate(seeded, timeout=60)
    crowd = [request(text, 3, "ngram", temperature=0.7, seed=i) for i, text in enumerate(prompts(12))]
    together, *_ = await asyncio.gather(cluster.stub.Generate(seeded, timeout=120),
                                        *(cluster.stub.Generate(r, timeout=120) for r in crowd))
    assert list(together.token_ids) == list(alone.token_ids)


# ----------------------------------------------------------------------------- prefills of many sessions at once


def test_opens_of_one_prefill_batch_are_checked_one_by_one_and_equal_opening_alone(tiny_pair):
    """One forward prefills every open of a batch; a refused open (bad token, twice in the batch,
    over the KV budget once its batch-mates' reservations count) gets its error and the rest open,
    with the keys and values (and so the next logits) of a session opened alone."""
    engine = VerifierEngine.from_config(TargetConfig(tiny_pair[0], max_kv_tokens=100))
    a, b, c = (secrets.token_hex(16) for _ in range(3))
    prompt_a, prompt_b = tuple(range(1, 30)), tuple(range(40, 52))
    opens = [(SessionSpec(a, prompt_a, SamplingParams()), 20, ()),  # reserves 49
             (SessionSpec(c, (1, 10**6), SamplingParams()), 4, ()),  # not a token of this vocabulary
             (SessionSpec(b, prompt_b, SamplingParams()), 20, ()),  # 32 more: 81 of 100
             (SessionSpec(a, prompt_a, SamplingParams()), 20, ()),  # the same session twice
             (SessionSpec(c, (5, 6, 7), SamplingParams()), 20, ())]  # 23 more would make 104
    results = engine.open_batch(opens)
    assert isinstance(results[0], int) and isinstance(results[2], int)
    assert isinstance(results[1], InvalidRequest) and "vocabulary" in str(results[1])
    assert isinstance(results[3], SessionAlreadyOpen)
    assert isinstance(results[4], KVBudgetFull) and "81 are reserved" in str(results[4])
    assert sorted(engine.sessions.ids()) == sorted([a, b])
    assert engine.kv_reserved_tokens() == 81
    alone = secrets.token_hex(16)
    engine.close(b)
    engine.open(SessionSpec(alone, prompt_a, SamplingParams()), 20)
    for step in [(3, 4, 5), (), (9,)]:
        together, by_itself = engine.verify(a, DraftProposal(step)), engine.verify(alone, DraftProposal(step))
        assert together.token_ids == by_itself.token_ids and together.num_accepted == by_itself.num_accepted


@pytest.mark.parametrize("prompts, eligible, want", [
    # the same prompt three times: the first computed, the others copy all but their last token
    ([list(range(40)), list(range(40)), list(range(40))], None, [None, (0, 39), (0, 39)]),
    # a shared start of 20, then different: copy 20, compute the rest
    ([list(range(20)) + [1, 2], list(range(20)) + [3, 4, 5]], None, [None, (0, 20)]),
    # a shared start under the minimum (15 of 16): each computed in full
    ([list(range(15)) + [90] * 10, list(range(15)) + [91] * 10], None, [None, None]),
    # the longest shared start wins among the prompts computed in full; one that copies is copied from by none
    # (the copies come before the second forward): the third shares 30 with the second, 18 with the first
    ([list(range(18)) + [7] * 5, list(range(30)), list(range(30)) + [1]], None, [None, (0, 18), (0, 18)]),
    ([list(range(18)) + [7] * 5, list(range(10)) + [5] * 20, list(range(30)), list(range(30)) + [1]], None,
     [None, None, (0, 18), (0, 18)]),
    ([list(range(20)) + [7] * 5, list(range(24)) + [5] * 20, list(range(30))], None, [None, (0, 20), (0, 20)]),
    # prompts of 16 tokens: the last token is always fed, so 15 could be shared: under the minimum
    ([list(range(16)), list(range(16))], None, [None, None]),
    # a prompt that may not copy (it starts from stored KV blocks) leads nobody and follows nobody
    ([list(range(40)), list(range(40)), list(range(40))], [False, True, True], [None, None, (1, 39)]),
])
def test_prompts_of_one_prefill_batch_that_begin_alike_compute_their_shared_start_once(prompts, eligible, want):
    from specdec.core.kv import shared_prefixes

    assert shared_prefixes(prompts, 16, eligible) == want


def test_a_session_that_copied_a_shared_prompt_start_verifies_as_one_prefilled_alone(tiny_pair):
    """Three opens of one prompt and one that shares its first 20 tokens: the prefill computes the
    prompt once and the fourth's last 6 tokens (and each copy's last token); every session then
    verifies exactly as one opened alone."""
    engine = VerifierEngine.from_config(TargetConfig(tiny_pair[0]))
    shared = tuple(range(3, 30))
    other = shared[:20] + (201, 202, 203, 204, 205, 206)
    ids = [secrets.token_hex(16) for _ in range(4)]
    results = engine.open_batch([(SessionSpec(ids[0], shared, SamplingParams()), 20, ()),
                                 (SessionSpec(ids[1], shared, SamplingParams()), 20, ()),
                                 (SessionSpec(ids[2], other, SamplingParams()), 20, ()),
                                 (SessionSpec(ids[3], shared, SamplingParams()), 20, ())])
    assert all(isinstance(r, int) for r in results)
    assert engine.last_prefill_tokens == len(shared) + 1 + 6 + 1
    for sid, prompt in zip(ids, (shared, shared, other, shared)):
        alone = secrets.token_hex(16)
        engine.open(SessionSpec(alone, prompt, SamplingParams()), 20)
        assert engine.last_prefill_tokens == len(prompt)
        for step in [(3, 4, 5), (), (9,)]:
            copied, by_itself = engine.verify(sid, DraftProposal(step)), engine.verify(alone, DraftProposal(step))
            assert copied.token_ids == by_itself.token_ids and copied.num_accepted == by_itself.num_accepted
        engine.close(alone)


async def test_sessions_that_open_together_are_prefilled_in_one_forward(tiny_pair):
    """Nine clients at once: their opens queue together and go in one forward; one cancelled while
    it waits is never prefilled."""
    engine = VerifierEngine.from_config(TargetConfig(tiny_pair[0]))
    sizes = []
    real = engine.open_batch
    engine.open_batch = lambda opens: sizes.append(len(opens)) or real(opens)
    verifier = VerifierScheduler(engine)
    ids = [secrets.token_hex(16) for _ in range(9)]
    opens = [asyncio.ensure_future(verifier.open(SessionSpec(sid, tuple(range(1, 5 + 3 * i)), SamplingParams()), 8))
             for i, sid in enumerate(ids)]
    await asyncio.sleep(0)  # all nine are queued; the prefill has not started
    opens[-1].cancel()
    done = await asyncio.gather(*opens, return_exceptions=True)
    assert all(isinstance(t, int) for t in done[:-1]) and isinstance(done[-1], asyncio.CancelledError)
    assert sizes == [8]
    assert sorted(engine.sessions.ids()) == sorted(ids[:-1])
    outcomes = await asyncio.gather(*(verifier.verify(sid, DraftProposal(())) for sid in ids[:-1]))
    assert all(len(o.token_ids) == 1 for o in outcomes)


def test_draft_sessions_that_open_together_are_prefilled_in_one_forward_and_draft_as_alone(tiny_pair):
    target_path, draft_path = tiny_pair
    drafter = DraftEngine.from_config(DraftConfig(draft_path, target_path))
    model = drafter.drafters["model"]
    sizes = []
    real = model.open_many
    model.open_many = lambda opens: sizes.append(len(opens)) or real(opens)
    try:
        gate = threading.Event()
        busy = drafter.submit(gate.wait, 10)  # the draft thread is busy: the opens queue behind it
        prompts = [tuple(range(3, 9 + 5 * i)) for i in range(5)]
        blocks = [Blocks() for _ in prompts]
        ids = [secrets.token_hex(16) for _ in prompts]
        opened = [drafter.open(SessionSpec(sid, p, SamplingParams(), "model"), b.emit) for sid, p, b in zip(ids, prompts, blocks)]
        gate.set()
        busy.result(timeout=10)
        for f in opened:
            f.result(timeout=30)
        assert sizes == [5]
        for sid, p, b in zip(ids, prompts, blocks):
            drafter.outcome(sid, StepOutcome(len(p), (), 4, overlap=False))
            block = b.until(lambda blk: blk.continues(list(p)))
            assert block.proposal.token_ids == fresh_block(drafter, list(p), 4).proposal.token_ids
    finally:
        drafter.shutdown()
