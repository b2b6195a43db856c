"""What drafting costs a verification that runs at the same time on the same machine.

    python benchmarks/bench_contention.py [--target PATH] [--draft PATH] [--k 3] [--reps 200] [--prefix 100]

Overlap (draft block n+1 while block n is verified) only gains if the two really run in
parallel. On a machine where drafter and verifier share cores, a draft forward can slow the
target forward it overlaps; this measures by how much. The median ms of one target verification
forward (1 + k rows after --prefix tokens, one thread) in three states, cycled in every repetition:

  alone           nothing else runs
  beside_process  a second process drafts without pause (draft forwards, one thread), as a
                  `specdec serve draft` on the same machine would
  beside_thread   a thread of the same process drafts without pause (the embedded path, where
                  drafter and verifier are threads of one process and share its GIL)
  beside_spin     a second process runs a pure-Python loop (no vector units, little memory traffic)

The ratio beside / alone bounds what overlap can gain here (the model of overlap's gain in
docs/performance.md, "How to read these figures", assumes the draft costs the verifier nothing;
section 1.7 there has this benchmark's figures).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, machine, median  # noqa: E402

DRAFT_LOOP = """
import sys, torch
torch.set_num_threads(1)
from specdec.core.llama_decode import LlamaDecoder
from specdec.core.models import load_causal_lm
dec = LlamaDecoder(load_causal_lm(sys.argv[1]).model)
cache = dec.new_cache()
dec.forward(cache, list(range(1, 101)), 0, 1)
print("ready", flush=True)
while True:
    for t in range(4):  # a 4-token block, drafted one token at a time
        dec.forward(cache, [5], 100 + t, 1)
"""
SPIN_LOOP = 'print("ready", flush=True)\nwhile True: pass\n'


def start(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    if proc.stdout.readline().strip() != b"ready":
        raise SystemExit("the background process did not start")
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--k", type=int, default=3, help="draft tokens per verification (the forward feeds 1 + k rows)")
    ap.add_argument("--prefix", type=int, default=100)
    ap.add_argument("--reps", type=int, default=200, help="forwards per state and cycle")
    ap.add_argument("--cycles", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from specdec.core.llama_decode import LlamaDecoder
    from specdec.core.models import load_causal_lm

    dec = LlamaDecoder(load_causal_lm(args.target).model)
    cache = dec.new_cache()
    dec.forward(cache, list(range(1, args.prefix + 1)), 0, 1)
    rows = [5] * (args.k + 1)

    def forwards() -> list[float]:
        out = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            dec.forward(cache, rows, args.prefix, len(rows))  # positions past the prefix are scratch
            out.append(time.perf_counter() - t0)
        return out

    draft = LlamaDecoder(load_causal_lm(args.draft).model)
    draft_cache = draft.new_cache()
    draft.forward(draft_cache, list(range(1, 101)), 0, 1)
    drafting = threading.Event()

    def draft_thread() -> None:
        while drafting.is_set():
            for t in range(4):
                draft.forward(draft_cache, [5], 100 + t, 1)

    forwards()  # warm-up
    times: dict[str, list[float]] = {"alone": [], "beside_process": [], "beside_thread": [], "beside_spin": []}
    for _ in range(args.cycles):
        times["alone"] += forwards()
        drafting.set()
        worker = threading.Thread(target=draft_thread, daemon=True)
        worker.start()
        try:
            times["beside_thread"] += forwards()
        finally:
            drafting.clear()
            worker.join()
        for state, proc in (("beside_process", start(DRAFT_LOOP, args.draft)), ("beside_spin", start(SPIN_LOOP))):
            try:
                time.sleep(0.2)
                times[state] += forwards()
            finally:
                proc.kill()
                proc.wait()
    info = machine()
    alone = median(times["alone"])
    print(f"target {args.target}: verification of 1 + {args.k} rows after {args.prefix} tokens, one thread, "
          f"{args.cycles} x {args.reps} forwards per state, medians")
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}")
    for state, xs in times.items():
        print(f"{state:<16}{1e3 * median(xs):8.2f} ms  x{median(xs) / alone:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
