"""The paged runner's attention choices on this machine: one verify step (k = 3: 4 rows a session) of
the demo target at 1, 4 and 16 sessions, each 200 positions in, through the paged runner with one
batched SDPA per layer over padded page gathers ("batched") and one SDPA per sequence ("loop"),
beside the lean CPU forward; and one layer's attention alone, SDPA batched against FlexAttention
(eager: torch.compile is not on the request path). Configurations alternate; medians in ms.

    python benchmarks/bench_paged_attention.py [--threads 1] [--reps 15]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.core.llama_decode import LlamaDecoder
from specdec.core.models import load_causal_lm
from specdec.core.paged_runner import PagedRunner
from specdec.core.runner import Feed, LeanRunner

ROOT = Path(__file__).resolve().parents[1]


def median_ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times), 2)


def forwards(model, sessions: int, reps: int) -> dict[str, float]:
    runners = {"lean": LeanRunner(LlamaDecoder(model, numerics="fast")),
               "paged_batched": PagedRunner(model, num_pages=sessions * 16 + 8, attention="batched"),
               "paged_loop": PagedRunner(model, num_pages=sessions * 16 + 8, attention="loop")}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 6000, (200,), generator=gen).tolist() for _ in range(sessions)]
    feeds = {}
    for name, runner in runners.items():
        caches = [runner.new_cache() for _ in prompts]
        runner.forward([Feed(c, 0, p, 1) for c, p in zip(caches, prompts)])
        feeds[name] = [Feed(c, 199, [p[-1], 5, 6, 7], 4) for c, p in zip(caches, prompts)]
    times = {name: [] for name in runners}
    for _ in range(reps):
        for name, runner in runners.items():
            for f in feeds[name]:
                runner.truncate(f.cache, f.start)
            t = time.perf_counter()
            runner.forward(feeds[name])
            times[name].append(time.perf_counter() - t)
    return {name: median_ms(t) for name, t in times.items()}


def attention_alone(sessions: int, reps: int) -> dict[str, float]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    h, d, rows, length = 6, 64, 4, 204
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sessions, h, rows, d, generator=gen)
    k = torch.randn(sessions, h, length, d, generator=gen)
    v = torch.randn(sessions, h, length, d, generator=gen)
    mask = torch.arange(length)[None, :] <= torch.arange(rows)[:, None] + length - rows  # [rows, length]
    block = create_block_mask(lambda b, hh, qi, ki: ki <= qi + length - rows, sessions, None, rows, length, device="cpu")
    calls = {
        "sdpa_batched": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa_loop": lambda: [F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], attn_mask=mask)
                              for b in range(sessions)],
        "flex_eager": lambda: flex_attention(q, k, v, block_mask=block),
    }
    times = {name: [] for name in calls}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile"
        for name, call in calls.items():
            call()  # warm-up
        for _ in range(reps):
            for name, call in calls.items():
                t = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t)
    return {name: median_ms(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_causal_lm(ROOT / "models" / "demo" / "target").model
    result = {"threads": args.threads, "torch": torch.__version__, "forward_ms": {}, "attention_one_layer_ms": {}}
    with torch.inference_mode():
        for sessions in (1, 4, 16):
            result["forward_ms"][sessions] = forwards(model, sessions, args.reps)
            result["attention_one_layer_ms"][sessions] = attention_alone(sessions, args.reps)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
