"""A batched decode forward with pool slots against one attention call per sequence.

    python benchmarks/bench_batch_forward.py [--target PATH] [--context 100] [--reps 20]

For B = 1, 4, 16, 64 sessions of --context tokens each, the median ms of one decode forward (one
new token per session) through ``LlamaDecoder.forward_batch``, with the sessions' caches either
pool slots (core/kv_slots.py: the sessions of a slab attend in one SDPA call per layer) or private
buffers (attended one sequence at a time, as every cache was before the pool). Both ways alternate
within every repetition; one thread, fp32.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, machine, median  # noqa: E402

SESSIONS = (1, 4, 16, 64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--context", type=int, default=100, help="tokens in every session's cache")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from specdec.core.llama_decode import LlamaDecoder
    from specdec.core.models import load_causal_lm

    dec = LlamaDecoder(load_causal_lm(args.target).model)
    prompt = list(range(1, args.context + 1))
    caches = {}
    for kind, make in (("pooled", dec.new_cache), ("private", dec.private_cache)):
        caches[kind] = [make() for _ in range(max(SESSIONS))]
        for cache in caches[kind]:
            dec.forward(cache, prompt, 0, 1)

    def step(kind: str, b: int) -> float:
        t0 = time.perf_counter()
        dec.forward_batch(caches[kind][:b], [[5]] * b, [args.context] * b, [1] * b)  # position `context` is scratch
        return time.perf_counter() - t0

    times = {(kind, b): [] for kind in caches for b in SESSIONS}
    for rep in range(args.reps + 3):  # the first 3 warm up
        for b in SESSIONS:
            for kind in caches:
                t = step(kind, b)
                if rep >= 3:
                    times[kind, b].append(t)
    info = machine()
    print(f"target {args.target}, {args.context} tokens per session, one new token each, 1 thread, {args.reps} reps, medians")
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}")
    print(f"{'sessions':>8}{'pooled ms':>11}{'private ms':>12}{'private/pooled':>16}{'pooled tok/s':>14}")
    for b in SESSIONS:
        pooled, private = median(times["pooled", b]), median(times["private", b])
        print(f"{b:>8}{1e3 * pooled:>11.2f}{1e3 * private:>12.2f}{private / pooled:>16.2f}{b / pooled:>14.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
