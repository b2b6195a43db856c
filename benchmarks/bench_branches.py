"""Cost of pre-drafting B branches in one forward per step (core/branch_decode.py) vs one row.

    python benchmarks/bench_branches.py [--draft PATH] [--prefix 200] [--reps 400] [--dtype float32]

On the draft model, after a prefix of --prefix tokens, the median ms of:
  forward_1row     one LlamaDecoder.forward step, one token (the drafter's step today)
  branch_B         one BranchBatch.step with B rows (B branches, one token each), averaged over the
                   m steps of a batch; setup_ms is building the batch (the one copy of the prefix K/V)
  drafts_ms        m-token drafts for all B branches: setup + m steps, against B * m one-row steps
Methods alternate within every repetition so machine noise hits all alike; one thread.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, held_out_prompts, machine, median  # noqa: E402

BRANCHES = (1, 3, 5, 9)
NUM_STEPS = 4  # m: tokens drafted per branch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--prefix", type=int, default=200, help="tokens in the session cache")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from specdec.core.branch_decode import BranchBatch
    from specdec.core.llama_decode import LlamaDecoder
    from specdec.core.models import load_causal_lm

    loaded = load_causal_lm(args.draft)
    dec = LlamaDecoder(loaded.model, dtype=getattr(torch, args.dtype))
    prefix: list[int] = []
    for prompt in held_out_prompts(40, chars=400):  # real text, so attention sees real keys
        prefix += loaded.tokenizer(prompt)["input_ids"]
        if len(prefix) >= args.prefix:
            break
    assert len(prefix) >= args.prefix, f"only {len(prefix)} tokens of held-out text"
    prefix = prefix[: args.prefix]
    n = len(prefix)
    cache = dec.new_cache()
    dec.forward(cache, prefix, 0, 1)
    # Branch b: (b % 5) of 4 drafts rejected, i.e. base lengths n, n-1, .., n-4, then again.
    base_lens = {B: [n - b % 5 for b in range(B)] for B in BRANCHES}
    tokens = prefix[:9]

    one_row, steps, setups = [], {B: [] for B in BRANCHES}, {B: [] for B in BRANCHES}
    for rep in range(args.reps + 20):  # the first 20 warm up
        keep = rep >= 20
        for B in BRANCHES:
            t0 = time.perf_counter()
            batch = BranchBatch(dec, cache, base_lens[B], NUM_STEPS, cached_len=n)
            t1 = time.perf_counter()
            step_s = []
            for t in range(NUM_STEPS):
                s0 = time.perf_counter()
                batch.step(tokens[:B])
                step_s.append(time.perf_counter() - s0)
            if keep:
                setups[B].append(t1 - t0)
                steps[B].append(sum(step_s) / NUM_STEPS)
        for t in range(NUM_STEPS):  # positions n.. of the session cache are scratch for this benchmark
            t0 = time.perf_counter()
            dec.forward(cache, tokens[t : t + 1], n + t, 1)
            if keep:
                one_row.append(time.perf_counter() - t0)

    ms = 1e3
    base = median(one_row) * ms
    info = machine()
    print(f"draft {args.draft} ({args.dtype}), prefix {n}, m = {NUM_STEPS}, 1 thread, {args.reps} reps, medians")
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}")
    print(f"{'method':<14}{'rows':>5}{'ms/step':>9}{'x 1-row':>9}{'setup_ms':>10}{'drafts_ms':>11}{'B*m 1-row':>11}")
    print(f"{'forward_1row':<14}{1:>5}{base:>9.3f}{1.0:>9.2f}{'':>10}{'':>11}{'':>11}")
    for B in BRANCHES:
        step, setup = median(steps[B]) * ms, median(setups[B]) * ms
        print(f"{'branch_' + str(B):<14}{B:>5}{step:>9.3f}{step / base:>9.2f}{setup:>10.3f}"
              f"{setup + NUM_STEPS * step:>11.2f}{B * NUM_STEPS * base:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
