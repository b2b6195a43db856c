"""Many sessions at once, in one process: aggregate tokens/s, time to first token and inter-token
latency per concurrency level, speculation off / fixed k / adaptive, all in one run.

Each level runs `level` clients at once; each client sends requests back to back until it has
generated its share. The verifier batches the verify steps of every session that is ready.

    python benchmarks/bench_concurrency.py --levels 1,4,16,64 --json concurrency.json
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time

from common import held_out_prompts, machine, pair_arguments
from specdec import roles
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.draft.drafters import DraftConfig
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.target.engine import TargetConfig


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_level(orch, prompts: list[str], level: int, policy: SpeculationPolicy, max_new: int, requests_per_client: int):
    ttft, itl, tokens = [], [], 0

    async def client(c: int) -> None:
        nonlocal tokens
        for r in range(requests_per_client):
            prompt = prompts[(c * requests_per_client + r) % len(prompts)]
            started = last = time.perf_counter()
            first = True
            async for chunk in orch.generate(GenerationRequest(prompt_text=prompt, max_new_tokens=max_new, policy=policy)):
                now = time.perf_counter()
                n = len(chunk.token_ids)
                if n:
                    if first:
                        ttft.append(now - started)
                        first = False
                    else:
                        itl.extend([(now - last) / n] * n)
                    last = now
                    tokens += n

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(level)))
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99)}


async def main() -> None:
    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--modes", default="off,k2,adaptive", help="off | kN | adaptive, comma-separated")
    ap.add_argument("--tokens-per-level", type=int, default=1536, help="roughly, per level and mode")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    modes = args.modes.split(",")
    prompts = held_out_prompts(max(args.prompts, 16))
    orch = roles.embedded(TargetConfig(args.target, threads=args.threads), DraftConfig(args.draft, args.target, threads=args.threads),
                          OrchestratorConfig(max_new_tokens_limit=2048, max_concurrent_requests=max(levels) + 1))

    def policy(mode: str) -> SpeculationPolicy:
        if mode == "off":
            return SpeculationPolicy(SpeculationMode.FIXED, 0)
        if mode == "adaptive":
            return SpeculationPolicy(SpeculationMode.ADAPTIVE, 4, 8)
        return SpeculationPolicy(SpeculationMode.FIXED, int(mode[1:]))

    await run_level(orch, prompts, 2, policy("off"), 16, 1)  # warm-up
    results = {}
    for level in levels:
        per_client = max(1, round(args.tokens_per_level / (level * args.max_new_tokens)))
        for mode in modes:  # alternated within a level: the machine drifts less between them
            r = await run_level(orch, prompts, level, policy(mode), args.max_new_tokens, per_client)
            batches = orch.verifier.engine.batch_sizes
            r["mean_batch_sessions"] = sum(s * n for s, n in batches.items()) / max(1, sum(batches.values()))
            batches.clear()
            results[f"{level}/{mode}"] = r
            print(f"{level:>3} {mode:>8}: {r['tokens_per_s']:7.1f} tok/s  ttft p50 {r['ttft_p50_ms']:7.1f} ms  "
                  f"itl p50 {r['itl_p50_ms']:6.1f} p99 {r['itl_p99_ms']:6.1f} ms  batch {r['mean_batch_sessions']:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "max_new_tokens": args.max_new_tokens, "results": results}, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
