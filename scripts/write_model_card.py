"""Write models/demo/README.md (the model card) from the measured figures.

    python benchmarks/bench_costs.py > benchmarks/results/costs/costs.json
    python benchmarks/bench_decode.py --out benchmarks/results/decode/speed.json
    python scripts/write_model_card.py

models/demo/training.json comes from scripts/train_demo_pair.py; costs.json from
benchmarks/bench_costs.py; speed.json from benchmarks/bench_decode.py --out (both kept, with the
other benchmarks' runs, under benchmarks/results/; docs/performance.md says when and where each was
measured). Nothing here is typed in by hand.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
RESULTS = ROOT / "benchmarks" / "results"
SAMPLE_PROMPT = "def fibonacci(n):"


def sample_completion() -> str:
    """What `specdec generate` prints for the issue's prompt with the defaults (greedy), 48 tokens."""
    out = subprocess.run([sys.executable, "-m", "specdec", "generate", SAMPLE_PROMPT, "--max-new-tokens", "48", "--json",
                          "--target", str(DEMO / "target"), "--draft", str(DEMO / "draft")],
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout)["text"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--costs", type=Path, default=RESULTS / "costs" / "costs.json")
    ap.add_argument("--decode", type=Path, default=RESULTS / "decode" / "speed.json")
    args = ap.parse_args()
    card = json.loads((DEMO / "training.json").read_text())
    costs = json.loads(args.costs.read_text())
    decode = json.loads(args.decode.read_text())
    tr, models = card["training"], card["models"]
    t, d = models["target"], models["draft"]
    ratios = ", ".join(f"{v:.2f}" for v in costs["verify_cost_ratio"].values())
    ratios_hf = ", ".join(f"{v:.2f}" for v in costs["verify_cost_ratio_hf"].values())
    by_k = "\n".join(f"| {k} | {v['acceptance_rate']:.3f} | {v['tokens_per_step']:.2f} | {v['alpha_fit']:.3f} |" for k, v in costs["by_k"].items())
    methods = "\n".join(
        f"| {m} | {v['tokens_per_s']:.1f} | {v['speedup_vs_target_only']:.2f}x | {v['speedup_vs_specdec_k0']:.2f}x |"
        for m, v in decode["methods"].items()
    )
    bar = [
        ("target held-out bits per byte <= 1.15", t["held_out_bits_per_byte"] <= 1.15, f"{t['held_out_bits_per_byte']:.3f}"),
        ("greedy acceptance alpha (k = 1) >= 0.65", costs["alpha_k1"] >= 0.65, f"{costs['alpha_k1']:.3f}"),
        ("c <= 0.12", costs["c"] <= 0.12, f"{costs['c']:.3f}"),
        ("verifying 4 tokens <= 1.25x a decode step", costs["verify_cost_ratio"]["4"] <= 1.25, f"{costs['verify_cost_ratio']['4']:.2f}x"),
        ("training <= 100 minutes", tr["total_training_seconds"] <= 6000, f"{tr['total_training_seconds'] / 60:.0f} min"),
    ]
    m = costs.get("machine", {})
    machine_line = (f"{m['cpu']}, {m['cores']} cores, {m['cpu_capability']}, native bf16: {'yes' if m['native_bf16'] else 'no'}, "
                    f"torch {m['torch']}") if m else "2 cores"
    draft_bf16_note = (f" (with `--draft-dtype bfloat16`: {costs['draft_step_ms_bf16']:.2f} ms a token, c = {costs['c_bf16']:.3f})"
                       if "draft_step_ms_bf16" in costs else "")
    bar_rows = "\n".join(f"| {name} | {value} | {'met' if ok else '**not met**'} |" for name, ok, value in bar)
    text = f"""# specdec demo pair

A small Llama **target** and **draft** trained from scratch on CPU by `scripts/train_demo_pair.py` on
the Python {tr['python_version']} standard library (test folders skipped), for specdec's embedded
default and benchmarks. They complete Python code; they are demonstration models, not assistants.
Everything below was measured by the project's scripts (`scripts/write_model_card.py` writes this
file from `training.json` and the results of `benchmarks/bench_costs.py` and
`benchmarks/bench_decode.py`, kept in [`benchmarks/results/`](../../benchmarks/results/); when and
where they were measured: [docs/performance.md](../../docs/performance.md)).

| | target | draft |
|---|---|---|
| architecture | Llama, width {t['arch']['hidden_size']}, {t['arch']['num_hidden_layers']} layers, {t['arch']['num_attention_heads']} heads | Llama, width {d['arch']['hidden_size']}, {d['arch']['num_hidden_layers']} layers, {d['arch']['num_attention_heads']} heads |
| parameters | {t['parameters'] / 1e6:.2f}M | {d['parameters'] / 1e6:.2f}M |
| held-out bits per byte | {t['held_out_bits_per_byte']:.3f} | {d['held_out_bits_per_byte']:.3f} |
| training tokens | {tr['target_training_tokens']:,} | {tr['draft_distillation_tokens']:,}, distilled from the finished target |

- Tokenizer: byte-level BPE (`tokenizers`), 6,144 tokens, shared by both (a copy in each folder).
- Corpus: {tr['train_files']} files ({tr['train_tokens_in_corpus']:,} tokens); {tr['held_out_files']} files
  ({tr['held_out_percent']}%, chosen by a hash of their path) held out. File list SHA-256 `{tr['stdlib_file_list_sha256'][:16]}…`.
- Training: {tr['total_training_seconds'] / 60:.0f} minutes on {tr['threads']} CPU threads (target phase
  {tr['target_phase_seconds'] / 60:.0f} min), matmuls in {tr.get('matmul_precision', 'fp32')} (fp32 weights,
  optimizer state and losses), seed {tr['seed']}; weights shipped in float16 and loaded in float32.
- The target trains alone first; the draft is then distilled from the frozen target (0.9 KL to the
  target's logits, 0.1 next-token loss).

## Against the release bar (issue 3)

| target | measured | |
|---|---|---|
{bar_rows}

## Costs on this machine ({machine_line})

Both roles run specdec's lean Llama forward (`core/llama_decode.py`: fused projections,
oneDNN-packed weights, a growing KV buffer); `--reference-forward` runs the HF forward instead.
The target runs in fp32; the draft runs in {costs.get('draft_dtype', 'float32')}{draft_bf16_note}.

| | lean forward (default) | HF forward |
|---|---|---|
| target decode step | {costs['target_step_ms']:.2f} ms | {costs['target_step_ms_hf']:.2f} ms |
| draft token | {costs['draft_step_ms_lean']:.2f} ms | {costs['draft_step_ms_hf']:.2f} ms |
| c = t_draft / t_target | **{costs['c']:.3f}** | {costs['c_hf']:.3f} |
| verify-cost ratio, k = 1..8 | {ratios} | {ratios_hf} |

The verify-cost ratio is one forward over k+1 positions divided by one decode step.

## Acceptance (greedy, held-out prompts)

| k | acceptance rate | tokens per verification | α fitted to (1 − α^(k+1)) / (1 − α) |
|---|---|---|---|
{by_k}

## Speed ({decode['prompts']} held-out prompts, {decode['max_new_tokens']} new tokens, greedy, one run; outputs identical: {decode['outputs_identical']})

`specdec_k0` is target-only decoding through specdec's own forward: the last column is the gain
from speculation alone; the one before it also counts the faster forward.

| method | tokens/s | vs target-only (HF generate) | vs specdec k = 0 |
|---|---|---|---|
{methods}

## A sample (greedy, 48 tokens: `specdec generate "{SAMPLE_PROMPT}"`)

The training files (the stdlib, tests and site-packages skipped) hold no Fibonacci function to
imitate; a {t['parameters'] / 1e6:.1f}M-parameter model trained on {tr['target_training_tokens'] / 1e6:.1f}M tokens writes Python-shaped text
(docstrings, signatures, stdlib idioms) that does not compute the function.

```python
{SAMPLE_PROMPT}{sample_completion()}
```
"""
    (DEMO / "README.md").write_text(text)
    print(f"wrote {DEMO / 'README.md'}")


if __name__ == "__main__":
    main()
