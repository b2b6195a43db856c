"""What every drafter implements and is configured by: the session and drafter protocols, DraftConfig.

The implementations (model_drafter, ngram, jacobi, layer_skip, eagle_drafter; tree_drafter builds on model_drafter) import only this module, the core and each other, never the registry; the registry
(specdec.draft.drafters) imports them. So the registry knows the drafters and no drafter knows the
registry: drafters depend one way.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftProposal


class DraftSession(Protocol):
    """One session's drafting state (e.g. a KV cache)."""

    def propose(self, committed: Sequence[int], num_speculative_tokens: int, num_alternatives: int = 0,
                interrupt: Callable[[], bool] | None = None) -> DraftProposal:
        """Propose up to ``num_speculative_tokens`` tokens to follow ``committed`` (prompt included).

        ``num_alternatives``: per position, up to that many next likeliest tokens besides the draft
        (``DraftProposal.alternatives``), where the drafter has any. ``interrupt`` is polled between
        tokens; when it returns True the drafter may stop early (a shorter block is still valid).
        """
        ...


class Drafter(Protocol):
    """A way of proposing tokens, shared by all sessions that chose it."""

    name: str
    vocab_size: int  # 0 when the drafter needs no model

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> DraftSession: ...


@dataclass(frozen=True)
class DraftConfig:
    """What the draft worker serves. Built once, passed explicitly."""

    draft_model_path: str | None = None  # None: only model-free drafters
    target_model_path: str | None = None  # if set, the draft's tokenizer is checked against it at start-up
    # An EAGLE head trained on the target (core/eagle_head.py): serves drafter `eagle`, which reads
    # the target's embedding and LM head from target_model_path and its features from the verifier.
    eagle_head_path: str | None = None
    eagle_draft_vocab: bool = True  # score only the head's draft vocabulary (draft_vocab.json beside it) when it has one
    proposal_top_k: int = 32  # a model drafter samples from, and sends, its top-K renormalised distribution
    fast_draft_forward: bool = True  # lean Llama decode path (specdec.core.llama_decode) when supported
    draft_dtype: str = "float32"  # lean path's precision: float32 | bfloat16 (docs/operations.md: which compute runs where)
    draft_device: str = "cpu"  # where the draft model runs: cpu | cuda | cuda:N (the CLI resolves auto)
    # A model drafter ends a block after a token it gives less probability than this (0: every
    # block is as long as the verifier asked): k becomes an upper bound, and a long k costs little.
    min_confidence: float = 0.0
    # Layer-skip self-speculation (drafter `layer_skip`): "" off; "auto": the target's layers chosen by
    # measurement at start-up; "0,1,3": those layers (services/draft/layer_skip.py).
    layer_skip: str = ""
    # Lookahead decoding (drafter `lookahead`): Jacobi window W, n-gram size N, candidate n-grams G.
    lookahead_window: int = 4
    lookahead_ngram: int = 4
    lookahead_candidates: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    max_sessions: int = 256
    # Longest sequence a session may hold: the draft model's context caps it too; for model-free
    # drafters (n-gram) this is the only bound on what a session keeps.
    max_session_tokens: int = 1 << 16
    idle_timeout_s: float = 300.0
    threads: int | None = None
    thread_nice: int = 10  # niceness of the draft thread: yields cores to a verifier and event loops sharing them


DrafterFactory = Callable[[DraftConfig], Drafter | None]  # None: this configuration cannot serve the drafter
