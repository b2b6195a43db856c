"""BranchBatch: B branches off one session cache, one forward per step, each branch's logits equal to a
fresh LlamaDecoder.forward over that branch's own sequence, and the session cache left untouched."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.core import llama_decode
from specdec.core.branch_decode import BranchBatch, draft_greedy
from specdec.core.llama_decode import DecodeCache, LlamaDecoder

VOCAB = 97
NUM_STEPS = 4  # m: tokens drafted per branch


def tiny_llama(kv_heads: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=128, tie_word_embeddings=True,
                      initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=[2, 4], ids=["gqa", "mha"])
def decoder(request) -> LlamaDecoder:
    return LlamaDecoder(tiny_llama(request.param, seed=request.param))


def session(decoder: LlamaDecoder, rnd: random.Random, num_drafts: int) -> tuple[DecodeCache, list[int], int]:
    """A drafter's session cache holding a committed prefix of n0 tokens plus ``num_drafts`` drafts, as
    during verification. Capacity past the valid length holds stale K/V (a rejected branch's), which a
    branch must never see. Returns (cache, cached token ids, n0)."""
    n0 = rnd.randint(5, 60)
    ids = [rnd.randrange(VOCAB) for _ in range(n0 + num_drafts)]
    cache = decoder.new_cache()
    decoder.forward(cache, ids + [rnd.randrange(VOCAB) for _ in range(6)], 0)  # 6 stale positions past the end
    return cache, ids, n0


def fresh_logits(decoder: LlamaDecoder, ids: list[int]) -> torch.Tensor:
    return decoder.forward(decoder.new_cache(), ids, 0)  # [len(ids), vocab]


@pytest.mark.parametrize("num_branches", [1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_branch_matches_a_fresh_forward_of_its_own_sequence(decoder, num_branches, seed):
    rnd = random.Random(seed * 10 + num_branches)
    k = 4
    cache, ids, n0 = session(decoder, rnd, num_drafts=k)
    # Branch j: j drafts accepted. Always include "all k accepted" (base = everything cached) and "none".
    base_lens = [n0 + k, n0] + [n0 + rnd.randint(0, k) for _ in range(num_branches - 2)]
    base_lens = base_lens[:num_branches]
    before = cache.buf[:, :, :, : len(ids) + 6].clone()  # what session() wrote (a pool slot's rest is unwritten)
    batch = BranchBatch(decoder, cache, base_lens, NUM_STEPS, cached_len=len(ids))
    fed = [[rnd.randrange(VOCAB) for _ in range(NUM_STEPS)] for _ in base_lens]  # [B, m]
    got = torch.stack([batch.step([row[t] for row in fed]) for t in range(NUM_STEPS)], dim=1)  # [B, m, vocab]
    for b, base in enumerate(base_lens):
        want = fresh_logits(decoder, ids[:base] + fed[b])[base:]  # [m, vocab]
        torch.testing.assert_close(got[b], want, atol=1e-4, rtol=1e-4, msg=f"branch {b} (base {base})")
    assert got.dtype == torch.float32
    assert torch.equal(cache.buf[:, :, :, : len(ids) + 6], before), "the session cache changed"


def test_greedy_drafting_in_one_batch_matches_drafting_each_branch_alone(decoder):
    rnd = random.Random(7)
    k = 4
    cache, ids, n0 = session(decoder, rnd, num_drafts=k)
    base_lens = [n0 + j for j in (0, 1, 2, 4)]
    guesses = [rnd.randrange(VOCAB) for _ in base_lens]  # the recovered token each branch assumes
    batch = BranchBatch(decoder, cache, base_lens, NUM_STEPS, cached_len=len(ids))
    got = draft_greedy(batch, guesses, NUM_STEPS)
    for b, (base, guess) in enumerate(zip(base_lens, guesses)):
        alone = DecodeCache(cache.buf.clone())  # the old way: roll the session back and draft
        token, want = guess, []
        for t in range(NUM_STEPS):
            token = int(decoder.forward(alone, [token], base + t, 1)[0].argmax())
            want.append(token)
        assert got[b] == want, f"branch {b}"


def test_bad_arguments_are_refused(decoder):
    rnd = random.Random(3)
    cache, ids, _ = session(decoder, rnd, num_drafts=2)
    n = len(ids)
    with pytest.raises(ValueError, match="cache holds"):
        BranchBatch(decoder, cache, [n, n + 1], NUM_STEPS, cached_len=n)  # past what the session cached
    with pytest.raises(ValueError, match="cache holds"):
        BranchBatch(decoder, cache, [-1], NUM_STEPS, cached_len=n)
    with pytest.raises(ValueError, match="capacity"):
        BranchBatch(decoder, cache, [n], NUM_STEPS, cached_len=cache.capacity + 1)
    with pytest.raises(ValueError, match="at least one branch"):
        BranchBatch(decoder, cache, [], NUM_STEPS, cached_len=n)
    with pytest.raises(ValueError, match="context length"):
        BranchBatch(decoder, cache, [n], decoder.context_length, cached_len=n)
    batch = BranchBatch(decoder, cache, [n, n - 1], 1, cached_len=n)
    with pytest.raises(ValueError, match="one token per branch"):
        batch.step([1])
    batch.step([1, 2])
    with pytest.raises(ValueError, match="steps of this batch are used"):
        batch.step([1, 2])


def test_bf16_branches_match_the_bf16_forward(monkeypatch):
    """The bf16 drafter path. Where the CPU lacks native bf16 the decoder refuses bf16 for speed's sake;
    the numbers are the same emulated, so the check is lifted here to test them on any CPU."""
    monkeypatch.setattr(llama_decode, "native_bf16", lambda: True)
    dec = LlamaDecoder(tiny_llama(2, seed=5), dtype=torch.bfloat16)
    rnd = random.Random(11)
    cache, ids, n0 = session(dec, rnd, num_drafts=3)
    base_lens = [n0 + 3, n0, n0 + 1]
    before = cache.buf[:, :, :, : len(ids) + 6].clone()  # what session() wrote (a pool slot's rest is unwritten)
    batch = BranchBatch(dec, cache, base_lens, NUM_STEPS, cached_len=len(ids))
    fed = [[rnd.randrange(VOCAB) for _ in range(NUM_STEPS)] for _ in base_lens]
    got = torch.stack([batch.step([row[t] for row in fed]) for t in range(NUM_STEPS)], dim=1)  # [B, m, vocab]
    assert got.dtype == torch.float32
    for b, base in enumerate(base_lens):
        want = fresh_logits(dec, ids[:base] + fed[b])[base:]
        # Same bf16 ops; only GEMM blocking over a different row count differs, a rounding or two of bf16.
        assert (got[b] - want).abs().max() < 0.02 * want.abs().max(), f"branch {b}"
    assert torch.equal(cache.buf[:, :, :, : len(ids) + 6], before)
