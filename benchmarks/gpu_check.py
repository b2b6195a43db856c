"""specdec on one GPU, checked in one command: correctness, speed and the distributed layout, one JSON and one table.

On a GPU machine: a CUDA build of torch, then specdec (README, "Quick start"), and from the
repository root (a few minutes on an H200: docs/performance.md, "GPU check"):

    python3 benchmarks/gpu_check.py --out DIR     # DIR: gpu_check.json, gpu_check.md, specdec-up.log

On a GPU machine without network that has Python 3.12, a CUDA torch, transformers, grpcio, protobuf
and prometheus-client: first, on a machine with network, from the repository root,
``python3 scripts/bundle_wheels.py`` puts in wheels/ the rest that specdec's servers import and
specdec's own wheel. Copy the checkout with wheels/ there; then, from its root:

    python3 -m pip install --no-index --no-deps --target /tmp/site wheels/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py --out DIR

The check runs the specdec it imports; rebuild the wheels after any change (the JSON's
``stale_specdec_files`` lists the checkout's files that the installed specdec does not hold as they
are). ``--out`` defaults to benchmarks/results/gpu_check/. On a CPU, in the test suite
(tests/test_gpu_check.py), in under a minute: ``python3 benchmarks/gpu_check.py --device cpu --small``.

Sections (each records its own failures in the JSON and the rest go on):

(a) correctness: greedy output of specdec at k = 0, 1, 3, 5, adaptive and with the n-gram drafter
    equals ``transformers`` ``generate`` in float32 on the demo pair, and equals specdec's own k = 0
    in bfloat16 (exact numerics) on the demo pair and on a random Llama-shaped target of about 1B
    parameters made on the fly (its draft: random, the demo draft's depth at the target's width;
    --small: a tiny one); and in exact numerics a row's logits are bitwise the same alone, in a k + 1
    block and beside other sessions.
(b) speed: tokens/s target-only and speculative (adaptive) at 1, 16 and 64 sessions; the time of a
    forward of k + 1 rows over one row (k = 1..8) for the random target; exact numerics against fast
    (and, where exact numerics run on the Triton kernels, against the PyTorch tiles they replace);
    CUDA graphs on and off.
(c) the distributed premise: ``specdec up`` with the target on --device and the drafter on CPU cores,
    overlap on and off, against one process, on the demo pair (--small: the same roles over gRPC
    inside this process, ``--deployment in-process``: three processes importing torch take a minute
    to start on a 2-core machine).

Without CUDA, bfloat16 runs only on a CPU with native bf16; elsewhere the bfloat16 parts run in
float32 (said in the JSON). The engines are specdec's own, in this process (roles.embedded_engines,
VerifierEngine's runner); nothing here reimplements decoding. The report's files: gpu_report.py.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, ROOT  # noqa: E402
import make_random_target  # noqa: E402
from gpu_report import SECTIONS, environment, log, run_section, stale_files, write_report  # noqa: E402

KS = (0, 1, 3, 5, None)  # None: adaptive
NGRAM_KS = (3, None)
VERIFY_KS = tuple(range(1, 9))
# Random targets: ~1.0B parameters in Llama-3.2-1B's shape (the demo tokenizer's 6,144-token vocabulary), or tiny.
BIG_SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=8192, max_position_embeddings=1024)
SMALL_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, max_position_embeddings=512)


@dataclass(frozen=True)
class Plan:
    """What one run measures: sizes follow --small."""

    device: str
    draft_device: str  # (a) and (b); (c) always drafts on the CPU
    runner: str
    lowp: str  # "bfloat16", or float32 where this CPU has no native bf16
    small: bool
    out: Path
    threads: int | None
    prompts: int
    max_new: int
    levels: tuple[int, ...]
    distributed_levels: tuple[int, ...]
    reps: int
    context: int  # tokens in a session's cache when forwards are timed
    deployment: str  # (c): "up" (three processes) or "in-process" (the same roles over gRPC in this process)


def make_plan(args: argparse.Namespace) -> Plan:
    from specdec.core.cpu_features import native_bf16

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    lowp = "bfloat16" if device != "cpu" or native_bf16() else "float32"
    small = args.small
    return Plan(device=device, draft_device=args.draft_device or device, runner=args.runner, lowp=lowp, small=small,
                out=Path(args.out), threads=args.threads or (1 if device == "cpu" else None),
                prompts=2 if small else 8, max_new=args.max_new or (8 if small else 64), levels=(1, 4) if small else (1, 16, 64),
                distributed_levels=(1, 2) if small else (1, 16), reps=3 if small else 20, context=32 if small else 128,
                deployment=args.deployment or ("in-process" if small else "up"))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- models and engines
@dataclass(frozen=True)
class Pair:
    name: str
    target: str
    draft: str


def prompts(n: int) -> list[str]:
    """The demo pair's held-out openings where this Python's standard library has them, else built-in ones."""
    from specdec.bench_common import BUILTIN_PROMPTS, held_out_prompts

    try:
        out = held_out_prompts(n, DEMO)
    except OSError:  # another Python's standard library (the held-out files are named by path)
        out = []
    out = out or list(BUILTIN_PROMPTS)
    return [out[i % len(out)] for i in range(n)]


def make_random_pair(folder: Path, small: bool) -> Pair:
    """A random Llama-shaped target (BIG_SHAPE, or SMALL_SHAPE) and a random draft of the demo draft's
    depth at its width, saved in bfloat16 with the demo tokenizer; end-of-text never wins (make_random_target)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(make_random_target.DEMO_TARGET, local_files_only=True)
    eos = tok.eos_token_id
    draft_layers = json.loads((DEMO / "draft" / "config.json").read_text())["num_hidden_layers"]
    shape = SMALL_SHAPE if small else BIG_SHAPE
    paths = []
    for name, layers, seed in (("target", shape["num_hidden_layers"], 0), ("draft", draft_layers, 1)):
        cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                          rms_norm_eps=1e-6, **{**shape, "num_hidden_layers": layers})
        cfg.architectures = ["LlamaForCausalLM"]
        out = folder / name
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.to(torch.bfloat16) for k, v in make_random_target.weights(cfg, len(tok), eos, seed).items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(out)
        for f in make_random_target.TOKENIZER_FILES:
            shutil.copy(make_random_target.DEMO_TARGET / f, out / f)
        paths.append((str(out), sum(t.numel() for t in tensors.values())))
    (target, params), (draft, _) = paths
    return Pair(f"random-{params / 1e9:.2f}B" if not small else f"random-{params / 1e6:.1f}M", target, draft)


def load_verifier(plan: Plan, path: str, dtype: str, numerics: str, **extra):
    """A VerifierEngine on plan.device, checked to compute there (one forward)."""
    from specdec.core.runner import Feed
    from specdec.target.engine import TargetConfig, VerifierEngine

    sessions = max(max(plan.levels), plan.prompts * (len(KS) + len(NGRAM_KS))) + 8  # the grid's requests all at once
    config = TargetConfig(path, device=plan.device, runner=plan.runner, dtype=dtype, numerics=numerics,
                          threads=plan.threads, max_sessions=sessions, max_kv_tokens=sessions * 512, **extra)
    engine = VerifierEngine.from_config(config)
    cache = engine.runner.new_cache()
    with torch.inference_mode():
        logits = engine.runner.forward([Feed(cache, 0, [1, 2, 3], 1)])[0]
    engine.runner.free(cache)
    if logits.device.type != torch.device(plan.device).type:
        raise RuntimeError(f"asked for --device {plan.device}, the target's {type(engine.runner).__name__} computed on {logits.device}")
    return engine


def describe(engine) -> str:
    """The runner, its numerics, and on the paged runner its exact kernels and whether CUDA graphs replay."""
    paged = engine.paged
    kernels = f" ({paged.exact_kernels})" if paged is not None and paged.exact_kernels else ""
    graphs = ", CUDA graphs" if paged is not None and paged.graphs is not None else ""
    return f"{type(engine.runner).__name__}, {engine.numerics}{kernels}{graphs}"


class Engines:
    """The run's VerifierEngines, each loaded once and shared by the sections (a 1B target takes seconds
    to load); an engine's sessions are all closed between uses."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.loaded: dict[tuple, object] = {}

    def get(self, path: str, dtype: str, numerics: str, **extra):
        """The engine; CUDA graphs on unless exact numerics (which has none)."""
        extra.setdefault("cuda_graphs", numerics != "exact")
        key = (path, dtype, numerics, tuple(sorted(extra.items())))
        if key not in self.loaded:
            engine = self.loaded[key] = load_verifier(self.plan, path, dtype, numerics, **extra)
            self.loaded.setdefault((path, dtype, engine.numerics, key[3]), engine)  # "auto" is exact or fast: one engine
        return self.loaded[key]

    def clear(self) -> None:
        self.loaded.clear()
        free()


def load_drafter(plan: Plan, pair: Pair, device: str):
    from specdec.draft.drafters import DraftConfig
    from specdec.draft.engine import DraftEngine

    dtype = "float32" if device == "cpu" else "bfloat16"
    # One model thread for both models in one process (as roles.embedded): no niceness on it.
    return DraftEngine.from_config(DraftConfig(pair.draft, pair.target, draft_device=device, draft_dtype=dtype,
                                               threads=plan.threads, thread_nice=0))


@contextlib.asynccontextmanager
async def orchestrator(verifier, drafter, patient: bool = False):
    """specdec's roles in this process over engines already loaded (roles.embedded_engines)."""
    from specdec import roles
    from specdec.orchestrator.request import OrchestratorConfig
    from specdec.target.loop import LoopConfig

    loop = LoopConfig(draft_wait_s=120.0) if patient else LoopConfig()  # patient: every step waits for its block
    orch = roles.embedded_engines(verifier, drafter, OrchestratorConfig(max_new_tokens_limit=4096, max_concurrent_requests=256),
                                  loop_config=loop)
    try:
        yield orch
    finally:
        await orch.aclose()
        drafter.shutdown()


def free() -> None:
    """Collect what the caller let go of and hand the device's cached memory back."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def policy(k: int | None, overlap: bool = True):
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy

    if k is None:
        return SpeculationPolicy(SpeculationMode.ADAPTIVE, 4, 8, overlap=overlap)
    return SpeculationPolicy(SpeculationMode.FIXED, k, overlap=overlap)


def label(drafter: str, k: int | None) -> str:
    return f"{'' if drafter == 'model' else drafter + ' '}{'adaptive' if k is None else f'k={k}'}"


# ----------------------------------------------------------------------------- (a) correctness
async def greedy_grid(orch, prompt_ids: list[tuple[int, ...]], max_new: int, runs: list[tuple[str, int | None]]) -> dict:
    """Every (drafter, k) x prompt at once, so sessions of different k share the verifier's forwards:
    {label: ([ids per prompt], draft tokens, accepted tokens)}."""
    from specdec.orchestrator.loop import collect
    from specdec.orchestrator.request import GenerationRequest

    grid = [(d, k, ids) for d, k in runs for ids in prompt_ids]
    replies = await asyncio.gather(*(collect(orch.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=max_new, drafter=d,
                                                                             policy=policy(k)))) for d, k, ids in grid))
    out: dict[str, tuple[list, int, int]] = {}
    for (d, k, _), (last, ids, _) in zip(grid, replies):
        got, drafted, accepted = out.setdefault(label(d, k), ([], 0, 0))
        got.append(ids)
        out[label(d, k)] = (got, drafted + last.counters.draft_tokens, accepted + last.counters.accepted_tokens)
    return out


def compare(rows: list[dict], what: dict, reference: list[tuple[int, ...]], grid: dict) -> None:
    for run, (got, drafted, accepted) in grid.items():
        differ = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
        first = [next((j for j, (x, y) in enumerate(zip(got[i], reference[i])) if x != y), min(len(got[i]), len(reference[i])))
                 for i in differ]
        rows.append({**what, "run": run, "prompts": len(reference), "equal": not differ, "differing_prompts": differ,
                     "first_difference_at": first, "draft_tokens": drafted, "accepted_tokens": accepted})


def hf_greedy(path: str, device: str, prompt_ids: list[tuple[int, ...]], max_new: int) -> list[tuple[int, ...]]:
    """transformers' own greedy ``generate`` in float32 on ``device``, one prompt at a time."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).to(device).eval()
    eos = model.config.eos_token_id
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, pad_token_id=eos)
            out.append(tuple(y[0, len(ids):].tolist()))
    del model
    free()
    return out


def batch_invariance(engine, context: int) -> dict:
    """Exact numerics' promise on this device: a row's logits are bitwise the same decoded alone, as row
    0 of a 4-row block, and beside three other sessions. Returns the largest differences seen."""
    from specdec.core.runner import Feed

    prompt = [(7 * i) % 97 + 1 for i in range(context)]
    rows = [11, 12, 13, 14]

    def logits_of(sessions: int, block: list[int]) -> torch.Tensor:
        caches = [engine.runner.new_cache() for _ in range(sessions)]
        try:
            with torch.inference_mode():
                engine.runner.forward([Feed(c, 0, prompt[: context - i], 1) for i, c in enumerate(caches)])
                return engine.runner.forward([Feed(c, context - i, block, len(block)) for i, c in enumerate(caches)])[0][0].float().cpu()
        finally:
            for c in caches:
                engine.runner.free(c)

    alone = logits_of(1, rows[:1])
    return {f"max_abs_diff_{name}": float((alone - logits_of(s, b)).abs().max())
            for name, s, b in (("in_block", 1, rows), ("beside_sessions", 4, rows[:1]), ("block_beside_sessions", 4, rows))}


async def check_correctness(plan: Plan, engines: Engines, demo: Pair, rand: Pair) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo.target, local_files_only=True)
    prompt_ids = [tuple(tok(p)["input_ids"]) for p in prompts(plan.prompts)]
    runs = [("model", k) for k in KS] + [("ngram", k) for k in NGRAM_KS]
    rows: list[dict] = []
    errors, info = {}, {"prompts": len(prompt_ids), "max_new_tokens": plan.max_new}
    if plan.lowp != "bfloat16":
        info["bfloat16"] = "this CPU has no native bf16: the own-k=0 comparisons ran in float32"

    async def float32_against_transformers() -> None:
        log(f"correctness: {demo.name} float32: transformers generate on {plan.device}")
        reference = hf_greedy(demo.target, plan.device, prompt_ids, plan.max_new)
        verifier = engines.get(demo.target, "float32", "auto")
        log(f"correctness: {demo.name} float32: specdec ({describe(verifier)}), {len(runs)} runs x {len(prompt_ids)} prompts")
        async with orchestrator(verifier, load_drafter(plan, demo, plan.draft_device), patient=True) as orch:
            grid = await greedy_grid(orch, prompt_ids, plan.max_new, runs)
        compare(rows, {"pair": demo.name, "dtype": "float32", "engine": describe(verifier), "reference": "transformers generate"},
                reference, grid)

    async def lowp_against_own_k0(pair: Pair) -> None:
        verifier = engines.get(pair.target, plan.lowp, "exact")
        log(f"correctness: {pair.name} {plan.lowp}: specdec ({describe(verifier)}) against its own k=0")
        async with orchestrator(verifier, load_drafter(plan, pair, plan.draft_device), patient=True) as orch:
            reference = (await greedy_grid(orch, prompt_ids, plan.max_new, [("model", 0)]))["k=0"][0]
            grid = await greedy_grid(orch, prompt_ids, plan.max_new, [r for r in runs if r[1] != 0])
        compare(rows, {"pair": pair.name, "dtype": plan.lowp, "engine": describe(verifier), "reference": "specdec k=0"},
                reference, grid)
        info[f"batch_invariance {pair.name} {plan.lowp} exact"] = diffs = batch_invariance(verifier, plan.context)
        rows.append({"pair": pair.name, "dtype": plan.lowp, "engine": describe(verifier), "reference": "the row decoded alone",
                     "run": "logits bitwise, exact numerics", "prompts": 1, "equal": not any(diffs.values()),
                     "differing_prompts": [], "first_difference_at": [], "draft_tokens": 0, "accepted_tokens": 0})

    for name, step in (("float32 against transformers", float32_against_transformers),
                       (f"{demo.name} {plan.lowp} against k=0", lambda: lowp_against_own_k0(demo)),
                       (f"{rand.name} {plan.lowp} against k=0", lambda: lowp_against_own_k0(rand))):
        try:
            await step()
        except Exception:  # one comparison's failure is recorded; the others still run
            errors[name] = traceback.format_exc(limit=6)
            log(f"correctness: {name} FAILED:\n{errors[name]}")
    return {"comparisons": rows, "all_equal": bool(rows) and all(r["equal"] for r in rows) and not errors,
            "info": info, "errors": errors}


# ----------------------------------------------------------------------------- (b) speed
async def tokens_per_s(orch, texts: list[str], levels: tuple[int, ...], max_new: int, modes: dict) -> dict:
    """{"<level>/<mode>": tokens/s} over ``level`` sessions at once, each mode alternated per level."""
    from specdec.bench_load import run_level

    await run_level(orch, texts, 2, policy(0), max_new, 1)  # warm-up: first-call costs out of the figures
    await run_level(orch, texts, 2, policy(None), max_new, 1)
    out = {}
    for level in levels:
        for mode, pol in modes.items():
            run = await run_level(orch, texts, level, pol, max_new, 1)
            out[f"{level}/{mode}"] = run["tokens"] / run["seconds"]
            log(f"speed:   {level:>3} sessions {mode:<22} {out[f'{level}/{mode}']:9.1f} tokens/s")
    return out


def forward_ms(runner, device: str, shapes: list[tuple[int, int]], context: int, reps: int) -> dict:
    """Median ms of one forward of ``runner`` (core/runner.py) over ``rows`` new tokens for each of
    ``sessions`` sessions holding ``context`` tokens, for each (sessions, rows); shapes alternated
    within every repetition."""
    from specdec.core.runner import Feed

    prompt = [(5 * i) % 89 + 1 for i in range(context)]
    caches = {s: [runner.new_cache() for _ in range(s)] for s in {s for s, _ in shapes}}
    times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    with torch.inference_mode():
        for cs in caches.values():
            runner.forward([Feed(c, 0, prompt, 1) for c in cs])
        for rep in range(reps + 2):  # two warm-ups
            for sessions, rows in shapes:
                feeds = [Feed(c, context, list(range(20, 20 + rows)), rows) for c in caches[sessions]]
                for c in caches[sessions]:
                    runner.truncate(c, context)
                sync(device)
                t0 = time.perf_counter()
                runner.forward(feeds)
                sync(device)
                if rep >= 2:
                    times[sessions, rows].append((time.perf_counter() - t0) * 1e3)
    for cs in caches.values():
        for c in cs:
            runner.free(c)
    return {shape: statistics.median(ts) for shape, ts in times.items()}


def exact_tiles_runner(plan: Plan, path: str, dtype: str, sessions: int):
    """The paged runner in exact numerics on the PyTorch tiles the Triton kernels replace. A paged
    runner picks its exact kernels once, at load, and TargetConfig leaves them to it: so this one is
    built here, over its own copy of the model."""
    from specdec.core.models import load_causal_lm
    from specdec.core.paged_runner import PagedRunner

    loaded = load_causal_lm(path, dtype=dtype, threads=plan.threads, device=plan.device)
    return PagedRunner(loaded.model, max_sessions=sessions, numerics="exact", exact_kernels="tiles", own_weights=True)


async def check_speed(plan: Plan, engines: Engines, demo: Pair, rand: Pair) -> dict:
    results: dict[str, dict] = {}
    errors, skipped, info = {}, {}, {"dtype": plan.lowp}
    texts = prompts(max(plan.levels))
    shapes = [(1, 1), (1, 4), (max(plan.levels), 1), (max(plan.levels), 4)]
    modes = {"target-only": policy(0), "speculative adaptive": policy(None)}

    async def sessions_sweep(pair: Pair) -> None:
        verifier = engines.get(pair.target, plan.lowp, "auto")
        info[f"engine {pair.name}"] = describe(verifier)
        log(f"speed: {pair.name} {plan.lowp} ({describe(verifier)}): tokens/s at {plan.levels} sessions")
        async with orchestrator(verifier, load_drafter(plan, pair, plan.draft_device)) as orch:
            got = await tokens_per_s(orch, texts, plan.levels, plan.max_new, modes)
        results[f"tokens_per_s {pair.name}"] = got
        results[f"speculative_over_target_only {pair.name}"] = {
            str(level): got[f"{level}/speculative adaptive"] / got[f"{level}/target-only"] for level in plan.levels}

    def verify_cost() -> None:
        verifier = engines.get(rand.target, plan.lowp, "auto")
        log(f"speed: {rand.name} ({describe(verifier)}): a forward of k + 1 rows against one, k = 1..8")
        ms = forward_ms(verifier.runner, plan.device, [(1, k + 1) for k in (0, *VERIFY_KS)], plan.context, plan.reps)
        results[f"verify_ms {rand.name}"] = {str(rows): v for (_, rows), v in ms.items()}
        results[f"verify_cost_ratio {rand.name}"] = {str(k): ms[1, k + 1] / ms[1, 1] for k in VERIFY_KS}

    def numerics_cost() -> None:
        ms = {}
        for numerics in ("fast", "exact"):  # the arithmetic's cost alone: no CUDA graphs (exact has none)
            verifier = engines.get(rand.target, plan.lowp, numerics, cuda_graphs=False)
            log(f"speed: {rand.name} numerics {numerics} ({describe(verifier)}): forwards {shapes}")
            ms[numerics] = forward_ms(verifier.runner, plan.device, shapes, plan.context, plan.reps)
            if numerics == "exact" and verifier.paged is not None and verifier.paged.exact_kernels == "triton":
                log(f"speed: {rand.name} numerics exact on the PyTorch tiles the Triton kernels replace: forwards {shapes}")
                tiles = exact_tiles_runner(plan, rand.target, plan.lowp, max(plan.levels))
                try:
                    ms["exact_tiles"] = forward_ms(tiles, plan.device, shapes, plan.context, plan.reps)
                finally:
                    del tiles
                    free()
        for numerics, got in ms.items():
            results[f"numerics_{numerics}_ms {rand.name}"] = {f"{s}x{r}": v for (s, r), v in got.items()}
        for numerics in ms.keys() - {"fast"}:
            results[f"{numerics}_over_fast {rand.name}"] = {f"{s}x{r}": ms[numerics][s, r] / ms["fast"][s, r] for s, r in shapes}

    def cuda_graphs() -> None:
        if not plan.device.startswith("cuda"):
            skipped["cuda_graphs"] = "CUDA graphs are CUDA's: not on the CPU"
            return
        ms = {}
        for on in (True, False):
            verifier = engines.get(rand.target, plan.lowp, "fast", cuda_graphs=on)
            log(f"speed: {rand.name} cuda_graphs={on} ({describe(verifier)}): forwards {shapes}")
            ms[on] = forward_ms(verifier.runner, plan.device, shapes, plan.context, plan.reps)
        results[f"graphs_on_ms {rand.name}"] = {f"{s}x{r}": v for (s, r), v in ms[True].items()}
        results[f"graphs_off_ms {rand.name}"] = {f"{s}x{r}": v for (s, r), v in ms[False].items()}
        results[f"graphs_off_over_on {rand.name}"] = {f"{s}x{r}": ms[False][s, r] / ms[True][s, r] for s, r in shapes}

    steps = [(f"sessions {demo.name}", lambda: sessions_sweep(demo)), (f"sessions {rand.name}", lambda: sessions_sweep(rand)),
             ("verify cost", verify_cost), ("exact numerics", numerics_cost), ("cuda graphs", cuda_graphs)]
    for name, step in steps:
        try:
            done = step()
            if asyncio.iscoroutine(done):
                await done
        except Exception:  # one measurement's failure is recorded; the others still run
            errors[name] = traceback.format_exc(limit=6)
            log(f"speed: {name} FAILED:\n{errors[name]}")
    return {"results": results, "info": info, "skipped": skipped, "errors": errors}


# ----------------------------------------------------------------------------- (c) distributed
def up_argv(plan: Plan, pair: Pair, dtype: str, base_port: int) -> list[str]:
    """``specdec up``'s arguments: target on plan.device, drafter on the CPU, sessions in memory, no HTTP API."""
    return ["up", "--topology", "split", "--target", pair.target, "--draft", pair.draft, "--base-port", str(base_port),
            "--redis-url=", "--http-port=-1",
            "--threads", str(plan.threads or 4), "--device", plan.device, "--draft-device", "cpu", "--dtype", dtype,
            "--numerics", "auto"]


@contextlib.asynccontextmanager
async def deployment(plan: Plan, pair: Pair, dtype: str):
    """The three roles over gRPC on loopback; yields (orchestrator address, guard) where ``await guard(aw)``
    fails at once if the deployment dies meanwhile. ``plan.deployment`` "up": ``specdec up``, three processes
    in a process group of their own, started from outside the checkout (so ``-m specdec`` is the installed
    package); "in-process": the same roles in this process (specdec.roles, as tests/cluster.py starts them)."""
    if plan.deployment == "up":
        from specdec.bench_runners import Deployment, free_base_port, until_exit_or

        log_path, base = plan.out / "specdec-up.log", free_base_port()
        with open(log_path, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "specdec", *up_argv(plan, pair, dtype, base)],
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=tempfile.gettempdir())
        up = Deployment(proc, f"127.0.0.1:{base}", log_path)
        log(f"distributed: specdec up at {up.address} (log {log_path})")
        try:
            yield up.address, lambda aw: until_exit_or(aw, up)
        finally:
            up.stop()
        return
    from specdec import roles
    from specdec.core.sessions import InMemorySessionStore
    from specdec.draft.drafters import DraftConfig
    from specdec.orchestrator.request import OrchestratorConfig
    from specdec.rpc.server import ServerConfig
    from specdec.target.engine import TargetConfig

    loopback = ServerConfig("127.0.0.1", 0)
    servers = []
    try:
        draft_server, _ = await roles.start_draft(DraftConfig(pair.draft, pair.target, draft_device="cpu",
                                                              threads=plan.threads), loopback)
        servers.append(draft_server)
        target_server, _ = await roles.start_target(TargetConfig(pair.target, device=plan.device, runner=plan.runner,
                                                                 dtype=dtype, threads=plan.threads), loopback)
        servers.append(target_server)
        upstreams = roles.Upstreams(draft_server.address, target_server.address, pair.target, timeout_s=120.0, step_timeout_s=120.0)
        orch_server, orch = await roles.start_orchestrator(OrchestratorConfig(max_concurrent_requests=256), upstreams,
                                                           InMemorySessionStore(3600.0), loopback)
        servers.append(orch_server)
        log(f"distributed: the roles in this process over gRPC, orchestrator at {orch_server.address}")

        async def guard(aw):
            return await aw

        yield orch_server.address, guard
        await orch.aclose()
    finally:
        for server in reversed(servers):
            await server.stop(0)


async def grpc_generate(stub, texts: list[str], level: int, k: int | None, overlap: bool, max_new: int) -> tuple[float, list]:
    """``level`` Generate calls at once through an orchestrator: (tokens/s, each one's token ids)."""
    from specdec.v1 import common_pb2, generation_pb2 as pb

    if k is None:
        spec = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_ADAPTIVE, num_speculative_tokens=4,
                                            max_speculative_tokens=8, overlap=overlap)
    else:
        spec = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=k, overlap=overlap)
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(stub.Generate(pb.GenerateRequest(text=texts[i % len(texts)], max_new_tokens=max_new,
                                                                      drafter="model", speculation=spec), timeout=600)
                                     for i in range(level)))
    seconds = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in replies) / seconds, [tuple(r.token_ids) for r in replies]


async def wait_until_serving(stub, wait_s: float = 300.0) -> None:
    """Until the orchestrator answers a one-token request (its workers may still be loading)."""
    import grpc

    from specdec.v1 import generation_pb2 as pb

    deadline = time.monotonic() + wait_s
    while True:
        try:
            await stub.Generate(pb.GenerateRequest(text="x", max_new_tokens=1), timeout=30)
            return
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def check_distributed(plan: Plan, engines: Engines, demo: Pair) -> dict:
    import grpc

    from specdec.orchestrator.loop import collect
    from specdec.orchestrator.request import GenerationRequest
    from specdec.rpc.server import CHANNEL_OPTIONS
    from specdec.v1 import generation_pb2_grpc

    dtype = "bfloat16" if plan.device != "cpu" else "float32"
    texts = prompts(max(plan.distributed_levels))
    modes = {"target-only": (0, True), "adaptive overlap": (None, True), "adaptive no overlap": (None, False)}
    results: dict[str, dict] = {"one_process": {}, "distributed": {}}
    errors = {}
    info = {"layout": f"target on {plan.device} ({dtype}), drafter on the CPU", "deployment": plan.deployment}
    outputs: dict[str, list] = {}

    async def one_process() -> None:
        verifier = engines.get(demo.target, dtype, "auto")
        info["one_process_engine"] = describe(verifier)
        log(f"distributed: one process, {info['layout']} ({describe(verifier)})")
        async with orchestrator(verifier, load_drafter(plan, demo, "cpu")) as orch:
            for level in plan.distributed_levels:
                for mode, (k, overlap) in modes.items():
                    t0 = time.perf_counter()
                    replies = await asyncio.gather(*(collect(orch.generate(GenerationRequest(
                        prompt_text=texts[i], max_new_tokens=plan.max_new, drafter="model", policy=policy(k, overlap))))
                        for i in range(level)))
                    rate = sum(len(ids) for _, ids, _ in replies) / (time.perf_counter() - t0)
                    results["one_process"][f"{level}/{mode}"] = rate
                    outputs[f"one/{level}/{mode}"] = [ids for _, ids, _ in replies]
                    log(f"distributed:   one process {level:>3} sessions {mode:<20} {rate:9.1f} tokens/s")
        engines.clear()  # the deployment loads its own target: this one's device memory goes back first

    async def deployed() -> None:
        async with deployment(plan, demo, dtype) as (address, guard):
            async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                await guard(wait_until_serving(stub))
                await guard(grpc_generate(stub, texts, 2, None, True, plan.max_new))  # warm-up
                for level in plan.distributed_levels:
                    for mode, (k, overlap) in modes.items():
                        rate, ids = await guard(grpc_generate(stub, texts, level, k, overlap, plan.max_new))
                        results["distributed"][f"{level}/{mode}"] = rate
                        outputs[f"distributed/{level}/{mode}"] = ids
                        log(f"distributed:   {plan.deployment:<11} {level:>3} sessions {mode:<20} {rate:9.1f} tokens/s")

    for name, step in (("one process", one_process), (plan.deployment, deployed)):
        try:
            await step()
        except Exception:
            errors[name] = traceback.format_exc(limit=6)
            log(f"distributed: {name} FAILED:\n{errors[name]}")
    done = [key for key in results["distributed"] if key in results["one_process"]]
    results["distributed_over_one_process"] = {key: results["distributed"][key] / results["one_process"][key] for key in done}
    info["same_tokens_as_one_process"] = {key: outputs[f"distributed/{key}"] == outputs[f"one/{key}"] for key in done}
    return {"results": results, "info": info, "errors": errors}


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N: the target's (auto: cuda when visible)")
    ap.add_argument("--draft-device", default=None, help="the draft's in (a) and (b) (default: --device); (c) drafts on the CPU")
    ap.add_argument("--runner", default="auto", choices=("auto", "lean", "paged", "hf"), help="the target's model runner")
    ap.add_argument("--small", action="store_true", help="tiny random target, few tokens, 1 and 4 sessions (the test suite's run)")
    ap.add_argument("--max-new", type=int, default=None, help="tokens a request generates (default: 64; --small: 8)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per model (default: 1 on the CPU, torch's own with CUDA)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check"),
                    help="folder for gpu_check.json, gpu_check.md and specdec-up.log (default: benchmarks/results/gpu_check)")
    ap.add_argument("--deployment", choices=("up", "in-process"), default=None,
                    help="(c): specdec up's three processes (default), or the same roles over gRPC in this process "
                         "(default with --small: starting three processes that import torch takes a minute on 2 cores)")
    ap.add_argument("--skip", action="append", default=[], choices=SECTIONS)
    args = ap.parse_args(argv)
    plan = make_plan(args)
    plan.out.mkdir(parents=True, exist_ok=True)
    if plan.threads:
        torch.set_num_threads(plan.threads)
    log(f"gpu_check: target on {plan.device}, draft on {plan.draft_device}, {plan.lowp}, runner {plan.runner}"
        f"{', small' if plan.small else ''}; out {plan.out}")
    demo = Pair("demo", str(DEMO / "target"), str(DEMO / "draft"))
    report: dict = {"environment": environment(plan.device, draft_device=plan.draft_device, runner=plan.runner,
                                               low_precision=plan.lowp, small=plan.small)}
    stale = report["environment"]["stale_specdec_files"] = stale_files()
    if stale:
        log(f"WARNING: the specdec imported here differs from this checkout in {len(stale)} files ({', '.join(stale[:5])}"
            f"{', ...' if len(stale) > 5 else ''}): rebuild its wheel (scripts/bundle_wheels.py) and reinstall")
    with tempfile.TemporaryDirectory(prefix="specdec-gpu-check-") as tmp:
        log("making the random pair" + (" (tiny)" if plan.small else " (about 1B parameters)"))
        try:
            rand = make_random_pair(Path(tmp), plan.small)
        except Exception:  # each use of it then fails, recorded, and the demo pair's parts still run
            report["environment"]["random_pair_error"] = traceback.format_exc(limit=4)
            rand = Pair("random (not made)", str(Path(tmp) / "missing" / "target"), str(Path(tmp) / "missing" / "draft"))
        report["environment"]["random_pair"] = rand.name
        engines = Engines(plan)
        sections = {"correctness": lambda: check_correctness(plan, engines, demo, rand),
                    "speed": lambda: check_speed(plan, engines, demo, rand),
                    "distributed": lambda: check_distributed(plan, engines, demo)}
        for name in sections:
            report[name] = {"status": "not run yet", "seconds": 0}
        for name, run in sections.items():
            report[name] = {"status": "skipped", "seconds": 0} if name in args.skip else run_section(name, run)
            write_report(plan.out, report)  # after every section: a run stopped at its time limit keeps what it measured
        engines.clear()
    log(f"wrote {plan.out / 'gpu_check.json'} and {plan.out / 'gpu_check.md'}")
    ok = report["correctness"].get("all_equal", "correctness" in args.skip) and all(
        report[n]["status"] in ("ok", "skipped") for n in sections)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
