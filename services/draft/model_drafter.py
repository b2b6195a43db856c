"""Drafting with a small causal LM that shares the target's tokenizer.

Greedy: the draft's argmax tokens, sent as point masses. Coupled sampling (specdec.core.coupled):
the draft's own coupled token under the request's per-position noise, sent as a point mass too.
Sampling under the rejection rule: each draft token is drawn from
the draft's distribution (same temperature / top-k / top-p as the target) truncated to its
``proposal_top_k`` most likely tokens and renormalised; that exact distribution is sent, so the
verifier's rejection rule stays lossless while a step ships K numbers per token, not a vocabulary:
the verifier must know the exact distribution each draft token was drawn from.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from specdec.core import rng
from specdec.core.branch_decode import BranchBatch
from specdec.core.coupled import processed_logprobs
from specdec.core.noise import gumbel_noise
from specdec.core.kv import KVSequence, logits_for_batch
from specdec.core.choose_runner import choose_runner
from specdec.core.paged_runner import PagedRunner
from specdec.core.runner import HFRunner, LeanRunner, ModelRunner
from specdec.core.exact_ops import ExactNumericsUnavailable
from specdec.core.llama_decode import LlamaDecoder, native_usable
from specdec.core.models import LoadedModel, check_same_tokenizer, load_causal_lm
from specdec.core.sampling import SamplingParams, probs_from_logits, sample_from
from specdec.core.steps import DraftProposal, SparseDistribution
from specdec.draft.base import DraftConfig

log = logging.getLogger(__name__)


def to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Small tensors of one device on the host, in one transfer, each in its own shape and dtype (token
    ids and float32 values are exact in float64); None stays None. Tensors already there stay as they are."""
    present = [t for t in tensors if t is not None]
    if all(t.device.type == "cpu" for t in present):
        return list(tensors)
    flat = torch.cat([t.reshape(-1).double() for t in present]).cpu().split([t.numel() for t in present])
    parts = iter([part.reshape(t.shape).to(t.dtype) for part, t in zip(flat, present)])
    return [None if t is None else next(parts) for t in tensors]


def pick_draft_token(logits: torch.Tensor, position: int, sampling: SamplingParams, top_k: int, num_alternatives: int = 0,
                     noise: torch.Tensor | None = None, want_confidence: bool = False) -> tuple[int, SparseDistribution | None, tuple[int, ...], float]:
    """One draft token from one row of logits [vocab]: the token, its distribution (None: greedy),
    alternatives, and the probability the draft gives the token (greedy: 1.0 unless ``want_confidence``:
    a block may end on it, and only then is the softmax worth computing)."""
    token = confidence = top = None  # on the logits' device until the one transfer below
    if sampling.greedy:
        ranked, token = logits, logits.argmax()
        if want_confidence:
            confidence = torch.softmax(logits.float(), -1)[token]
    elif sampling.coupled:
        # The very noise row the verifier adds at this position: the draft is its own coupled
        # token, and no distribution needs to cross the wire.
        if noise is None:
            noise = gumbel_noise(sampling.seed, (position,), logits.shape[-1], logits.device)[0]
        logprobs = processed_logprobs(logits, sampling)
        ranked = logprobs + noise.to(logits.device)
        token = ranked.argmax()
        confidence = logprobs[token].exp()
    else:  # drawn on the host from the top-K distribution it is sent with
        ranked = probs_from_logits(logits, sampling)  # [vocab]
        top = torch.topk(ranked, min(top_k, ranked.shape[-1]))  # values, ids [K], most likely first
    alternatives = torch.topk(ranked, min(num_alternatives + 1, ranked.shape[-1])).indices if num_alternatives else None
    # One transfer per drafted token: the token (or its top-K distribution), its probability, the alternatives.
    token, confidence, alternatives, *top = to_host(token, confidence, alternatives, *(top or (None, None)))
    dist = None
    if top[0] is not None:
        values, ids = top
        keep = values > 0  # the top K without tokens of probability 0, renormalised
        values, ids = values[keep], ids[keep]
        probs_k = values / values.sum()
        u = rng.uniform(sampling.seed, rng.Stream.DRAFT_SAMPLE, position)
        drawn = int(sample_from(probs_k, torch.tensor(u, device=probs_k.device)))
        token, confidence = ids[drawn], values[drawn]
        dist = SparseDistribution(tuple(ids.tolist()), tuple(probs_k.tolist()))
    token = int(token)
    alternatives = () if alternatives is None else tuple(t for t in alternatives.tolist() if t != token)[:num_alternatives]
    return token, dist, alternatives, 1.0 if confidence is None else float(confidence)


def draft_chain(logits: torch.Tensor, position: int, length: int, sampling: SamplingParams, top_k: int,
                num_alternatives: int, step: Callable[[int, int], torch.Tensor],
                interrupt: Callable[[], bool] | None = None) -> DraftProposal:
    """A chain of up to ``length`` draft tokens: ``logits`` [vocab] propose ``position``; each token is
    picked by `pick_draft_token`, then ``step(token, its position)`` gives the next position's logits
    (not called after the last). ``interrupt`` is polled between tokens. draft_time_ns is left 0."""
    tokens, dists, alternatives = [], [], []
    for i in range(length):
        if tokens and interrupt is not None and interrupt():
            break
        token, dist, alt, _ = pick_draft_token(logits, position + i, sampling, top_k, num_alternatives)
        tokens.append(token)
        if dist is not None:
            dists.append(dist)
        if num_alternatives:
            alternatives.append(alt)
        if i + 1 < length:
            logits = step(token, position + i)
    return DraftProposal(tuple(tokens), tuple(dists) if dists else None, 0, tuple(alternatives))


class ModelDraftSession:
    def __init__(self, model: torch.nn.Module, decoder: LlamaDecoder | None, sampling: SamplingParams, proposal_top_k: int,
                 runner=None, min_confidence: float = 0.0) -> None:
        self._kv = KVSequence(model, decoder, runner)  # the drafter's shared runner: sessions draft together
        # Sessions with the same key can draft in one batched forward (propose_together): those of
        # one drafter on the lean forward. None: one at a time.
        self.batch_key = runner if decoder is not None and runner is not None else None
        self._sampling = sampling
        self._top_k = proposal_top_k
        self.min_confidence = min_confidence  # a block ends after a token the draft gives less probability

    @property
    def kv(self) -> KVSequence:
        """This session's KV sequence (the tree drafter feeds its trees past the committed tokens)."""
        return self._kv

    def propose(self, committed: Sequence[int], num_speculative_tokens: int, num_alternatives: int = 0,
                interrupt: Callable[[], bool] | None = None) -> DraftProposal:
        """Draft up to ``num_speculative_tokens`` tokens after ``committed``; with ``num_alternatives``,
        also each position's next likeliest tokens (guesses of a recovered token, for pre-drafting).
        ``interrupt`` is polled between tokens: a shorter block is still a valid block."""
        t0 = time.perf_counter_ns()
        seq = list(committed)
        tokens: list[int] = []
        dists: list[SparseDistribution] = []
        alternatives: list[tuple[int, ...]] = []
        for _ in range(num_speculative_tokens):
            if tokens and interrupt is not None and interrupt():
                break
            logits = self._kv.logits_for(seq, 1)[0]  # [vocab]
            token, dist, alt, confidence = self._pick(logits, len(seq), num_alternatives)
            if dist is not None:
                dists.append(dist)
            if num_alternatives:
                alternatives.append(alt)
            tokens.append(token)
            seq.append(token)
            if confidence < self.min_confidence:
                break
        distributions = tuple(dists) if dists else None
        return DraftProposal(tuple(tokens), distributions, time.perf_counter_ns() - t0, tuple(alternatives))

    def _noise(self, positions: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor | None:
        """The coupled rule's noise rows for these positions, [len(positions), vocab] on ``device``; None unless coupled."""
        return gumbel_noise(self._sampling.seed, positions, vocab, device) if self._sampling.coupled else None

    def _pick(self, logits: torch.Tensor, position: int, num_alternatives: int,
              noise: torch.Tensor | None = None) -> tuple[int, SparseDistribution | None, tuple[int, ...], float]:
        return pick_draft_token(logits, position, self._sampling, self._top_k, num_alternatives, noise,
                                want_confidence=self.min_confidence > 0)

    def propose_branches(self, sequences: Sequence[Sequence[int]], num_tokens: int, num_alternatives: int = 0,
                         interrupt: Callable[[], bool] | None = None) -> list[DraftProposal] | None:
        """Draft ``num_tokens`` after each of several sequences at once: one batched forward per token.

        Each sequence but its last token must already be cached (the pre-drafts of a block in flight
        all continue prefixes of what was just drafted). Returns None where that does not hold or
        the lean forward is not in use: the caller then drafts them one by one.
        """
        cache = self._kv.decode_cache
        if cache is None or not sequences or num_tokens < 1:
            return None
        longest = list(max((seq[:-1] for seq in sequences), key=len))
        if list(self._kv.cached_ids[: len(longest)]) != longest and longest:
            self._kv.logits_for(longest, 1)  # e.g. a pre-drafted block in flight: cache it once for all its branches
        cached = self._kv.cached_ids
        base_lens = [len(seq) - 1 for seq in sequences]
        if any(n < 0 or n > len(cached) or list(seq[:n]) != cached[:n] for seq, n in zip(sequences, base_lens)):
            return None
        t0 = time.perf_counter_ns()
        batch = BranchBatch(self._kv.decoder, cache, base_lens, num_tokens, cached_len=len(cached))
        feed = [seq[-1] for seq in sequences]
        rows: list[tuple[list[int], list[SparseDistribution], list[tuple[int, ...]]]] = [([], [], []) for _ in sequences]
        ended = [False] * len(sequences)  # a branch whose last token fell under min_confidence drafts no more
        for step in range(num_tokens):
            if all(ended) or (step and interrupt is not None and interrupt()):
                break
            logits = batch.step(feed)  # [branches, vocab]
            positions = [len(seq) + step for seq in sequences]
            noise = self._noise(positions, logits.shape[-1], logits.device)  # one block for every branch, or None
            for b, (tokens, dists, alts) in enumerate(rows):
                if ended[b]:
                    continue  # still fed (the batch steps together); its rows are dropped
                token, dist, alt, confidence = self._pick(logits[b], positions[b], num_alternatives,
                                                          None if noise is None else noise[b])
                tokens.append(token)
                if dist is not None:
                    dists.append(dist)
                alts.append(alt)
                feed[b] = token
                ended[b] = confidence < self.min_confidence
        elapsed = time.perf_counter_ns() - t0
        return [DraftProposal(tuple(tokens), tuple(dists) if dists else None, elapsed, tuple(alts))
                for tokens, dists, alts in rows]


DRAFT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_draft_dtype(name: str) -> torch.dtype:
    """bf16 halves the bytes a draft step reads, which pays off once a draft's step is bound by its
    weights rather than by per-op overhead (a tiny draft mostly is not; docs/performance.md has the
    figures). The draft's precision never changes what the verifier accepts, only how often. Whether
    the CPU runs bf16 natively is LlamaDecoder's check."""
    if name not in DRAFT_DTYPES:
        raise ValueError(f"draft dtype must be one of {', '.join(DRAFT_DTYPES)}; got {name!r}")
    return DRAFT_DTYPES[name]


def propose_together(items: Sequence[tuple[ModelDraftSession, Sequence[int], int]], num_alternatives: int = 0,
                     interrupts: Sequence[Callable[[], bool] | None] | None = None) -> list[DraftProposal]:
    """`ModelDraftSession.propose` for many sessions of one drafter at once: one batched draft
    forward per position, each session drafting ``num_tokens`` after its ``committed`` tokens.

    Each session picks its tokens from its own logits with its own sampling and seed, exactly as
    alone; a session whose interrupt fires (after its first token) or whose block is full drops
    out of the later forwards."""
    t0 = time.perf_counter_ns()
    seqs = [list(committed) for _, committed, _ in items]
    drafted: list[list[int]] = [[] for _ in items]
    dists: list[list[SparseDistribution]] = [[] for _ in items]
    alts: list[list[tuple[int, ...]]] = [[] for _ in items]
    interrupts = interrupts or [None] * len(items)
    active = [i for i, (_, _, n) in enumerate(items) if n > 0]
    while active:
        rows = logits_for_batch([(items[i][0]._kv, seqs[i], 1) for i in active])  # each [1, vocab]
        still = []
        for i, logits in zip(active, rows):
            session, _, num_tokens = items[i]
            token, dist, alt, confidence = session._pick(logits[0], len(seqs[i]), num_alternatives)
            drafted[i].append(token)
            seqs[i].append(token)
            if dist is not None:
                dists[i].append(dist)
            if num_alternatives:
                alts[i].append(alt)
            stop = confidence < session.min_confidence or interrupts[i] is not None and interrupts[i]()
            if len(drafted[i]) < num_tokens and not stop:
                still.append(i)
        active = still
    elapsed = time.perf_counter_ns() - t0
    return [DraftProposal(tuple(drafted[i]), tuple(dists[i]) if dists[i] else None, elapsed, tuple(alts[i]))
            for i in range(len(items))]


class ModelDrafter:
    name = "model"

    def __init__(self, loaded: LoadedModel, proposal_top_k: int, fast: bool = True, dtype: torch.dtype = torch.float32,
                 min_confidence: float = 0.0, max_sessions: int = 256) -> None:
        if proposal_top_k < 1:
            raise ValueError(f"proposal_top_k must be >= 1, got {proposal_top_k}")
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.min_confidence = min_confidence
        self.loaded = loaded
        self.vocab_size = loaded.vocab_size
        self._top_k = proposal_top_k
        self.decoder, self.runner = _runner(loaded.model, fast, dtype, max_sessions)

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> ModelDraftSession:
        return self.open_many([(prompt_ids, sampling)])[0]

    def open_many(self, opens: Sequence[tuple[Sequence[int], SamplingParams]]) -> list[ModelDraftSession]:
        """Open sessions whose prefills run as one batched forward (many clients arriving at once)."""
        sessions = [ModelDraftSession(self.loaded.model, self.decoder, sampling, self._top_k, self.runner, self.min_confidence)
                    for _, sampling in opens]
        logits_for_batch([(session._kv, prompt_ids, 1) for session, (prompt_ids, _) in zip(sessions, opens)])
        return sessions


def build(config: DraftConfig) -> ModelDrafter | None:
    """The registry's factory (specdec.draft.drafters): None without a draft model."""
    if not config.draft_model_path:
        return None
    dtype = resolve_draft_dtype(config.draft_dtype)  # before the load: a typo should fail fast
    device = torch.device(config.draft_device)
    fast = config.fast_draft_forward
    # The lean forward converts float32 weights to its own dtype; the transformers forward runs in the dtype loaded.
    draft = load_causal_lm(config.draft_model_path, dtype=dtype if device.type != "cpu" else torch.float32,
                           threads=config.threads, device=device)
    if config.target_model_path:
        # Only the tokenizer is needed for the check; loading it is cheap.
        from transformers import AutoTokenizer

        target_tok = AutoTokenizer.from_pretrained(config.target_model_path, local_files_only=True)
        check_same_tokenizer(_TokenizerOnly(config.target_model_path, target_tok), draft)
    return ModelDrafter(draft, config.proposal_top_k, fast=fast, dtype=dtype,
                        min_confidence=config.min_confidence, max_sessions=config.max_sessions)


def _runner(model: torch.nn.Module, fast: bool, dtype: torch.dtype, max_sessions: int) -> tuple[LlamaDecoder | None, ModelRunner]:
    """The draft's decoder (the lean forward, or None) and runner, chosen by the verifier's rule
    (core/choose_runner.py). Drafts need speed, not bit-exactness: where specdec's C kernels run the
    draft's weights, the exact numerics' path, for its layers are one C call each (a small draft's
    step is mostly per-op overhead: docs/performance.md 17); else fast numerics."""
    kind = choose_runner(model, fast_forward=fast)
    if kind == "lean":
        decoder = None
        if native_usable(dtype):
            try:
                decoder = LlamaDecoder(model, dtype=dtype, numerics="exact")
            except ExactNumericsUnavailable as exc:
                log.info("the draft runs fast numerics: %s", exc)
        decoder = decoder or LlamaDecoder(model, dtype=dtype)
        return decoder, LeanRunner(decoder)
    if kind == "paged":
        return None, PagedRunner(model, max_sessions=max_sessions)
    return None, HFRunner(model)


class _TokenizerOnly:
    """Enough of a LoadedModel for check_same_tokenizer."""

    def __init__(self, path: str, tokenizer) -> None:
        self.path, self.tokenizer = path, tokenizer
