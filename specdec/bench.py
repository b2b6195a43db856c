"""``specdec bench``: every way of decoding, on the same prompts, in one run.

Methods (greedy everywhere, so every output must equal target-only's token for token):
  target_only              ``transformers`` generate on the target alone (HF forward): the baseline
  specdec_k0               specdec, fixed k = 0: target-only through specdec's own lean forward
  inproc_seq_k{K}          all roles in this process, fixed k = K, no overlap (draft, then verify)
  inproc_seq_adaptive      the same, adaptive k
  inproc_overlap_k4        in this process, overlap on (draft block n+1 while block n is verified)
  inproc_overlap_adaptive
  dist_seq_k{K}, dist_seq_adaptive, dist_overlap_k{K}, dist_overlap_adaptive
                           over gRPC through a ``specdec up`` (three processes) that the command
                           starts on free ports and stops at the end
Methods alternate prompt by prompt (each prompt runs every method) after one warm-up pass on the
first prompt, so machine noise hits all alike; the report gives ratios measured in this one run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specdec import bench_load, bench_report
from specdec.bench_common import bench_prompts
from specdec.bench_methods import BASELINE, DEFAULT_KS, BenchConfig, Method, all_methods, select
from specdec.bench_runners import BenchError, Deployment, Run, Runners, until_exit_or
from specdec.cli_common import (
    DTYPE_CHOICES,
    ENV_DRAFT,
    ENV_REDIS,
    ENV_TARGET,
    RUNNER_CHOICES,
    UsageError,
    device_arg,
    draft_placement,
    fraction,
    model_path,
    probability_below_one,
    target_placement,
)


# ----------------------------------------------------------------------------- the run
@dataclass
class Results:
    methods: list[Method]
    runs: dict[str, list[Run]] = field(default_factory=dict)
    mismatches: list[dict] = field(default_factory=list)


def bench(config: BenchConfig, progress: Callable[..., None] | None = None) -> dict:
    """Run every selected method on every prompt; write bench.json (and bench.png) under ``config.out``
    and return the report (see ``specdec.bench_report.report``)."""
    progress = progress or _Progress()
    config.out.mkdir(parents=True, exist_ok=True)
    methods = select(all_methods(config.ks, eagle=config.draft_fields()["eagle_head_path"] is not None), config.methods,
                     (BASELINE, config.reference))
    if not config.distributed:
        methods = [m for m in methods if not m.distributed]
    deployment = Deployment.start(config) if any(m.distributed for m in methods) else None
    try:
        in_process = any(m.policy is not None and not m.distributed for m in methods)
        # The layer-skip drafter loads the target a second time: only when a method asks for it.
        layer_skip = any(m.drafter == "layer_skip" and not m.distributed for m in methods)
        runners = Runners(config, deployment.address if deployment else None, in_process, layer_skip)
        results = asyncio.run(_run_all(config, methods, runners, progress, deployment))
    finally:
        if deployment is not None:
            deployment.stop()
    report = bench_report.report(config, results)
    bench_report.write(report, config.out, progress)
    return report


async def _run_all(config: BenchConfig, methods: list[Method], runners: Runners, progress, deployment) -> Results:
    results = Results(methods, {m.name: [] for m in methods})
    t0 = time.perf_counter()
    try:
        if deployment is not None:
            progress(f"waiting for specdec up at {deployment.address} (log: {deployment.log})")
            await until_exit_or(runners.open(), deployment)
        n = len(config.prompts)
        for i, prompt in [(-1, config.prompts[0]), *enumerate(config.prompts)]:
            ref = None
            for m in methods:
                progress(f"{'warm-up' if i < 0 else f'prompt {i + 1}/{n}'}  {m.name:<24} elapsed {time.perf_counter() - t0:6.1f}s")
                run = await runners.run(m, prompt)
                if i < 0:
                    continue
                results.runs[m.name].append(run)
                if m.name == config.reference:
                    ref = run.token_ids  # the reference runs before every method compared with it
                if ref is not None and run.token_ids != ref:
                    first = next((j for j, (a, b) in enumerate(zip(run.token_ids, ref)) if a != b), min(len(ref), len(run.token_ids)))
                    results.mismatches.append({"prompt": i, "method": m.name, "first_difference_at": first})
        progress(f"done in {time.perf_counter() - t0:.1f}s", end=True)
    finally:
        await runners.close()
    return results


class _Progress:
    """One overwritten line on a terminal, one line per step otherwise; always on stderr."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream, self.tty = stream, stream.isatty()

    def __call__(self, line: str, end: bool = False) -> None:
        if self.tty:
            self.stream.write(f"\r\033[K{line}" + ("\n" if end else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# ----------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help=f"target model folder (default: ${ENV_TARGET} or the demo pair)")
    p.add_argument("--draft", help=f"draft model folder (default: ${ENV_DRAFT} or the demo pair)")
    p.add_argument("--prompts", type=int, default=8, help="number of prompts (default 8)")
    p.add_argument("--prompts-file", help="prompts: a JSON list of strings, or one per line "
                                          "(default: the pair's held-out files, else built-in code openings)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", default=",".join(map(str, DEFAULT_KS)), help="fixed speculation lengths (default 1,...,8)")
    p.add_argument("--methods", default="", help="comma-separated substrings or globs of method names (target_only always runs)")
    p.add_argument("--skip-distributed", action="store_true", help="no `specdec up`: in-process methods only")
    p.add_argument("--redis-url", default=os.environ.get(ENV_REDIS, "redis://127.0.0.1:6379/0"),
                   help="session store of the distributed orchestrator ('' keeps sessions in its memory)")
    p.add_argument("--threads", default="1", help="torch threads per model, in every method (default 1); 'auto': one "
                   "process measures 1..cores per forward as `specdec generate` does (the HF baseline gets every core, "
                   "`specdec up`'s processes 1 each)")
    p.add_argument("--draft-min-confidence", type=probability_below_one, default=0.0, metavar="P",
                   help="the drafter ends a block after a token it gives less than P probability (default 0: blocks of k)")
    p.add_argument("--device", type=device_arg, default=None, metavar="auto|cpu|cuda|cuda:N",
                   help="the target's device in every method, the transformers baseline's too (default auto: cuda when "
                        "visible, else cpu)")
    p.add_argument("--draft-device", type=device_arg, default=None, metavar="auto|cpu|cuda|cuda:N",
                   help="the draft's device in specdec's methods (default auto)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="the target's precision in specdec's methods (default auto: bfloat16 on CUDA, float32 on the CPU); "
                        "in bfloat16 outputs are compared with specdec's own k = 0")
    p.add_argument("--draft-dtype", choices=DTYPE_CHOICES, default=None,
                   help="the draft's precision (default auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--runner", choices=RUNNER_CHOICES, default="auto",
                   help="the target's model runner in specdec's methods (default auto, as `specdec generate --runner`)")
    p.add_argument("--kv-memory-fraction", type=fraction, default=None, metavar="F",
                   help="paged runner on CUDA: the target's KV page pool as this fraction of the device's free memory")
    p.add_argument("--numerics", choices=("auto", "exact", "fast"), default="auto",
                   help="the target's numerics in specdec's methods (docs/guarantees.md)")
    p.add_argument("--out", default="bench-results", help="folder for bench.json and bench.png (default ./bench-results)")
    p.add_argument("--concurrency", help="instead: a load benchmark in one process at these levels, e.g. 1,4,16,64 "
                                         "(load.json, load.png)")
    p.add_argument("--modes", default="off,k1,k2,k3,adaptive",
                   help="with --concurrency: off, kN, kN-seq (no drafting ahead), adaptive (default off,k1,k2,k3,adaptive)")
    p.add_argument("--tokens-per-level", type=int, default=2048, help="with --concurrency: tokens each level x mode generates")
    p.add_argument("--rounds", type=int, default=1, help="with --concurrency: run every level x mode this many times, "
                   "alternated, and report the median (default 1)")


def run(args: argparse.Namespace) -> int:
    """The ``specdec bench`` command: 0 when every output equals target-only's, else 1."""
    try:
        ks = tuple(sorted({int(k) for k in args.k.split(",") if k.strip()}))
    except ValueError:
        raise UsageError(f"--k takes comma-separated integers, got {args.k!r}") from None
    if not ks or min(ks) < 1:
        raise UsageError(f"--k takes speculation lengths >= 1, got {args.k!r}")
    if args.threads == "auto":
        threads = None
    elif args.threads.isdigit() and int(args.threads) >= 1:
        threads = int(args.threads)
    else:
        raise UsageError(f"--threads takes a count >= 1 or 'auto', got {args.threads!r}")
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise UsageError("--prompts and --max-new-tokens must be >= 1")
    target = model_path(args.target, ENV_TARGET, "target")
    prompts, source = bench_prompts(args.prompts, target, args.prompts_file)
    config = BenchConfig(target, model_path(args.draft, ENV_DRAFT, "draft"), tuple(prompts), args.max_new_tokens, ks,
                         tuple(p.strip() for p in args.methods.split(",") if p.strip()), not args.skip_distributed,
                         args.redis_url, Path(args.out), source, threads, args.draft_min_confidence,
                         **target_placement(args.device, args.dtype, args.numerics, args.runner,
                                            kv_memory_fraction=args.kv_memory_fraction),
                         **draft_placement(args.draft_device, args.draft_dtype))
    # Ctrl-C raises KeyboardInterrupt; make SIGTERM unwind the same way so `specdec up` is stopped.
    if args.concurrency:
        try:
            levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
            modes = [m.strip() for m in args.modes.split(",") if m.strip()]
            for mode in modes:
                bench_load.policy_for(mode)
        except ValueError as exc:
            raise UsageError(f"--concurrency takes comma-separated integers and --modes off/kN/kN-seq/adaptive: {exc}") from None
        if not levels or min(levels) < 1 or args.tokens_per_level < 1 or args.rounds < 1:
            raise UsageError("--concurrency levels, --tokens-per-level and --rounds must be >= 1")
        return bench_load.run(config, levels, modes, args.tokens_per_level, Path(args.out), args.rounds)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        report = bench(config)
    except BenchError as exc:
        print(f"specdec bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspecdec bench: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(bench_report.table(report))
    return bench_report.exit_code(report)
