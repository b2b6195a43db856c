"""Small random-weight Hugging Face models for tests, saved with save_pretrained and loaded back
through specdec's real loading path. Built once per test session (a second or two)."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

VOCAB = 384


def corpus_texts(limit: int = 40) -> list[str]:
    """Some real Python source to train the tokenizer and draw prompts from."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in sorted(root.glob("*.py"))[:limit]:
        texts.append(name.read_text(encoding="utf-8", errors="replace")[:4000])
    return texts


def build_tokenizer(out: Path, vocab_size: int = VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_texts(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def build_model(out: Path, tokenizer, hidden: int, layers: int, seed: int, context: int = 256, vocab: int | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=context, tie_word_embeddings=True, initializer_range=0.2,
                      bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_family_model(out: Path, tokenizer, family: str, seed: int = 0, context: int = 256, **extra) -> Path:
    """A tiny random Llama-family model with grouped-query attention (4 query heads, 2 KV heads) and
    untied embeddings: ``family`` llama, qwen2 (q/k/v biases, made non-zero so they matter) or
    mistral; ``extra`` goes to the config (``sliding_window=8``, ``attention_bias=True``, ...)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "mistral": (MistralConfig, MistralForCausalLM)}[family]
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=context,
                     tie_word_embeddings=False, initializer_range=0.2, bos_token_id=tokenizer.eos_token_id,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **extra)
    model = model_cls(cfg)
    with torch.no_grad():  # HF initialises biases to zero: give them values, or a dropped bias would go unseen
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
