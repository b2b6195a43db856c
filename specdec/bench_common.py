"""What every benchmark shares (``specdec bench`` and ``benchmarks/``): the machine a figure was
measured on, and the prompts it was measured with."""
from __future__ import annotations

import json
import os
import platform
import sysconfig
from pathlib import Path

# Openings of ordinary Python, for model pairs that come without a held-out list (a pair trained
# elsewhere, the tests' random-weight pair).
BUILTIN_PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_files(root):\n    for dirpath, dirnames, filenames in os.walk(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_config(path):\n    with open(path, encoding=\"utf-8\") as f:\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n",
    "import json\n\n\ndef load(path):\n    \"\"\"Load a JSON file and return its contents.\"\"\"\n",
    "def merge_sort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
)


def held_out_prompts(n: int, card_dir: Path, chars: int = 160) -> list[str]:
    """Openings of functions/classes in a trained pair's held-out files (never trained on); the list
    is ``training.json`` in ``card_dir`` (the folder holding target/ and draft/)."""
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


def bench_prompts(n: int, target: str | Path, prompts_file: str | Path | None = None) -> tuple[list[str], str]:
    """``n`` prompts and where they came from: a file (a JSON list of strings, else one prompt per
    line), else the pair's held-out files when its folder has ``training.json``, else built-in code
    openings (repeated when ``n`` exceeds them)."""
    if prompts_file:
        text = Path(prompts_file).read_text(encoding="utf-8")
        prompts = json.loads(text) if text.lstrip().startswith("[") else [line for line in text.splitlines() if line.strip()]
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise ValueError(f"{prompts_file}: expected a JSON list of non-empty strings or one prompt per line")
        return [prompts[i % len(prompts)] for i in range(n)], str(prompts_file)
    card_dir = Path(target).resolve().parent
    if (card_dir / "training.json").is_file():
        return held_out_prompts(n, card_dir), f"held-out files of {card_dir / 'training.json'}"
    return [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(n)], "built-in code openings"


def machine() -> dict:
    """What the figures were measured on: timings only compare within one machine kind."""
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
