"""Batched "branch" decoding for pre-drafting: B continuations of one sequence in one forward per step.

While the verifier checks drafts d_1..d_k, the drafter can draft ahead for several likely outcomes at
once. Branch b assumes the committed sequence is the session's first ``base_lens[b]`` tokens followed
by a guessed token (e.g. ``base_lens[b] = n0 + j``: j drafts accepted, then the recovered token).
A step feeds one token per branch as B rows of one forward (tree attention): on a small draft model
a step is bound by per-op overhead, not arithmetic, so B rows cost about what one row does
(benchmarks/bench_branches.py measures it).

Layout: a private buffer ``[layers, 2 (k, v), kv_heads, P + B * max_steps, head_dim]`` whose first
``P = max(base_lens)`` positions are a copy of the session cache, made once; step t writes branch b's
K/V at ``P + t * B + b``. Row b attends to buffer positions ``[0, base_lens[b])`` and to its own
scratch slots, through one boolean mask and one SDPA call per layer. The session's ``DecodeCache``
is only read, so the drafter's real KV is untouched whatever branch wins. The per-layer math is
``LlamaDecoder.forward``'s, row for row.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdec.core.llama_decode import DecodeCache, LlamaDecoder


class BranchBatch:
    """B branches off one sequence's ``DecodeCache``: branch b sees cache positions ``[0, base_lens[b])``
    plus its own tokens.

    ``cached_len``: how many leading positions of ``cache`` hold valid K/V (the session's cached length;
    a ``DecodeCache`` has capacity, not a length). Every ``base_lens[b]`` must be at most that.
    ``max_steps``: tokens each branch will be fed at most (the m of m-token drafting).
    """

    @torch.inference_mode()
    def __init__(self, decoder: LlamaDecoder, cache: DecodeCache, base_lens: Sequence[int], max_steps: int, *,
                 cached_len: int) -> None:
        if not base_lens:
            raise ValueError("base_lens is empty: a batch needs at least one branch")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if not 0 <= cached_len <= cache.capacity:
            raise ValueError(f"cached_len {cached_len} is outside the cache's capacity {cache.capacity}")
        if cache.buf.dtype != decoder.dtype:
            raise ValueError(f"cache is {cache.buf.dtype} but the decoder runs {decoder.dtype}")
        bad = [n for n in base_lens if not 0 <= n <= cached_len]
        if bad:
            raise ValueError(f"base_lens {bad} outside [0, {cached_len}]: the cache holds {cached_len} positions")
        if max(base_lens) + max_steps > decoder.context_length:
            raise ValueError(f"{max(base_lens)} + {max_steps} positions exceed the model's context length {decoder.context_length}")
        self._decoder = decoder
        self.base_lens = tuple(base_lens)
        self.max_steps = max_steps
        self.steps = 0  # tokens fed to each branch so far
        B, P = len(base_lens), max(base_lens)
        self._prefix = P
        dec = decoder
        self._buf = torch.empty(len(dec.layers), 2, dec.n_kv, P + B * max_steps, dec.head_dim, dtype=dec.dtype)
        self._buf[:, :, :, :P] = cache.buf[:, :, :, :P]  # the one copy of the shared prefix
        base = torch.tensor(self.base_lens)  # [B]
        steps = torch.arange(max_steps)
        self._rotary = dec.rotary[base[None, :] + steps[:, None]]  # [max_steps, B, 1, d/2]
        # mask[b, j]: row b may attend to buffer position j. Scratch slot s belongs to branch s % B;
        # slicing to P + B * (t + 1) at step t hides the later steps. (Sliced views run as fast as
        # contiguous copies or float masks, measured; building the mask is most of the setup.)
        mask = torch.cat([torch.arange(P)[None, :] < base[:, None],
                          torch.eye(B, dtype=torch.bool).repeat(1, max_steps)], dim=1)  # [B, P + B * max_steps]
        # None where every row sees everything (one branch, at P): SDPA's unmasked path.
        self._masks = [None if B == 1 else mask[:, : P + B * (t + 1)] for t in range(max_steps)]

    @property
    def num_branches(self) -> int:
        return len(self.base_lens)

    @torch.inference_mode()
    def step(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed one token per branch (branch b's at position ``base_lens[b] + steps``); logits ``[B, vocab]`` float32."""
        B, t = self.num_branches, self.steps
        if len(token_ids) != B:
            raise ValueError(f"expected one token per branch ({B}), got {len(token_ids)}")
        if t >= self.max_steps:
            raise ValueError(f"all {self.max_steps} steps of this batch are used")
        dec = self._decoder
        lo = self._prefix + t * B  # this step's scratch slots [lo, lo + B)
        x = dec.embed_rows(token_ids)  # [B, hidden]
        # Row b at its own position (rotary) and seeing only its branch (mask): LlamaDecoder's layer math.
        x = dec.layers_forward(x, self._rotary[t], self._buf, lo, self._masks[t])
        self.steps = t + 1
        return dec.lm_head(F.rms_norm(x, (dec.hidden,), dec.final_norm, dec.eps)).float()  # [B, vocab]


def draft_greedy(batch: BranchBatch, first_tokens: Sequence[int], num_tokens: int) -> list[list[int]]:
    """Greedy drafts of ``num_tokens`` tokens per branch, branch b starting from ``first_tokens[b]``
    (its guessed token, fed at ``base_lens[b]``). Uses ``num_tokens`` steps of ``batch``."""
    drafts: list[list[int]] = [[] for _ in first_tokens]
    tokens = list(first_tokens)
    for _ in range(num_tokens):
        tokens = batch.step(tokens).argmax(dim=-1).tolist()  # [B]
        for draft, token in zip(drafts, tokens):
            draft.append(token)
    return drafts
