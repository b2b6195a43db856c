"""Token trees in the paged runner (core/paged_runner.py with core/tree.py): each node's logits are
those of the chain of its path, beside a chain feed and a k = 0 feed, in both attention modes and in
exact numerics, for a plain Llama and for a sliding-window Mistral whose window is shorter than the
prompt (windows count a node's position, not its buffer index); after `keep_path` the cache holds
the accepted path as a chain would; and the same tree gives the lean forward's logits."""
from __future__ import annotations

import pytest
import torch

from specdec.core import cuda_graphs
from specdec.core.llama_decode import LlamaDecoder
from specdec.core.models import load_causal_lm
from specdec.core.paged_runner import PagedRunner
from specdec.core.runner import Feed
from specdec.core.tree import ROOT, DraftTree

from tiny_models import build_family_model, build_tokenizer

# depths 0 0 1 1 1 2 2: node 6 is row 7 of its feed but at depth position 3, so a window keyed on
# the buffer index would cut its prefix 4 positions early
TREE = DraftTree((5, 9, 7, 8, 3, 11, 2), (ROOT, ROOT, 0, 0, 1, 2, 2))
WINDOW = 8  # Mistral's sliding window: shorter than every prompt here
PAGE_TOKENS = 4  # small pages: a feed and a kept path straddle page boundaries
GEN = torch.Generator().manual_seed(3)


def ids(n: int) -> list[int]:
    return torch.randint(1, 300, (n,), generator=GEN).tolist()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("trees")
    tok = build_tokenizer(root)
    return {"llama": load_causal_lm(build_family_model(root / "llama", tok, "llama")).model,
            "mistral": load_causal_lm(build_family_model(root / "mistral", tok, "mistral", sliding_window=WINDOW)).model}


_runners: dict = {}


def runner(models, name: str, **kw) -> PagedRunner:
    key = (name, *sorted(kw.items()))
    if key not in _runners:
        _runners[key] = PagedRunner(models[name], page_tokens=PAGE_TOKENS, num_pages=400, **kw)
    return _runners[key]


def prefilled(r: PagedRunner, prompt: list[int]):
    cache = r.new_cache()
    r.forward([Feed(cache, 0, prompt[:-1], 1)])  # the last prompt token goes with the tree, as the verifier feeds it
    return cache


def tree_feed(cache, prompt: list[int], tree: DraftTree) -> Feed:
    return Feed(cache, len(prompt) - 1, [prompt[-1], *tree.token_ids], len(tree) + 1, tree.parents)


def chain_logits(r: PagedRunner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The last row's logits of ``prompt + tokens`` fed as a chain after the prompt's prefill: [vocab]."""
    cache = prefilled(r, prompt)
    try:
        return r.forward([Feed(cache, len(prompt) - 1, [prompt[-1], *tokens], 1)])[0][0]
    finally:
        r.free(cache)


def assert_each_node_scores_its_path(logits: torch.Tensor, reference: PagedRunner, prompt: list[int],
                                     tree: DraftTree) -> None:
    close(logits[0], chain_logits(reference, prompt, []))
    for node in range(len(tree)):
        path = [tree.token_ids[j] for j in tree.path_to(node)]
        close(logits[node + 1], chain_logits(reference, prompt, path))


@pytest.mark.parametrize("name", ["llama", "mistral"])
@pytest.mark.parametrize("attention", ["batched", "loop"])
def test_each_node_scores_its_path_beside_a_chain_and_a_k0_feed(models, name, attention):
    r = runner(models, name, attention=attention)
    tree_prompt, chain_prompt, plain_prompt = ids(19), ids(11), ids(26)
    caches = [prefilled(r, p) for p in (tree_prompt, chain_prompt, plain_prompt)]
    chain = [4, 6, 8]
    out = r.forward([tree_feed(caches[0], tree_prompt, TREE),
                     Feed(caches[1], len(chain_prompt) - 1, [chain_prompt[-1], *chain], len(chain) + 1),
                     Feed(caches[2], len(plain_prompt) - 1, plain_prompt[-1:], 1)])
    assert caches[0].length == len(tree_prompt) + len(TREE)  # every node's keys, at buffer positions first + node
    assert_each_node_scores_its_path(out[0], r, tree_prompt, TREE)
    for j in range(len(chain) + 1):  # the tree's rows did not disturb the chain's, nor the k = 0 feed's
        close(out[1][j], chain_logits(r, chain_prompt, chain[:j]))
    close(out[2][0], chain_logits(r, plain_prompt, []))
    for c in caches:
        r.free(c)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_keep_path_then_one_more_token_equals_the_chain(models, name):
    r = runner(models, name)
    prompt = ids(21)
    first = len(prompt)
    for leaf in (6, 4, 3, 1, 0):  # paths of depth 3 and 2 from either root child, and one already in place
        path = TREE.path_to(leaf)
        cache = prefilled(r, prompt)
        r.forward([tree_feed(cache, prompt, TREE)])
        r.keep_path(cache, first, path)
        r.truncate(cache, first + len(path))
        accepted = [TREE.token_ids[j] for j in path]
        got = r.forward([Feed(cache, first + len(path), [3], 1)])[0][0]
        close(got, chain_logits(r, prompt, [*accepted, 3]))
        r.free(cache)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_exact_numerics_score_each_node_within_float_error_of_its_chain(models, name):
    """Within 1e-5, not bitwise: exact numerics keep a row's bits whatever shares its forward, but a
    node is not its chain's row. Its ancestors' keys sit at buffer positions first + node, with
    masked siblings between them, not at their chain positions, so its attention sums the same
    terms in other key blocks; and those keys come from rows whose own attention differed the same
    way. The rotary angles and the set of keys seen are the chain's; the summation order is not."""
    r = runner(models, name, numerics="exact")
    tree_prompt, chain_prompt = ids(23), ids(9)
    caches = [prefilled(r, p) for p in (tree_prompt, chain_prompt)]
    out = r.forward([tree_feed(caches[0], tree_prompt, TREE),
                     Feed(caches[1], len(chain_prompt) - 1, [chain_prompt[-1], 7, 8], 3),
                     Feed(r.new_cache(), 0, ids(12), 1)])
    assert_each_node_scores_its_path(out[0], r, tree_prompt, TREE)
    # the chain beside the tree keeps exact numerics' promise: bitwise its rows fed alone
    assert torch.equal(out[1][2], chain_logits(r, chain_prompt, [7, 8]))
    r.keep_path(caches[0], len(tree_prompt), TREE.path_to(5))
    r.truncate(caches[0], len(tree_prompt) + 3)
    got = r.forward([Feed(caches[0], len(tree_prompt) + 3, [3], 1)])[0][0]
    close(got, chain_logits(r, tree_prompt, [TREE.token_ids[j] for j in TREE.path_to(5)] + [3]))


def test_a_tree_gives_the_lean_forwards_logits(models):
    """The same trees, prefixes and batch in the lean forward (core/llama_decode.py): each row within 1e-5."""
    paged = runner(models, "llama")
    lean = LlamaDecoder(models["llama"], pack_rows=None, numerics="fast")  # F.linear, as the paged runner
    prompts, trees = [ids(17), ids(30)], [TREE, DraftTree((1, 2, 3), (ROOT, ROOT, 1))]
    paged_caches = [prefilled(paged, p) for p in prompts]
    lean_caches = [lean.new_cache() for _ in prompts]
    for c, p in zip(lean_caches, prompts):
        lean.forward(c, p[:-1], 0, 1)
    got = paged.forward([tree_feed(c, p, t) for c, p, t in zip(paged_caches, prompts, trees)])
    want = lean.forward_batch(lean_caches, [[p[-1], *t.token_ids] for p, t in zip(prompts, trees)],
                              [len(p) - 1 for p in prompts], [len(t) + 1 for t in trees], [t.parents for t in trees])
    for g, w in zip(got, want):
        close(g, w)
    for c in paged_caches:
        paged.free(c)
    for c in lean_caches:
        c.free()


def test_a_batch_with_a_tree_runs_eagerly_past_the_cuda_graph_buckets(models):
    """The buckets' static masks are causal: a tree batch skips them (replayed eagerly here, as on the CPU)."""
    r = PagedRunner(models["mistral"], page_tokens=PAGE_TOKENS, num_pages=200, cuda_graphs=False)
    r.graphs = cuda_graphs.CudaGraphs(r, [cuda_graphs.GraphBucket(4, 8, 64)], capture=False)
    prompt = ids(20)
    cache = prefilled(r, prompt)
    out = r.forward([tree_feed(cache, prompt, TREE)])[0]
    assert r.graphs.replays == 0
    assert_each_node_scores_its_path(out, runner(models, "mistral"), prompt, TREE)
