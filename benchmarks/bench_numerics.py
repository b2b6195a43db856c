"""Exact vs fast numerics of the lean forward (core/exact_ops.py): what exactness costs, and what it fixes.

    python benchmarks/bench_numerics.py [--target PATH] [--threads 1,2] [--reps 15]
    python benchmarks/bench_numerics.py --out benchmarks/results/numerics/numerics.json

Speed: per-forward milliseconds of the target's lean forward, fast (kernels timed at load, SDPA)
and exact, alternated call by call so machine noise hits both alike, medians and exact/fast ratios:
one session feeding k+1 = 1..8 rows, and 16 sessions of mixed lengths (each 1 row, each 4 rows,
and mixed k = 0..8), in float32 and (where the CPU has native bf16) bfloat16.

Numerics: greedy target-only decoding of held-out prompts one row per step, then the same tokens
fed again in blocks of 4 rows (a k = 3 verification): the largest |logit difference| between the
two and the number of positions whose greedy token flips, per mode and dtype. Exact mode must
show 0 and 0; fast mode shows what speculation would change.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, held_out_prompts, machine  # noqa: E402

ROWS = range(1, 9)  # k + 1 of one session's verification
SESSIONS = 16
MIXED_K = [i % 9 for i in range(SESSIONS)]  # k = 0..8 across the 16 sessions


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def prefill(dec, prompt_ids: list[int]):
    cache = dec.new_cache()
    dec.forward(cache, prompt_ids, 0, 1)
    return cache


def speed(decoders: dict, prompts_ids: list[list[int]], reps: int) -> dict:
    """Per-forward ms of each decoder, alternated call by call; the same feeds for all."""
    out: dict = {}
    names = list(decoders)
    one = {n: prefill(d, prompts_ids[0]) for n, d in decoders.items()}
    text = [t for ids in prompts_ids for t in ids]  # mixed lengths: 30..195 positions of held-out code
    text = text * (1 + 300 // len(text))
    prefixes = [text[7 * i: 7 * i + 30 + 11 * i] for i in range(SESSIONS)]
    many = {n: [prefill(d, prefix) for prefix in prefixes] for n, d in decoders.items()}
    starts = [len(prefix) for prefix in prefixes]
    feed = prompts_ids[1]

    def batch_call(name: str, rows: list[int]):
        d = decoders[name]
        return lambda: d.forward_batch(many[name], [feed[:r] for r in rows], starts, rows)

    cases = {f"1 session, {r} rows": (lambda name, r=r: (lambda: decoders[name].forward(one[name], feed[:r], len(prompts_ids[0]), r)))
             for r in ROWS}
    cases[f"{SESSIONS} sessions, 1 row each"] = lambda name: batch_call(name, [1] * SESSIONS)
    cases[f"{SESSIONS} sessions, 4 rows each"] = lambda name: batch_call(name, [4] * SESSIONS)
    cases[f"{SESSIONS} sessions, mixed k 0..8"] = lambda name: batch_call(name, [k + 1 for k in MIXED_K])
    for case, make in cases.items():
        calls = {n: make(n) for n in names}
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(reps + 2):
            for n in (names if rep % 2 == 0 else names[::-1]):  # alternate the order too
                ms = timed(calls[n])
                if rep >= 2:  # warm-up
                    times[n].append(ms)
        med = {n: statistics.median(t) for n, t in times.items()}
        out[case] = {"median_ms": {n: round(m, 3) for n, m in med.items()}}
        for dtype in ("float32", "bfloat16"):
            fast, exact = f"{dtype} fast", f"{dtype} exact"
            if fast in med and exact in med:
                out[case][f"{dtype} exact/fast"] = round(med[exact] / med[fast], 3)
        print(case, out[case], flush=True)
    return out


def greedy_single_rows(dec, prompt_ids: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """Target-only greedy decoding, one row per forward: the tokens and the logits that chose them."""
    cache, seq = dec.new_cache(), list(prompt_ids)
    rows = [dec.forward(cache, seq, 0, 1)[0]]
    for _ in range(max_new - 1):
        seq.append(int(rows[-1].argmax()))
        rows.append(dec.forward(cache, [seq[-1]], len(seq) - 1, 1)[0])
    seq.append(int(rows[-1].argmax()))
    return seq, torch.stack(rows)  # logits of positions len(prompt)-1 .. len(seq)-2


def blocks_of_four(dec, prompt_ids: list[int], seq: list[int]) -> torch.Tensor:
    """The same positions' logits, the generated tokens fed 4 rows per forward (as k = 3 verifications)."""
    cache, n = dec.new_cache(), len(prompt_ids)
    rows = [dec.forward(cache, seq[:n], 0, 1)[0]]
    pos = n
    while pos < len(seq) - 1:
        block = seq[pos: min(pos + 4, len(seq) - 1)]
        rows.extend(dec.forward(cache, block, pos, len(block)))
        pos += len(block)
    return torch.stack(rows)


def numerics(decoders: dict, prompts_ids: list[list[int]], max_new: int) -> dict:
    out = {}
    for name, dec in decoders.items():
        worst, flips, positions = 0.0, 0, 0
        for ids in prompts_ids:
            seq, single = greedy_single_rows(dec, ids, max_new)
            block = blocks_of_four(dec, ids, seq)
            worst = max(worst, (single - block).abs().max().item())
            flips += int((single.argmax(-1) != block.argmax(-1)).sum())
            positions += single.shape[0]
        out[name] = {"max_abs_logit_diff_single_vs_4row_blocks": worst, "greedy_flips": flips, "positions": positions}
        print(name, out[name], flush=True)
    return out


def with_threads(count: int, run):
    torch.set_num_threads(count)
    print(f"-- {count} torch threads", flush=True)
    return run()


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--threads", default="1", help="torch thread counts, comma-separated: speed is measured at each")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", help="write the JSON result here too")
    args = ap.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(thread_counts[0])

    from specdec.core.cpu_features import describe_cpu, native_bf16
    from specdec.core.llama_decode import LlamaDecoder
    from specdec.core.models import load_causal_lm

    loaded = load_causal_lm(args.target)
    tok = loaded.tokenizer
    prompts = held_out_prompts(args.prompts, Path(args.target).resolve().parent)
    prompts_ids = [tok(p)["input_ids"] for p in prompts]
    dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16() else [])
    decoders, load_s = {}, {}
    for dtype in dtypes:
        for numerics_mode in ("fast", "exact"):
            name = f"{str(dtype).removeprefix('torch.')} {numerics_mode}"
            t0 = time.perf_counter()
            decoders[name] = LlamaDecoder(loaded.model, dtype=dtype, numerics=numerics_mode)
            load_s[name] = round(time.perf_counter() - t0, 2)
            print(name, "kernels", decoders[name].kernels, "plan", decoders[name].exact_plan, f"built in {load_s[name]} s", flush=True)
    load_before = os.getloadavg()
    result = {
        "machine": machine(), "cpu": describe_cpu(), "threads": thread_counts, "reps": args.reps,
        "target": args.target, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "kernels": {n: list(d.kernels) for n, d in decoders.items()},
        "exact_plan": {n: str(d.exact_plan) for n, d in decoders.items()}, "build_s": load_s,
        "speed": {f"{count} threads": with_threads(count, lambda: speed(decoders, prompts_ids, args.reps)) for count in thread_counts},
        "numerics": with_threads(thread_counts[0], lambda: numerics(decoders, prompts_ids, args.max_new_tokens)),
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "note": "per-forward medians of alternated calls on a shared 2-core machine: compare the ratios, not the ms across runs",
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
