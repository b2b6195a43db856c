"""`specdec bench --concurrency` of two checkouts (or settings), alternated run by run, on one machine.

    python benchmarks/bench_before_after.py --before /path/to/venv-of-main/bin/python \\
        --levels 1,4,16,64 --modes off,adaptive --numerics fast,exact --rounds 3 --out benchmarks/results/x.json

Each variant is a `python -m specdec bench --concurrency ...` subprocess run from a neutral folder,
so the interpreter decides which specdec it imports (a venv with the other checkout installed
editable is "before"). Variants: before and after, in each of ``--numerics``. Every round runs each
once, in turn, so machine noise hits all alike; the table gives per level and mode the median
tokens/s and, per numerics, the after/before ratio (its median and its lowest over the rounds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402


def run_variant(python: str, extra: list[str], args, out: Path) -> dict:
    cmd = [python, "-m", "specdec", "bench", "--concurrency", args.levels, "--modes", args.modes,
           "--tokens-per-level", str(args.tokens_per_level), "--threads", str(args.threads), "--out", str(out), *extra]
    subprocess.run(cmd, check=True, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)
    return json.loads((out / "load.json").read_text())["results"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the python whose specdec is 'before'")
    ap.add_argument("--after", default=sys.executable, help="the python whose specdec is 'after' (default: this one)")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--modes", default="off,adaptive")
    ap.add_argument("--numerics", default="fast,exact", help="the numerics each side runs in, comma-separated")
    ap.add_argument("--tokens-per-level", type=int, default=1024)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args()
    numerics = args.numerics.split(",")
    variants = {f"{side}_{n}": (python, ["--numerics", n]) for n in numerics
                for side, python in (("before", args.before), ("after", args.after))}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, (python, extra) in variants.items():
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                runs[name].append(run_variant(python, extra, args, Path(tmp) / f"{name}-{r}"))
    keys = list(runs[next(iter(variants))][0])
    table = {}
    print(f"{'level/mode':<14}" + "".join(f"{name:>15}" for name in variants)
          + "".join(f"{'after/before ' + n:>22}" for n in numerics))
    for key in keys:
        med = {name: statistics.median(run[key]["tokens_per_s"] for run in runs[name]) for name in variants}
        row = {f"{name}_tokens_per_s": med[name] for name in variants}
        line = f"{key:<14}" + "".join(f"{med[name]:>15.1f}" for name in variants)
        for n in numerics:
            per_round = [a[key]["tokens_per_s"] / b[key]["tokens_per_s"]
                         for a, b in zip(runs[f"after_{n}"], runs[f"before_{n}"])]
            row[f"after_vs_before_{n}"] = med[f"after_{n}"] / med[f"before_{n}"]
            row[f"after_vs_before_{n}_per_round"] = per_round
            line += f"{row[f'after_vs_before_{n}']:>15.2f} (min {min(per_round):.2f})"
        table[key] = row
        print(line)
    if args.out:
        write_result(args.out, args=vars(args), table=table, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
