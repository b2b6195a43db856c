"""Drafting token trees with the draft model (drafter ``tree``): several continuations per block.

A chain spends its k rows on one guess per position; after the first wrong guess the rest is wasted.
A tree spends them where the draft is unsure (EAGLE-2's dynamic trees, Li et al. 2024,
https://arxiv.org/abs/2406.16858): depth by depth, each frontier node's ``BRANCH`` likeliest
children become candidates scored by the path's cumulative draft log-probability, the ``width``
best are added and expanded next (`width_for`); at the end the ``k`` best-scored nodes form the block (a node
scores below its parent, so the choice keeps every chosen node's ancestors). A confident draft
thereby goes deep; an unsure one branches.

Rules: greedy ranks by the draft's logits; the coupled rule by its processed log-probabilities plus
the request's noise at the node's position (its first child is then the draft's own coupled token,
the chain's draft); the rejection rule by processed log-probabilities. Every node is a point mass,
which each tree rule verifies exactly (core/tree_rules.py). One draft forward per depth feeds the
whole tree so far (core/tree.py masks: a node sees the committed tokens and its ancestors).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from specdec.core.coupled import processed_logprobs
from specdec.core.noise import gumbel_noise
from specdec.core.runner import Feed
from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftProposal
from specdec.core.tree import ROOT, depths
from specdec.draft.base import DraftConfig
from specdec.draft.model_drafter import ModelDrafter, ModelDraftSession

BRANCH = 3  # children considered per expanded node


def width_for(budget: int) -> int:
    """Nodes added per depth (the next frontier): about the square root of the budget, less one, so a
    small budget stays nearly a chain (at 3 nodes, branching costs depth the chain would have used)
    and a large one branches; the tree grows ``budget / width + 1`` deep at most."""
    return max(1, round(math.sqrt(budget)) - 1)


class TreeDraftSession:
    def __init__(self, session: ModelDraftSession, runner, sampling: SamplingParams) -> None:
        self._session = session  # its KV sequence holds the committed tokens' keys and values
        self._runner = runner
        self._sampling = sampling

    def propose(self, committed: Sequence[int], num_speculative_tokens: int, num_alternatives: int = 0,
                interrupt: Callable[[], bool] | None = None) -> DraftProposal:
        """A tree of at most ``num_speculative_tokens`` nodes after ``committed``."""
        t0 = time.perf_counter_ns()
        if num_speculative_tokens <= 0:
            return DraftProposal(())
        n = len(committed)
        kv = self._session.kv

        def expand(tokens: list[int], parents: list[int], added: list[int]) -> torch.Tensor:
            return self._runner.forward([Feed(kv.cache, n, list(tokens), len(added), tuple(parents))])[0]

        ids, parents = grow_tree(kv.logits_for(committed, 1)[0], n, num_speculative_tokens, self._sampling, expand, interrupt)
        return DraftProposal(ids, None, time.perf_counter_ns() - t0, parents=parents)


Expand = Callable[[list[int], list[int], list[int]], torch.Tensor]


def grow_tree(root_logits: torch.Tensor, n: int, budget: int, sampling: SamplingParams, expand: Expand,
              interrupt: Callable[[], bool] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A tree of at most ``budget`` nodes after ``n`` committed tokens (see the module's docstring):
    ``root_logits`` [vocab] propose position n; ``expand(tokens, parents, added)`` returns the
    logits [len(added), vocab] after each of the nodes ``added`` (the last ones of the tree so far)."""
    width = width_for(budget)
    max_depth = -(-budget // width) + 1
    frontier = [(ROOT, 0.0, root_logits)]  # (node, path score, its logits [vocab])
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    for depth in range(max_depth):
        candidates = []  # (score, parent, token)
        for node, score, logits in frontier:
            rank, logprobs = ranked(logits, n + depth, sampling)
            top = torch.topk(rank, min(BRANCH, rank.shape[-1])).indices
            for token, lp in zip(top.tolist(), logprobs[top].tolist()):
                if lp > float("-inf"):
                    candidates.append((score + lp, node, token))
        candidates.sort(key=lambda c: -c[0])
        added = []
        for score, parent, token in candidates[:width]:
            tokens.append(token)
            parents.append(parent)
            scores.append(score)
            added.append(len(tokens) - 1)
        if not added or depth == max_depth - 1 or (interrupt is not None and interrupt()):
            break
        rows = expand(tokens, parents, added)  # [len(added), vocab]
        frontier = [(node, scores[node], rows[j]) for j, node in enumerate(added)]
    return best_nodes(tokens, parents, scores, budget)


def ranked(logits: torch.Tensor, position: int, s: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(what candidates are ranked by, the draft's log-probabilities that score a path), [vocab] each."""
    if s.greedy:
        logprobs = torch.log_softmax(logits.float(), -1)
        return logprobs, logprobs
    logprobs = processed_logprobs(logits, s)
    if s.coupled:
        return logprobs + gumbel_noise(s.seed, (position,), logits.shape[-1], logits.device)[0], logprobs
    return logprobs, logprobs


def best_nodes(tokens: Sequence[int], parents: Sequence[int], scores: Sequence[float],
               budget: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``budget`` best-scored nodes as a block's tree (tokens, parents re-indexed; parents
    empty for a chain). A node scores below its parent, so every chosen node's ancestors are chosen."""
    node_depths = depths(parents)  # ties (a child as likely as its parent) keep the parent first
    keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], node_depths[i], i))[:budget])
    index = {old: new for new, old in enumerate(keep)}
    chosen = [(tokens[i], ROOT if parents[i] == ROOT else index[parents[i]]) for i in keep]
    ids, tree_parents = tuple(t for t, _ in chosen), tuple(p for _, p in chosen)
    if all(p == i - 1 for i, p in enumerate(tree_parents)):
        tree_parents = ()  # a chain: sent as one
    return ids, tree_parents


class TreeDrafter:
    """Trees from a `ModelDrafter`'s model (shared, not loaded again), where its runner verifies trees."""

    name = "tree"

    def __init__(self, model_drafter: ModelDrafter) -> None:
        self._drafter = model_drafter
        self.vocab_size = model_drafter.vocab_size
        self.loaded = model_drafter.loaded

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TreeDraftSession:
        return TreeDraftSession(self._drafter.open(prompt_ids, sampling), self._drafter.runner, sampling)


def derive(drafters: dict, config: DraftConfig) -> TreeDrafter | None:
    """The registry's derived factory: a tree drafter over the ``model`` drafter, if its runner takes trees."""
    model = drafters.get("model")
    if model is None or not getattr(model.runner, "verifies_trees", False):
        return None
    return TreeDrafter(model)
