"""The model runner: the narrow interface between schedulers and a model's forward.

A batch of feeds (sequence cache, start position, tokens, how many logits) goes in, each feed's
logits come out; caches are created, truncated and freed through the runner. Everything above it
(KV bookkeeping with rollback in core/kv.py, the verifier's batching, the samplers) never reaches
into the model, so another backend implements these methods and nothing else. The KV bookkeeping
(core/kv.py) imports this module, never the reverse. Three implementations: the lean Llama forward
on the CPU, which runs a whole batch in one forward; the paged runner (core/paged_runner.py), on
any device, every sequence's KV in one page pool; and the Hugging Face fallback, which runs the
feeds one after another on the model's device.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


def crop_to(cache, length: int) -> None:
    """Truncate ``cache`` to its first ``length`` positions.

    transformers 5.x ``DynamicCache.crop(n)`` takes a negative count of tokens to drop and rejects a
    positive n, so translate a target length into that.
    """
    current = cache.get_seq_length()
    if length < 0 or length > current:
        raise ValueError(f"cannot crop a cache of {current} tokens to {length}")
    if length < current:
        cache.crop(length - current)


@dataclass(frozen=True)
class Feed:
    """One sequence's part of a forward."""

    cache: object  # what the runner's new_cache() made for this sequence
    start: int  # position of token_ids[0]: the cache holds valid keys and values for [0, start)
    token_ids: Sequence[int]
    num_last: int  # logits wanted for the last num_last of token_ids
    # A token tree (core/tree.py): the last len(parents) of token_ids are its nodes, node i's parent
    # an earlier node or -1 (the row before the tree). Node i sits at its parent's position + 1 and
    # attends to the rows before the tree and its own ancestors; its keys and values go to buffer
    # position start + row like any row's, and `keep_path` moves an accepted path's into place.
    # Empty: every row is causal (a chain).
    parents: tuple[int, ...] = ()
    # The final-norm hidden states of the last num_features rows are wanted too (core/features.py):
    # the runner leaves them in `last_features`. 0: none, and nothing is computed or kept for them.
    num_features: int = 0


class ModelRunner(Protocol):
    verifies_trees: bool  # whether `forward` takes feeds with parents (else send a tree's main chain)
    # After `forward`: per feed, its features [num_features, hidden] (None where it asked for none,
    # or where this runner cannot give them); None when no feed asked.
    last_features: list[torch.Tensor | None] | None

    def new_cache(self) -> object:
        """An empty cache for one sequence."""

    def truncate(self, cache: object, length: int) -> None:
        """Forget everything past the first ``length`` positions (exact rollback)."""

    def free(self, cache: object) -> None:
        """The sequence is over: its memory may be reused."""

    def forward(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """Feed every sequence its tokens; logits ``[num_last, vocab]`` float32 per feed, in order."""

    def read_kv(self, cache: object, lo: int, hi: int) -> torch.Tensor:
        """Keys and values of positions [lo, hi): ``[layers, 2 (k, v), kv_heads, hi - lo, head_dim]``
        (the layout core/kv_blocks.py encodes), on the runner's device."""

    def write_prefix(self, cache: object, kv: torch.Tensor) -> None:
        """Adopt ``kv`` (as `read_kv` returns it) as positions [0, n) of ``cache`` (stored KV blocks)."""

    def keep_path(self, cache: object, first: int, path: Sequence[int]) -> None:
        """After a tree feed whose nodes' keys and values lie at positions ``first + node``: move the
        accepted ``path``'s to ``first, first + 1, ...`` (then truncating to ``first + len(path)``
        keeps exactly the accepted tokens', as after a chain)."""


class LeanRunner:
    """The lean Llama decoder (core/llama_decode.py) over a KV backend (core/kv_backend.py): by default
    its own CPU slabs, where one forward runs the whole batch and a cache is a slot."""
    verifies_trees = True

    def __init__(self, decoder, backend=None) -> None:
        self.decoder = decoder
        self.kv = backend if backend is not None else decoder.kv
        self.last_features = None

    def new_cache(self):
        return self.kv.new_cache()

    def truncate(self, cache, length: int) -> None:
        self.kv.truncate(cache, length)

    def free(self, cache) -> None:
        self.kv.free(cache)

    def read_kv(self, cache, lo: int, hi: int) -> torch.Tensor:
        return self.kv.read_kv(cache, lo, hi)

    def write_prefix(self, cache, kv: torch.Tensor) -> None:
        self.kv.write_prefix(cache, kv)

    def keep_path(self, cache, first: int, path: Sequence[int]) -> None:
        self.kv.keep_path(cache, first, path)

    def forward(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        out = self.decoder.forward_feeds(feeds, self.kv)
        self.last_features = self.decoder.last_features
        return out


class HFRunner:
    """The model's own Hugging Face forward and DynamicCache, one feed at a time, on the model's device
    (the reference path; no `read_kv`/`write_prefix`: its sessions keep no KV blocks; no trees)."""
    verifies_trees = False
    last_features = None  # not kept by this forward: a feature drafter gets none and drafts nothing

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # transformers renamed the forward's `past_key_values` to `cache` during 5.x (the later name
        # warns of the earlier): pass the one this version's forward names.
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def truncate(self, cache, length: int) -> None:
        crop_to(cache, length)

    def free(self, cache) -> None:
        pass

    def keep_path(self, cache, first: int, path: Sequence[int]) -> None:
        raise NotImplementedError("the transformers forward verifies chains only: send it a tree's main chain")

    @torch.inference_mode()
    def forward(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        if any(f.parents for f in feeds):
            raise ValueError("the transformers forward verifies chains only: send it a tree's main chain")
        out = []
        device = self.model.get_input_embeddings().weight.device
        for f in feeds:
            result = self.model(input_ids=torch.tensor([list(f.token_ids)], device=device), use_cache=True,
                                logits_to_keep=f.num_last, **{self.cache_arg: f.cache})
            out.append(result.logits[0].float())
        return out


def runner_for(model: torch.nn.Module, decoder=None) -> ModelRunner:
    return LeanRunner(decoder) if decoder is not None else HFRunner(model)
