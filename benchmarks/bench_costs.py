"""Cost and acceptance figures of a target/draft pair (the model card's numbers).

    python benchmarks/bench_costs.py [--target PATH --draft PATH] [--prompts 8]
    python benchmarks/bench_costs.py > benchmarks/results/costs/costs.json   # the model card's figures

Reports, measured in one run with alternating repetitions and medians (timings on these machines
vary 10-15% run to run: docs/performance.md, "How to read these figures"):
  target_step_ms        one decode step of the target, through the verifier's forward (the lean
                        Llama path, oneDNN-packed weights) with a KV cache
  verify_cost_ratio[k]  a verification of k draft tokens (k+1 positions in one forward) / one decode step
  draft_step_ms_lean    one draft token through the drafter's forward (the same lean path, in the
                        drafter's default precision: draft_dtype)
  c                     draft_step_ms_lean / target_step_ms
  *_bf16                the draft on the lean path in bf16 (--draft-dtype bfloat16; CPUs with native bf16)
  *_hf                  the same through the reference HF forward (--reference-forward)
  alpha_k1              greedy acceptance at k=1 (accepted / drafted) on held-out prompts
  tokens_per_step[k]    committed tokens per verification at fixed k, and the alpha that fits it
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import torch
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, pair_arguments, held_out_prompts, median  # noqa: E402


def step_times(kv_factory, prompt_ids, feed: int, reps: int) -> list[float]:
    """Time feeding `feed` new tokens after the prompt, rolling back each time."""
    kv = kv_factory()
    kv.logits_for(prompt_ids, 1)
    extra = [(prompt_ids[i % len(prompt_ids)] + 1) % 100 + 10 for i in range(feed)]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        kv.logits_for(prompt_ids + extra, feed)
        times.append(time.perf_counter() - t0)
        kv.logits_for(prompt_ids, 1)  # roll back (re-feeds the last prompt token only)
    return times


def fit_alpha(tokens_per_step: float, k: int) -> float:
    lo, hi = 0.0, 0.9999
    for _ in range(60):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> int:
    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec import roles
    from specdec.core.kv import KVSequence
    from specdec.core.llama_decode import LlamaDecoder, native_bf16
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy
    from specdec.draft.drafters import DraftConfig, build_drafters
    from specdec.orchestrator.loop import collect
    from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
    from specdec.target.engine import TargetConfig, VerifierEngine

    # Built exactly as the verifier and the drafter build them.
    verifier = VerifierEngine.from_config(TargetConfig(args.target))
    drafter = build_drafters(DraftConfig(args.draft))["model"]
    target, draft = verifier.loaded, drafter.loaded
    prompts = held_out_prompts(args.prompts, Path(args.target).parent)
    prompt_ids = target.tokenizer(prompts[0])["input_ids"][:64]
    forwards = {
        "target": lambda: KVSequence(target.model, verifier.decoder),
        "target_hf": lambda: KVSequence(target.model),
        "draft": lambda: KVSequence(draft.model, drafter.decoder),
        "draft_hf": lambda: KVSequence(draft.model),
    }
    if drafter.decoder is not None and native_bf16():
        draft_bf16 = LlamaDecoder(draft.model, dtype=torch.bfloat16)
        forwards["draft_bf16"] = lambda: KVSequence(draft.model, draft_bf16)
    feeds = {name: range(1, 10) if name.startswith("target") else (1,) for name in forwards}
    times = {(name, n): [] for name in forwards for n in feeds[name]}
    for _ in range(3):  # alternate configurations, pool the repetitions
        for name, make in forwards.items():
            for n in feeds[name]:
                times[name, n] += step_times(make, prompt_ids, n, args.reps // 3)
    step = {name: median(times[name, 1]) for name in forwards}
    result = {
        "machine": machine(),
        "draft_dtype": str(drafter.decoder.dtype if drafter.decoder is not None else draft.model.dtype).removeprefix("torch."),
        "target_parameters": sum(p.numel() for p in target.model.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.model.parameters()),
        "target_step_ms": round(step["target"] * 1e3, 3),
        "verify_cost_ratio": {k: round(median(times["target", k + 1]) / step["target"], 3) for k in range(1, 9)},
        "draft_step_ms_lean": round(step["draft"] * 1e3, 3),
        "c": round(step["draft"] / step["target"], 4),
        "target_step_ms_hf": round(step["target_hf"] * 1e3, 3),
        "verify_cost_ratio_hf": {k: round(median(times["target_hf", k + 1]) / step["target_hf"], 3) for k in range(1, 9)},
        "draft_step_ms_hf": round(step["draft_hf"] * 1e3, 3),
        "c_hf": round(step["draft_hf"] / step["target_hf"], 4),
    }
    if "draft_bf16" in step:
        result["draft_step_ms_bf16"] = round(step["draft_bf16"] * 1e3, 3)
        result["c_bf16"] = round(step["draft_bf16"] / step["target"], 4)

    orch = roles.embedded(TargetConfig(args.target), DraftConfig(args.draft, args.target), OrchestratorConfig())
    per_k = {}
    for k in (1, 2, 4, 6):
        drafted = accepted = steps = 0
        for p in prompts:
            req = GenerationRequest(prompt_text=p, max_new_tokens=args.max_new_tokens, drafter="model",
                                    policy=SpeculationPolicy(SpeculationMode.FIXED, k, max(k, 8)))
            last, _, _ = asyncio.run(collect(orch.generate(req)))
            c = last.counters
            drafted, accepted, steps = drafted + c.draft_tokens, accepted + c.accepted_tokens, steps + c.drafts
        tps = 1 + accepted / max(1, steps)
        per_k[k] = {"acceptance_rate": round(accepted / max(1, drafted), 4), "tokens_per_step": round(tps, 3),
                    "alpha_fit": round(fit_alpha(tps, k), 4)}
    result["alpha_k1"] = per_k[1]["acceptance_rate"]
    result["by_k"] = per_k
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
