"""Prefilling many prompts at once: one target forward for all of them against one forward each.

    python benchmarks/bench_prefill.py [--target PATH] [--prompts 64] [--reps 3]

What 64 clients arriving together cost the verifier before their first token: the held-out prompts
(~43 tokens each on the demo pair) prefilled through ``logits_for_batch`` one sequence at a time,
and all in one call (as ``VerifierEngine.open_batch`` does), at one torch thread and at every core.
The ways alternate within every repetition; medians, seconds for all the prompts.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, held_out_prompts, machine, median  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from specdec.core.kv import KVSequence, logits_for_batch
    from specdec.roles import available_cores
    from specdec.target.engine import TargetConfig, VerifierEngine

    torch.set_num_threads(1)
    engine = VerifierEngine.from_config(TargetConfig(args.target, threads=1))
    tok = engine.loaded.tokenizer
    prompts = [tok.encode(p) for p in held_out_prompts(args.prompts)]

    def prefill(together: bool) -> float:
        kvs = [KVSequence(engine.loaded.model, engine.decoder, engine.runner) for _ in prompts]
        t0 = time.perf_counter()
        if together:
            logits_for_batch([(kv, p, 1) for kv, p in zip(kvs, prompts)])
        else:
            for kv, p in zip(kvs, prompts):
                logits_for_batch([(kv, p, 1)])
        return time.perf_counter() - t0  # (the caches go back to the pool as kvs goes)

    counts = sorted({1, available_cores()})
    times: dict[tuple[int, bool], list[float]] = {(c, t): [] for c in counts for t in (False, True)}
    for rep in range(args.reps + 1):  # the first warms up
        for count in counts:
            torch.set_num_threads(count)
            for together in (False, True):
                t = prefill(together)
                if rep:
                    times[count, together].append(t)
    info = machine()
    mean_len = sum(map(len, prompts)) / len(prompts)
    print(f"target {args.target}: {len(prompts)} prompts of {mean_len:.1f} tokens on average, {args.reps} reps, medians")
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}")
    print(f"{'threads':>7}{'one by one s':>14}{'together s':>12}{'ratio':>7}")
    for count in counts:
        alone, together = median(times[count, False]), median(times[count, True])
        print(f"{count:>7}{alone:>14.3f}{together:>12.3f}{alone / together:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
