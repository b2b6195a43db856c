"""Drafting from the target's own guesses: Jacobi decoding (drafter ``jacobi``) and lookahead
decoding (drafter ``lookahead``; Fu et al. 2024, https://arxiv.org/abs/2402.02057). No draft model.

The verifier tells these drafters, with each outcome, its likeliest token after every draft of the
block it verified (`StepOutcome.row_argmax`, core/features.py). Past the accepted prefix those rows
were conditioned on wrong drafts, yet they are the target's next guesses for the positions after
them: the next *Jacobi iterate*. Row i of a block verified at ``base`` predicts position
``base + i + 1``; after ``a`` accepted drafts and one token of the target's, the committed sequence
reaches ``base + a + 1``, so rows ``a ..`` are the new guesses for the positions from there on.

- ``jacobi`` proposes its window of guesses as a chain (padded with prompt lookup, then the last
  token), every step one Jacobi iteration on the positions ahead.
- ``lookahead`` keeps an n-gram pool, filled from the committed tokens (the prompt included) and
  from the Jacobi trajectories (``N - 1`` window tokens followed by the target's guess after them).
  Each block is one token tree: the *verification branch*, up to ``G`` pooled n-grams that follow
  the last committed token, and the *lookahead branch*, as much of the Jacobi window of ``W``
  guesses as the node budget leaves, merged as a trie (siblings distinct). One target forward verifies every candidate and iterates the window.

Every draft is a point mass, which every rule verifies exactly: these drafters change speed, never output.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftProposal, SessionSpec
from specdec.core.tree import ROOT
from specdec.draft.base import DraftConfig
from specdec.draft.ngram import lookup



def next_window(rows: Sequence[int], accepted: int) -> list[int]:
    """The guesses for the positions after the committed sequence: a chain block's rows past its
    accepted prefix (row i predicts position base + i + 1; the sequence now reaches base + accepted + 1)."""
    return list(rows[accepted:])


class JacobiSession:
    def __init__(self) -> None:
        self._window: list[int] = []  # guesses for positions base ..
        self._base = -1

    def add_row_tokens(self, base: int, committed: Sequence[int], ids: Sequence[int], parents: Sequence[int],
                       rows: Sequence[int]) -> None:
        if parents or not committed:
            return  # (a chain drafter's blocks are chains)
        accepted = len(committed) - 1
        self._window, self._base = next_window(rows, accepted), base + accepted + 1

    def propose(self, committed: Sequence[int], num_speculative_tokens: int, num_alternatives: int = 0,
                interrupt: Callable[[], bool] | None = None) -> DraftProposal:
        t0 = time.perf_counter_ns()
        guesses = guesses_after(committed, self._window, self._base)[:num_speculative_tokens]
        return DraftProposal(tuple(pad(committed, guesses, num_speculative_tokens)), None, time.perf_counter_ns() - t0)


def guesses_after(committed: Sequence[int], window: Sequence[int], base: int) -> list[int]:
    """The window's guesses for the positions after ``committed``: all of them when it starts there, the
    rest when ``committed`` ends in its first guesses (a pre-draft assumed them), else none."""
    n = len(committed)
    if base < 0 or n < base or n - base > len(window):
        return []
    if list(committed[base:]) != list(window[: n - base]):
        return []
    return list(window[n - base:])


def pad(committed: Sequence[int], guesses: list[int], length: int) -> list[int]:
    """``guesses`` made ``length`` long: what followed the suffix earlier in the sequence (prompt
    lookup), then the last token again (Jacobi's initial guess needs only to be some token)."""
    if len(guesses) < length:
        seq = list(committed) + guesses
        guesses = guesses + list(lookup(seq, length - len(guesses), 3, 1))
    while len(guesses) < length:
        guesses.append(guesses[-1] if guesses else committed[-1])
    return guesses


class NgramPool:
    """Continuations of ``n - 1`` tokens keyed by the token before them, the ``per_key`` newest kept."""

    def __init__(self, n: int, per_key: int) -> None:
        self.n, self.per_key = n, per_key
        self._pool: dict[int, collections.OrderedDict] = {}

    def add(self, key: int, continuation: Sequence[int]) -> None:
        if len(continuation) != self.n - 1:
            return
        entries = self._pool.setdefault(key, collections.OrderedDict())
        entries.pop(tuple(continuation), None)
        entries[tuple(continuation)] = None  # newest last
        while len(entries) > self.per_key:
            entries.popitem(last=False)

    def add_sequence(self, tokens: Sequence[int], start: int = 0) -> None:
        """Every n-gram of ``tokens`` that ends at or after ``start``."""
        for i in range(max(0, start - self.n + 1), len(tokens) - self.n + 1):
            self.add(tokens[i], tokens[i + 1 : i + self.n])

    def after(self, key: int) -> list[tuple[int, ...]]:
        return list(reversed(self._pool.get(key, {})))  # newest first


class LookaheadSession:
    def __init__(self, window: int, ngram: int, candidates: int) -> None:
        self.W, self.N, self.G = window, ngram, candidates
        self.pool = NgramPool(ngram, candidates)
        self._indexed = 0  # committed tokens whose n-grams are in the pool
        self._window: list[int] = []
        self._base = -1
        self._proposed: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[int]] = {}  # block -> its window's nodes

    def add_row_tokens(self, base: int, committed: Sequence[int], ids: Sequence[int], parents: Sequence[int],
                       rows: Sequence[int]) -> None:
        nodes = self._proposed.pop((base, tuple(ids), tuple(parents)), None)
        if nodes is None or not committed:
            return  # not a block of ours (or nothing committed): the window is not iterated this step
        window = [ids[j] for j in nodes]
        guesses = [rows[j] for j in nodes]  # the target's guess after each window token
        for j in range(self.N - 2, len(window)):  # trajectories: N - 1 window tokens, then the target's guess
            gram = window[j - self.N + 2 : j + 1] + [guesses[j]]
            self.pool.add(gram[0], gram[1:])
        accepted = len(committed) - 1
        self._window, self._base = next_window(guesses, accepted), base + accepted + 1

    def propose(self, committed: Sequence[int], num_speculative_tokens: int, num_alternatives: int = 0,
                interrupt: Callable[[], bool] | None = None) -> DraftProposal:
        t0 = time.perf_counter_ns()
        budget = num_speculative_tokens
        if budget <= 0:
            return DraftProposal(())
        n = len(committed)
        self.pool.add_sequence(committed, self._indexed)
        self._indexed = max(self._indexed, n)
        window = pad(committed, guesses_after(committed, self._window, self._base)[: self.W], min(self.W, budget))
        trie = _Trie()
        for candidate in self.pool.after(committed[-1])[: self.G]:  # the verification branch first: it is what gets accepted
            if trie.add(candidate, budget) is None:
                break
        window_nodes = None  # the lookahead branch: as much of the window as the budget leaves
        for size in range(len(window), 0, -1):
            if (window_nodes := trie.add(window[:size], budget)) is not None:
                window = window[:size]
                break
        ids, parents = tuple(trie.tokens), tuple(trie.parents)
        if all(p == i - 1 for i, p in enumerate(parents)):
            parents = ()  # a chain: sent as one (and verified as one)
        if window_nodes:
            self._proposed[(n, ids, parents)] = window_nodes
            while len(self._proposed) > 16:  # blocks never verified (pre-drafts not taken) are forgotten
                self._proposed.pop(next(iter(self._proposed)))
        return DraftProposal(ids, None, time.perf_counter_ns() - t0, parents=parents)


class _Trie:
    """Token paths merged on common prefixes (siblings distinct), nodes in insertion order (parents first)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._children: dict[tuple[int, int], int] = {}

    def add(self, path: Sequence[int], budget: int) -> list[int] | None:
        """The path's node indices; None (nothing added) when it would take more than ``budget`` nodes."""
        parent, known = ROOT, 0  # the path's leading nodes already in the trie
        for token in path:
            node = self._children.get((parent, token))
            if node is None:
                break
            parent, known = node, known + 1
        if len(self.tokens) + len(path) - known > budget:
            return None
        parent, out = ROOT, []
        for token in path:
            node = self._children.get((parent, token))
            if node is None:
                node = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(parent)
                self._children[(parent, token)] = node
            out.append(node)
            parent = node
        return out


class JacobiDrafter:
    name = "jacobi"
    vocab_size = 0

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> JacobiSession:
        return JacobiSession()


class LookaheadDrafter:
    name = "lookahead"
    vocab_size = 0

    def __init__(self, window: int, ngram: int, candidates: int) -> None:
        if window < 1 or ngram < 2 or candidates < 0:
            raise ValueError(f"lookahead needs W >= 1, N >= 2, G >= 0; got {window}, {ngram}, {candidates}")
        self.window, self.ngram, self.candidates = window, ngram, candidates

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> LookaheadSession:
        return LookaheadSession(self.window, self.ngram, self.candidates)

    def open_for(self, spec: SessionSpec) -> LookaheadSession:
        """The request's W, N and G where it set them, the deployment's elsewhere."""
        p = spec.lookahead
        return LookaheadSession(p.window or self.window, p.ngram or self.ngram, p.candidates or self.candidates)


def build_jacobi(config: DraftConfig) -> JacobiDrafter:
    return JacobiDrafter()


def build_lookahead(config: DraftConfig) -> LookaheadDrafter:
    return LookaheadDrafter(config.lookahead_window, config.lookahead_ngram, config.lookahead_candidates)
