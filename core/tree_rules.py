"""Verification of a token tree (core/tree.py) under each rule: walk down from the root, at every
node take the child the rule accepts, stop at the first node where none is.

* greedy and coupled: the target's own token at a node (its argmax, or its coupled token at that
  position) is compared with the node's children; a child with that token is accepted. Every
  committed token is then the target's own: greedy output equals target-only greedy decoding, and a
  seed gives target-only coupled sampling's tokens, whatever tree the drafter sent.
* rejection: recursive rejection sampling over point-mass proposals (the children are the drafter's
  chosen alternatives, not draws). At a node whose target distribution is p, the children x_1, x_2, ...
  are tried in order; x_j is accepted with probability r(x_j) / sum(r), r being p with the tried
  children removed; if none is, the token is drawn from the last r. Each token is thereby distributed
  exactly as p (x_1 with p(x_1); x_2 with (1 - p(x_1)) * p(x_2) / (1 - p(x_1)); ...): SpecInfer's
  multi-step speculative sampling (Miao et al. 2024, https://arxiv.org/abs/2305.09781) with proposals
  that are point masses, i.e. recursive rejection sampling without replacement (Jeon et al. 2024,
  https://arxiv.org/abs/2402.14160). The first child's test uses the chain's ACCEPT uniform and
  later ones TREE_ACCEPT, so a chain-shaped tree decides bit for bit as the chain rule does.

Rows as in core/tree.py: row 0 scores the root, row i + 1 the position after node i.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core import rng
from specdec.core.coupled import processed_logprobs
from specdec.core.noise import gumbel_noise
from specdec.core.sampling import SamplingParams, probs_from_logits, sample_from, top_ids
from specdec.core.tree import ROOT, DraftTree


@dataclass(frozen=True)
class TreeStep:
    tree: DraftTree
    sampling: SamplingParams
    position: int  # the session's committed length n: the position of a root child's token


@dataclass(frozen=True)
class TreeOutcome:
    tokens: tuple[int, ...]  # the accepted nodes' tokens, then the recovered or bonus token
    path: tuple[int, ...]  # the accepted nodes, root to leaf: where their keys and values lie in the forward

    @property
    def accepted(self) -> int:
        return len(self.path)


def row_positions(step: TreeStep) -> list[int]:
    """The position each row's distribution chooses a token for: [n + 1] for n nodes."""
    return [step.position] + [step.position + d + 1 for d in step.tree.depths]


def decide_tree(logits: torch.Tensor, step: TreeStep) -> TreeOutcome:
    """One tree step by its session's rule. ``logits``: [len(tree) + 1, vocab], rows as above."""
    tree, sampling = step.tree, step.sampling
    if logits.dim() != 2 or logits.shape[0] != len(tree) + 1:
        raise ValueError(f"logits must be [nodes + 1, vocab] = [{len(tree) + 1}, vocab], got {list(logits.shape)}")
    vocab = logits.shape[-1]
    if tree.token_ids and not (0 <= min(tree.token_ids) and max(tree.token_ids) < vocab):
        raise ValueError(f"tree tokens must be inside the vocabulary [0, {vocab})")
    if sampling.greedy:
        return _walk_exact(tree, top_ids(logits).tolist())
    if sampling.coupled:
        noise = gumbel_noise(sampling.seed, row_positions(step), vocab).to(logits.device)  # [n + 1, vocab]
        return _walk_exact(tree, top_ids(processed_logprobs(logits, sampling) + noise).tolist())
    return _walk_rejection(probs_from_logits(logits, sampling), step)


def decide_tree_batch(logits: torch.Tensor, steps: Sequence[TreeStep]) -> list[TreeOutcome]:
    """Every step of a batch, step i's ``len(tree) + 1`` rows contiguous and in order."""
    sizes = [len(s.tree) + 1 for s in steps]
    if logits.dim() != 2 or logits.shape[0] != sum(sizes):
        raise ValueError(f"logits must have sum(nodes + 1) = {sum(sizes)} rows, got {list(logits.shape)}")
    if all(s.sampling.greedy for s in steps):  # one argmax and one transfer for the whole batch
        ids, out, row = top_ids(logits).tolist(), [], 0
        for s, size in zip(steps, sizes):
            out.append(_walk_exact(s.tree, ids[row:row + size]))
            row += size
        return out
    return [decide_tree(part, s) for part, s in zip(logits.split(sizes), steps)]


def _walk_exact(tree: DraftTree, target_ids: list[int]) -> TreeOutcome:
    """Greedy and coupled: follow the children equal to the target's own token at each row."""
    path, node = [], ROOT
    while True:
        chosen = target_ids[node + 1]
        child = next((c for c in tree.children.get(node, ()) if tree.token_ids[c] == chosen), None)
        if child is None:
            return TreeOutcome((*(tree.token_ids[c] for c in path), chosen), tuple(path))
        path.append(child)
        node = child


def _walk_rejection(target_probs: torch.Tensor, step: TreeStep) -> TreeOutcome:
    tree, seed, positions = step.tree, step.sampling.seed, row_positions(step)
    # p(x) of every node's token under its parent's row, read once: [n] float64 on the host.
    parent_rows = torch.tensor([p + 1 for p in tree.parents], dtype=torch.long, device=target_probs.device)
    tokens = torch.tensor(tree.token_ids, dtype=torch.long, device=target_probs.device)
    p_node = target_probs[parent_rows, tokens].double().tolist() if len(tree) else []
    path, node = [], ROOT
    while True:
        position, tried, removed = positions[node + 1], [], 0.0
        child = None
        for rank, c in enumerate(tree.children.get(node, ())):
            u = (rng.uniform(seed, rng.Stream.ACCEPT, position) if rank == 0
                 else rng.uniform_ranked(seed, rng.Stream.TREE_ACCEPT, position, rank))
            # u < r(x) / sum(r) without the division, sum(r) = 1 - the tried children's mass (float64).
            if u * (1.0 - removed) < p_node[c]:
                child = c
                break
            tried.append(tree.token_ids[c])
            removed += p_node[c]
        if child is None:
            return TreeOutcome((*(tree.token_ids[c] for c in path), _draw(target_probs[node + 1], tried, seed, position)),
                               tuple(path))
        path.append(child)
        node = child


def _draw(target_probs: torch.Tensor, tried: list[int], seed: int, position: int) -> int:
    """The recovered or bonus token: from ``target_probs`` [vocab] without the tried tokens (all of
    it if that leaves nothing, as the chain rule falls back)."""
    residual = target_probs
    if tried:
        residual = target_probs.clone()
        residual[tried] = 0
        if residual.sum() <= 0:
            residual = target_probs
    u = torch.tensor(rng.uniform(seed, rng.Stream.TARGET_SAMPLE, position), dtype=torch.float64, device=target_probs.device)
    return int(sample_from(residual, u))
