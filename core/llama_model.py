"""The Llama-family math, written once: weights in the layout they run with, rotary, and the layer loop.

Both runners hold a model this way (core/llama_decode.py: the CPU's lean forward over slot caches;
core/paged_runner.py: any device over a page pool); only where keys live and how attention reads
them differs, and that is the ``attend`` callback a runner gives `run_layers`. How a linear, a norm
or SwiGLU is computed (oneDNN, specdec's C kernels, Triton, fixed tiles) is a runner's strategy,
chosen once at load; the order of operations here is the same for all of them.

Layout at load:
- q, k and v stacked into one [(h + 2kv) * d, hidden] weight, gate and up into one [2 * inter, hidden];
- each head's q and k rows (and biases) reordered so a rotary pair is adjacent: rotary is then one
  complex multiply per pair, and q.k is unchanged because q and k get the same permutation.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

Cast = Callable[[torch.Tensor], torch.Tensor]


def pairs_adjacent(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Each head's rows (or bias entries) of ``w`` from HF's (x_0..x_{d/2-1}, y_0..) order to (x_0, y_0, x_1, ..)."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten().to(w.device)  # [d]
    return w.reshape(heads, head_dim, -1)[:, order].reshape(w.shape)


def fused_qkv(attn: torch.nn.Module, heads: int, kv_heads: int, head_dim: int,
              cast: Cast) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k and v of ``attn`` stacked, rotary pairs adjacent, each weight ``cast`` first (a reordering
    and a cast commute): ([(h + 2kv) * d, hidden], bias [(h + 2kv) * d] or None where none has one)."""
    weight = torch.cat([pairs_adjacent(cast(attn.q_proj.weight), heads, head_dim),
                        pairs_adjacent(cast(attn.k_proj.weight), kv_heads, head_dim),
                        cast(attn.v_proj.weight)])
    biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    if all(b is None for b in biases):
        return weight, None
    q_b, k_b, v_b = (cast(b) if b is not None else weight.new_zeros(n * head_dim)
                     for b, n in zip(biases, (heads, kv_heads, kv_heads)))
    return weight, torch.cat([pairs_adjacent(q_b, heads, head_dim), pairs_adjacent(k_b, kv_heads, head_dim), v_b])


def fused_gate_up(mlp: torch.nn.Module, cast: Cast) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gate and up stacked: ([2 * inter, hidden], bias or None)."""
    weight = torch.cat([cast(mlp.gate_proj.weight), cast(mlp.up_proj.weight)])
    if mlp.gate_proj.bias is None:
        return weight, None
    return weight, torch.cat([cast(mlp.gate_proj.bias), cast(mlp.up_proj.bias)])


def inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """Default rotary frequencies [d/2] float32, as transformers computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rotations(freqs: torch.Tensor, context: int, scale: float = 1.0) -> torch.Tensor:
    """Positions 0..context-1 turned by ``freqs`` [d/2]: [context, 1, d/2] complex64 of magnitude ``scale``."""
    angles = torch.outer(torch.arange(context, dtype=torch.float32, device=freqs.device), freqs.float())  # [context, d/2]
    return torch.polar(torch.full_like(angles, scale), angles)[:, None, :]


def rotary_table(model: torch.nn.Module, head_dim: int, context: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Each position's rotation of an adjacent pair: [context, 1, d/2] complex64. Default rotary from
    the config's theta in float32 (whatever dtype the model's buffers were cast to); a scaled one
    (llama3, yarn, linear) from the model's own rotary module, its frequencies and attention scaling."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        return rotations(inv_freq(theta, head_dim).to(device), context)
    rotary_emb = model.model.rotary_emb
    return rotations(rotary_emb.inv_freq.detach().to(device), context, float(getattr(rotary_emb, "attention_scaling", 1.0)))


def rotate(qk: torch.Tensor, rotary: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """q and k rows ``qk`` [n, heads * d] (pairs adjacent) turned by ``rotary`` [n, 1, d/2], in float32:
    [n, heads, d] in ``qk``'s dtype."""
    n = qk.shape[0]
    pairs = torch.view_as_complex(qk.float().reshape(n, heads, head_dim // 2, 2))  # [n, heads, d/2]
    return torch.view_as_real(pairs * rotary).reshape(n, heads, head_dim).to(qk.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of rows [gate | up] [n, 2 * intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


Linear = Callable[[torch.Tensor], torch.Tensor]
Layer = tuple[torch.Tensor, Linear, Linear, torch.Tensor, Linear, Linear]  # (ln1, qkv, o, ln2, gate_up, down)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LayerMath(Protocol):
    """What `run_layers` needs of a runner: its shape, its layers and its strategy for each op, chosen
    at load: ``norm(x, weight)``, ``rotate(qk, rotary)`` and ``swiglu(gate_up)``."""

    n_heads: int
    n_kv: int
    head_dim: int
    layers: Sequence[Layer]
    norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    swiglu: Callable[[torch.Tensor], torch.Tensor]


def run_layers(model: LayerMath, x: torch.Tensor, rotary: torch.Tensor, attend: Attend,
               only: Sequence[int] | None = None) -> torch.Tensor:
    """The decoder layers over the flat rows ``x`` [n, hidden] at ``rotary`` [n, 1, d/2].
    ``attend(layer, q [n, h, d], k [n, kv, d], v [n, kv, d])`` stores the new keys and values wherever
    the runner keeps them and returns attention [n, h * d]. ``only``: these layers alone (layer skip)."""
    n = x.shape[0]
    h, kv, d = model.n_heads, model.n_kv, model.head_dim
    norm, rotate, swiglu, layers = model.norm, model.rotate, model.swiglu, model.layers
    for i in (range(len(layers)) if only is None else only):
        ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj = layers[i]
        qkv = qkv_proj(norm(x, ln1))  # [n, (h + 2kv) * d]
        qk = rotate(qkv[:, : (h + kv) * d], rotary)  # rotated q and k [n, h + kv, d]
        x = x + o_proj(attend(i, qk[:, :h], qk[:, h:], qkv[:, (h + kv) * d:].view(n, kv, d)))
        x = x + down_proj(swiglu(gate_up_proj(norm(x, ln2))))
    return x


def final_features(x: torch.Tensor, offsets: Sequence[int], num_features: Sequence[int] | None,
                   final_norm: torch.Tensor, eps: float) -> list[torch.Tensor | None] | None:
    """Each sequence's last ``num_features[b]`` rows of the flat batch ``x`` [N, hidden] after the
    final norm, or None where none are wanted; None when no sequence wants any (nothing computed)."""
    if not num_features or not any(num_features):
        return None
    return [rms_norm(x[offsets[b + 1] - m: offsets[b + 1]], final_norm, eps) if m else None
            for b, m in enumerate(num_features)]


class Model(LayerMath, Protocol):
    """What `forward` reads of a model beyond its layers: embeddings, the final norm and the head."""

    final_norm: torch.Tensor
    eps: float
    rotary: torch.Tensor  # [context, 1, d/2] complex64
    lm_head: Linear

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[n, hidden] in the activations' dtype."""


def forward(model: Model, backend, plan, num_features: Sequence[int] | None = None
            ) -> tuple[torch.Tensor, list[torch.Tensor | None] | None]:
    """The whole model over one planned batch (core/kv_backend.py): logits of the plan's ``last``
    rows [rows, vocab] float32, and each feed's final-norm features where ``num_features`` asks."""
    x = model.embed_rows(plan.token_ids)  # [N, hidden]
    x = backend.run_layers(model, x, model.rotary[plan.positions], plan)
    wanted = num_features is not None and any(num_features)  # (a CUDA graph's static batch has no offsets: it never asks)
    features = final_features(x, plan.offsets, num_features, model.final_norm, model.eps) if wanted else None
    return model.lm_head(model.norm(x[plan.last], model.final_norm)).float(), features
