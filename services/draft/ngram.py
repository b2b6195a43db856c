"""Prompt lookup / n-gram drafting: propose what followed the last occurrence of the current suffix.

Needs no model (Saxena 2023, "Prompt Lookup Decoding"; vLLM's and HF's n-gram proposers). Drafts are
deterministic given the context, hence point masses: no distribution is sent.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftProposal
from specdec.draft.base import DraftConfig


def lookup(tokens: Sequence[int], num_speculative_tokens: int, ngram_max: int, ngram_min: int) -> tuple[int, ...]:
    """Tokens that followed the most recent earlier occurrence of the longest matching suffix.

    Tries suffix lengths ngram_max down to ngram_min; the first length with a match wins.
    """
    n_tokens = len(tokens)
    if num_speculative_tokens <= 0:
        return ()
    for n in range(min(ngram_max, n_tokens - 1), ngram_min - 1, -1):
        suffix = list(tokens[n_tokens - n :])
        # Latest start first; a match must end before the suffix itself starts overlapping the end.
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                follow = tokens[start + n : start + n + num_speculative_tokens]
                return tuple(follow)
    return ()


class NgramSession:
    def __init__(self, ngram_max: int, ngram_min: int) -> None:
        self._max, self._min = ngram_max, ngram_min

    def propose(self, committed: Sequence[int], num_speculative_tokens: int, num_alternatives: int = 0,
                interrupt: Callable[[], bool] | None = None) -> DraftProposal:
        """No alternatives: a lookup has no second choice worth pre-drafting for."""
        t0 = time.perf_counter_ns()
        ids = lookup(committed, num_speculative_tokens, self._max, self._min)
        return DraftProposal(ids, None, time.perf_counter_ns() - t0)


class NgramDrafter:
    name = "ngram"
    vocab_size = 0

    def __init__(self, ngram_max: int, ngram_min: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self._max, self._min = ngram_max, ngram_min

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> NgramSession:
        return NgramSession(self._max, self._min)


def build(config: DraftConfig) -> NgramDrafter:
    """The registry's factory (specdec.draft.drafters)."""
    return NgramDrafter(config.ngram_max, config.ngram_min)
