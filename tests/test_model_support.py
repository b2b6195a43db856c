"""Models whose cache cannot be rolled back exactly are refused when a worker loads them, with the
setting named; never a traceback mid-request."""
from __future__ import annotations

import pytest

from specdec import cli
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


def test_a_sliding_window_shorter_than_the_context_is_refused_naming_the_setting(tmp_path, tok):
    folder = build_mistral(tmp_path / "m", tok, sliding_window=16)
    with pytest.raises(UnsupportedModel, match="sliding_window=16"):
        load_causal_lm(folder)


@pytest.mark.parametrize("window", [None, 256, 4096], ids=["none", "equal-to-context", "beyond-context"])
def test_a_window_that_never_slides_is_served(tmp_path, tok, window):
    loaded = load_causal_lm(build_mistral(tmp_path / "m", tok, sliding_window=window))
    assert loaded.context_length == 256


def test_the_cli_says_why_instead_of_a_traceback(tmp_path, tok, capsys):
    folder = build_mistral(tmp_path / "m", tok, sliding_window=16)
    assert cli.main(["generate", "def f():", "--target", str(folder), "--drafter", "ngram", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "sliding_window=16" in err and "Traceback" not in err
