"""The rejection rule of speculative sampling, as one pure batched function.

Leviathan et al. 2023 (https://arxiv.org/abs/2211.17192), Chen et al. 2023
(https://arxiv.org/abs/2302.01318). Words used everywhere in specdec:

* **draft tokens**: the k tokens a drafter proposed for positions n .. n+k-1, drawn from
  ``draft_probs`` (its distribution q after sampling transforms and any top-K truncation).
* **accepted** token: a draft token kept because ``u < target_probs(x) / draft_probs(x)``.
* **recovered** token: at the first rejection, a token drawn from
  norm(max(0, target_probs - draft_probs)) instead of the rejected draft token.
* **bonus** token: when all k draft tokens are accepted, one more token drawn from the target's
  distribution at position n+k.

Every step therefore emits ``num_accepted + 1`` tokens, and their distribution is exactly the
target's. Greedy needs no special case: with one-hot target probabilities (see
``specdec.core.sampling.probs_from_logits``) a draft token is accepted iff it is the target's argmax,
and the recovered and bonus tokens are the argmax.
"""
from __future__ import annotations

import torch

from specdec.core.steps import common_prefix_len
from specdec.core.sampling import sample_from, top_ids


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decide which draft tokens to keep and draw the recovered or bonus token.

    Args:
        draft_token_ids: [batch, k] int64, the proposals.
        draft_probs: [batch, k, vocab] the exact distribution each draft token was drawn from, or
            None when drafts are point masses (greedy or n-gram drafts: q(x) = 1 at the token).
        target_probs: [batch, k + 1, vocab] the target's distribution at each draft position plus
            the bonus position.
        accept_uniforms: [batch, k] in [0, 1): the accept/reject test of each draft token.
        sample_uniforms: [batch, k + 1] in [0, 1): the draw of a recovered token (at the rejected
            position) or of the bonus token (at position k).

    Returns:
        output_ids: [batch, k + 1] int64: accepted tokens, then the recovered or bonus token, then -1.
        num_accepted: [batch] int64 in [0, k].
    """
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape != (batch, k + 1, vocab):
        raise ValueError(f"target_probs must be [batch, k+1, vocab] = [{batch}, {k + 1}, {vocab}], got {list(target_probs.shape)}")
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_token_ids, vocab).to(target_probs.dtype)  # [batch, k, vocab]
    elif draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must be [batch, k, vocab] = [{batch}, {k}, {vocab}], got {list(draft_probs.shape)}")
    draft_probs = draft_probs.to(target_probs.dtype)
    if accept_uniforms.shape != (batch, k) or sample_uniforms.shape != (batch, k + 1):
        raise ValueError(f"uniforms must be [batch, k] and [batch, k+1] = [{batch}, {k}] and [{batch}, {k + 1}], "
                         f"got {list(accept_uniforms.shape)} and {list(sample_uniforms.shape)}")

    ids = draft_token_ids.unsqueeze(-1)  # [batch, k, 1]
    p_x = target_probs[:, :k].gather(-1, ids).squeeze(-1)  # [batch, k]
    q_x = draft_probs.gather(-1, ids).squeeze(-1)  # [batch, k]
    # u < p/q written without the division (q(x) = 0 means x was never drawn, and then p/q = inf).
    # Compared in float64: rounding a float64 uniform just below 1 to float32 gives 1.0, which would
    # reject a draft token with p(x) = q(x) (e.g. a matching greedy draft) that must be accepted.
    accepted = accept_uniforms.double() * q_x.double() < p_x.double()  # [batch, k]
    # Accepted prefix length: position of the first rejection, or k.
    num_accepted = torch.cumprod(accepted.long(), dim=-1).sum(dim=-1)  # [batch]

    # The distribution of the final token: residual at the first rejection, target at the bonus.
    residual = (target_probs[:, :k] - draft_probs).clamp_min(0)  # [batch, k, vocab]
    # If p <= q everywhere the residual is empty, but then u < p/q held with probability 1 at this
    # position up to rounding; fall back to the target's distribution rather than divide by zero.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:, :k], residual)
    final_dists = torch.cat([residual, target_probs[:, k:]], dim=1)  # [batch, k + 1, vocab]
    rows = torch.arange(batch, device=target_probs.device)
    final_dist = final_dists[rows, num_accepted]  # [batch, vocab]
    final_token = sample_from(final_dist, sample_uniforms[rows, num_accepted])  # [batch]

    positions = torch.arange(k + 1, device=target_probs.device).expand(batch, k + 1)  # [batch, k + 1]
    padded_drafts = torch.cat([draft_token_ids, torch.full((batch, 1), -1, dtype=torch.long, device=draft_token_ids.device)], dim=1)
    output_ids = torch.where(positions < num_accepted[:, None], padded_drafts, torch.full_like(padded_drafts, -1))
    output_ids[rows, num_accepted] = final_token
    return output_ids, num_accepted


def exact_match_verify(draft_token_ids: tuple[int, ...], target_ids: list[int]) -> tuple[tuple[int, ...], int]:
    """Verification by exact match against the target's own choices ``target_ids`` [k+1]: the draft
    tokens up to the first that differs are accepted, then the target's token there. Returns (the
    tokens to commit, num_accepted). Greedy and coupled verification are both this rule."""
    accepted = common_prefix_len(draft_token_ids, target_ids[: len(draft_token_ids)])
    return (*draft_token_ids[:accepted], target_ids[accepted]), accepted


def greedy_verify(draft_token_ids: tuple[int, ...], logits: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """The rejection rule at temperature 0, without building distributions: a draft token is accepted
    iff it is the target's argmax; the token after the accepted ones is the argmax there.

    Exactly ``rejection_sample`` with one-hot target probabilities (ties go to the lowest id, as
    ``argmax`` and ``probs_from_logits`` agree), at a tenth of its cost per step
    (tests/test_rejection.py holds the two to the same output). ``logits``: [k+1, vocab].
    """
    return exact_match_verify(draft_token_ids, top_ids(logits).tolist())
