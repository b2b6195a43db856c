"""Drafting with an EAGLE head (drafter ``eagle``): the target's own features, sent by the verifier,
and a one-layer head over them (core/eagle_head.py).

The head at position ``p`` reads the pair (``f_p``, token ``p + 1``) and predicts ``f̂_{p+1}``,
whose LM-head logits propose token ``p + 2``. The verifier sends each position's feature once the
token after it is committed (core/features.py), so after every step the head *ingests* the new
true pairs into its own KV cache (one forward over them) and keeps its last prediction. To draft
after ``committed``: positions the head has no true feature for (the tokens a pre-draft assumes, or
features still on their way) are fed with its own predicted features, then each draft token is
proposed from the current prediction and fed back, as EAGLE chains. Everything past the true pairs
is rolled back after the block (the cache truncated, the prediction restored), so the head's state
is always a function of the committed tokens and their features alone.

Tokens are chosen as the model drafter chooses them (`pick_draft_token`): greedy the argmax; the
coupled rule the argmax of processed log-probabilities plus the request's noise at the position
(the target-only coupled token wherever the head agrees with the target); the rejection rule a
draw from the head's top-K distribution, which is sent with the block. Every rule verifies these
exactly, so the head can only change speed, never output.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from specdec.core.eagle_fast import FastHead
from specdec.core.eagle_head import EagleHead
from specdec.core.errors import InvalidRequest
from specdec.core.features import FeatureChunk
from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftProposal
from specdec.core.tree import ROOT, depths
from specdec.draft.base import DraftConfig
from specdec.draft.model_drafter import draft_chain
from specdec.draft.tree_drafter import grow_tree

DRAFT_VOCAB_FILE = "draft_vocab.json"


class EagleDraftSession:
    def __init__(self, head: FastHead, sampling: SamplingParams, proposal_top_k: int) -> None:
        self._head = head
        self._sampling = sampling
        self._top_k = proposal_top_k
        # Chunks from the verifier, appended on the servicer's thread, taken on the draft thread.
        self._arriving: collections.deque[FeatureChunk] = collections.deque()
        self._features: FeatureChunk | None = None  # true features not yet ingested
        self._cache = head.new_cache()  # the head's keys and values of positions cache_start ..
        self._cache_start = 0
        self._prediction: torch.Tensor | None = None  # f̂ after the last ingested pair [1, hidden]
        self._device = head.device

    def check_features(self, chunk: FeatureChunk) -> None:
        """InvalidRequest for a chunk this head cannot read (another target's width)."""
        if chunk.values.shape[1] != self._head.hidden:
            raise InvalidRequest(f"features of width {chunk.values.shape[1]} for a head over a target of hidden size "
                                 f"{self._head.hidden}: the verifier serves another target than this head's")

    def add_features(self, chunk: FeatureChunk) -> None:
        self.check_features(chunk)
        self._arriving.append(chunk)

    @property
    def ingested_end(self) -> int:
        """One past the last position whose true pair the head has read."""
        return self._cache_start + self._cache.length

    def propose(self, committed: Sequence[int], num_speculative_tokens: int, num_alternatives: int = 0,
                interrupt: Callable[[], bool] | None = None) -> DraftProposal:
        t0 = time.perf_counter_ns()
        proposal = DraftProposal(())
        with self._rolled_back(committed) as ready:
            if ready:
                def step(token: int, position: int) -> torch.Tensor:  # the token at position, fed at the head's position - 1
                    self._prediction = self._step(self._prediction, token, position - 1)
                    return self._head.logits(self._prediction)[0]

                proposal = draft_chain(self._head.logits(self._prediction)[0], len(committed), num_speculative_tokens,
                                       self._sampling, self._top_k, num_alternatives, step, interrupt)
        return dataclasses.replace(proposal, draft_time_ns=time.perf_counter_ns() - t0)

    def propose_tree(self, committed: Sequence[int], budget: int, interrupt: Callable[[], bool] | None = None) -> DraftProposal:
        """A dynamic tree of at most ``budget`` nodes (EAGLE-2: grown where the head is unsure;
        services/draft/tree_drafter.py), each depth one masked head forward over its new nodes."""
        t0 = time.perf_counter_ns()
        n = len(committed)
        with self._rolled_back(committed) as ready:
            if not ready or budget <= 0:
                return DraftProposal((), None, time.perf_counter_ns() - t0)
            prefix = self._cache.length  # keys every node sees: the true pairs and chained guesses
            outputs: dict[int, torch.Tensor] = {ROOT: self._prediction}  # node -> its predicted feature [1, hidden]
            fed: list[int] = []  # nodes in the order their rows entered the cache

            def expand(tokens: list[int], parents: list[int], added: list[int]) -> torch.Tensor:
                node_depths = depths(parents)
                row_of = {node: prefix + j for j, node in enumerate(fed)}
                mask = torch.zeros(len(added), prefix + len(fed) + len(added), dtype=torch.bool)
                mask[:, :prefix] = True
                for j, node in enumerate(added):
                    mask[j, prefix + len(fed) + j] = True
                    a = parents[node]
                    while a != ROOT:
                        mask[j, row_of[a]] = True
                        a = parents[a]
                features = torch.cat([outputs[parents[node]] for node in added])  # [T, hidden]
                ids = torch.tensor([tokens[node] for node in added], device=self._device)
                positions = torch.tensor([n - 1 + node_depths[node] for node in added], device=self._device)
                out = self._head.forward(features, ids, positions, self._cache, mask.to(self._device))
                fed.extend(added)
                for j, node in enumerate(added):
                    outputs[node] = out[j : j + 1]
                return self._head.logits(out)

            root_logits = self._head.logits(self._prediction)[0]
            ids, parents = grow_tree(root_logits, n, budget, self._sampling, expand, interrupt)
        return DraftProposal(ids, None, time.perf_counter_ns() - t0, parents=parents)

    @contextlib.contextmanager
    def _rolled_back(self, committed: Sequence[int]) -> Iterator[bool]:
        """Ingest the true pairs ``committed`` completes, chain the head over the positions after
        them (its own predictions in place of features not yet known), yield whether it can draft,
        then forget everything past the true pairs: the head's state never holds a guess."""
        self._take_arrived()
        self._ingest(committed)
        if self._prediction is None:
            yield False
            return
        true_length, true_prediction = self._cache.length, self._prediction
        try:
            for p in range(self.ingested_end, len(committed) - 1):
                self._prediction = self._step(self._prediction, committed[p + 1], p)
            yield True
        finally:
            self._cache.truncate(true_length)
            self._prediction = true_prediction

    # ------------------------------------------------------------------------------------ internals

    def _take_arrived(self) -> None:
        """Add the chunks that arrived to the features still to ingest. A chunk that does not
        follow on (a gap: the verifier had none to send for some positions, e.g. a prefix it read
        from stored KV) restarts the head's history at its first position."""
        while self._arriving:
            chunk = self._arriving.popleft()
            have = self._features.end if self._features is not None else self.ingested_end  # first position not held
            if chunk.end <= have:
                continue  # already held
            if chunk.first_position > have:
                self._restart(chunk.first_position)
                self._features = chunk
                continue
            fresh = chunk.values[have - chunk.first_position :]
            self._features = FeatureChunk(have, fresh) if self._features is None else \
                FeatureChunk(self._features.first_position, torch.cat([self._features.values, fresh]))

    def _restart(self, position: int) -> None:
        self._cache, self._cache_start, self._prediction = self._head.new_cache(), position, None

    def _ingest(self, committed: Sequence[int]) -> None:
        """Read every true pair (f_p, token p + 1) that ``committed`` completes, in one head forward."""
        f = self._features
        if f is None:
            return
        hi = min(f.end, len(committed) - 1)  # the pair needs the token after the feature
        lo = f.first_position
        if hi <= lo:
            return
        rows = f.values[: hi - lo].to(device=self._device)  # [T, hidden]
        tokens = torch.tensor(list(committed[lo + 1 : hi + 1]), device=self._device)
        predicted = self._head.forward(rows, tokens, torch.arange(lo, hi, device=self._device), self._cache)
        self._prediction = predicted[-1:]
        rest = f.values[hi - lo :]
        self._features = FeatureChunk(hi, rest) if rest.shape[0] else None

    def _step(self, feature: torch.Tensor, token: int, position: int) -> torch.Tensor:
        """One chained position: (feature, token) at ``position`` -> the predicted next feature [1, hidden]."""
        return self._head.forward(feature, torch.tensor([token], device=self._device),
                                  torch.tensor([position], device=self._device), self._cache)


class EagleTreeSession:
    """Drafter ``eagle_tree``: the head's dynamic trees; its state is an `EagleDraftSession`'s."""

    def __init__(self, session: EagleDraftSession) -> None:
        self._session = session
        self.add_features, self.check_features = session.add_features, session.check_features

    def propose(self, committed: Sequence[int], num_speculative_tokens: int, num_alternatives: int = 0,
                interrupt: Callable[[], bool] | None = None) -> DraftProposal:
        return self._session.propose_tree(committed, num_speculative_tokens, interrupt)


class EagleDrafter:
    name = "eagle"

    def __init__(self, head: EagleHead, proposal_top_k: int, draft_vocab: torch.Tensor | None = None) -> None:
        self.head = head.eval()
        self.fast = FastHead(self.head, draft_vocab)  # what drafting runs
        self.vocab_size = head.config.vocab_size
        self._top_k = proposal_top_k

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> EagleDraftSession:
        return EagleDraftSession(self.fast, sampling, self._top_k)  # nothing to prefill: the features come from the verifier


class EagleTreeDrafter:
    """Trees from an `EagleDrafter`'s head (shared, not loaded again)."""

    name = "eagle_tree"

    def __init__(self, chains: EagleDrafter) -> None:
        self._chains = chains
        self.vocab_size = chains.vocab_size

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> EagleTreeSession:
        return EagleTreeSession(self._chains.open(prompt_ids, sampling))


def derive(drafters: dict, config: DraftConfig) -> EagleTreeDrafter | None:
    """The registry's derived factory: trees over the ``eagle`` drafter's head."""
    chains = drafters.get("eagle")
    return EagleTreeDrafter(chains) if chains is not None else None


def build(config: DraftConfig) -> EagleDrafter | None:
    """The registry's factory: None without a head (``eagle_head_path``) and the target it was trained on."""
    if not config.eagle_head_path or not config.target_model_path:
        return None
    from specdec.core.eagle_head import load_target_parts

    parts = load_target_parts(config.target_model_path)  # its embedding and LM head only
    device = torch.device(config.draft_device)
    head = EagleHead.load(config.eagle_head_path, parts).to(device)
    head.requires_grad_(False)
    vocab_file = Path(config.eagle_head_path) / DRAFT_VOCAB_FILE  # scripts/draft_vocab.py; absent: the whole vocabulary
    draft_vocab = None
    if config.eagle_draft_vocab and vocab_file.is_file():
        draft_vocab = torch.tensor(json.loads(vocab_file.read_text())["token_ids"], dtype=torch.long, device=device)
        if draft_vocab.numel() == 0 or int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= head.config.vocab_size:
            raise ValueError(f"{vocab_file}: token ids must lie in [0, {head.config.vocab_size})")
    return EagleDrafter(head, config.proposal_top_k, draft_vocab)
