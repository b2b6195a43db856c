"""An EAGLE-1 draft head over a Llama target's own last hidden states (Li et al. 2024,
https://arxiv.org/abs/2401.15077).

The *feature* ``f_t`` is the target's last hidden state at position ``t`` **after** its final
RMSNorm: the tensor its LM head multiplies (``model.model(...).last_hidden_state`` in Hugging Face
Llama; EAGLE's own code takes the same tensor). So the target's logits are ``lm_head(f_t)`` with no
extra op, and a head's predicted feature goes through the same frozen ``lm_head`` alone.

The head at position ``t`` reads ``concat(f_t, embed(token_{t+1}))`` (token_{t+1} is the token the
target committed after ``f_t``), projects it with ``fc`` (2·hidden → hidden) and runs one Llama
decoder layer of the target's width (its own weights, rotary positions, causal attention over the
head's earlier positions) to predict ``f̂_{t+1}``; its proposal for token ``t+2`` comes from
``lm_head(f̂_{t+1})``. Drafting further feeds ``f̂`` back in place of the true feature.

What a head file holds: ``fc`` and the decoder layer only (``head.safetensors``) plus
``config.json`` (shapes and the target's fingerprint). The embedding and the LM head are the
target's, never copied: a drafter rebuilds the head with ``EagleHead.load(folder, target)``, which
takes the target's ``embed_tokens`` and ``lm_head`` by reference (frozen) and refuses a head
trained on a different target. A drafter that needs only those two can skip the full target:
``load_target_parts(path)`` reads its config and the two tensors and stands in for it.

Tree drafting (EAGLE-2): ``forward`` takes each new row's rotary position and an attention mask, so
one call scores the nodes of a draft tree over the head's cache (``specdec.core.tree.feed_positions``
and ``feed_mask`` build both); the nodes' keys and values are appended like any rows, and ``truncate``
drops them again.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.core import llama_model

FEATURE = "post_norm"  # which hidden state a head reads: the target's final-norm output (see above)
FORMAT_VERSION = 1
WEIGHTS = "head.safetensors"
CONFIG = "config.json"
_VOLATILE_CONFIG_KEYS = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")


class TargetMismatch(ValueError):
    """The head was trained on another target (its fingerprint differs)."""


EMBEDDING_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"


class TargetParts(nn.Module):
    """The parts of a Hugging Face Llama target a head uses, without its decoder layers: its config,
    its embedding and its LM head (frozen). Stands in for the target in ``EagleHead.load``,
    ``EagleHead.from_target``, ``EagleHeadConfig.for_target`` and ``target_fingerprint``."""

    def __init__(self, config: Any, embedding: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        super().__init__()
        self.config = config
        vocab, hidden = embedding.shape
        # registered first: target_fingerprint samples the first parameter, the embedding as in the full model
        self.embed_tokens = nn.Embedding.from_pretrained(embedding, freeze=True)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, device="meta")
        self.lm_head.weight = self.embed_tokens.weight if lm_head is None else nn.Parameter(lm_head, requires_grad=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def _safetensors_file_of(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: one model.safetensors, or an index's shards."""
    single = folder / "model.safetensors"
    if single.exists():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        raise FileNotFoundError(f"{folder}: neither model.safetensors nor model.safetensors.index.json")
    weight_map = json.loads(index.read_text())["weight_map"]
    return {name: folder / shard for name, shard in weight_map.items()}


def _read_tensor(file: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name).to(dtype)


def load_target_parts(target_path: str | Path, dtype: torch.dtype = torch.float32) -> TargetParts:
    """The config, embedding and LM head of the Hugging Face Llama checkpoint in ``target_path``,
    read from its safetensors without loading the decoder layers; a tied (or absent) LM head is the
    embedding's own weight, shared."""
    from transformers import AutoConfig

    folder = Path(target_path)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    files = _safetensors_file_of(folder)
    embedding = _read_tensor(files[EMBEDDING_KEY], EMBEDDING_KEY, dtype)
    tied = getattr(config, "tie_word_embeddings", False) or LM_HEAD_KEY not in files
    lm_head = None if tied else _read_tensor(files[LM_HEAD_KEY], LM_HEAD_KEY, dtype)
    return TargetParts(config, embedding, lm_head).eval()


def target_fingerprint(target: nn.Module) -> str:
    """sha256 (hex, 32 digits) of the target's config and a sample of its first weights.

    As core/kv_blocks.py ``model_fingerprint``, except that it must not depend on the precision the
    target happens to be loaded in (a head serves a float32, float16 or bfloat16 copy alike): the
    config's dtype keys are dropped and the weight sample is rounded to bfloat16, which gives the
    same bytes for all three loads of one float16 checkpoint."""
    cfg = {k: v for k, v in target.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    first = next(target.parameters()).detach().flatten()[:4096].to(torch.bfloat16).float().cpu().contiguous()
    h.update(first.numpy().tobytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class EagleHeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    target_fingerprint: str
    feature: str = FEATURE
    format_version: int = FORMAT_VERSION

    @classmethod
    def for_target(cls, target: nn.Module) -> EagleHeadConfig:
        """The head's shapes are the target's (one of its decoder layers, its width and heads)."""
        c = target.config
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        return cls(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, rms_norm_eps=c.rms_norm_eps,
                   rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
                   vocab_size=c.vocab_size, target_fingerprint=target_fingerprint(target))


@dataclass
class HeadCache:
    """The head's own keys and values, [batch, kv_heads, positions, head_dim] each; ``truncate``
    rolls back rejected drafts."""
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Attention(nn.Module):
    def __init__(self, c: EagleHeadConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: HeadCache | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape  # x [batch, T, hidden]; cos, sin [T, head_dim]; mask [T, past + T] or None
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [b, heads, T, hd]
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        past = 0 if cache is None else cache.length
        if mask is not None:  # checked before the cache grows: a refused call leaves it as it was
            _check_mask(mask, t, past)
        if cache is not None:
            k, v = cache.append(k, v)
        if mask is not None:
            mask, causal = mask.to(x.device), False
        elif t == 1:  # one new position sees everything before it
            mask, causal = None, False
        elif past == 0:
            mask, causal = None, True
        else:  # several new positions after a cache: query i sees keys up to past + i
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
            causal = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _check_mask(mask: torch.Tensor, rows: int, past: int) -> None:
    if mask.dtype != torch.bool or mask.shape[-2:] != (rows, past + rows):
        raise ValueError(f"the mask must be bool [{rows}, {past + rows}] (new rows x cached then new keys), "
                         f"got {mask.dtype} {list(mask.shape)}")


class _MLP(nn.Module):
    def __init__(self, c: EagleHeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One Llama decoder layer (pre-norm attention and SwiGLU MLP, residuals), parameter names as
    in Hugging Face's LlamaDecoderLayer."""

    def __init__(self, c: EagleHeadConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: HeadCache | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class _TargetRefs:
    """The target's frozen modules the head uses; a plain record so that they are not the head's
    submodules (not in its state_dict, its parameters or its file)."""
    embed_tokens: nn.Module
    lm_head: nn.Module


class EagleHead(nn.Module):
    def __init__(self, config: EagleHeadConfig, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(config)
        self.target = _TargetRefs(embed_tokens, lm_head)
        self.register_buffer("inv_freq", llama_model.inv_freq(config.rope_theta, config.head_dim), persistent=False)

    @classmethod
    def from_target(cls, target: nn.Module) -> EagleHead:
        """A freshly initialised head (the caller seeds torch) for a Hugging Face Llama target."""
        return cls(EagleHeadConfig.for_target(target), target.get_input_embeddings(), target.get_output_embeddings())

    def _rotary(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary_at(torch.arange(start, start + length))

    def _rotary_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions.to(device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.float())  # rotary angles in fp32 whatever the head's dtype
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        dtype = self.fc.weight.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, start: int = 0,
                cache: HeadCache | None = None, *, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted features: ``features`` [batch, T, hidden] are f_t for positions start..start+T-1,
        ``next_tokens`` [batch, T] the token after each (token_{t+1}); returns f̂_{t+1} [batch, T, hidden].

        For a tree: ``positions`` (int64 [T]) replaces each row's rotary position, and ``mask`` (bool
        [T, past + T], True = may attend; past = ``cache.length`` before the call) says which of the
        cached keys followed by the new rows' keys each row attends to, in place of causal attention.
        The new rows are appended to ``cache`` all the same."""
        emb = self.target.embed_tokens(next_tokens).to(features.dtype)  # [batch, T, hidden]
        x = self.fc(torch.cat([features, emb], dim=-1))
        if positions is None:
            cos, sin = self._rotary(start, features.shape[1])
        elif positions.shape != (features.shape[1],):
            raise ValueError(f"positions must be [{features.shape[1]}] (one per new row), got {list(positions.shape)}")
        else:
            cos, sin = self._rotary_at(positions)
        return self.layer(x, cos, sin, cache, mask)

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """The target's LM head on predicted features (post-norm features: no norm in between)."""
        return self.target.lm_head(predicted)  # [..., vocab]

    @torch.no_grad()
    def draft(self, feature: torch.Tensor, token: torch.Tensor, position: int,
              cache: HeadCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One greedy draft step. ``feature`` [batch, hidden] is f_position (the target's, or the head's
        own prediction when chaining), ``token`` [batch] the token after it; ``cache`` holds the head's
        keys and values of positions < ``position``. Returns the proposed next token [batch], its
        predicted feature f̂_{position+1} [batch, hidden] (feed it back to chain) and the logits
        [batch, vocab]."""
        if cache.length != position:
            raise ValueError(f"the head's cache holds {cache.length} positions, drafting at {position}")
        predicted = self(feature[:, None], token[:, None], start=position, cache=cache)[:, 0]
        logits = self.logits(predicted)
        return logits.argmax(-1), predicted, logits

    def save(self, folder: str | Path, dtype: torch.dtype = torch.float16, extra: dict | None = None) -> Path:
        """``fc`` and the decoder layer in ``dtype`` (safetensors) and config.json (plus ``extra``)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, folder / WEIGHTS, metadata={"format": "pt", "target_fingerprint": self.config.target_fingerprint})
        meta = {"architecture": "EagleHead", **asdict(self.config), "weights_dtype": str(dtype).removeprefix("torch.")}
        (folder / CONFIG).write_text(json.dumps({**meta, **(extra or {})}, indent=2) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path, target: nn.Module, dtype: torch.dtype = torch.float32) -> EagleHead:
        """The head in ``folder`` over ``target``'s own embedding and LM head; TargetMismatch if the head
        was trained on another target."""
        from safetensors.torch import load_file

        folder = Path(folder)
        meta = json.loads((folder / CONFIG).read_text())
        if meta.get("format_version") != FORMAT_VERSION or meta.get("feature") != FEATURE:
            raise ValueError(f"{folder}: head format {meta.get('format_version')}/{meta.get('feature')}, "
                             f"this code reads {FORMAT_VERSION}/{FEATURE}")
        fields = EagleHeadConfig.__dataclass_fields__
        config = EagleHeadConfig(**{k: v for k, v in meta.items() if k in fields})
        have = target_fingerprint(target)
        if config.target_fingerprint != have:
            raise TargetMismatch(f"{folder}: head trained on target {config.target_fingerprint}, this target is {have}")
        head = cls(config, target.get_input_embeddings(), target.get_output_embeddings())
        head.load_state_dict({k: v.to(dtype) for k, v in load_file(folder / WEIGHTS).items()})
        return head.to(dtype)
