"""What verifying k drafts costs: one sequence's forward of 1, 5, 9 and 17 rows against one row.

    python benchmarks/bench_rows.py [--target PATH] [--dtypes float32,bfloat16] [--numerics exact,fast]
        [--threads 1,2] [--context 200] [--reps 15] [--out benchmarks/results/rows/NAME.json]

Speculative decoding's premise is that k + 1 rows cost about one row's weight traffic. For each
target dtype, numerics and torch thread count, a decoder (the lean runner, as a verifier builds it)
holds one sequence of --context tokens; each repetition runs, in turn, a forward of every row count
over it (rolled back after each, as a rejection would), so machine noise hits all alike. Reported:
the median ms of each and its ratio to one row's; the machine's CPU flags. Not a test: timings.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, machine  # noqa: E402

from specdec.core.llama_decode import LlamaDecoder  # noqa: E402
from specdec.core.models import load_causal_lm  # noqa: E402
from specdec.core.runner import Feed, LeanRunner  # noqa: E402

ROWS = (1, 5, 9, 17)


def measure(target: str, dtype: str, numerics: str, threads: int, context: int, reps: int) -> dict:
    torch.set_num_threads(threads)
    loaded = load_causal_lm(target, dtype=dtype)
    decoder = LlamaDecoder(loaded.model, dtype=loaded.model.dtype, numerics=numerics, own_weights=True)
    runner = LeanRunner(decoder)
    cache = runner.new_cache()
    ids = torch.randint(10, loaded.vocab_size, (context + max(ROWS),), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward([Feed(cache, 0, ids[:context], 1)])
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    for rep in range(reps + 2):  # the first two warm up
        for n in ROWS:
            start = time.perf_counter()
            runner.forward([Feed(cache, context, ids[context:context + n], n)])
            elapsed = time.perf_counter() - start
            runner.truncate(cache, context)
            if rep >= 2:
                times[n].append(elapsed)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    return {"dtype": dtype, "numerics": decoder.numerics, "half_weights": getattr(decoder, "half_weights", False),
            "threads": threads, "ms": med, "vs_one_row": {n: med[n] / med[1] for n in ROWS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--numerics", default="exact,fast")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    print(f"{'dtype':<9} {'numerics':<6} thr " + " ".join(f"{n:>2} rows ms" for n in ROWS) + "   " +
          " ".join(f"{n:>2}/1" for n in ROWS[1:]))
    for dtype in args.dtypes.split(","):
        for numerics in args.numerics.split(","):
            for threads in (int(t) for t in args.threads.split(",")):
                r = measure(args.target, dtype, numerics, threads, args.context, args.reps)
                results.append(r)
                print(f"{dtype:<9} {r['numerics']:<6} {threads:>3} " + " ".join(f"{r['ms'][n]:>10.2f}" for n in ROWS) + "   " +
                      " ".join(f"{r['vs_one_row'][n]:>5.2f}" for n in ROWS[1:]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"target": args.target, "machine": machine(), "args": vars(args) | {"out": str(args.out)},
                                        "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
