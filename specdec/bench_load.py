"""``specdec bench --concurrency 1,4,16,64``: many sessions at once, in one process.

At each level, that many clients send requests back to back until the level has generated its
share of tokens; the verifier batches the verify steps of every ready session. Per level and mode
(speculation off, each fixed k, adaptive): aggregate tokens/s, time to first token and inter-token
latency p50/p99, the mean number of sessions per target forward, and draft tokens per step and
their acceptance (from the requests' own counters). With ``--rounds N`` every mode of a level runs
N times, the modes alternated and their order rotated each round (a machine's speed drifts within
minutes by more than some differences measured; docs/performance.md): tokens/s is the median of the
rounds, latency percentiles are over every round's samples. Writes load.json and load.png to --out.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

from specdec.core.speculation import SpeculationMode, SpeculationPolicy


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def policy_for(mode: str) -> SpeculationPolicy:
    """off | kN | kN-seq (fixed k, no drafting ahead) | adaptive."""
    if mode == "off":
        return SpeculationPolicy(SpeculationMode.FIXED, 0)
    if mode == "adaptive":
        return SpeculationPolicy(SpeculationMode.ADAPTIVE, 4, 8)
    if mode.startswith("k") and mode.endswith("-seq"):
        return SpeculationPolicy(SpeculationMode.FIXED, int(mode[1:-4]), overlap=False)
    if mode.startswith("k"):
        return SpeculationPolicy(SpeculationMode.FIXED, int(mode[1:]))
    raise ValueError(f"unknown mode {mode!r}: off, kN, kN-seq or adaptive")


async def run_level(orch, prompts: list[str], level: int, policy: SpeculationPolicy, max_new: int,
                    requests_per_client: int) -> dict:
    from specdec.orchestrator.request import GenerationRequest

    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    spec = {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0}  # over the level's requests: what speculation did

    async def client(c: int) -> None:
        nonlocal tokens
        for r in range(requests_per_client):
            prompt = prompts[(c * requests_per_client + r) % len(prompts)]
            started = last = time.perf_counter()
            first = True
            async for chunk in orch.generate(GenerationRequest(prompt_text=prompt, max_new_tokens=max_new, policy=policy)):
                now, n = time.perf_counter(), len(chunk.token_ids)
                if n:
                    if first:
                        ttft.append(now - started)
                        first = False
                    else:
                        itl.extend([(now - last) / n] * n)  # n tokens after a gap: n gaps of gap / n
                    last = now
                    tokens += n
                if chunk.finish_reason is not None:
                    counters = chunk.counters
                    spec["steps"] += counters.verify_steps
                    spec["draft_tokens"] += counters.draft_tokens
                    spec["accepted_tokens"] += counters.accepted_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(level)))
    elapsed = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": elapsed, "ttft_s": ttft, "itl_s": itl, **spec}


def combine(runs: list[dict], level: int) -> dict:
    """One level and mode over its rounds: the median round's tokens/s, latencies over all samples.

    ``decode_tokens_per_s`` is ``level`` over the mean inter-token latency: the rate while every
    session decodes, without the prefills (at 64 sessions that start at once, the first token of
    all of them waits for one prefill of all their prompts)."""
    rates = [r["tokens"] / r["seconds"] for r in runs]
    ttft = [x for r in runs for x in r["ttft_s"]]
    itl = [x for r in runs for x in r["itl_s"]]
    itl_mean = statistics.fmean(itl) if itl else float("nan")
    # (A run without counters, as a caller may build one, counts as no steps.)
    steps, drafted, accepted = (sum(r.get(key, 0) for r in runs) for key in ("steps", "draft_tokens", "accepted_tokens"))
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_rounds": rates,
            "decode_tokens_per_s": level / itl_mean if itl else float("nan"), "itl_mean_ms": 1e3 * itl_mean,
            "tokens": sum(r["tokens"] for r in runs), "seconds": sum(r["seconds"] for r in runs),
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99),
            "mean_batch_sessions": statistics.fmean(r["mean_batch_sessions"] for r in runs),
            "draft_tokens_per_step": drafted / steps if steps else float("nan"),
            "acceptance": accepted / drafted if drafted else float("nan")}


async def load_bench(orch, prompts: list[str], levels: list[int], modes: list[str], max_new: int,
                     tokens_per_level: int, rounds: int = 1, log=print) -> dict:
    """Every level x mode, ``rounds`` times; returns {"level/mode": figures}."""
    await run_level(orch, prompts, 2, policy_for("off"), 16, 1)  # warm-up: first-call costs out of the figures
    results = {}
    batches = orch.verifier.scheduler.batch_sizes
    for level in levels:
        per_client = max(1, round(tokens_per_level / (level * max_new)))
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for r in range(rounds):
            turn = r % len(modes)
            for mode in modes[turn:] + modes[:turn]:  # no mode always first or last of a round
                batches.clear()
                run = await run_level(orch, prompts, level, policy_for(mode), max_new, per_client)
                run["mean_batch_sessions"] = sum(s * n for s, n in batches.items()) / max(1, sum(batches.values()))
                runs[mode].append(run)
                if rounds > 1:
                    log(f"{level:>3} {mode:>8}: round {r + 1}/{rounds} {run['tokens'] / run['seconds']:7.1f} tok/s")
        for mode in modes:
            f = results[f"{level}/{mode}"] = combine(runs[mode], level)
            log(f"{level:>3} {mode:>8}: {f['tokens_per_s']:7.1f} tok/s (decoding {f['decode_tokens_per_s']:7.1f})  "
                f"ttft p50 {f['ttft_p50_ms']:7.1f} ms  "
                f"itl p50 {f['itl_p50_ms']:6.1f} p99 {f['itl_p99_ms']:6.1f} ms  batch {f['mean_batch_sessions']:.1f}  "
                f"drafts/step {f['draft_tokens_per_step']:.2f}")
    return results


def summarize(results: dict, levels: list[int], modes: list[str]) -> dict:
    """The issue's ratios: level n against level 1, adaptive against the better of off and the best fixed k."""
    out = {}
    fixed = [m for m in modes if m != "adaptive"]
    for level in levels:
        best_mode = max(fixed, key=lambda m: results[f"{level}/{m}"]["tokens_per_s"])
        row = {"best_fixed": best_mode, "best_fixed_tokens_per_s": results[f"{level}/{best_mode}"]["tokens_per_s"]}
        if "adaptive" in modes:
            row["adaptive_vs_best"] = results[f"{level}/adaptive"]["tokens_per_s"] / row["best_fixed_tokens_per_s"]
        for mode in modes:
            now, first = results[f"{level}/{mode}"], results[f"{levels[0]}/{mode}"]
            row[f"{mode}_vs_level_1"] = now["tokens_per_s"] / first["tokens_per_s"]
            row[f"{mode}_decoding_vs_level_1"] = now["decode_tokens_per_s"] / first["decode_tokens_per_s"]
        out[str(level)] = row
    return out


def plot(results: dict, levels: list[int], modes: list[str], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in modes:
        left.plot(levels, [results[f"{n}/{mode}"]["tokens_per_s"] for n in levels], marker="o", label=mode)
        right.plot(levels, [results[f"{n}/{mode}"]["itl_p99_ms"] for n in levels], marker="o", label=mode)
    for ax, title in ((left, "aggregate tokens/s"), (right, "inter-token latency p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent sessions")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(config, levels: list[int], modes: list[str], tokens_per_level: int, out: Path, rounds: int = 1) -> int:
    """In one process: the same engines, threads and batching as the servers."""
    from specdec import roles
    from specdec.bench_common import machine
    from specdec.draft.drafters import DraftConfig
    from specdec.orchestrator.request import OrchestratorConfig
    from specdec.target.engine import TargetConfig

    orch = roles.embedded(TargetConfig(config.target, threads=config.threads, **config.target_fields()),
                          DraftConfig(config.draft, config.target, threads=config.threads, **config.draft_fields()),
                          OrchestratorConfig(max_new_tokens_limit=max(2048, config.max_new_tokens),
                                             max_concurrent_requests=max(levels) + 1))
    results = asyncio.run(load_bench(orch, list(config.prompts), levels, modes, config.max_new_tokens, tokens_per_level,
                                     rounds, log=lambda line: print(line, flush=True)))
    summary = summarize(results, levels, modes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps({"machine": machine(), "max_new_tokens": config.max_new_tokens,
                                               "rounds": rounds, "levels": levels, "modes": modes, "results": results,
                                               "summary": summary}, indent=2))
    for level, row in summary.items():
        ratio = f", adaptive {row['adaptive_vs_best']:.2f}x the best fixed ({row['best_fixed']})" if "adaptive_vs_best" in row else ""
        print(f"{level:>3} sessions: best fixed {row['best_fixed']} {row['best_fixed_tokens_per_s']:.1f} tok/s{ratio}")
    plotted = plot(results, levels, modes, out / "load.png")
    print(f"wrote {out / 'load.json'}" + (f" and {out / 'load.png'}" if plotted else ""))
    return 0
