"""Token trees: a draft block that proposes several continuations at once (SpecInfer, Sequoia, EAGLE-2).

A tree of n nodes is two tuples: ``token_ids[i]`` is node i's token and ``parents[i]`` its parent,
-1 for a child of the root (the last committed token); parents come before their children. A chain
is the tree whose node i has parent i - 1, so every chain block is a tree. Words:

* **depth** of node i: how many nodes lie on its path from the root, itself excluded; node i's token
  sits at position ``n + depth(i)`` for a session of committed length n.
* **rows**: the verify forward scores the root (the last committed token) and every node: row 0
  gives the distribution at position n, row i + 1 the distribution after node i.
* **path**: the nodes a decision accepted, root to leaf; their tokens are the accepted drafts.

Siblings carry distinct tokens: a repeated sibling would only be a second chance for the same token,
which a point-mass rule cannot use and greedy does not need.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

ROOT = -1


@dataclass(frozen=True)
class DraftTree:
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]  # one per node: an earlier node's index, or ROOT

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"a tree needs one parent per token: {len(self.token_ids)} tokens, {len(self.parents)} parents")
        seen: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(self.token_ids, self.parents)):
            if not ROOT <= parent < i:
                raise ValueError(f"node {i}'s parent must be -1 (the root) or an earlier node, got {parent}")
            if (parent, token) in seen:
                raise ValueError(f"node {i} repeats token {token} under parent {parent}: siblings must differ")
            seen.add((parent, token))

    @classmethod
    def chain(cls, token_ids: Sequence[int]) -> DraftTree:
        return cls(tuple(token_ids), tuple(range(-1, len(token_ids) - 1)))

    @classmethod
    def from_wire(cls, token_ids: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """The proto's form: an empty ``parents`` means a chain."""
        return cls(tuple(token_ids), tuple(parents)) if parents else cls.chain(token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        return depths(self.parents)

    @cached_property
    def children(self) -> dict[int, tuple[int, ...]]:
        """Node (or ROOT) -> its children, in node order (the order the rejection rule tries them)."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return {p: tuple(c) for p, c in out.items()}

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``, inclusive."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @cached_property
    def main_chain(self) -> tuple[int, ...]:
        """The first child at every level: what a runner that cannot attend along a tree verifies."""
        path, node = [], ROOT
        while node in self.children:
            node = self.children[node][0]
            path.append(node)
        return tuple(path)

    def ancestor_mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)


def depths(parents: Sequence[int]) -> tuple[int, ...]:
    """Each node's depth, for valid ``parents`` (each ROOT or an earlier node)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p == ROOT else out[p] + 1)
    return tuple(out)


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: node i may attend to node j iff j is i or one of its ancestors."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p != ROOT:
            mask[i] |= mask[p]
    return mask


def feed_positions(start: int, rows: int, parents: Sequence[int]) -> list[int]:
    """The position of each row of a feed whose last ``len(parents)`` rows are a tree's nodes (in
    node order, their keys and values written at buffer positions ``start + row`` like any row's):
    the rows before the tree are consecutive from ``start``, node i sits at its parent's position + 1."""
    first = rows - len(parents)
    return list(range(start, start + first)) + [start + first + d for d in depths(parents)]


def feed_mask(start: int, rows: int, parents: Sequence[int]) -> torch.Tensor:
    """[rows, start + rows] bool: which buffer positions each row of such a feed attends to. Rows
    before the tree are causal; node i sees everything before the tree and its own ancestors and itself."""
    end, first = start + rows, rows - len(parents)
    mask = torch.ones(rows, end, dtype=torch.bool).tril(diagonal=start)
    if parents:
        mask[first:, start + first:] = ancestor_mask(parents)
    return mask
