"""The coupled rule of speculative sampling, beside the rejection rule (specdec.core.rejection).

Gumbel-max: if g is standard Gumbel noise over the vocabulary, argmax(log p + g) is distributed as p
(Gumbel 1954; Maddison, Tarlow & Minka 2014, https://arxiv.org/abs/1410.3831). Drafter and verifier
sharing that noise is "drafter-invariant speculative decoding" (Daliri, Musco & Suresh 2024,
https://arxiv.org/abs/2408.07978). Words used here:

* **noise** g_i: the Gumbel noise of position i of a request, [vocab], a pure function of
  (seed, i) (specdec.core.noise.gumbel_noise). Position i is the index in the sequence of the token
  being chosen, prompt included.
* **coupled token** of a distribution at position i: argmax(logprobs_i + g_i), ties to the lowest id.
* **draft tokens**: the k tokens a drafter proposed for positions n .. n+k-1. A model drafter drafts
  its own coupled token (:func:`coupled_draft`); any other proposal (n-gram, ...) is allowed too.
* **accepted** token: a draft token equal to the target's coupled token at its position, with all
  draft tokens before it accepted.
* **recovered** token: at the first draft token that is not accepted, the target's coupled token
  there, in its place.
* **bonus** token: when all k draft tokens are accepted, the target's coupled token at position n+k.

Every step emits ``num_accepted + 1`` tokens, each the target's coupled token at its position: the
very token target-only coupled sampling would choose. A seed therefore gives the same output whatever
k, the drafter, the batch, the topology or the replica, and each token is distributed exactly as the
target's (processed) distribution. Only the acceptance rate depends on the drafter: a model drafter's
coupled token from q equals the target's from p with probability at least (1 - TV) / (1 + TV), TV the
total variation between p and q (Daliri et al.), a little below the rejection rule's 1 - TV.
Greedy (temperature 0) is not routed here: it stays on ``greedy_verify``.
"""
from __future__ import annotations

import torch

from specdec.core.rejection import exact_match_verify
from specdec.core.sampling import SamplingParams, probs_from_logits, top_ids


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log of the distribution tokens are drawn from: ``logits`` [..., vocab] -> [..., vocab] float32.

    The log of ``probs_from_logits`` (temperature, then top-k, then top-p), -inf where a token is
    filtered out: the coupled rule draws from exactly the distribution the rejection rule would.
    Drafter and verifier both call it, each on its own logits.
    """
    if params.greedy:
        raise ValueError("temperature 0 is greedy: verify with greedy_verify, not the coupled rule")
    return probs_from_logits(logits, params).log()


def coupled_token(logprobs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The coupled token: argmax(``logprobs`` + ``noise``) over the last dim, ties to the lowest id.

    ``logprobs`` and ``noise``: [..., vocab] (noise on the device of logprobs). Returns int64 [...].
    """
    if logprobs.shape != noise.shape:
        raise ValueError(f"logprobs and noise must have one shape, got {list(logprobs.shape)} and {list(noise.shape)}")
    return top_ids(logprobs + noise.to(logprobs.device))


def coupled_draft(draft_logprobs: torch.Tensor, noise: torch.Tensor) -> int:
    """The draft token of a model drafter at one position: its own coupled token.

    ``draft_logprobs``: [vocab] from :func:`processed_logprobs` of the drafter's logits; ``noise``:
    [vocab], the noise of that position, the very row the verifier will use.
    """
    return int(coupled_token(draft_logprobs, noise))


def coupled_verify(
    draft_token_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the draft tokens that equal the target's coupled tokens; add the recovered or bonus token.

    Args:
        draft_token_ids: [batch, k] int64, the proposals.
        target_logprobs: [batch, k + 1, vocab] the target's processed log-probabilities
            (:func:`processed_logprobs`) at each draft position plus the bonus position.
        noise: [batch, k + 1, vocab] the noise of those positions, one request's seed per row.

    Returns:
        output_ids: [batch, k + 1] int64: accepted tokens, then the recovered or bonus token, then -1.
        num_accepted: [batch] int64 in [0, k].
    """
    batch, k = draft_token_ids.shape
    vocab = target_logprobs.shape[-1]
    if target_logprobs.shape != (batch, k + 1, vocab):
        raise ValueError(f"target_logprobs must be [batch, k+1, vocab] = [{batch}, {k + 1}, {vocab}], "
                         f"got {list(target_logprobs.shape)}")
    target_ids = coupled_token(target_logprobs, noise)  # [batch, k + 1]
    accepted = draft_token_ids.to(target_ids.device) == target_ids[:, :k]  # [batch, k]
    # Accepted prefix length: position of the first mismatch, or k.
    num_accepted = torch.cumprod(accepted.long(), dim=-1).sum(dim=-1)  # [batch]
    # Accepted draft tokens equal the target's coupled tokens, so the output is those up to and
    # including position num_accepted (the recovered or bonus token).
    positions = torch.arange(k + 1, device=target_ids.device).expand(batch, k + 1)  # [batch, k + 1]
    output_ids = torch.where(positions <= num_accepted[:, None], target_ids, torch.full_like(target_ids, -1))
    return output_ids, num_accepted


def coupled_verify_one(draft_token_ids: tuple[int, ...], target_logprobs: torch.Tensor,
                       noise: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """:func:`coupled_verify` for one request, in the shape of ``greedy_verify``.

    ``target_logprobs`` and ``noise``: [k+1, vocab]. Returns (the tokens to commit, num_accepted).
    """
    target_ids = coupled_token(target_logprobs, noise).tolist()  # [k+1]
    if len(target_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"target_logprobs must have k+1 = {len(draft_token_ids) + 1} rows, got {len(target_ids)}")
    return exact_match_verify(draft_token_ids, target_ids)
