"""Shared helpers for benchmarks: prompts from held-out files, timing, models."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdec.bench_common import held_out_prompts as _held_out_prompts
from specdec.bench_common import machine  # noqa: F401  (shared with `specdec bench`)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


def held_out_prompts(n: int, card_dir: Path = DEMO, chars: int = 160) -> list[str]:
    """Openings of functions/classes in the demo pair's held-out files (never trained on)."""
    return _held_out_prompts(n, card_dir, chars)


def write_result(path: str | Path, **fields) -> None:
    """A benchmark's JSON result, with the machine it ran on first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **fields}, indent=2))


def median(xs):
    return statistics.median(xs) if xs else float("nan")


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def pair_arguments(description: str) -> argparse.ArgumentParser:
    """The options every benchmark shares: which pair, how many prompts, how long."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    return ap
