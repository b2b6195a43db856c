"""Torch threads on this machine: one or every core per forward, one model thread or two.

    python benchmarks/bench_threads.py [--target PATH] [--draft PATH] [--reps 40] [--busy]

1. A target decode forward of B = 1, 16, 64 sessions (100 cached tokens each) at 1 thread and at
   every core, alternated call by call.
2. A sequential speculation step (3 draft tokens, then a verification of 4 rows): drafter and
   verifier on one thread, taking turns, against a thread each that hand over with an event (the
   embedded path before `DraftEngine.submit`), each at 1 thread and at every core.

``--busy``: the same with another process spinning on a core, as a neighbour on a shared machine
does. Why core/threads.py chooses the count by measurement: every core wins on a quiet machine and
loses by several times beside a busy neighbour.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, machine  # noqa: E402

K = 3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--busy", action="store_true", help="another process spins on a core meanwhile")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from specdec.core.llama_decode import LlamaDecoder
    from specdec.roles import available_cores

    cores = available_cores()
    torch.set_num_threads(1)
    tgt = LlamaDecoder(AutoModelForCausalLM.from_pretrained(args.target).eval())
    drf = LlamaDecoder(AutoModelForCausalLM.from_pretrained(args.draft).eval())
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        info = machine()
        print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}; "
              f"{'a busy neighbour process' if args.busy else 'quiet'}; counts 1 and {cores}")
        print("\ndecode forward of B sessions, median ms")
        print(f"{'B':>4} {'1 thread':>9} {f'{cores} threads':>10} {'ratio':>6}")
        for b in (1, 16, 64):
            caches = [tgt.new_cache() for _ in range(b)]
            for c in caches:
                tgt.forward(c, list(range(5, 105)), 0, 1)
            times: dict[int, list[float]] = {1: [], cores: []}
            for r in range(args.reps):
                count = (1, cores)[r % 2]
                torch.set_num_threads(count)
                t = time.perf_counter()
                tgt.forward_batch(caches, [[7]] * b, [100] * b, [1] * b)
                times[count].append(time.perf_counter() - t)
            one, many = (statistics.median(times[c][2:]) * 1e3 for c in (1, cores))
            print(f"{b:>4} {one:9.2f} {many:10.2f} {one / many:6.2f}")
            for c in caches:
                c.free()
        tc, dc = tgt.new_cache(), drf.new_cache()
        tgt.forward(tc, list(range(5, 105)), 0, 1)
        drf.forward(dc, list(range(5, 105)), 0, 1)
        print(f"\nsequential speculation step ({K} drafts, then verify {K + 1} rows), median ms")
        for count in (1, cores):
            one = step(tgt, drf, tc, dc, count, True, args.reps * 3)
            two = step(tgt, drf, tc, dc, count, False, args.reps * 3)
            print(f"  {count} thread(s): one model thread {one:6.2f}, a thread each {two:6.2f}")
    finally:
        if neighbour is not None:
            neighbour.kill()
    return 0


def step(tgt, drf, tc, dc, count: int, one_thread: bool, reps: int) -> float:
    """Median ms of a draft-then-verify step, the two models on one thread or a thread each."""
    times: list[float] = []
    turn_draft, turn_verify = threading.Event(), threading.Event()

    def draft() -> None:
        for j in range(K):
            drf.forward(dc, [7], 100 + j, 1)

    def verify() -> None:
        tgt.forward(tc, [7] * (K + 1), 100, K + 1)

    def both() -> None:
        torch.set_num_threads(count)
        for _ in range(reps):
            t = time.perf_counter()
            draft()
            verify()
            times.append(time.perf_counter() - t)

    def drafter() -> None:
        torch.set_num_threads(count)
        for _ in range(reps):
            turn_draft.wait()
            turn_draft.clear()
            times.append(time.perf_counter())
            draft()
            turn_verify.set()

    def verifier() -> None:
        torch.set_num_threads(count)
        for i in range(reps):
            turn_verify.wait()
            turn_verify.clear()
            verify()
            times[i] = time.perf_counter() - times[i]
            turn_draft.set()

    threads = [threading.Thread(target=both)] if one_thread else [threading.Thread(target=drafter), threading.Thread(target=verifier)]
    for t in threads:
        t.start()
    turn_draft.set()
    for t in threads:
        t.join()
    return statistics.median(times[10:]) * 1e3


if __name__ == "__main__":
    sys.exit(main())
