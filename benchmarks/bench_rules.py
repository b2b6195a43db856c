"""Coupled against rejection verification on the demo pair: per-token acceptance and tokens/s.

    python benchmarks/bench_rules.py [--prompts 8] [--max-new-tokens 96] [--temperatures 1.0,0.7]
    python benchmarks/bench_rules.py --out benchmarks/results/rules/rules.json   # docs/performance.md, 3
    python benchmarks/bench_rules.py --decide-batch [--vocab 6144] [--reps 15]   # no models needed

Per-token acceptance is measured at k = 1 (one draft per step: accepted / drafted is alpha itself);
tokens/s with fixed k = 3 and the adaptive policy, all roles in one process, overlap off so the two
rules meet the same machine noise. Rules alternate prompt by prompt (docs/performance.md, "How to
read these figures"). Coupled outputs must not depend on k: the script checks that k = 1, k = 3 and
adaptive gave the same tokens.

--decide-batch times the rules alone on random logits: the verifier's one call over a batch
(specdec.core.batch_rules.decide_batch) against the per-session loop it replaced (decide_one per
step), at 1, 16 and 64 sessions with k mixed (0..8), per rule and mixed; medians of alternated
runs, ms per batch. It checks the two gave the same outcomes.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import torch

from specdec import roles
from specdec.bench_common import held_out_prompts, machine
from specdec.core.batch_rules import RuleStep, decide_batch, decide_one
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.draft.drafters import DraftConfig
from specdec.orchestrator.loop import collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.target.engine import TargetConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import DEMO, median, pair_arguments  # noqa: E402

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


# ----------------------------------------------------------------------------- --decide-batch
SESSIONS = (1, 16, 64)
MIXES = ("greedy", "coupled", "rejection", "mixed")


def random_steps(r: random.Random, mix: str, sessions: int, vocab: int) -> tuple[torch.Tensor, list[RuleStep]]:
    """A verify batch as the verifier builds it: k in 0..8 per session, drafts often the target's argmax."""
    steps, blocks = [], []
    for _ in range(sessions):
        rule = r.choice(MIXES[:3]) if mix == "mixed" else mix
        k = r.randint(0, 8)
        g = torch.Generator().manual_seed(r.getrandbits(32))  # seeded: every run times the same batches
        logits = torch.randn(k + 1, vocab, generator=g) * 3  # [k+1, vocab]
        top = logits.argmax(-1).tolist()
        draft_ids = tuple(top[j] if r.random() < 0.7 else r.randrange(vocab) for j in range(k))
        sampling = SamplingParams(temperature=0.0 if rule == "greedy" else r.choice([0.7, 1.0]),
                                  top_k=r.choice([0, 50]), top_p=r.choice([1.0, 0.9]), seed=r.getrandbits(63),
                                  rule=VerificationRule.COUPLED if rule == "coupled" else VerificationRule.REJECTION)
        draft_probs = None
        if rule == "rejection" and k and r.random() < 0.5:  # a model drafter's top-K distributions, dense
            draft_probs = torch.zeros(k, vocab)
            draft_probs[:, torch.randint(vocab, (32,), generator=g)] = 1.0
            draft_probs[torch.arange(k), torch.tensor(draft_ids)] = 1.0
            draft_probs /= draft_probs.sum(-1, keepdim=True)
        steps.append(RuleStep(draft_ids, draft_probs, sampling, r.randrange(4096)))
        blocks.append(logits)
    return torch.cat(blocks), steps


def decide_each(logits: torch.Tensor, steps: list[RuleStep]) -> list:
    """The per-session loop decide_batch replaced: each step's rule over its own rows."""
    rows = torch.split(logits, [s.k + 1 for s in steps])
    return [decide_one(step_logits, step) for step_logits, step in zip(rows, steps)]


def decide_batch_table(vocab: int, reps: int, seed: int = 0) -> dict:
    r = random.Random(seed)
    table = {}
    for mix in MIXES:
        for sessions in SESSIONS:
            logits, steps = random_steps(r, mix, sessions, vocab)
            if decide_batch(logits, steps) != decide_each(logits, steps):
                raise AssertionError(f"{mix} x {sessions}: decide_batch differs from the per-session rules")
            wall = {"per_session": [], "batch": []}
            cpu = {"per_session": [], "batch": []}  # process CPU time: what preemption on a shared machine leaves out
            for rep in range(reps):  # alternate which goes first, so drifts in machine load hit both
                order = [("per_session", decide_each), ("batch", decide_batch)]
                for name, decide in order if rep % 2 == 0 else order[::-1]:
                    t0, c0 = time.perf_counter(), time.process_time()
                    decide(logits, steps)
                    wall[name].append((time.perf_counter() - t0) * 1e3)
                    cpu[name].append((time.process_time() - c0) * 1e3)
            table[f"{mix} x{sessions}"] = {
                "rows": logits.shape[0],
                **{f"{name}_ms": round(median(wall[name]), 3) for name in wall},
                **{f"{name}_cpu_ms": round(median(cpu[name]), 3) for name in cpu},
                "speedup": round(median(wall["per_session"]) / median(wall["batch"]), 2),
            }
    return table


def print_table(table: dict) -> None:
    print(f"{'rules x sessions':<18}{'rows':>5}{'per-session ms':>16}{'decide_batch ms':>17}{'speedup':>9}"
          f"{'(cpu ms:':>12}{'per-session':>12}{'batch)':>9}")
    for name, row in table.items():
        print(f"{name:<18}{row['rows']:>5}{row['per_session_ms']:>16.3f}{row['batch_ms']:>17.3f}{row['speedup']:>8.2f}x"
              f"{'':>12}{row['per_session_cpu_ms']:>12.3f}{row['batch_cpu_ms']:>9.3f}")


def main() -> int:
    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--decide-batch", action="store_true", help="time the rules alone: decide_batch against the per-session loop")
    ap.add_argument("--vocab", type=int, default=6144, help="--decide-batch: vocabulary size (the demo target's)")
    ap.add_argument("--reps", type=int, default=15, help="--decide-batch: alternated repetitions per cell")
    ap.add_argument("--threads", type=int, default=1, help="--decide-batch: torch threads (the verifier's own count)")
    args = ap.parse_args()
    if args.decide_batch:
        torch.set_num_threads(args.threads)
        table = decide_batch_table(args.vocab, args.reps)
        print_table(table)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"machine": machine(), "vocab": args.vocab, "threads": args.threads, "results": table}, f, indent=2)
        return 0
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["coupled_same_tokens_across_k"] else 1


if __name__ == "__main__":
    sys.exit(main())
