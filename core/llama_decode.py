"""A lean decode path for Hugging Face Llama checkpoints: same weights, same math, far fewer ops.

On small models the per-call overhead of ``LlamaForCausalLM.forward`` (masks, cache objects, output
records) dwarfs the arithmetic (FINDINGS.md: a 2-layer draft step is ~0.8 ms in HF, ~0.5 ms
hand-written; here more). This is the gpt-fast style forward: fused QKV and gate/up weights,
a preallocated KV buffer per sequence, rotary tables computed once. It serves drafting, where speed
matters and exactness does not (any draft keeps the output lossless); the verifier keeps the
reference HF forward. Supported: ``LlamaForCausalLM`` with default RoPE, no attention/MLP bias, SiLU.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def supports(model: torch.nn.Module) -> bool:
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
    return (
        type(model).__name__ == "LlamaForCausalLM"
        and rope.get("rope_type", "default") == "default"
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and cfg.hidden_act == "silu"
    )


class LlamaDecoder:
    """Weights shared by every sequence of one model."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a plain Llama; use the HF forward")
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.context_length = cfg.max_position_embeddings
        base = model.model
        with torch.no_grad():
            self.embed = base.embed_tokens.weight.detach().float()
            self.lm_head = model.lm_head.weight.detach().float()
            self.final_norm = base.norm.weight.detach().float()
            self.layers = []
            for layer in base.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append((
                    layer.input_layernorm.weight.detach().float(),
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().float(),  # [(h+2kv)*d, hidden]
                    a.o_proj.weight.detach().float(),
                    layer.post_attention_layernorm.weight.detach().float(),
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().float(),  # [2*inter, hidden]
                    m.down_proj.weight.detach().float(),
                ))
            theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
            freqs = torch.outer(torch.arange(self.context_length, dtype=torch.float32), inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)  # [context, head_dim]
            self.cos, self.sin = emb.cos(), emb.sin()

    def new_cache(self) -> torch.Tensor:
        # [layers, 2 (k, v), kv_heads, context, head_dim]
        return torch.zeros(len(self.layers), 2, self.n_kv, self.context_length, self.head_dim)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    @torch.inference_mode()
    def forward(self, cache: torch.Tensor, token_ids: list[int], start: int) -> torch.Tensor:
        """Feed ``token_ids`` at positions start.. into ``cache``; logits [len(token_ids), vocab]."""
        n = len(token_ids)
        end = start + n
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        x = self.embed[torch.tensor(token_ids)]  # [n, hidden]
        cos, sin = self.cos[start:end], self.sin[start:end]  # [n, d]
        # Causal mask only when several tokens arrive at once (prefill / multi-token feed).
        mask = None
        if n > 1:
            mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)  # [n, end]
        scale = 1.0 / math.sqrt(d)
        for i, (ln1, wqkv, wo, ln2, wgu, wdown) in enumerate(self.layers):
            qkv = F.linear(self._norm(x, ln1), wqkv)  # [n, (h + 2kv) * d]
            q = qkv[:, : h * d].view(n, h, d).transpose(0, 1)  # [h, n, d]
            k = qkv[:, h * d : (h + kv) * d].view(n, kv, d).transpose(0, 1)  # [kv, n, d]
            v = qkv[:, (h + kv) * d :].view(n, kv, d).transpose(0, 1)  # [kv, n, d]
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            cache[i, 0, :, start:end] = k
            cache[i, 1, :, start:end] = v
            keys, values = cache[i, 0, :, :end], cache[i, 1, :, :end]  # [kv, end, d]
            if kv != h:
                keys = keys.repeat_interleave(h // kv, dim=0)
                values = values.repeat_interleave(h // kv, dim=0)
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)  # [h, n, d]
            x = x + F.linear(att.transpose(0, 1).reshape(n, h * d), wo)
            gate, up = F.linear(self._norm(x, ln2), wgu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, wdown)
        return F.linear(self._norm(x, self.final_norm), self.lm_head)  # [n, vocab]
