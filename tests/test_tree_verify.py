"""Token trees through the verifier (services/target/engine.py): greedy output equals target-only
`generate` whatever trees are sent, with the accepted path landing at every depth and on every kind
of node (first or later sibling), so every step rolls its cache back to a path that was not the
chain's; coupled sampling gives target-only coupled sampling's tokens; a runner that cannot verify
trees verifies their main chain and stays exact."""
from __future__ import annotations

import random
import secrets

import pytest
import torch

from specdec.core.models import load_causal_lm
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.steps import DraftProposal, SessionSpec
from specdec.core.tree import ROOT
from specdec.target.engine import TargetConfig, VerifierEngine

PROMPTS = 20
NEW_TOKENS = 16
_engines: dict = {}


def engine_for(target: str, runner: str, numerics: str = "auto") -> VerifierEngine:
    key = (target, runner, numerics)
    if key not in _engines:
        _engines[key] = VerifierEngine.from_config(TargetConfig(target, runner=runner, numerics=numerics, max_sessions=PROMPTS))
    return _engines[key]


def prompts(vocab: int) -> list[list[int]]:
    rnd = random.Random(4)
    return [[rnd.randrange(vocab) for _ in range(rnd.randint(3, 30))] for _ in range(PROMPTS)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def tree_around(right: list[int], rnd: random.Random, vocab: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A tree holding the right continuation down to a random depth, the right node at a random
    place among wrong siblings, and wrong subtrees beside it: (token ids, parents)."""
    tokens: list[int] = []
    parents: list[int] = []
    parent = ROOT
    depth = rnd.randint(0, len(right))
    for d in range(len(right)):
        wrong = rnd.sample([t for t in range(vocab) if t != right[d]], rnd.randint(0, 2))
        siblings = wrong + ([right[d]] if d < depth else [])
        rnd.shuffle(siblings)
        right_node = None
        for token in siblings:
            tokens.append(token)
            parents.append(parent)
            if token == right[d] and d < depth:
                right_node = len(tokens) - 1
            elif rnd.random() < 0.5:  # a wrong node's own child
                tokens.append(rnd.randrange(vocab))
                parents.append(len(tokens) - 2)
        if right_node is None:
            break
        parent = right_node
    return tuple(tokens), tuple(parents)


def decode_with_trees(engine: VerifierEngine, prompt_ids: list[list[int]], reference: list[list[int]],
                      sampling: SamplingParams, seed: int) -> tuple[list[list[int]], int]:
    """Every session verifies a tree per step, all sessions in one batch; returns the outputs and how
    many steps accepted a node that was not its parent's first child."""
    rnd = random.Random(seed)
    vocab = engine.loaded.vocab_size
    sids = [secrets.token_hex(16) for _ in prompt_ids]
    for sid, p in zip(sids, prompt_ids):
        engine.open(SessionSpec(sid, tuple(p), sampling), NEW_TOKENS + 16)
    out: list[list[int]] = [[] for _ in prompt_ids]
    off_chain = 0
    while any(len(o) < len(r) for o, r in zip(out, reference)):
        batch = []
        for i, (sid, o, r) in enumerate(zip(sids, out, reference)):
            if len(o) < len(r):
                tokens, parents = tree_around(r[len(o):len(o) + 4], rnd, vocab)
                batch.append((i, sid, DraftProposal(tokens, parents=parents if parents else ())))
        for (i, _, proposal), result in zip(batch, engine.verify_batch([(sid, p) for _, sid, p in batch])):
            out[i].extend(result.token_ids)
            tree = proposal.tree
            accepted_nodes = [j for j in range(len(tree)) if tree.token_ids[j] in result.token_ids]
            off_chain += any(tree.children[tree.parents[j]][0] != j for j in accepted_nodes[:result.num_accepted])
    for sid in sids:
        engine.close(sid)
    return [o[:len(r)] for o, r in zip(out, reference)], off_chain


@pytest.fixture(scope="module")
def references(tiny_pair) -> tuple[list[list[int]], list[list[int]]]:
    """PROMPTS prompts and target-only greedy `generate` after each."""
    loaded = load_causal_lm(tiny_pair[0])
    ps = prompts(loaded.vocab_size)
    return ps, [hf_greedy(loaded.model, p, NEW_TOKENS) for p in ps]


@pytest.mark.parametrize("runner, numerics, count", [("lean", "exact", PROMPTS), ("lean", "fast", 8),
                                                     ("paged", "exact", 8), ("hf", "auto", 6)])
def test_greedy_trees_equal_target_only_generate(tiny_pair, references, runner, numerics, count):
    """All prompts on the default runner and numerics; a few on the others (the paged runner's trees
    are also held node by node in tests/test_paged_trees.py)."""
    engine = engine_for(tiny_pair[0], runner, numerics)
    ps, reference = references[0][:count], references[1][:count]
    got, off_chain = decode_with_trees(engine, ps, reference, SamplingParams(), seed=1)
    assert got == reference
    if engine.runner.verifies_trees:
        assert off_chain > 0  # paths through later siblings were accepted (and their keys moved into place)


def test_coupled_trees_give_target_only_coupled_tokens(tiny_pair):
    engine = engine_for(tiny_pair[0], "lean", "exact")
    ps = prompts(engine.loaded.vocab_size)[:6]
    sampling = SamplingParams(temperature=0.9, top_k=40, seed=23, rule=VerificationRule.COUPLED)
    alone = []
    for p in ps:  # target-only coupled sampling: k = 0 every step
        sid = secrets.token_hex(16)
        engine.open(SessionSpec(sid, tuple(p), sampling), NEW_TOKENS + 16)
        out: list[int] = []
        while len(out) < NEW_TOKENS:
            out.extend(engine.verify(sid, DraftProposal(())).token_ids)
        engine.close(sid)
        alone.append(out[:NEW_TOKENS])
    got, _ = decode_with_trees(engine, ps, alone, sampling, seed=2)
    assert got == alone


# ----------------------------------------------------------------------------- the tree drafter
@pytest.fixture(scope="module")
def tree_drafter(tiny_pair):
    from specdec.draft.drafters import DraftConfig, build_drafters

    drafters = build_drafters(DraftConfig(draft_model_path=tiny_pair[1]))
    return drafters["tree"], drafters["model"]


@pytest.mark.parametrize("budget", [1, 4, 8, 16])
def test_the_tree_drafter_spends_its_budget_on_a_valid_tree(tree_drafter, budget):
    tree, model = tree_drafter
    prompt = list(range(3, 40))
    proposal = tree.open(prompt, SamplingParams()).propose(prompt, budget)
    assert 1 <= len(proposal.token_ids) <= budget
    shape = proposal.tree  # validates parents
    chain = model.open(prompt, SamplingParams()).propose(prompt, 1)
    assert shape.token_ids[shape.children[ROOT][0]] == chain.token_ids[0]  # the draft's first choice comes first
    if budget >= 8:
        assert not shape.is_chain  # the random pair is unsure: its budget branches


async def test_greedy_over_grpc_with_the_tree_drafter_equals_target_only(cluster, tiny_pair):
    """20 prompts at tree budgets 4 and 8 in turn, against `generate` (one model load for all)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_e2e import MAX_NEW, prompts as e2e_prompts, request

    tok = AutoTokenizer.from_pretrained(tiny_pair[0], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], local_files_only=True, dtype=torch.float32).eval()
    for i, prompt in enumerate(e2e_prompts(20)):
        reply = await cluster.stub.Generate(request(prompt, (4, 8)[i % 2], "tree"))
        assert reply.token_ids == hf_greedy(model, tok(prompt)["input_ids"], MAX_NEW), prompt
        assert reply.stats.draft_tokens > 0


async def test_coupled_over_grpc_with_the_tree_drafter_is_seed_exact(cluster):
    from test_e2e import prompts as e2e_prompts, request

    for prompt in e2e_prompts(6):
        plain = await cluster.stub.Generate(request(prompt, 0, "model", temperature=0.8, seed=5))
        tree = await cluster.stub.Generate(request(prompt, 8, "tree", temperature=0.8, seed=5))
        assert tuple(tree.token_ids) == tuple(plain.token_ids), prompt
