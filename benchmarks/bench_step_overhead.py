"""Where a step goes: the target's forward, the draft's forwards, and everything else.

    python benchmarks/bench_step_overhead.py [--modes k0,k3,adaptive] [--prompts 4] [--max-new-tokens 96]
    python benchmarks/bench_step_overhead.py --concurrency 64 --modes k0,adaptive   # Python time between forwards under load

One process (`specdec generate`'s embedded path), one torch thread, the demo pair; ``--concurrency``
streams at once (default 1: a single stream; a "step" is then one verify batch). Each
model's forward is timed where it runs (the lean decoder's ``forward``/``forward_batch``, and the
draft's branch steps); "outside" is the stream's wall time minus both, i.e. the scheduler, the
rules, the loops, the drafter's bookkeeping and the event loop. Modes alternate prompt by prompt.
Prints per-step and per-token medians and writes JSON (--out).
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import held_out_prompts, pair_arguments, write_result  # noqa: E402


class ForwardClock:
    """Seconds spent in one decoder's forwards (patched on the instance, so only that model counts;
    a forward that calls another of the patched methods is counted once)."""

    def __init__(self, decoder, names: tuple[str, ...]) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        for name in names:
            setattr(decoder, name, self._timed(getattr(decoder, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1
        return timed


def main() -> int:
    ap = pair_arguments(__doc__.splitlines()[0])
    ap.set_defaults(prompts=4)
    ap.add_argument("--modes", default="k0,k3,adaptive", help="k0 | kN | adaptive, comma-separated")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--numerics", default="fast")
    ap.add_argument("--weight-layouts", type=int, default=None)
    ap.add_argument("--pack-rows", type=int, default=None, help="the target's oneDNN packing hint (default: TargetConfig's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1, help="streams at once (each prompt sent this many times)")
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args()

    import torch

    from specdec import roles
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy
    from specdec.draft.drafters import DraftConfig
    from specdec.orchestrator.loop import collect
    from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
    from specdec.target.engine import TargetConfig

    torch.set_num_threads(1)
    orch = roles.embedded(TargetConfig(args.target, threads=1, dtype=args.dtype, numerics=args.numerics,
                                       **({"weight_layouts": args.weight_layouts} if args.weight_layouts else {}),
                                       **({"pack_rows": args.pack_rows} if args.pack_rows else {})),
                          DraftConfig(args.draft, args.target, threads=1),
                          OrchestratorConfig(max_new_tokens_limit=4096, max_concurrent_requests=args.concurrency + 1))
    # (Checkouts before the scheduler called it the verifier's engine: this script compares both.)
    scheduler = getattr(orch.verifier, "scheduler", None) or orch.verifier.engine
    engine = scheduler.engine
    drafter = scheduler._run._pool  # the draft engine: in one process it runs both models
    target_clock = ForwardClock(engine.decoder, ("forward", "forward_batch", "forward_feeds"))
    model_drafter = drafter.drafters["model"]
    draft_clock = ForwardClock(model_drafter.decoder, ("forward", "forward_batch", "forward_feeds", "layers_forward"))
    steps = [0]
    verify_batch = engine.verify_batch
    engine.verify_batch = lambda batch: steps.__setitem__(0, steps[0] + 1) or verify_batch(batch)

    def policy(mode: str) -> SpeculationPolicy:
        if mode == "adaptive":
            return SpeculationPolicy()
        return SpeculationPolicy(SpeculationMode.FIXED, int(mode.lstrip("k")))

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    prompts = held_out_prompts(args.prompts)
    rows: dict[str, list[dict]] = {m: [] for m in modes}

    async def one(mode: str, prompt: str) -> dict:
        t_before, d_before, s_before = target_clock.seconds, draft_clock.seconds, steps[0]
        t0 = time.perf_counter()
        request = GenerationRequest(prompt_text=prompt, max_new_tokens=args.max_new_tokens, policy=policy(mode), drafter="model")
        results = await asyncio.gather(*(collect(orch.generate(request)) for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        n_steps = steps[0] - s_before
        target_s, draft_s = target_clock.seconds - t_before, draft_clock.seconds - d_before
        tokens = sum(len(ids) for _, ids, _ in results)
        return {"tokens": tokens, "steps": n_steps, "wall_s": wall, "target_forward_s": target_s, "draft_forward_s": draft_s,
                "outside_s": wall - target_s - draft_s}

    async def run() -> None:
        await one(modes[0], prompts[0])  # warm-up
        for _ in range(args.rounds):
            for prompt in prompts:
                for mode in modes:
                    rows[mode].append(await one(mode, prompt))

    asyncio.run(run())
    summary = {}
    print(f"concurrency {args.concurrency}; a step is one verify batch")
    print(f"{'mode':<9} {'tok/s':>7} {'ms/step':>8} {'target':>7} {'draft':>7} {'outside':>8} {'outside %':>9} {'tok/step':>8}")
    for mode in modes:
        rs = rows[mode]
        per = lambda key: statistics.median(r[key] / r["steps"] for r in rs) * 1e3  # noqa: E731
        s = {"tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in rs),
             "ms_per_step": per("wall_s"), "target_forward_ms_per_step": per("target_forward_s"),
             "draft_forward_ms_per_step": per("draft_forward_s"), "outside_ms_per_step": per("outside_s"),
             "outside_fraction": statistics.median(r["outside_s"] / r["wall_s"] for r in rs),
             "tokens_per_step": statistics.median(r["tokens"] / r["steps"] for r in rs)}
        summary[mode] = s
        print(f"{mode:<9} {s['tokens_per_s']:>7.1f} {s['ms_per_step']:>8.2f} {s['target_forward_ms_per_step']:>7.2f} "
              f"{s['draft_forward_ms_per_step']:>7.2f} {s['outside_ms_per_step']:>8.2f} {100 * s['outside_fraction']:>8.1f}% "
              f"{s['tokens_per_step']:>8.2f}")
    if args.out:
        write_result(args.out, args=vars(args), summary=summary, runs=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
