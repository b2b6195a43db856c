"""Write a randomly initialised Llama-shaped target of about 0.46B parameters (1.8 GB of float32).

For measuring what specdec's start-up and memory cost on a model past toy size
(benchmarks/bench_big_target.py). It uses the demo pair's tokenizer (models/demo/target), so
``specdec generate --target <folder> --draft models/demo/draft`` runs it. The shape: hidden 1536,
16 layers, 12 attention heads over 4 KV heads (GQA), intermediate 4608, untied output layer.

The output layer's row for the end-of-text token is zero: its logit is then 0 while the other
6,143 are spread around 0, so greedy decoding never stops early and every run makes the tokens asked for.

    python3 benchmarks/make_random_target.py [--out /tmp/specdec-big-target]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SHAPE = dict(hidden_size=1536, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=4608, max_position_embeddings=512)


def weights(cfg, vocab: int, eos: int, seed: int) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM state dict, float32, N(0, 0.02) like HF's own initialisation."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = hidden // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * cfg.initializer_range

    out = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": normal(hidden, hidden),
            p + "self_attn.k_proj.weight": normal(kv, hidden),
            p + "self_attn.v_proj.weight": normal(kv, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, hidden),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    head = normal(vocab, hidden)
    head[eos] = 0  # greedy never picks end-of-text: every run is as long as asked
    out["lm_head.weight"] = head
    return out


def make(out: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(DEMO_TARGET, local_files_only=True)
    eos = tok.eos_token_id
    cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos,
                      pad_token_id=eos, rms_norm_eps=1e-6, **SHAPE)
    cfg.architectures = ["LlamaForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    tensors = weights(cfg, len(tok), eos, seed)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_TARGET / name, out / name)
    params = sum(t.numel() for t in tensors.values())
    (out / "random_target.json").write_text(json.dumps({"parameters": params, "weight_bytes": 4 * params, "seed": seed}, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/specdec-big-target"), help="folder to write (1.8 GB)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    folder = make(args.out, args.seed)
    card = json.loads((folder / "random_target.json").read_text())
    print(f"{folder}: {card['parameters'] / 1e9:.3f}B parameters, {card['weight_bytes'] / 1e9:.2f} GB float32")


if __name__ == "__main__":
    main()
