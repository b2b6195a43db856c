"""Models whose cache cannot be rolled back exactly (recurrent layers) are refused when a worker loads
them, with the setting named; never a traceback mid-request. Sliding-window models are served through
the paged runner's masked full cache (tests/test_paged_runner.py checks their output)."""
from __future__ import annotations

import pytest

from specdec import cli
from specdec.core.choose_runner import choose_runner
from specdec.core.errors import UnsupportedModel
from specdec.core.models import load_causal_lm

from tiny_models import build_tokenizer


def build_mistral(out, tokenizer, sliding_window, context: int = 256, **extra):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=context,
                        sliding_window=sliding_window, eos_token_id=tokenizer.eos_token_id, **extra)
    MistralForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def build_recurrent(out, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # a layer type whose cache cannot be cut (as a hybrid model's config names it)
    config = out / "config.json"
    config.write_text(config.read_text().replace('"full_attention"', '"linear_attention"'))
    return out


def test_a_recurrent_layer_type_is_refused_naming_the_setting(tmp_path, tok):
    with pytest.raises(UnsupportedModel, match="linear_attention"):
        load_causal_lm(build_recurrent(tmp_path / "m", tok))


def test_a_sliding_window_shorter_than_the_context_is_served_by_the_paged_runner(tmp_path, tok):
    folder = build_mistral(tmp_path / "m", tok, sliding_window=16)
    loaded = load_causal_lm(folder)
    assert choose_runner(loaded.model) == "paged"
    with pytest.raises(UnsupportedModel, match="sliding_window=16"):  # HF's cache cannot roll it back
        choose_runner(loaded.model, "hf")


@pytest.mark.parametrize("window", [None, 256, 4096], ids=["none", "equal-to-context", "beyond-context"])
def test_a_window_that_never_slides_is_served(tmp_path, tok, window):
    loaded = load_causal_lm(build_mistral(tmp_path / "m", tok, sliding_window=window))
    assert loaded.context_length == 256


def test_the_cli_says_why_instead_of_a_traceback(tmp_path, tok, capsys):
    folder = build_recurrent(tmp_path / "m", tok)
    assert cli.main(["generate", "def f():", "--target", str(folder), "--drafter", "ngram", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "linear_attention" in err and "Traceback" not in err


@pytest.mark.parametrize("family, fast, want", [
    ("llama", True, "lean"),  # a plain Llama on the CPU
    ("qwen2", True, "paged"),  # biases: the paged runner (a drafter used to fall back to transformers here)
    ("mistral", True, "paged"),  # a sliding window only the paged runner rolls back
    ("llama", False, "hf"),  # the reference forward
])
def test_the_verifier_and_the_drafter_choose_a_runner_by_one_rule(tmp_path, tok, family, fast, want):
    from tiny_models import build_family_model

    from specdec.core.paged_runner import PagedRunner
    from specdec.core.runner import HFRunner, LeanRunner
    from specdec.draft.model_drafter import ModelDrafter
    from specdec.target.engine import TargetConfig, VerifierEngine

    extra = {"sliding_window": 8} if family == "mistral" else {}
    folder = str(build_family_model(tmp_path / family, tok, family, **extra))
    assert choose_runner(load_causal_lm(folder).model, fast_forward=fast) == want
    runner_type = {"lean": LeanRunner, "paged": PagedRunner, "hf": HFRunner}[want]
    verifier = VerifierEngine(load_causal_lm(folder), TargetConfig(folder, fast_forward=fast, numerics="fast"))
    drafter = ModelDrafter(load_causal_lm(folder), proposal_top_k=4, fast=fast)
    assert isinstance(verifier.runner, runner_type) and isinstance(drafter.runner, runner_type)


def test_a_runner_that_cannot_serve_the_model_is_refused_by_name(tmp_path, tok):
    from tiny_models import build_family_model

    model = load_causal_lm(str(build_family_model(tmp_path / "q", tok, "qwen2"))).model
    with pytest.raises(ValueError, match="lean runner serves plain Llamas"):
        choose_runner(model, "lean")
    with pytest.raises(ValueError, match="runner must be one of auto, lean, paged, hf"):
        choose_runner(model, "vllm")
