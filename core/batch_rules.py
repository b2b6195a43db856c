"""Every verification rule over a whole batch at once: one call per verify step of the verifier.

The verifier scores a flat ragged batch in one target forward (step i's k_i + 1 rows, in order) and
then decides every step by its session's rule. :func:`decide_batch` does that in one call, grouped by
rule, with tensor ops over all of a group's rows instead of a Python loop of batch-size-1 calls:

* greedy: one argmax over every greedy row (as ``specdec.core.rejection.greedy_verify``).
* coupled: processed log-probabilities of every coupled row plus each session's Gumbel noise, one
  argmax (as ``specdec.core.coupled.coupled_verify_one``); noise is keyed by seed, so made per session.
* rejection: target distributions of every rejection row, one accept test over all draft tokens, one
  draw of all recovered or bonus tokens (as ``specdec.core.rejection.rejection_sample``).

Outcomes are bitwise those of the per-session rules (:func:`decide_one`, the executable reference),
whatever else shares the batch: every op here is elementwise, an exact selection (argmax, sort,
top-k values, comparisons, gathers), or a reduction along one row (softmax, cumsum) that gives a row
the same bits inside [rows, vocab] as alone. tests/test_batch_rules.py holds both claims. Words
(draft, accepted, recovered, bonus tokens) as in specdec.core.rejection.

Every tensor is made on the logits' device, and the decisions of a whole call come back to the host
in one transfer (tests/test_device.py holds both).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.core import rng
from specdec.core.coupled import coupled_verify_one, processed_logprobs
from specdec.core.noise import gumbel_noise
from specdec.core.rejection import greedy_verify, rejection_sample
from specdec.core.sampling import SamplingParams, probs_from_logits, sample_from, top_ids

Outcome = tuple[tuple[int, ...], int]  # (the tokens to commit, num_accepted)


@dataclass(frozen=True)
class RuleStep:
    """One session's verification step, as the rules see it."""

    draft_ids: tuple[int, ...]  # k draft tokens (k may be 0)
    draft_probs: torch.Tensor | None  # [k, vocab] float32, what each was drawn from; None: point masses
    sampling: SamplingParams  # greedy / coupled / rejection, temperature, top_k, top_p, seed
    position: int  # committed length n before the step: the position of the first draft token

    @property
    def k(self) -> int:
        return len(self.draft_ids)


def decide_batch(logits: torch.Tensor, steps: Sequence[RuleStep]) -> list[Outcome]:
    """Decide every step of a verify batch by its own rule, in one call.

    Args:
        logits: [sum(k_i + 1), vocab] the target's logits, step i's k_i + 1 rows contiguous and in
            the order of ``steps`` (its draft positions, then its bonus position).
        steps: one per session; each session's rule comes from its ``sampling``.

    Returns:
        Per step, (the tokens to commit, num_accepted): ``num_accepted`` draft tokens, then the
        recovered or bonus token. Exactly what :func:`decide_one` gives for that step alone.
    """
    ks = [len(s.draft_ids) for s in steps]
    _check(logits, steps, ks)
    if len(steps) <= 1:  # the per-session rule itself: cheaper than building a layout for one step
        return [decide_one(logits, step) for step in steps]
    groups: dict[str, list[int]] = {"greedy": [], "coupled": [], "rejection": []}
    for i, step in enumerate(steps):
        rule = "greedy" if step.sampling.greedy else "coupled" if step.sampling.coupled else "rejection"
        groups[rule].append(i)
    decided: list[tuple[list[int], Decided]] = []
    for rule, indices in groups.items():
        if not indices:
            continue
        group = [steps[i] for i in indices]
        rows = logits if len(indices) == len(steps) else logits[_group_rows(ks, indices, logits.device)]
        decided.append((indices, _DECIDERS[rule](rows, group, _Layout.of(group, logits.device))))
    # Every group's decisions leave the logits' device together: one transfer per verify step, whatever
    # the number of sessions (each one a sync with the device where it is a GPU).
    values = torch.cat([d.values for _, d in decided]).tolist()
    outcomes: list[Outcome | None] = [None] * len(steps)
    at = 0
    for indices, d in decided:
        n = d.values.numel()
        for i, outcome in zip(indices, d.outcomes(values[at : at + n])):
            outcomes[i] = outcome
        at += n
    return outcomes


def decide_one(logits: torch.Tensor, step: RuleStep) -> Outcome:
    """The per-session rule over one step's own logits [k+1, vocab]: the reference :func:`decide_batch`
    must equal (the verifier's loop before batching, one call per session)."""
    k, n, sampling = step.k, step.position, step.sampling
    if sampling.greedy:
        return greedy_verify(step.draft_ids, logits)
    if sampling.coupled:
        noise = gumbel_noise(sampling.seed, range(n, n + k + 1), logits.shape[-1], logits.device)  # [k+1, vocab]
        return coupled_verify_one(step.draft_ids, processed_logprobs(logits, sampling), noise)
    device = logits.device
    output, num_accepted = rejection_sample(
        draft_token_ids=torch.tensor([step.draft_ids], dtype=torch.long, device=device).reshape(1, k),  # [1, k]
        draft_probs=None if step.draft_probs is None else step.draft_probs[None].to(device),  # [1, k, vocab]
        target_probs=probs_from_logits(logits, sampling)[None],  # [1, k+1, vocab]
        accept_uniforms=rng.uniforms(sampling.seed, rng.Stream.ACCEPT, range(n, n + k), device)[None],  # [1, k]
        sample_uniforms=rng.uniforms(sampling.seed, rng.Stream.TARGET_SAMPLE, range(n, n + k + 1), device)[None],  # [1, k+1]
    )
    accepted, *ids = torch.cat([num_accepted, output[0]]).tolist()  # one transfer: [1 + k + 1]
    return tuple(ids[: accepted + 1]), accepted


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Layout:
    """Where a group's steps sit in the group's own flat rows: step b owns rows starts[b] .. starts[b] + k_b.

    Built in Python and turned into tensors in two calls: per-step overhead is what batching saves.
    """

    starts_list: list[int]  # [B] the row of each step's first draft position
    per_row_steps: list[int]  # [R] the step each row belongs to
    ks: torch.Tensor  # [B] int64
    starts: torch.Tensor  # [B] int64, starts_list
    first_drafts: torch.Tensor  # [B] int64, the index of each step's first draft token among all D = sum(k)
    drafts: torch.Tensor  # [D] int64, every draft token, step by step
    draft_rows: torch.Tensor  # [D] int64, the row that scores it
    draft_steps: torch.Tensor  # [D] int64, the step of each draft token
    draft_places: torch.Tensor  # [D] int64, its place j in its step, 0 .. k-1
    draft_ks: torch.Tensor  # [D] int64, the k of its step

    @classmethod
    def of(cls, steps: Sequence[RuleStep], device: torch.device) -> _Layout:
        ks = [len(s.draft_ids) for s in steps]
        starts, first_drafts, per_row_steps, row, first = [], [], [], 0, 0
        drafts, draft_rows, draft_steps, draft_places, draft_ks = [], [], [], [], []
        for b, (step, k) in enumerate(zip(steps, ks)):  # list extends: per step, not per token
            starts.append(row)
            first_drafts.append(first)
            per_row_steps += [b] * (k + 1)
            drafts += step.draft_ids
            draft_rows += range(row, row + k)
            draft_steps += [b] * k
            draft_places += range(k)
            draft_ks += [k] * k
            row, first = row + k + 1, first + k
        per_step = _tensor([ks, starts, first_drafts], np.int64, device)  # [3, B]
        per_draft = _tensor([drafts, draft_rows, draft_steps, draft_places, draft_ks], np.int64, device)  # [5, D]
        return cls(starts, per_row_steps, *per_step.unbind(), *per_draft.unbind())

    def num_accepted(self, accepted: torch.Tensor) -> torch.Tensor:
        """Each draft token's own test [D] bool -> the accepted prefix length of each step [B]: the
        place of its first failed draft token, or k."""
        first_failed = torch.where(accepted, self.draft_ks, self.draft_places)  # [D]
        return self.ks.scatter_reduce(0, self.draft_steps, first_failed, reduce="amin")  # k where none failed

    def per_row(self, values: Sequence) -> list:
        """One value per step -> one per row [R]."""
        return [values[b] for b in self.per_row_steps]


def _group_rows(ks: list[int], indices: list[int], device: torch.device) -> torch.Tensor:
    """The rows of the batch's logits that belong to the steps ``indices``, in order: [sum(k+1)] int64."""
    first_rows = list(itertools.accumulate((k + 1 for k in ks), initial=0))
    rows = [r for i in indices for r in range(first_rows[i], first_rows[i + 1])]
    return _tensor(rows, np.int64, device)


def _tensor(values: list, dtype: type, device: torch.device) -> torch.Tensor:
    """A tensor from Python numbers through numpy: several times faster than torch.tensor on lists.
    Floats round to float32 as torch's cast does (IEEE round to nearest even)."""
    return torch.from_numpy(np.array(values, dtype=dtype)).to(device)


# ----------------------------------------------------------------------------- the rules
@dataclass(frozen=True)
class Decided:
    """A group's decisions, still on the logits' device: ``values`` [n] int64, turned into outcomes by
    ``outcomes`` once they are on the host (decide_batch moves every group's at once)."""

    values: torch.Tensor  # [n] int64
    outcomes: Callable[[list[int]], list[Outcome]]


def _decide_greedy(logits: torch.Tensor, steps: Sequence[RuleStep], layout: _Layout) -> Decided:
    # argmax breaks ties to the lowest id, row by row, as greedy_verify's does.
    return _exact_match(top_ids(logits), layout)


def _decide_coupled(logits: torch.Tensor, steps: Sequence[RuleStep], layout: _Layout) -> Decided:
    logprobs = _target_probs(logits, steps, layout).log_()  # [R, vocab], processed_logprobs of each row
    vocab = logits.shape[-1]
    # The noise of (seed, position): one call per session, as its rows have their own seed; made on
    # the CPU and moved once for the group (core/noise.py says why it is not made on the device).
    noise = torch.cat([gumbel_noise(s.sampling.seed, range(s.position, s.position + s.k + 1), vocab) for s in steps])
    return _exact_match(top_ids(logprobs.add_(noise.to(logprobs.device))), layout)


def _exact_match(target_ids: torch.Tensor, layout: _Layout) -> Decided:
    """Greedy and coupled verification: draft tokens are accepted up to the first that differs from
    the target's own token ``target_ids`` [R]; the tokens to commit are then the target's own up to
    and including that place (accepted draft tokens equal them)."""
    num_accepted = layout.num_accepted(layout.drafts == target_ids[layout.draft_rows])  # [B]
    steps = len(layout.starts_list)

    def outcomes(values: list[int]) -> list[Outcome]:  # [B] num_accepted, then [R] target_ids
        ids = values[steps:]
        return [(tuple(ids[start : start + accepted + 1]), accepted)
                for start, accepted in zip(layout.starts_list, values[:steps])]

    return Decided(torch.cat([num_accepted, target_ids]), outcomes)


def _decide_rejection(logits: torch.Tensor, steps: Sequence[RuleStep], layout: _Layout) -> Decided:
    """rejection_sample over every step of the group at once (its docstring has the rule), without a
    sync with the device: every step is computed as if rejected, and the selection made by where."""
    target_probs = _target_probs(logits, steps, layout)  # [R, vocab]
    vocab, device = target_probs.shape[-1], target_probs.device
    drafts = layout.drafts  # [D]
    # Steps that sent distributions, their rows stacked [Dq, vocab]; the others are point masses, q(x) = 1.
    dense = [s.k > 0 and s.draft_probs is not None for s in steps]
    has_probs = _tensor([d for d, s in zip(dense, steps) for _ in range(s.k)], np.bool_, device)  # [D]
    draft_probs = (torch.cat([s.draft_probs for d, s in zip(dense, steps) if d]).to(device, target_probs.dtype)
                   if any(dense) else None)  # [Dq, vocab]
    rows_in_sent = (torch.cumsum(has_probs.long(), 0) - 1).clamp_min_(0)  # [D] its row in draft_probs, where it has one
    q_x = torch.ones(len(drafts), dtype=target_probs.dtype, device=device)  # [D]
    if draft_probs is not None:
        q_x = torch.where(has_probs, draft_probs[rows_in_sent, drafts], q_x)
    p_x = target_probs[layout.draft_rows, drafts]  # [D]
    accept_uniforms = _tensor([rng.uniform(s.sampling.seed, rng.Stream.ACCEPT, s.position + j)
                               for s in steps for j in range(s.k)], np.float64, device)  # [D]
    # u < p/q without the division, in float64: rejection_sample's test, bit for bit (why: there).
    accepted = accept_uniforms * q_x.double() < p_x.double()  # [D]
    num_accepted = layout.num_accepted(accepted)  # [B]

    final_probs = target_probs[layout.starts + num_accepted]  # [B, vocab]: the bonus rows, until replaced
    if drafts.numel():
        rejected = num_accepted < layout.ks  # [B] steps with a recovered token
        at = (layout.first_drafts + num_accepted).clamp_max_(drafts.numel() - 1)  # [B] each one's rejected draft token
        # Their draft distributions: one-hot for point masses (as rejection_sample builds them), else sent.
        rejected_draft = torch.nn.functional.one_hot(drafts[at], vocab).to(target_probs.dtype)  # [B, vocab]
        if draft_probs is not None:
            rejected_draft = torch.where(has_probs[at, None], draft_probs[rows_in_sent[at]], rejected_draft)
        residual = (final_probs - rejected_draft).clamp_min_(0)
        # An empty residual (p <= q everywhere) falls back to the target's distribution, as there.
        use_residual = rejected[:, None] & (residual.sum(-1, keepdim=True) > 0)  # [B, 1]
        final_probs = torch.where(use_residual, residual, final_probs)
    # Every place's uniform, k+1 per step as rejection_sample takes them; the accepted count picks one.
    sample_uniforms = _tensor([rng.uniform(s.sampling.seed, rng.Stream.TARGET_SAMPLE, s.position + j)
                               for s in steps for j in range(s.k + 1)], np.float64, device)  # [R]
    final_tokens = sample_from(final_probs, sample_uniforms[layout.starts + num_accepted])  # [B], row by row
    count = len(steps)

    def outcomes(values: list[int]) -> list[Outcome]:  # [B] num_accepted, then [B] final tokens
        return [((*s.draft_ids[:a], token), a) for s, a, token in zip(steps, values[:count], values[count:])]

    return Decided(torch.cat([num_accepted, final_tokens]), outcomes)


_DECIDERS = {"greedy": _decide_greedy, "coupled": _decide_coupled, "rejection": _decide_rejection}


# ----------------------------------------------------------------------------- distributions
def _target_probs(logits: torch.Tensor, steps: Sequence[RuleStep], layout: _Layout) -> torch.Tensor:
    """``probs_from_logits`` of every row [R, vocab] with its own step's sampling params, bitwise.

    Temperature, then top-k, then top-p, then softmax, as there. Row-wise equal because: division is
    elementwise (a float32 tensor divisor rounds as the Python scalar does); the k-th largest value is
    an exact element whichever top-k call finds it; sort, softmax and cumsum work along one row (a
    row's tie order and sums are its own); comparisons cast top_p to float32 as the scalar compare does.
    """
    vocab, device = logits.shape[-1], logits.device
    params = layout.per_row([s.sampling for s in steps])  # [R]
    temperature = _tensor([p.temperature for p in params], np.float32, device)  # [R]
    # A new tensor, so the in-place ops below (fewer large allocations) leave the caller's logits alone.
    logits = logits.float() / temperature[:, None]  # [R, vocab]

    rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if rows:
        filtered = logits if len(rows) == len(params) else logits[rows]  # [Rk, vocab]
        row_k = _tensor([params[i].top_k - 1 for i in rows], np.int64, device)  # [Rk]
        # One top-k call at the largest k; each row's k-th largest value is at its own index k-1.
        kth = torch.topk(filtered, max(params[i].top_k for i in rows), dim=-1).values.gather(-1, row_k[:, None])  # [Rk, 1]
        filtered.masked_fill_(filtered < kth, float("-inf"))
        if len(rows) < len(params):
            logits[rows] = filtered

    # Selected by the float64 test `top_p < 1.0`, as probs_from_logits does: a top_p that rounds to
    # 1.0 in float32 still filters there.
    rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        filtered = logits if len(rows) == len(params) else logits[rows]  # [Rp, vocab]
        top_p = _tensor([[params[i].top_p] for i in rows], np.float32, device)  # [Rp, 1]
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)
        drop = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order, mass_before >= top_p)
        filtered.masked_fill_(drop, float("-inf"))
        if len(rows) < len(params):
            logits[rows] = filtered
    return logits.softmax(dim=-1)


# ----------------------------------------------------------------------------- checks
def _check(logits: torch.Tensor, steps: Sequence[RuleStep], ks: list[int]) -> None:
    """ValueError naming what does not fit: the batch would otherwise be decided on the wrong rows."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [sum(k+1), vocab], got shape {list(logits.shape)}")
    rows, vocab = logits.shape
    needed = sum(ks) + len(ks)
    if rows != needed:
        raise ValueError(f"logits has {rows} rows but the steps need sum(k+1) = {needed} "
                         f"(k per step: {ks[:16]}{' ...' if len(ks) > 16 else ''})")
    for i, (s, k) in enumerate(zip(steps, ks)):
        if s.draft_probs is not None and tuple(s.draft_probs.shape) != (k, vocab):
            raise ValueError(f"step {i}: draft_probs must be [k, vocab] = [{k}, {vocab}], got {list(s.draft_probs.shape)}")
        if s.position < 0:
            raise ValueError(f"step {i}: position must be >= 0, got {s.position}")
    ids = [t for s in steps for t in s.draft_ids]
    if ids and not (0 <= min(ids) and max(ids) < vocab):  # one pass; the slow search only on failure
        i = next(i for i, s in enumerate(steps) if any(not 0 <= t < vocab for t in s.draft_ids))
        raise ValueError(f"step {i}: draft ids {list(steps[i].draft_ids)} must be inside the vocabulary [0, {vocab})")
