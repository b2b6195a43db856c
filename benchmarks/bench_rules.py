"""Coupled against rejection verification on the demo pair: per-token acceptance and tokens/s.

    python benchmarks/bench_rules.py [--prompts 8] [--max-new-tokens 96] [--temperatures 1.0,0.7]
    python benchmarks/bench_rules.py --out benchmarks/results/rules/rules.json   # docs/performance.md, 3

Per-token acceptance is measured at k = 1 (one draft per step: accepted / drafted is alpha itself);
tokens/s with fixed k = 3 and the adaptive policy, all roles in one process, overlap off so the two
rules meet the same machine noise. Rules alternate prompt by prompt (docs/performance.md, "How to
read these figures"). Coupled outputs must not depend on k: the script checks that k = 1, k = 3 and
adaptive gave the same tokens.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

from specdec import roles
from specdec.bench_common import held_out_prompts, machine
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.draft.drafters import DraftConfig
from specdec.orchestrator.loop import collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.target.engine import TargetConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import DEMO, pair_arguments  # noqa: E402

POLICIES = {
    "k1": SpeculationPolicy(SpeculationMode.FIXED, 1, 8, overlap=False),
    "k3": SpeculationPolicy(SpeculationMode.FIXED, 3, 8, overlap=False),
    "adaptive": SpeculationPolicy(overlap=False),
}


async def run(args) -> dict:
    orch = roles.embedded(TargetConfig(args.target, threads=1), DraftConfig(args.draft, args.target, threads=1), OrchestratorConfig())
    prompts = held_out_prompts(args.prompts, DEMO)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    totals: dict[str, dict[str, float]] = {}
    coupled_outputs: dict[tuple, set] = {}

    async def one(prompt: str, temperature: float, rule: VerificationRule, name: str, seed: int):
        sampling = SamplingParams(temperature=temperature, seed=seed, rule=rule)
        req = GenerationRequest(prompt_text=prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, seed_given=True,
                                policy=POLICIES[name])
        t0 = time.perf_counter()
        last, ids, _ = await collect(orch.generate(req))
        return ids, last.counters, time.perf_counter() - t0

    await one(prompts[0], 1.0, VerificationRule.COUPLED, "k1", 0)  # warm-up
    for i, prompt in enumerate(prompts):
        for temperature in temperatures:
            for name in POLICIES:
                for rule in VerificationRule:
                    ids, c, seconds = await one(prompt, temperature, rule, name, seed=1000 + i)
                    t = totals.setdefault(f"T={temperature} {rule.value} {name}", dict(tokens=0, seconds=0.0, drafted=0, accepted=0))
                    t["tokens"] += len(ids)
                    t["seconds"] += seconds
                    t["drafted"] += c.draft_tokens
                    t["accepted"] += c.accepted_tokens
                    if rule is VerificationRule.COUPLED:
                        coupled_outputs.setdefault((i, temperature), set()).add(ids)
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    rows = {name: {"tokens_per_s": round(t["tokens"] / t["seconds"], 1),
                   "acceptance": round(t["accepted"] / max(1, t["drafted"]), 4)} for name, t in totals.items()}
    return {"machine": machine(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "results": rows,
            "coupled_same_tokens_across_k": all(len(v) == 1 for v in coupled_outputs.values())}


def main() -> int:
    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["coupled_same_tokens_across_k"] else 1


if __name__ == "__main__":
    sys.exit(main())
