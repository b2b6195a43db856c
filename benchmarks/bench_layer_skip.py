"""Can layer-skip self-speculation pay on the demo target? Acceptance and cost of the target's own layers as a drafter.

A layer-skip drafter (LayerSkip's early exit, SWIFT's skipped layers) runs a subset of the target's
layers and its LM head. For each subset this measures, on the demo pair's held-out files:
- how often its greedy token equals the full target's (teacher-forced: the per-token acceptance a
  greedy chain of its drafts would see), against the 1.6M draft model's;
- what a one-row step costs relative to the full target's (the lean forward built over the subset,
  alternated, medians);
and the best speedup a chain drafter with that acceptance alpha and cost c could give over target-only
decoding, max over k of (1 - alpha^(k+1)) / (1 - alpha) / (k c + v(k)), v(k) the measured cost of
verifying k + 1 rows relative to one (taken as 1: a lower bound on the cost, so an upper bound on the gain).

    python benchmarks/bench_layer_skip.py            # results in benchmarks/results/layer_skip/
"""
from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEMO, write_result  # noqa: E402

SUBSETS = {  # name: the target layers the drafter runs, in order
    "exit after 2": [0, 1], "exit after 4": [0, 1, 2, 3], "exit after 6": list(range(6)), "exit after 7": list(range(7)),
    "skip 2": [0, 1, 3, 4, 5, 6, 7], "skip 5": [0, 1, 2, 3, 4, 6, 7], "skip 3 and 5": [0, 1, 2, 4, 6, 7],
    "skip 2, 4 and 6": [0, 1, 3, 5, 7],
}


def with_layers(model, layers: list[int]):
    """``model`` running only ``layers`` (shared weights; call again with all layers to restore)."""
    model.model.layers = torch.nn.ModuleList([model.all_layers[i] for i in layers])
    model.config.num_hidden_layers = len(layers)
    return model


def best_speedup(alpha: float, cost: float, max_k: int = 8) -> tuple[float, int]:
    gains = [((1 - alpha ** (k + 1)) / (1 - alpha) / (k * cost + 1.0), k) for k in range(1, max_k + 1)]
    return max(gains)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=15, help="held-out files to read (default: all 15)")
    ap.add_argument("--tokens", type=int, default=400, help="tokens per file")
    ap.add_argument("--repeats", type=int, default=30, help="timed one-row steps per subset")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "layer_skip")
    args = ap.parse_args(argv)
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.core.llama_decode import LlamaDecoder

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DEMO / "draft", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    target.all_layers = list(target.model.layers)
    full_layers = list(range(len(target.all_layers)))
    card = json.loads((DEMO / "training.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / rel).read_text(encoding="utf-8", errors="replace") for rel in card["training"]["held_out_list"][: args.files]]

    agree = {name: 0 for name in ["draft model", *SUBSETS]}
    positions = 0
    with torch.inference_mode():
        for text in texts:
            ids = tok(text[: args.tokens * 8], return_tensors="pt").input_ids[:, : args.tokens]
            full = with_layers(target, full_layers)(ids, use_cache=False).logits[0].argmax(-1)
            positions += full.numel()
            agree["draft model"] += int((draft(ids, use_cache=False).logits[0].argmax(-1) == full).sum())
            for name, layers in SUBSETS.items():
                agree[name] += int((with_layers(target, layers)(ids, use_cache=False).logits[0].argmax(-1) == full).sum())
        # One-row step cost, alternated over subsets, relative to the full target's.
        decoders = {"full": LlamaDecoder(with_layers(target, full_layers), numerics="fast")}
        for name, layers in SUBSETS.items():
            decoders[name] = LlamaDecoder(with_layers(target, layers), numerics="fast")
        decoders["draft model"] = LlamaDecoder(draft, numerics="fast")
        with_layers(target, full_layers)
        prompt = tok(texts[0][:2000], return_tensors="pt").input_ids[0, :64].tolist()
        caches = {name: dec.new_cache() for name, dec in decoders.items()}
        for name, dec in decoders.items():
            dec.forward(caches[name], prompt, 0, 1)
        times = {name: [] for name in decoders}
        for r in range(args.repeats):
            for name, dec in decoders.items():
                t0 = time.perf_counter()
                dec.forward(caches[name], [prompt[r % len(prompt)]], len(prompt), 1)
                times[name].append(time.perf_counter() - t0)
    full_ms = statistics.median(times["full"]) * 1e3
    rows = []
    for name in agree:
        alpha = agree[name] / positions
        cost = statistics.median(times[name]) * 1e3 / full_ms
        gain, k = best_speedup(alpha, cost)
        rows.append({"drafter": name, "acceptance": round(alpha, 3), "step_ms": round(cost * full_ms, 3),
                     "cost_vs_target": round(cost, 3), "best_speedup_bound": round(gain, 3), "at_k": k})
    result = {"positions": positions, "target_step_ms": round(full_ms, 3), "rows": rows}
    write_result(args.out / "layer_skip.json", **result)
    print(f"{positions} positions; target one-row step {full_ms:.2f} ms")
    print("| drafter | acceptance | cost vs target step | speedup bound (k) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['acceptance']} | {r['cost_vs_target']} | {r['best_speedup_bound']} ({r['at_k']}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
