"""The EAGLE head's inference path for drafting: the math of core/eagle_head.py's modules, with the
projections fused (q, k and v in one GEMM, gate and up in another), each weight transposed once for
``torch.mm``, q and k rotated as the target's model rotates them (core/llama_model.py: rotary pairs
adjacent, angles from a table) and keys and values in a preallocated buffer that a truncation rolls
back. A draft token then costs a handful of kernels instead of a module tree's
dozens of calls (docs/performance.md, 12.2). The module stays what training runs and what the
file holds; this is built from it (`FastHead(head)`) and gives the same numbers
(`tests/test_eagle_drafter.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.core import llama_model
from specdec.core.eagle_head import EagleHead


class FastCache:
    """The head's keys and values [kv_heads, capacity, head_dim]; ``length`` positions are valid."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int = 256) -> None:
        self.keys = torch.empty(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def reserve(self, length: int) -> None:
        capacity = self.keys.shape[1]
        if length > capacity:
            grown = max(length, 2 * capacity)
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], grown, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class FastHead:
    def __init__(self, head: EagleHead, draft_vocab: torch.Tensor | None = None) -> None:
        """``draft_vocab``: token ids the head may propose (scripts/draft_vocab.py); its LM head then
        reads only their rows, and every other token gets logit -inf. None: the whole vocabulary."""
        c = head.config
        attn, mlp = head.layer.self_attn, head.layer.mlp
        self.heads, self.kv_heads, self.head_dim, self.hidden = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
        self.eps = c.rms_norm_eps
        with torch.no_grad():
            self.fc_t = head.fc.weight.t().contiguous()  # [2 hidden, hidden]
            self.fc_b = head.fc.bias.detach().clone()
            self.ln1 = head.layer.input_layernorm.weight.detach().clone()
            self.ln2 = head.layer.post_attention_layernorm.weight.detach().clone()
            detach = torch.Tensor.detach
            self.qkv_t = llama_model.fused_qkv(attn, self.heads, self.kv_heads, self.head_dim, detach)[0].t().contiguous()
            self.o_t = attn.o_proj.weight.t().contiguous()
            self.gate_up_t = llama_model.fused_gate_up(mlp, detach)[0].t().contiguous()
            self.down_t = mlp.down_proj.weight.t().contiguous()
        self.embed = head.target.embed_tokens.weight  # the target's, by reference
        self.vocab_size = head.config.vocab_size
        self.draft_vocab = draft_vocab
        # the rows scored per draft token: a copy of the draft vocabulary's, else the target's own by reference
        self.lm_head = head.target.lm_head.weight if draft_vocab is None else head.target.lm_head.weight[draft_vocab].detach().clone()
        self.inv_freq = head.inv_freq.float()
        self.dtype, self.device = self.fc_t.dtype, self.fc_t.device
        self._turns = llama_model.rotations(self.inv_freq.to(self.device), 0)  # [positions, 1, d/2], grown on use

    def new_cache(self) -> FastCache:
        return FastCache(self.kv_heads, self.head_dim, self.dtype, self.device)

    def _rotary(self, positions: torch.Tensor) -> torch.Tensor:
        """Each row's rotation [T, 1, d/2]; the table grows in doublings."""
        need = int(positions.max()) + 1
        if need > self._turns.shape[0]:
            self._turns = llama_model.rotations(self.inv_freq.to(self.device), max(need, 2 * self._turns.shape[0], 256))
        return self._turns[positions]

    @torch.inference_mode()
    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: FastCache,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted features [T, hidden] for rows (f_p, token p + 1): ``features`` [T, hidden],
        ``tokens`` [T], rotary ``positions`` [T]; the rows' keys and values go to the cache after its
        valid ones. ``mask`` [T, past + T] (True: may attend); None: causal."""
        t, past = features.shape[0], cache.length
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        emb = self.embed[tokens].to(self.dtype)
        x = torch.addmm(self.fc_b, torch.cat([features.to(self.dtype), emb], dim=-1), self.fc_t)  # [T, hidden]
        qkv = F.rms_norm(x, (self.hidden,), self.ln1, self.eps) @ self.qkv_t  # [T, (h + 2kv) d]
        qk = llama_model.rotate(qkv[:, : (h + kv) * d], self._rotary(positions), h + kv, d)  # [T, h + kv, d]
        q, k = qk[:, :h], qk[:, h:]
        cache.reserve(past + t)
        cache.keys[:, past : past + t] = k.transpose(0, 1)
        cache.values[:, past : past + t] = qkv[:, (h + kv) * d :].view(t, kv, d).transpose(0, 1)
        cache.length = past + t
        keys, values = cache.keys[:, : past + t], cache.values[:, : past + t]
        if mask is None and t > 1:
            mask = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(past)
        att = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                             enable_gqa=kv != h)  # [1, h, T, d]
        x = x + att[0].transpose(0, 1).reshape(t, h * d) @ self.o_t
        gate, up = (F.rms_norm(x, (self.hidden,), self.ln2, self.eps) @ self.gate_up_t).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.down_t

    @torch.inference_mode()
    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """The target's LM head on predicted features [T, hidden]: [T, vocab] float32."""
        scores = F.linear(predicted, self.lm_head).float()
        if self.draft_vocab is None:
            return scores
        full = scores.new_full((scores.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_vocab] = scores
        return full
