"""End to end over real gRPC servers on loopback and a real Redis: the lossless invariants."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.core.sessions import unpack_ids
from specdec.v1 import common_pb2, generation_pb2 as pb

from cluster import drafts_settle_before_each_verify
from grid import FULL_GRID
from tiny_models import corpus_texts

MAX_NEW = 24


def prompts(n: int = 20) -> list[str]:
    """Real code snippets of varied length, cut from standard-library files."""
    out = []
    for i, text in enumerate(corpus_texts(limit=n)):
        start = (i * 97) % max(1, len(text) - 200)
        out.append(text[start : start + 20 + (i * 13) % 120] or "def f():")
    return out[:n]


@functools.lru_cache(maxsize=None)
def reference_greedy(target_path: str, prompt: str, max_new: int) -> tuple[int, ...]:
    """Target-only greedy decoding with transformers' own generate."""
    tok = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(target_path, local_files_only=True, dtype=torch.float32).eval()
    ids = tok(prompt)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id)
    return tuple(out[0, len(ids):].tolist())


def request(prompt: str, k: int | None, drafter: str, max_new: int = MAX_NEW, overlap: bool = True, **sampling) -> pb.GenerateRequest:
    """k None: the adaptive policy."""
    if k is None:
        policy = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_ADAPTIVE, overlap=overlap)
    else:
        policy = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=k, overlap=overlap)
    return pb.GenerateRequest(text=prompt, max_new_tokens=max_new, drafter=drafter, sampling=common_pb2.SamplingParams(**sampling),
                              speculation=policy)


GREEDY_GRID = [(drafter, k, overlap) for drafter in ("model", "ngram")
               for k, overlap in ((1, True), (3, True), (5, True), (None, True), (3, False))]
# By default (tests/grid.py) every k, overlap setting and drafter at least once, and the model
# drafter with drafting ahead at k >= 3 (where the overlap assertion below applies).
DEFAULT_GREEDY = {("model", 1, True), ("model", 5, True), ("model", None, True), ("model", 3, False),
                  ("ngram", 3, True), ("ngram", None, True)}


@pytest.mark.parametrize("drafter, k, overlap", [
    pytest.param(*c, id=f"{'adaptive' if c[1] is None else f'k{c[1]}'}{'' if c[2] else '-no-overlap'}-{c[0]}")
    for c in GREEDY_GRID if FULL_GRID or c in DEFAULT_GREEDY])
async def test_greedy_equals_target_only_greedy(cluster, tiny_pair, drafter, k, overlap):
    """Over the streaming path (Speculate between drafter and verifier, Generate to the orchestrator).

    The drafter settles before each verification (tests/cluster.py): every block it planned to draft
    ahead is drafted, so which steps verify a pre-drafted block follows from the tokens, not from
    thread timing, and the count below is the same on an idle machine and a loaded one."""
    target_path, _ = tiny_pair
    drafted = predrafted = 0
    async with drafts_settle_before_each_verify(cluster) as late:
        for prompt in prompts(20):
            reply = await cluster.stub.Generate(request(prompt, k, drafter, overlap=overlap))
            expected = reference_greedy(target_path, prompt, MAX_NEW)
            assert tuple(reply.token_ids) == expected, f"prompt {prompt!r}, drafter {drafter}, k={k}"
            assert reply.usage.completion_tokens == len(expected)
            drafted += reply.stats.draft_tokens
            predrafted += reply.stats.predrafted_steps
            # The session record keeps every step's speculation length, for an exact replay.
            record = await cluster.store.get(reply.session_id)
            assert len(record.step_ks) == reply.stats.verify_steps and sum(record.step_ks) == reply.stats.draft_tokens
    assert not late, "the drafter never settled before a verification"
    assert drafted > 0, "the drafter never proposed anything: this test would not test speculation"
    if not overlap:
        assert predrafted == 0, "overlap off, yet blocks were drafted ahead"
    elif drafter == "model" and k is not None and k >= 3:  # the random pair rarely agrees; adaptive k stays small
        assert predrafted > 0, "overlap on, yet no step used a block drafted ahead: this test would not test overlap"


@pytest.mark.parametrize("k", [8, None], ids=["k8", "adaptive"])
async def test_blocks_that_end_where_the_draft_is_unsure_keep_greedy_output_exact(cluster, tiny_pair, k):
    """With ``min_confidence`` a block is as long as the draft is sure (k only bounds it); what is
    verified is still exactly what was drafted, so the output stays target-only greedy's."""
    from specdec.core.models import load_causal_lm
    from test_draft_confidence import median_confidence

    target_path, draft_path = tiny_pair
    drafter = cluster.draft.drafters["model"]
    drafter.min_confidence = median_confidence(load_causal_lm(draft_path))
    try:
        lengths = set()
        for prompt in prompts(20):
            reply = await cluster.stub.Generate(request(prompt, k, "model"))
            assert tuple(reply.token_ids) == reference_greedy(target_path, prompt, MAX_NEW), f"prompt {prompt!r}, k={k}"
            record = await cluster.store.get(reply.session_id)
            assert sum(record.step_ks) == reply.stats.draft_tokens
            if k is not None and reply.stats.drafts:
                lengths.add(reply.stats.draft_tokens / reply.stats.drafts)
        if k is not None:
            assert min(lengths) < k, "no block ended early: the threshold tests nothing"
    finally:
        drafter.min_confidence = 0.0


async def test_draft_identical_to_target_accepts_every_token(twin_cluster):
    for prompt in prompts(5):
        reply = await twin_cluster.stub.Generate(request(prompt, 4, "model", max_new=30))
        stats = reply.stats
        assert stats.draft_tokens > 0
        assert stats.accepted_tokens == stats.draft_tokens
        # Each step commits all its drafts plus a bonus token.
        assert stats.mean_accepted_length == pytest.approx(1 + stats.accepted_tokens / stats.drafts)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
async def test_same_seed_same_sampled_output(cluster, drafter):
    prompt = prompts(3)[2]
    kw = dict(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    a = await cluster.stub.Generate(request(prompt, 3, drafter, max_new=32, **kw))
    b = await cluster.stub.Generate(request(prompt, 3, drafter, max_new=32, **kw))
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.seed == b.seed == 1234
    others = [await cluster.stub.Generate(request(prompt, 3, drafter, max_new=32, **{**kw, "seed": s})) for s in (1, 2, 3)]
    assert any(o.token_ids != a.token_ids for o in others), "other seeds should give other samples"


async def test_stream_matches_unary_and_ends_with_stats(cluster):
    prompt = prompts(4)[3]
    async with drafts_settle_before_each_verify(cluster) as late:  # the same blocks both times: the same steps
        unary = await cluster.stub.Generate(request(prompt, 3, "model"))
        chunks = [m async for m in cluster.stub.GenerateStream(request(prompt, 3, "model"))]
    assert not late
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert "".join(c.text for c in chunks) == unary.text
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == unary.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert last.usage.completion_tokens == len(unary.token_ids)
    assert last.stats.verify_steps == unary.stats.verify_steps


async def test_redis_record_holds_exactly_the_committed_tokens(cluster, redis_url):
    from specdec.core.redis_connect import connect

    reply = await cluster.stub.Generate(request(prompts(2)[1], 3, "model", max_new=20))
    record = await cluster.store.get(reply.session_id)
    assert record.output_ids == tuple(reply.token_ids)
    assert record.status.value == "finished"
    assert record.counters.accepted_tokens == reply.stats.accepted_tokens
    # And the raw Redis value, read without specdec's store: packed little-endian int32.
    client = connect(redis_url)
    raw = await client.get(f"{cluster.store._prefix}:sess:{{{reply.session_id}}}:out")
    await client.aclose()
    assert unpack_ids(raw) == tuple(reply.token_ids)
    info = await cluster.stub.GetSession(pb.GetSessionRequest(session_id=reply.session_id))
    assert tuple(info.output_token_ids) == tuple(reply.token_ids)
    assert await cluster.active_sessions() == (0, 0)


async def test_k0_is_plain_decoding_through_the_same_loop(cluster, tiny_pair):
    target_path, _ = tiny_pair
    for prompt in prompts(3):
        reply = await cluster.stub.Generate(request(prompt, 0, "model"))
        assert tuple(reply.token_ids) == reference_greedy(target_path, prompt, MAX_NEW)
        assert reply.stats.draft_tokens == 0 and reply.stats.verify_steps == len(reply.token_ids)
