"""KV-cache bookkeeping for one sequence of a Hugging Face causal LM, with exact rollback.

``KVSequence.logits_for(token_ids, num_last)`` is the only entry point: it keeps the longest cached
prefix of ``token_ids``, crops everything after it (a rejected branch leaves no trace:
docs/guarantees.md, "Exact rollback"), feeds the rest in one forward pass and returns the logits of
the last ``num_last`` positions.
Drafter and verifier both use it, so rollback is implemented once.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

# The bookkeeping drives the runner interface, which never imports back.
from specdec.core.runner import Feed, ModelRunner, runner_for
from specdec.core.steps import common_prefix_len


def shared_prefixes(prompts: Sequence[Sequence[int]], min_shared: int,
                    eligible: Sequence[bool] | None = None) -> list[tuple[int, int] | None]:
    """For prompts prefilled together: which can copy another's keys and values instead of computing them.

    Per prompt, None (compute it in full: a *leader*) or (index of an earlier leader, shared): its
    first ``shared`` tokens are that leader's, ``min_shared <= shared <= len - 1`` (its last token is
    still fed, so the prefill gives its logits). The longest shared start wins. Only ``eligible``
    prompts (default: all) copy or are copied from. Candidates are found by their first
    ``min_shared`` tokens, so a batch of distinct prompts costs one dict lookup each.
    """
    out: list[tuple[int, int] | None] = []
    by_start: dict[tuple[int, ...], list[int]] = {}  # a leader's first min_shared tokens -> leaders
    for i, prompt in enumerate(prompts):
        ok = eligible is None or eligible[i]
        start = tuple(prompt[:min_shared])
        best, shared = None, 0
        if ok and len(start) == min_shared:
            for j in by_start.get(start, ()):
                other = prompts[j]
                n = len(prompt) if list(other) == list(prompt) else common_prefix_len(other, prompt)
                if n > shared:
                    best, shared = j, n
        shared = min(shared, len(prompt) - 1)
        if best is not None and shared >= min_shared:
            out.append((best, shared))
            continue
        out.append(None)
        if ok and len(start) == min_shared:
            by_start.setdefault(start, []).append(i)
    return out


class KVSequence:
    """One sequence's KV cache and the token ids it covers, through a model runner (core/runner.py).

    With a ``LlamaDecoder`` (specdec.core.llama_decode) the cache is a slot of its pool (core/kv_slots.py) and a
    crop is just a shorter valid length; otherwise it is the model's own HF ``DynamicCache``.
    """

    def __init__(self, model: torch.nn.Module, decoder=None, runner: ModelRunner | None = None) -> None:
        """``runner``: the engine's shared runner (sequences batch together only through one runner)."""
        self._decoder = decoder
        self.runner = runner or runner_for(model, decoder)
        self._cache = self.runner.new_cache()
        self._cached_ids: list[int] = []  # token ids whose keys/values are in the cache

    @property
    def cached_len(self) -> int:
        return len(self._cached_ids)

    @property
    def cached_ids(self) -> Sequence[int]:
        """The token ids whose keys and values are cached (read-only by convention)."""
        return self._cached_ids

    @property
    def decoder(self):
        return self._decoder

    @property
    def cache(self):
        """The runner's cache for this sequence (positions past `cached_len` are scratch, e.g. a draft tree's)."""
        return self._cache

    @property
    def decode_cache(self):
        """The lean decoder's cache buffer (specdec.core.llama_decode.DecodeCache), or None on the HF forward."""
        return self._cache if self._decoder is not None else None

    def load_prefix(self, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Adopt keys and values computed elsewhere for ``token_ids`` ([layers, 2, kv_heads, n, head_dim],
        n = len(token_ids)): a resumed session skips recomputing them. The lean forward only."""
        if self._decoder is None:
            raise ValueError("loading a KV prefix needs the lean forward's cache")
        if kv.shape[3] != len(token_ids):
            raise ValueError(f"{kv.shape[3]} positions of keys and values for {len(token_ids)} tokens")
        self._decoder.write_prefix(self._cache, kv)
        self._cached_ids = list(token_ids)

    def plan(self, token_ids: Sequence[int], num_last: int) -> Feed:
        """The feed that brings the cache to ``token_ids``: keep the longest cached prefix (but feed at
        least ``num_last`` tokens), crop the rest. Run it with `commit` after the runner's forward."""
        if not 1 <= num_last <= len(token_ids):
            raise ValueError(f"num_last must be in [1, {len(token_ids)}], got {num_last}")
        cached = self._cached_ids
        # The usual case (the cache is a prefix of the request) is one C-speed slice comparison.
        prefix = len(cached) if list(token_ids[: len(cached)]) == cached else common_prefix_len(cached, token_ids)
        keep = min(prefix, len(token_ids) - num_last)
        if keep < len(cached):
            self.runner.truncate(self._cache, keep)
            del cached[keep:]
        return Feed(self._cache, keep, list(token_ids[keep:]), num_last)

    def commit(self, feed: Feed) -> None:
        """The feed ran: its tokens are cached now."""
        self._cached_ids.extend(feed.token_ids)

    @torch.inference_mode()
    def logits_for(self, token_ids: Sequence[int], num_last: int) -> torch.Tensor:
        """Logits predicting the token after each of the last ``num_last`` of ``token_ids``: [num_last, vocab]."""
        return logits_for_batch([(self, token_ids, num_last)])[0]


@torch.inference_mode()
def logits_for_batch(requests: Sequence[tuple[KVSequence, Sequence[int], int]]) -> list[torch.Tensor]:
    """`KVSequence.logits_for` for many sequences of one model in one runner forward.

    Each request is (sequence, its token ids, num_last); each gets ``[num_last, vocab]``."""
    if not requests:
        return []
    runner = requests[0][0].runner
    if any(kv.runner is not runner for kv, _, _ in requests[1:]):
        raise ValueError("a batch's sequences must share one model runner")
    if len({id(kv) for kv, _, _ in requests}) != len(requests):
        raise ValueError("a sequence may appear once per batch")
    feeds = [kv.plan(ids, num_last) for kv, ids, num_last in requests]
    logits = runner.forward(feeds)
    for (kv, _, _), feed in zip(requests, feeds):
        kv.commit(feed)
    return logits
