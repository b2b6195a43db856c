"""A draft vocabulary for an EAGLE head: the target's most frequent tokens in the head's training
stream (EAGLE-3's reduced draft vocabulary). The head then scores only those rows of the target's
LM head, a fraction of the bytes each draft token reads; a token outside it is never proposed, which
costs acceptance where the target would have chosen it and never changes output.

Writes ``draft_vocab.json`` beside the head: the ids, most frequent first, and their coverage of the
training stream and of the held-out files (the stream and split scripts/train_eagle_head.py uses).

    python scripts/draft_vocab.py --size 2048            # models/demo/eagle/draft_vocab.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FILE = "draft_vocab.json"


def _trainer():
    spec = importlib.util.spec_from_file_location("train_eagle_head", Path(__file__).with_name("train_eagle_head.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_eagle_head"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "models/demo/target"))
    ap.add_argument("--head", type=Path, default=ROOT / "models/demo/eagle")
    ap.add_argument("--card", type=Path, default=ROOT / "models/demo/training.json")
    ap.add_argument("--size", type=int, default=2048)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    stream, held, _ = _trainer().corpus_streams(tok, args.card)
    counts = torch.bincount(stream, minlength=len(tok))
    ids = torch.argsort(counts, descending=True, stable=True)[: args.size]
    chosen = torch.zeros(len(counts), dtype=torch.bool)
    chosen[ids] = True
    held_ids = torch.tensor([t for _, file_ids in held for t in file_ids])
    coverage = {"train": round(float(chosen[stream].float().mean()), 4), "held_out": round(float(chosen[held_ids].float().mean()), 4)}
    out = args.head / FILE
    out.write_text(json.dumps({"size": args.size, "coverage": coverage, "token_ids": ids.tolist()}) + "\n")
    print(f"{out}: {args.size} of {len(counts)} tokens, coverage {coverage}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
