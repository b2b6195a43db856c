"""One model over either KV backend (core/kv_backend.py): the lean decoder's weights run over its CPU
slabs (core/slab_backend.py) or over a page pool (core/paged_backend.py) through the same forward
(core/llama_model.py `forward`), and give the same logits: bitwise in exact numerics (both run
specdec's C attention, each row over its own keys in order), to float tolerance in fast numerics
(SDPA over other padded shapes). Sessions prefill, verify k + 1 rows, roll back, and verify a token
tree, in one batch."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.core.kv_backend import KVBackend
from specdec.core.llama_decode import LlamaDecoder, native_attention_usable
from specdec.core.paged_backend import PagedBackend
from specdec.core.paged_kv import PagedKV
from specdec.core.runner import Feed, LeanRunner
from specdec.core.slab_backend import SlabBackend
from test_branch_decode import VOCAB, tiny_llama


def paged_for(decoder: LlamaDecoder, strategy: str) -> PagedBackend:
    pages = PagedKV(len(decoder.layers), decoder.n_kv, decoder.head_dim, num_pages=64, page_tokens=8,
                    dtype=decoder.dtype, device="cpu")
    return PagedBackend(pages, decoder.n_heads, decoder.n_kv, decoder.head_dim, decoder.dtype,
                        [None] * len(decoder.layers), decoder.context_length, strategy)


def steps(runner: LeanRunner, rnd: random.Random) -> list[list[torch.Tensor]]:
    """Three sessions through a prefill, two verifications of k + 1 rows with a rollback after each
    (a rejection keeps 1 of the drafts), then a tree beside a chain; every step's logits."""
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (5, 23, 40)]
    caches = [runner.new_cache() for _ in prompts]
    out = [runner.forward([Feed(c, 0, p, 1) for c, p in zip(caches, prompts)])]
    lengths = [len(p) for p in prompts]
    for k in (3, 5):
        blocks = [[rnd.randrange(VOCAB) for _ in range(k + 1)] for _ in caches]
        out.append(runner.forward([Feed(c, n, b, k + 1) for c, n, b in zip(caches, lengths, blocks)]))
        lengths = [n + 2 for n in lengths]  # the last committed token and one accepted draft
        for c, n in zip(caches, lengths):
            runner.truncate(c, n)
    tree, parents = [rnd.randrange(VOCAB) for _ in range(4)], (-1, 0, 0, 1)
    out.append(runner.forward([Feed(caches[0], lengths[0], tree, 4, parents), Feed(caches[2], lengths[2], [7], 1)]))
    return out


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_the_lean_model_gives_its_logits_over_the_page_pool_too(numerics):
    if numerics == "exact" and not native_attention_usable(torch.float32):
        pytest.skip("specdec's C attention does not build on this machine: the paged pool's exact strategy here is another kernel")
    decoder = LlamaDecoder(tiny_llama(2, seed=41), numerics=numerics)
    backends: list[KVBackend] = [decoder.kv, paged_for(decoder, "exact-native" if numerics == "exact" else "batched")]
    assert isinstance(backends[0], SlabBackend)
    slab, paged = (steps(LeanRunner(decoder, b), random.Random(5)) for b in backends)
    for step, (a, b) in enumerate(zip(slab, paged)):
        for x, y in zip(a, b):
            if numerics == "exact":
                assert torch.equal(x, y), step
            else:
                torch.testing.assert_close(x, y, atol=2e-5, rtol=2e-5)


def test_a_page_pool_refuses_a_feed_past_what_its_cache_holds():
    decoder = LlamaDecoder(tiny_llama(2, seed=41))
    runner = LeanRunner(decoder, paged_for(decoder, "batched"))
    cache = runner.new_cache()
    runner.forward([Feed(cache, 0, [1, 2, 3], 1)])
    with pytest.raises(ValueError, match="starts at 5 but its cache holds 3"):
        runner.forward([Feed(cache, 5, [4], 1)])
    assert len(runner.forward([Feed(cache, 3, [4], 1)])[0]) == 1  # unchanged by the refusal: it goes on from 3
