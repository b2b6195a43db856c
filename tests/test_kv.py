"""KV-cache bookkeeping: exact rollback, and the lean Llama decode path against the HF forward."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdec.core.kv import KVSequence
from specdec.core.runner import crop_to
from specdec.core.llama_decode import LlamaDecoder, native_bf16, native_usable, supports


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_crop_to_keeps_exactly_length_positions(model):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), cache=cache, use_cache=True)
    crop_to(cache, 3)
    assert cache.get_seq_length() == 3
    crop_to(cache, 3)  # no-op
    assert cache.get_seq_length() == 3
    with pytest.raises(ValueError):
        crop_to(cache, 4)


@pytest.mark.parametrize("lean", [False, True], ids=["hf", "lean"])
def test_rejected_branch_leaves_no_trace(model, lean):
    kv = KVSequence(model, LlamaDecoder(model) if lean else None)
    prompt = [5, 6, 7, 8]
    kv.logits_for(prompt, 1)
    kv.logits_for(prompt + [50, 51, 52], 4)  # a draft branch that gets rejected
    after = kv.logits_for(prompt + [9, 10], 2)  # the committed branch
    assert torch.allclose(after, full_logits(model, prompt + [9, 10])[-2:], atol=1e-5)
    # Re-asking for tokens already cached still returns their logits.
    again = kv.logits_for(prompt + [9, 10], 1)
    assert torch.allclose(again, full_logits(model, prompt + [9, 10])[-1:], atol=1e-5)


def test_lean_decoder_matches_hf_forward(model):
    assert supports(model)
    dec = LlamaDecoder(model)
    cache = dec.new_cache()
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    pieces = [dec.forward(cache, ids[:6], 0), dec.forward(cache, ids[6:9], 6), dec.forward(cache, ids[9:], 9)]
    assert torch.allclose(torch.cat(pieces), full_logits(model, ids), atol=1e-5)


@pytest.mark.parametrize("pack_rows", [None, 8], ids=["mkl", "onednn-packed"])
def test_lean_cache_grows_past_its_first_allocation_and_matches_hf(pack_rows):
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=200, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    dec = LlamaDecoder(model, pack_rows=pack_rows)
    ids = [(i * 37) % 97 for i in range(150)]
    kv = KVSequence(model, dec)
    kv.logits_for(ids[:50], 1)
    got = torch.cat([kv.logits_for(ids[:end], end - start) for start, end in ((50, 60), (60, 61), (61, 150))])
    assert torch.allclose(got, full_logits(model, ids)[50:], atol=1e-4)
    cache = dec.new_cache()
    with pytest.raises(ValueError, match="context length 200"):
        dec.forward(cache, ids + ids[:51], 0)


@pytest.mark.parametrize("single_row,multi_row", [("packed", "packed"), ("plain", "packed"), ("transposed", "packed"),
                                                   ("plain", "transposed"), ("native", "packed"), ("plain", "native"),
                                                   ("native", "native"), ("measure", "measure")])
def test_every_kernel_matches_hf_one_token_at_a_time_and_in_blocks(model, single_row, multi_row):
    """Single-row calls and calls of more rows each go to the kernel that measured fastest (or the
    one asked for): the numbers stay the HF forward's whichever runs, one token per step or
    several, and only the layouts the chosen kernels use are kept."""
    if "native" in (single_row, multi_row) and not native_usable(torch.float32):
        pytest.skip("specdec's native kernel does not build here (no C compiler, or no AVX2 with FMA)")
    dec = LlamaDecoder(model, single_row=single_row, multi_row=multi_row)
    ids = [(i * 13) % 97 for i in range(40)]
    kv = KVSequence(model, dec)
    kv.logits_for(ids[:10], 1)
    steps = [kv.logits_for(ids[:end], 1) for end in range(11, 25)] + [kv.logits_for(ids[:40], 16)]
    assert torch.allclose(torch.cat(steps), full_logits(model, ids)[10:], atol=1e-5)
    one, many = dec.kernels
    if single_row != "measure":
        assert (one, many) == (single_row, multi_row)
    for f in dec._layouts():
        kept = {name for name, copy in (("packed", f.packed), ("plain", f.weight), ("transposed", f.transposed),
                                        ("native", f.native)) if copy is not None}
        assert kept == {one, many}


def test_a_kernel_is_chosen_by_its_measured_time():
    from specdec.core.llama_decode import fastest

    assert fastest({"packed": [7.4, 7.3, 7.5], "plain": [5.8, 5.9, 9.0], "transposed": [6.3, 6.2, 6.4]}) == "plain"
    assert fastest({"packed": [7.4, 7.3, 7.5], "transposed": [7.2, 7.3, 7.1]}) == "packed"  # within 5%: one copy
    assert fastest({"packed": [7.4, 7.3, 7.5], "transposed": [5.0, 9.0, 9.1]}) == "packed"  # one fast sample does not decide
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, max_position_embeddings=64)).eval()
    with pytest.raises(ValueError, match="measure, packed, plain, transposed or native"):
        LlamaDecoder(tiny, single_row="mkl")
    with pytest.raises(ValueError, match="multi_row must be measure, packed, transposed or native"):
        LlamaDecoder(tiny, multi_row="plain")


def test_lean_decoder_rejects_an_unsupported_dtype(model):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        LlamaDecoder(model, dtype=torch.float16)


@pytest.mark.skipif(not native_bf16(), reason="bf16 decoding needs a CPU with native bf16")
@pytest.mark.parametrize("pack_rows", [None, 8], ids=["plain", "onednn-packed"])
def test_bf16_decoder_tracks_the_fp32_forward_through_growth_and_rollback(pack_rows):
    """The drafter's bf16 path: same model, bf16 rounding only. Logits stay close to fp32 and a
    rejected branch still leaves no trace (the cache is bf16 too)."""
    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=200, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    ids = [(i * 37) % 97 for i in range(120)]
    want = full_logits(model, ids)
    kv = KVSequence(model, LlamaDecoder(model, pack_rows=pack_rows, dtype=torch.bfloat16))
    kv.logits_for(ids[:70] + [1, 2, 3], 3)  # a branch that gets rejected, past the first allocation
    got = torch.cat([kv.logits_for(ids[:end], end - start) for start, end in ((0, 70), (70, 71), (71, 120))])
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
