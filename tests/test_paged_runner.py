"""The paged runner (core/paged_runner.py) on the CPU, through the same code a GPU runs: its page
bookkeeping, its logits against the lean forward's, exact numerics, greedy output through the
verifier engine, Qwen2 (biases) and Mistral (sliding window) against transformers, KV blocks in and
out of pages, and the CUDA-graph bucketing and padding (replayed eagerly here)."""
from __future__ import annotations

import gc
import importlib.util
import secrets
from pathlib import Path

import pytest
import torch

from specdec.core import cuda_graphs
from specdec.core.errors import Overloaded
from specdec.core.kv_blocks import decode_block
from specdec.core.llama_decode import LlamaDecoder
from specdec.core.models import load_causal_lm
from specdec.core.paged_kv import FIRST_PAGE, KVPagesExhausted, PageAllocator
from specdec.core.paged_runner import PagedRunner
from specdec.core.runner import Feed, LeanRunner
from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftProposal, SessionSpec
from specdec.core.speculation import SpeculationPolicy
from specdec.draft.model_drafter import ModelDrafter
from specdec.target.engine import TargetConfig, VerifierEngine

from tiny_models import build_family_model, build_tokenizer

DEMO_TARGET = Path(__file__).resolve().parents[1] / "models" / "demo" / "target"
GEN = torch.Generator().manual_seed(0)


def ids(n: int, vocab: int = 300) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=GEN).tolist()


# ------------------------------------------------------------------------------------ bookkeeping

def test_pages_are_taken_as_a_sequence_grows_and_given_back_when_it_is_cut_or_freed():
    alloc = PageAllocator(num_pages=12, page_tokens=4)
    assert (alloc.pages_total, alloc.pages_free) == (10, 10)
    a, b = alloc.new_table(), alloc.new_table()
    alloc.reserve([a, b], [5, 3])  # 2 pages and 1, lowest first
    assert (a.pages, b.pages, alloc.pages_free) == ([2, 3], [4], 7)
    assert alloc.slots(a, 3, 6) == [2 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1]  # position -> page * 4 + offset
    a.length = 5
    alloc.reserve([a], [33])  # a session spanning many pages: 9 in all, positions in order
    assert len(a.pages) == 9 and alloc.pages_free == 0
    assert alloc.slots(a, 0, 33)[::4] == [p * 4 for p in a.pages]
    alloc.truncate(a, 6)  # rollback: the pages past position 6 go back, the first two stay
    assert (a.pages, a.length, alloc.pages_free) == ([2, 3], 5, 7)
    alloc.free(b)
    alloc.free(b)  # idempotent
    c = alloc.new_table()
    alloc.reserve([c], [1])
    assert c.pages == [4]  # b's page, reused (the lowest free)
    with pytest.raises(ValueError, match="freed"):
        alloc.reserve([b], [1])


def test_running_out_of_pages_is_refused_whole_and_changes_no_sequence():
    alloc = PageAllocator(num_pages=FIRST_PAGE + 4, page_tokens=4)
    a, b = alloc.new_table(), alloc.new_table()
    alloc.reserve([a], [8])
    before = (list(a.pages), list(b.pages), alloc.pages_free)
    with pytest.raises(KVPagesExhausted, match="free pages.*retry") as refused:
        alloc.reserve([a, b], [12, 8])  # a needs one more page, b two: three, with two free
    assert isinstance(refused.value, Overloaded)  # RESOURCE_EXHAUSTED to a caller
    assert (list(a.pages), list(b.pages), alloc.pages_free) == before


def test_a_sequence_dropped_without_a_free_gives_its_pages_back():
    alloc = PageAllocator(num_pages=FIRST_PAGE + 4, page_tokens=4)
    t = alloc.new_table()
    alloc.reserve([t], [16])
    assert alloc.pages_free == 0
    del t  # an expired session: the table is garbage
    gc.collect()
    assert alloc.pages_free == 4


# -------------------------------------------------------------------------------- models

@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Tiny random models of each family sharing one tokenizer: folder per name."""
    root = tmp_path_factory.mktemp("family")
    tok = build_tokenizer(root)
    return {
        "llama": build_family_model(root / "llama", tok, "llama"),
        "qwen2": build_family_model(root / "qwen2", tok, "qwen2"),
        "mistral": build_family_model(root / "mistral", tok, "mistral", sliding_window=8),
    }


@pytest.fixture(scope="module")
def demo():
    if not (DEMO_TARGET / "config.json").is_file():
        pytest.skip("demo pair not built (scripts/train_demo_pair.py)")
    return load_causal_lm(DEMO_TARGET)


def steps(runner, caches, prompts):
    """A prefill of three prompts (one of 90 rows), then two verify batches of mixed k (0 included,
    one after a rollback): each batch's feeds, for a runner and its caches."""
    k_drafts = [[5, 6, 7], [], [9]]
    yield [Feed(c, 0, p, 1) for c, p in zip(caches, prompts)]
    yield [Feed(c, len(p) - 1, [p[-1]] + d, len(d) + 1) for c, p, d in zip(caches, prompts, k_drafts)]
    # each rejected all its drafts: it goes on from its committed length with the recovered token
    yield [Feed(c, len(p), [11] + d, len(d) + 1) for c, p, d in zip(caches, prompts, k_drafts[::-1])]


def test_paged_logits_equal_the_lean_forwards_on_the_demo_target(demo):
    lean = LeanRunner(LlamaDecoder(demo.model, pack_rows=None, numerics="fast"))  # F.linear, as the paged runner
    paged = PagedRunner(demo.model, page_tokens=16, num_pages=64)
    prompts = [ids(40, 6000), ids(7, 6000), ids(90, 6000)]
    lean_caches, paged_caches = [lean.new_cache() for _ in prompts], [paged.new_cache() for _ in prompts]
    for want_feeds, got_feeds in zip(steps(lean, lean_caches, prompts), steps(paged, paged_caches, prompts)):
        for f in got_feeds:
            paged.truncate(f.cache, f.start)
        for want, got in zip(lean.forward(want_feeds), paged.forward(got_feeds)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["batched", "loop"])
def test_a_batch_gives_each_feed_what_it_gets_alone(family, attention):
    """Float32, ragged: each feed's logits in a batch equal its logits fed alone (to 1e-5)."""
    model = load_causal_lm(family["mistral"]).model  # GQA and a sliding window
    batched, alone = (PagedRunner(model, page_tokens=4, num_pages=200, attention=attention) for _ in range(2))
    prompts = [ids(30), ids(5), ids(61)]
    caches_b, caches_a = [batched.new_cache() for _ in prompts], [alone.new_cache() for _ in prompts]
    for together, one_by_one in zip(steps(batched, caches_b, prompts), steps(alone, caches_a, prompts)):
        got = batched.forward(together)
        want = [alone.forward([f])[0] for f in one_by_one]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_running_out_of_pages_mid_forward_leaves_the_other_sessions_intact(family):
    model = load_causal_lm(family["llama"]).model
    small, roomy = PagedRunner(model, page_tokens=4, num_pages=FIRST_PAGE + 8), PagedRunner(model, page_tokens=4, num_pages=100)
    prompt = ids(20)
    a, ref = small.new_cache(), roomy.new_cache()
    small.forward([Feed(a, 0, prompt, 1)])
    roomy.forward([Feed(ref, 0, prompt, 1)])
    with pytest.raises(KVPagesExhausted):
        small.forward([Feed(a, 19, prompt[-1:] + [3, 4], 3), Feed(small.new_cache(), 0, ids(40), 1)])
    assert a.length == 20
    got = small.forward([Feed(a, 19, prompt[-1:] + [3, 4], 3)])[0]
    want = roomy.forward([Feed(ref, 19, prompt[-1:] + [3, 4], 3)])[0]
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------- exact numerics

@pytest.mark.parametrize("kernels", ["auto", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (the dev extras bring it)"))])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_exact_a_row_is_bitwise_the_same_alone_in_its_block_or_beside_other_sessions(family, name, kernels):
    """Also on core/triton_exact.py's CUDA kernels, run here by Triton's interpreter (tests/conftest.py)."""
    model = load_causal_lm(family[name]).model
    one, many = (PagedRunner(model, page_tokens=4, num_pages=200, numerics="exact", exact_kernels=kernels) for _ in range(2))
    assert kernels == "auto" or one.exact_kernels == kernels
    prefix, block = ids(21), [7, 8, 9, 10]
    # alone: the prefix, then each position fed on its own
    c = one.new_cache()
    one.forward([Feed(c, 0, prefix[:-1], 1)])
    tokens = prefix[-1:] + block[:-1]
    alone = torch.cat([one.forward([Feed(c, len(prefix) - 1 + j, [t], 1)])[0] for j, t in enumerate(tokens)])
    # together: prefilled beside another prompt, then the k + 1 block beside a prefill and a k = 2 step
    c, other = many.new_cache(), many.new_cache()
    many.forward([Feed(c, 0, prefix[:-1], 1), Feed(other, 0, ids(9), 1)])
    out = many.forward([Feed(many.new_cache(), 0, ids(70), 1), Feed(c, len(prefix) - 1, tokens, 4),
                        Feed(other, 9, [3, 4, 5], 3)])
    assert torch.equal(out[1], alone)


# ----------------------------------------------------------------------------- greedy, end to end

def greedy_through_engine(engine: VerifierEngine, prompts: list[list[int]], reference: list[list[int]]) -> list[list[int]]:
    """Speculate greedily in one batch per step: drafts of k = 0, 1, 3, 5 in turn, right up to a
    point and wrong after it (so every step rolls back), until each has len(reference) new tokens."""
    sids = [secrets.token_hex(16) for _ in prompts]
    for sid, p in zip(sids, prompts):
        engine.open(SessionSpec(sid, tuple(p), SamplingParams()), 64)
    out = [[] for _ in prompts]
    step = 0
    while any(len(o) < len(r) for o, r in zip(out, reference)):
        batch = []
        for i, (sid, o, r) in enumerate(zip(sids, out, reference)):
            if len(o) >= len(r):
                continue
            k = (0, 1, 3, 5)[(step + i) % 4]
            right = r[len(o):len(o) + k]
            wrong_at = (step + i) % (k + 1)  # the first wrong draft (k: all right)
            draft = right[:wrong_at] + [(t + 1) % 300 for t in right[wrong_at:]]
            batch.append((i, sid, draft))
        results = engine.verify_batch([(sid, DraftProposal(tuple(d))) for _, sid, d in batch])
        for (i, _, _), result in zip(batch, results):
            out[i].extend(result.token_ids)
        step += 1
    for sid in sids:
        engine.close(sid)
    return [o[:len(r)] for o, r in zip(out, reference)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_speculation_through_the_paged_engine_equals_target_only_generate(family):
    """A plain Llama (GQA), which the CPU would run on the lean forward unless told (runner="paged")."""
    engine = VerifierEngine.from_config(TargetConfig(str(family["llama"]), runner="paged", kv_page_tokens=8, max_sessions=8))
    assert isinstance(engine.runner, PagedRunner) and engine.numerics == "exact" and engine.layout is not None
    reference_model = load_causal_lm(family["llama"]).model
    prompts = [ids(12), ids(30), ids(5)]
    reference = [hf_greedy(reference_model, p, 24) for p in prompts]
    assert greedy_through_engine(engine, prompts, reference) == reference
    assert engine.kv_bytes_held() == 0 and engine.paged.pages_free == engine.paged.pages_total  # all closed


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_qwen2_and_sliding_window_mistral_equal_transformers_generate(family, name):
    """Through the engine's default choice (the paged runner on the CPU for these), with rollbacks
    every step; Mistral's window (8) is far shorter than the sequences, so it matters."""
    engine = VerifierEngine.from_config(TargetConfig(str(family[name]), max_sessions=4))
    assert isinstance(engine.runner, PagedRunner)
    reference_model = load_causal_lm(family[name]).model
    prompts = [ids(20), ids(9)]
    reference = [hf_greedy(reference_model, p, 20) for p in prompts]
    assert greedy_through_engine(engine, prompts, reference) == reference
    if name == "mistral":  # the window is in effect: full attention over the same weights says otherwise
        full = PagedRunner(reference_model, page_tokens=4, num_pages=64)
        full.kv.windows = [None] * len(full.kv.windows)
        c = full.new_cache()
        logits = full.forward([Feed(c, 0, prompts[0] + reference[0], len(reference[0]) + 1)])[0]
        assert logits[:-1].argmax(-1).tolist() != reference[0]


def test_a_sliding_window_draft_model_drafts_through_the_paged_runner(family):
    """The drafter's own cache rolls back too: its greedy drafts after a rejected block equal what
    `generate` gives from the committed tokens (HF's sliding cache could not cut back that far)."""
    loaded = load_causal_lm(family["mistral"])
    drafter = ModelDrafter(loaded, proposal_top_k=8, max_sessions=4)
    assert isinstance(drafter.runner, PagedRunner)
    prompt = ids(20)
    session = drafter.open(prompt, SamplingParams())
    first = session.propose(prompt, 12).token_ids
    assert list(first) == hf_greedy(loaded.model, prompt, 12)
    committed = prompt + list(first[:3]) + [(first[3] + 1) % 300]  # three accepted, then another token
    assert list(session.propose(committed, 10).token_ids) == hf_greedy(loaded.model, committed, 10)


# ------------------------------------------------------------------------------------- KV blocks

def test_kv_blocks_round_trip_through_pages(tiny_pair):
    """A session's full blocks leave one paged engine (read from its pages, encoded) and open it on
    another (decoded, written into pages): the second goes on with bitwise the same logits."""
    config = TargetConfig(tiny_pair[0], runner="paged", kv_page_tokens=4, kv_block_tokens=8, max_sessions=4)
    first, second = VerifierEngine.from_config(config), VerifierEngine.from_config(config)
    prompt = ids(37)
    sid = secrets.token_hex(16)
    first.open(SessionSpec(sid, tuple(prompt), SamplingParams()), 16)
    (_, blocks), = first.due_blocks([sid])
    assert [i for i, _ in blocks] == [0, 1, 2, 3]  # 37 prompt positions: four full blocks of 8
    stored = [decode_block(data, second.layout, i * 8, prompt) for i, data in blocks]
    assert torch.equal(torch.cat(stored, dim=3), first.runner.read_kv(first.sessions.peek(sid).cache, 0, 32))
    other = secrets.token_hex(16)
    second.open(SessionSpec(other, tuple(prompt), SamplingParams()), 16, stored=stored)
    assert second.last_prefill_tokens == 37 - 32
    draft = DraftProposal((4, 5, 6))
    want = first.runner.forward([first.sessions.peek(sid).feed(draft.token_ids)])[0]
    got = second.runner.forward([second.sessions.peek(other).feed(draft.token_ids)])[0]
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------- CUDA graphs

def test_buckets_are_ladders_and_a_batch_takes_the_cheapest_that_holds_it():
    assert cuda_graphs.ladder(64) == (1, 2, 4, 8, 16, 32, 64)
    assert cuda_graphs.ladder(48) == (1, 2, 4, 8, 16, 32, 48)
    buckets = cuda_graphs.buckets_for(max_sessions=48, context=2048)
    assert {b.length for b in buckets} == {256, 1024, 2048} and {b.rows for b in buckets} == {1, 2, 4, 8, 9}
    assert cuda_graphs.choose_bucket(buckets, 1, SpeculationPolicy().max_speculative_tokens + 1, 100)  # the longest block
    assert cuda_graphs.choose_bucket(buckets, 3, 4, 300) == cuda_graphs.GraphBucket(4, 4, 1024)
    assert cuda_graphs.choose_bucket(buckets, 1, 1, 1) == cuda_graphs.GraphBucket(1, 1, 256)
    assert cuda_graphs.choose_bucket(buckets, 49, 1, 10) is None  # more sessions than any bucket: eager
    assert cuda_graphs.choose_bucket(buckets, 1, 200, 300) is None  # a prefill: eager


def test_padding_into_a_bucket_and_cutting_out_gives_each_feed_its_own_logits(family):
    """The graph path's padding, replayed eagerly on the CPU: the same logits as the plain forward."""
    model = load_causal_lm(family["mistral"]).model
    plain = PagedRunner(model, page_tokens=4, num_pages=200, cuda_graphs=False)
    padded = PagedRunner(model, page_tokens=4, num_pages=200, cuda_graphs=False)
    padded.graphs = cuda_graphs.CudaGraphs(padded, [cuda_graphs.GraphBucket(4, 4, 64)], capture=False)
    prompts = [ids(30), ids(5), ids(50)]
    caches_p, caches_q = [plain.new_cache() for _ in prompts], [padded.new_cache() for _ in prompts]
    for want_feeds, got_feeds in zip(steps(plain, caches_p, prompts), steps(padded, caches_q, prompts)):
        for want, got in zip(plain.forward(want_feeds), padded.forward(got_feeds)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert padded.graphs.replays == 2  # the two verify batches; the prefill (50 rows) ran eagerly
    logits = torch.arange(16.0)[:, None].expand(16, 3)  # 4 sessions x 4 rows
    cut = cuda_graphs.unpad_logits(logits, lengths=[3, 1], num_last=[2, 1], rows=4)
    assert [c[:, 0].tolist() for c in cut] == [[1.0, 2.0], [4.0]]
