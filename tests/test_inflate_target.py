"""scripts/inflate_target.py: the inflated target computes the source's function (same greedy tokens,
same logits to float32 rounding, the residual's extra dimensions exactly zero), on the demo target
and on a tiny random grouped-query Llama with untied embeddings."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
_spec = importlib.util.spec_from_file_location("inflate_target", ROOT / "scripts" / "inflate_target.py")
inflate_target = importlib.util.module_from_spec(_spec)
sys.modules["inflate_target"] = inflate_target
_spec.loader.exec_module(inflate_target)
Shape = inflate_target.Shape

PROMPTS = ["def fibonacci(n):", "import os\n\n\nclass Config:\n    def __init__(self", "for i, line in enumerate("]
NEW_TOKENS = 24
# Demo target: hidden 384, 8 layers, 6/6 heads of 64, intermediate 1024.
DEMO_BIG = Shape(hidden=512, layers=10, heads=8, kv_heads=8, intermediate=1536)
needs_demo = pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not built")


def load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def demo_models(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("inflated")
    record = inflate_target.inflate(DEMO / "target", out, DEMO_BIG, torch.float32, seed=0)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    return tok, load(DEMO / "target"), load(out), load(DEMO / "draft"), record


@needs_demo
def test_greedy_generation_is_the_demo_targets(demo_models):
    tok, target, big, _, _ = demo_models
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            want = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            got = big.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert got.tolist() == want.tolist(), prompt
        assert want.shape[1] == ids.shape[1] + NEW_TOKENS  # no early EOS hiding a difference


@needs_demo
def test_logits_agree_and_extra_residual_dims_stay_zero(demo_models):
    tok, target, big, draft, record = demo_models
    h = target.config.hidden_size
    assert big.config.hidden_size == DEMO_BIG.hidden and big.config.num_hidden_layers == DEMO_BIG.layers
    assert record["construction"]["source_layer_of_layer"] == list(range(8)) + [None, None]
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = draft.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)  # [1, T]: the draft's proposals
            want = target(seq).logits  # [1, T, vocab]
            out = big(seq, output_hidden_states=True)
        assert (out.logits - want).abs().max().item() < 1e-4, prompt
        for layer, hidden in enumerate(out.hidden_states):  # [1, T, H] each: embeddings, every layer, final norm
            assert torch.count_nonzero(hidden[..., h:]) == 0, (prompt, layer)

        # Greedy acceptance of the draft: a proposal is accepted where it is the target's argmax. Equal
        # argmaxes at every teacher-forced position give equal acceptance at any k.
        target_ids, big_ids = want.argmax(-1)[0, :-1], out.logits.argmax(-1)[0, :-1]  # [T-1]
        assert torch.equal(big_ids, target_ids), prompt
        proposals = seq[0, 1:]
        start = ids.shape[1] - 1
        assert (big_ids[start:] == proposals[start:]).sum() == (target_ids[start:] == proposals[start:]).sum()


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 8)], ids=["4-per-kv", "kv-copies"])
def test_grouped_query_untied_source(tmp_path, heads, kv_heads):
    """Source: 4 query heads on 2 KV heads (head_dim 16), untied LM head. 8/2 puts each source group
    in one new group; 8/8 has one query head per KV head, so each source KV head is copied twice."""
    from tiny_models import build_family_model, build_tokenizer

    source = build_family_model(tmp_path / "source", build_tokenizer(tmp_path / "tok"), "llama", seed=3)
    out = tmp_path / "big"
    record = inflate_target.inflate(source, out, Shape(hidden=heads * 16, layers=3, heads=heads, kv_heads=kv_heads,
                                                       intermediate=160), torch.float32, seed=1)
    if kv_heads == 8:
        assert record["construction"]["source_kv_head_of_kv_head"] == [0, 0, 1, 1, None, None, None, None]
        assert record["construction"]["query_head_of_source_head"] == [0, 1, 2, 3]
    else:
        assert record["construction"]["query_head_of_source_head"] == [0, 1, 4, 5]
    small, big = load(source), load(out)
    assert not big.config.tie_word_embeddings
    ids = torch.randint(1, small.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, out_big = small(ids).logits, big(ids, output_hidden_states=True)
    assert (out_big.logits - want).abs().max().item() < 1e-4
    assert all(torch.count_nonzero(hs[..., 64:]) == 0 for hs in out_big.hidden_states)


@pytest.mark.parametrize("shape,message", [
    (Shape(256, 10, 4, 4, 1536), "--hidden 256 is smaller than the source's 384"),
    (Shape(512, 6, 8, 8, 1536), "--layers 6 is smaller than the source's 8"),
    (Shape(512, 10, 8, 8, 512), "--intermediate 512 is smaller"),
    (Shape(768, 10, 12, 8, 1536), "--heads 12 is not a multiple of --kv-heads 8"),
    (Shape(1000, 10, 16, 8, 1536), "head_dim must stay 64"),
    (Shape(768, 10, 12, 4, 1536), "--kv-heads 4 is smaller than the source's 6"),
])
@needs_demo
def test_refuses_shapes_that_cannot_hold_the_source(tmp_path, capsys, shape, message):
    with pytest.raises(inflate_target.ShapeError, match=message):
        inflate_target.inflate(DEMO / "target", tmp_path / "out", shape, torch.float32)
    assert not (tmp_path / "out").exists()  # refused before writing anything
    with pytest.raises(SystemExit) as e:  # the CLI says the same and exits 2
        inflate_target.main(["--out", str(tmp_path / "out"), "--hidden", str(shape.hidden), "--layers", str(shape.layers),
                             "--heads", str(shape.heads), "--kv-heads", str(shape.kv_heads),
                             "--intermediate", str(shape.intermediate)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_refuses_a_grouping_the_kv_heads_cannot_hold():
    # 6 query heads on 2 KV heads (groups of 3); 6/3 has groups of 2, so each needs 2 KV heads: 4 > 3.
    config = {"model_type": "llama", "hidden_size": 384, "num_hidden_layers": 2, "num_attention_heads": 6,
              "num_key_value_heads": 2, "intermediate_size": 512, "head_dim": 64, "rms_norm_eps": 1e-6}
    with pytest.raises(inflate_target.ShapeError, match="each group needs 2 KV heads, 4 in all, but --kv-heads is 3: use --kv-heads 6"):
        inflate_target.plan(config, Shape(384, 2, 6, 3, 512))


@needs_demo
def test_bfloat16_output_writes_bfloat16_tensors(tmp_path):
    inflate_target.main(["--out", str(tmp_path), "--hidden", "512", "--layers", "9", "--heads", "8", "--kv-heads", "8",
                         "--intermediate", "1024", "--dtype", "bfloat16"])
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "inflation.json").read_text())["shape"]["layers"] == 9
