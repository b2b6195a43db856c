"""Shared helpers for benchmarks: prompts from held-out files, timing, models."""
from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


def held_out_prompts(n: int, card_dir: Path = DEMO, chars: int = 160) -> list[str]:
    """Openings of functions/classes in the demo pair's held-out files (never trained on)."""
    card = json.loads((Path(card_dir) / "training.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for rel in card["training"]["held_out_list"]:
        text = (stdlib / rel).read_text(encoding="utf-8", errors="replace")
        for marker in ("\ndef ", "\n    def ", "\nclass "):
            at = 0
            while len(prompts) < n * 4:
                at = text.find(marker, at + 1)
                if at < 0:
                    break
                prompts.append(text[at + 1 : at + 1 + chars])
    # Spread the picks over files instead of taking the first file's functions.
    step = max(1, len(prompts) // n)
    return prompts[::step][:n]


def machine() -> dict:
    """What the figures were measured on: timings only compare within one machine kind."""
    import os
    import platform

    import torch

    from specdec.core.llama_decode import native_bf16

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": native_bf16(), "torch": torch.__version__}


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
