"""One forward of two checkouts, alternated: the runners' own time per batch shape, before against after.

    python benchmarks/bench_forward_ab.py --before /path/to/venv-of-main/bin/python [--after PYTHON]
        [--runners lean,paged] [--numerics exact,fast] [--shapes 1x1,4x1,1x5,16x1,4x5] [--context 100]
        [--calls 130] [--rounds 6] [--threads 1] [--lean-kernels measure,measure] [--out FILE.json]

Each round runs, for each side in turn, one subprocess (``--worker``) that loads the demo target
into each runner and numerics asked, prefills S sessions of ``--context`` tokens and times
``--calls`` forwards of S sessions x R rows (rolled back after each, as a rejection would); the
table gives per shape the median of the rounds' medians and after/before speed per round. Through
the `ModelRunner` interface only (`core/runner.py`), so any two checkouts that keep it compare.
Not a test: timings.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, write_result  # noqa: E402


def worker(args) -> dict:
    import torch

    from specdec.core.exact_ops import ExactNumericsUnavailable
    from specdec.core.llama_decode import LlamaDecoder
    from specdec.core.models import load_causal_lm
    from specdec.core.paged_runner import PagedRunner
    from specdec.core.runner import Feed, LeanRunner

    torch.set_num_threads(args.threads)
    loaded = load_causal_lm(args.target)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    most = max(s for s, _ in shapes)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, loaded.vocab_size, (args.context + 8,), generator=gen).tolist() for _ in range(most)]
    out = {}
    for kind in args.runners.split(","):
        for numerics in args.numerics.split(","):
            try:
                if kind == "lean":
                    one, many = args.lean_kernels.split(",")
                    runner = LeanRunner(LlamaDecoder(loaded.model, numerics=numerics, single_row=one, multi_row=many))
                else:
                    runner = PagedRunner(loaded.model, numerics=numerics, max_sessions=most,
                                         kv_budget_tokens=most * (args.context + 16))
            except ExactNumericsUnavailable:  # (the paged runner's exact linears on some CPUs): not timed
                continue
            caches = [runner.new_cache() for _ in range(most)]
            runner.forward([Feed(c, 0, ids[b][:args.context], 1) for b, c in enumerate(caches)])
            for s, r in shapes:
                feeds = [Feed(caches[b], args.context, ids[b][args.context:args.context + r], r) for b in range(s)]
                times = []
                for call in range(args.calls + 5):  # the first five warm up
                    t = time.perf_counter()
                    runner.forward(feeds)
                    if call >= 5:
                        times.append(time.perf_counter() - t)
                    for c in caches[:s]:
                        runner.truncate(c, args.context)
                out[f"{kind} {numerics} {s}x{r}"] = statistics.median(times) * 1e3
            for c in caches:
                runner.free(c)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the python whose specdec is 'before'")
    ap.add_argument("--after", default=sys.executable, help="the python whose specdec is 'after' (default: this one)")
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--runners", default="lean,paged")
    ap.add_argument("--numerics", default="exact,fast")
    ap.add_argument("--shapes", default="1x1,4x1,1x5,16x1,4x5")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--calls", type=int, default=130)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lean-kernels", default="measure,measure",
                    help="the lean decoder's fast-numerics kernels for one row and more (fixed: no per-process timing noise)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if not args.before:
        ap.error("--before is required")
    passed = ["--target", args.target, "--runners", args.runners, "--numerics", args.numerics, "--shapes", args.shapes,
              "--context", str(args.context), "--calls", str(args.calls), "--threads", str(args.threads),
              "--lean-kernels", args.lean_kernels, "--worker"]
    rounds: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            python = args.before if side == "before" else args.after
            done = subprocess.run([python, os.path.abspath(__file__), *passed], check=True, capture_output=True, text=True,
                                  cwd=tempfile.gettempdir())
            rounds[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    table = {}
    print(f"{'forward':<24} {'before ms':>10} {'after ms':>10} {'speed':>6}  per round")
    for name in rounds["before"][0]:
        before = statistics.median(x[name] for x in rounds["before"])
        after = statistics.median(x[name] for x in rounds["after"])
        per_round = [b[name] / a[name] for b, a in zip(rounds["before"], rounds["after"])]
        table[name] = {"before_ms": before, "after_ms": after, "speed": before / after, "per_round": per_round}
        print(f"{name:<24} {before:>10.3f} {after:>10.3f} {before / after:>6.2f}  {', '.join(f'{x:.2f}' for x in per_round)}")
    if args.out:
        write_result(args.out, args=vars(args), table=table, rounds=rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
