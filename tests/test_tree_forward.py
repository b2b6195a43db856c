"""The lean forward over token trees (core/llama_decode.py with core/tree.py): each node's logits are
those of the chain of its path, in the slab-batched, private-cache and exact paths; after `keep_path`
the cache holds the accepted path as a chain would, so decoding goes on as if the chain had been fed."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.core.llama_decode import LlamaDecoder
from specdec.core.tree import ROOT, DraftTree
from test_branch_decode import VOCAB, tiny_llama

TREE = DraftTree((5, 9, 7, 8, 3, 11, 2), (ROOT, ROOT, 0, 0, 1, 2, 2))  # depths 0 0 1 1 1 2 2
_decoders: dict = {}


@pytest.fixture(params=["fast", "exact"])
def decoder(request) -> LlamaDecoder:
    if request.param not in _decoders:
        _decoders[request.param] = LlamaDecoder(tiny_llama(2, seed=8), numerics=request.param)
    return _decoders[request.param]


def _prefilled(dec: LlamaDecoder, prompt: list[int], private: bool = False):
    cache = dec.private_cache() if private else dec.new_cache()
    dec.forward(cache, prompt[:-1], 0, 1)  # the last prompt token is fed with the tree, as the verifier does
    return cache


def _chain_logits(dec: LlamaDecoder, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The last row's logits of ``prompt + tokens`` fed as a chain: [vocab]."""
    cache = _prefilled(dec, prompt)
    try:
        return dec.forward(cache, [prompt[-1], *tokens], len(prompt) - 1, 1)[0]
    finally:
        cache.free()


def _tree_logits(dec: LlamaDecoder, caches: list, prompts: list[list[int]], trees: list[DraftTree]) -> list[torch.Tensor]:
    return dec.forward_batch(caches, [[p[-1], *t.token_ids] for p, t in zip(prompts, trees)],
                             [len(p) - 1 for p in prompts], [len(t) + 1 for t in trees], [t.parents for t in trees])


@pytest.mark.parametrize("private", [False, True], ids=["slab", "private"])
def test_each_node_scores_its_path(decoder, private):
    rnd = random.Random(1)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (9, 23, 4)]
    trees = [TREE, DraftTree.chain([4, 6]), DraftTree((1, 2), (ROOT, ROOT))]
    caches = [_prefilled(decoder, p, private) for p in prompts]
    batch = _tree_logits(decoder, caches, prompts, trees)
    for prompt, tree, logits in zip(prompts, trees, batch):
        assert torch.allclose(logits[0], _chain_logits(decoder, prompt, []), atol=1e-5)
        for node in range(len(tree)):
            path = [tree.token_ids[j] for j in tree.path_to(node)]
            assert torch.allclose(logits[node + 1], _chain_logits(decoder, prompt, path), atol=1e-5), (tree, node)
    for c in caches:
        c.free()


def test_keep_path_leaves_the_cache_a_chain_would(decoder):
    rnd = random.Random(2)
    prompt = [rnd.randrange(VOCAB) for _ in range(12)]
    for leaf in (6, 4, 3, 1):  # paths of depth 3 and 2 from either root child
        path = TREE.path_to(leaf)
        cache = _prefilled(decoder, prompt)
        _tree_logits(decoder, [cache], [prompt], [TREE])
        decoder.keep_path(cache, len(prompt), path)
        accepted = [TREE.token_ids[j] for j in path]
        # The next step feeds one more token after the accepted path, on top of the kept keys and values.
        got = decoder.forward_batch([cache], [[3]], [len(prompt) + len(path)], [1])[0][0]
        assert torch.allclose(got, _chain_logits(decoder, prompt, [*accepted, 3]), atol=1e-5), leaf
        cache.free()
