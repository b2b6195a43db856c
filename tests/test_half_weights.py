"""bfloat16 weights in specdec's C kernels ("half weights", core/llama_decode.py): where the CPU has
no bf16 dot, and in exact numerics everywhere, a bfloat16 decoder holds its weight matrices in bf16,
widened exactly in registers, with float32 activations, norms and KV. Its logits are then bitwise
those of the float32 decoder over the same model with every weight matrix rounded to bf16; a CPU
with neither a bf16 dot nor the kernels is refused by name."""
from __future__ import annotations

import copy

import pytest
import torch

from specdec.core import cpu_features, llama_decode, models, native_kernels
from specdec.core.llama_decode import LlamaDecoder, bfloat16_supported
from specdec.core.runner import Feed, LeanRunner
from test_branch_decode import VOCAB, tiny_llama

pytestmark = pytest.mark.skipif(
    not llama_decode.native_usable(torch.bfloat16),
    reason="specdec's native kernels did not build here (they need a C compiler and AVX2 with FMA)")


def rounded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every weight matrix rounded to bf16 (kept in float32), norms as they are."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.bfloat16).float())
    return out


def steps(runner: LeanRunner) -> list[torch.Tensor]:
    """A prefill, single rows, a 4-row verification block and one after a rollback, beside another
    sequence: each feed's logits."""
    ids = torch.randint(1, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = runner.new_cache(), runner.new_cache()
    out = runner.forward([Feed(a, 0, ids[:20], 20), Feed(b, 0, ids[5:17], 1)])
    out += runner.forward([Feed(a, 20, ids[20:21], 1)])
    out += runner.forward([Feed(a, 21, ids[21:25], 4), Feed(b, 12, ids[17:19], 2)])
    runner.truncate(a, 23)
    out += runner.forward([Feed(a, 23, ids[30:35], 5)])
    return out


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_exact_half_weights_are_the_float32_forward_over_rounded_weights_bit_for_bit(kv_heads):
    model = tiny_llama(kv_heads, seed=7)
    half = LlamaDecoder(model, dtype=torch.bfloat16, numerics="exact")
    assert half.half_weights and half.weight_dtype == torch.bfloat16 and half.dtype == torch.float32
    assert all(f.dtype == torch.bfloat16 for layer in half.layers for f in layer[1:3] + layer[4:6])  # panels in bf16
    want = LlamaDecoder(rounded(model), numerics="exact")
    for got, ref in zip(steps(LeanRunner(half)), steps(LeanRunner(want))):
        assert torch.equal(got, ref)


def test_fast_half_weights_on_a_cpu_without_a_bf16_dot(monkeypatch):
    monkeypatch.setattr(llama_decode, "native_bf16", lambda: False)
    model = tiny_llama(2, seed=8)
    half = LlamaDecoder(model, dtype=torch.bfloat16, numerics="fast")
    assert half.half_weights and half.kernels == ("native", "native")  # oneDNN's bf16 would be emulated
    want = LlamaDecoder(rounded(model), numerics="fast")
    for got, ref in zip(steps(LeanRunner(half)), steps(LeanRunner(want))):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)  # (fast numerics: SDPA's order may differ)


def test_a_cpu_with_neither_a_bf16_dot_nor_the_kernels_is_refused(monkeypatch, tiny_pair):
    from specdec.cli_common import UsageError, resolve_dtype_for

    for module in (llama_decode, cpu_features):
        monkeypatch.setattr(module, "native_bf16", lambda: False)
    assert bfloat16_supported() and resolve_dtype_for("cpu", "bfloat16") == "bfloat16"  # the kernels read bf16
    monkeypatch.setattr(native_kernels, "weight_dtypes", lambda: ())
    monkeypatch.setattr(models, "weight_dtypes", lambda: ())
    assert not bfloat16_supported()
    with pytest.raises(ValueError, match="native bf16 .* or specdec's native kernels"):
        LlamaDecoder(tiny_llama(2, seed=1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="or specdec's native kernels"):
        models.load_causal_lm(tiny_pair[0], dtype="bfloat16")
    with pytest.raises(UsageError, match="--dtype bfloat16 needs a CPU with native bf16 .* or specdec's native kernels"):
        resolve_dtype_for("cpu", "bfloat16")
