"""What tensor parallelism costs per verify step on the CPU (gloo over loopback), and a paper model of
the same all-reduces on NVLink.

    python benchmarks/bench_tensor_parallel.py [--targets models/demo/target,/tmp/target-tp-768] [--steps 30]
    python benchmarks/bench_tensor_parallel.py --out benchmarks/results/tensor_parallel/tensor_parallel.json

Measured, per target that exists and each numerics mode: the median milliseconds of one verify
forward (one session, 1 and 5 rows: k = 0 and k = 4) at N = 1 and N = 2 ranks (one torch thread per
rank: N = 2 uses two cores), and, at N = 2, what rank 0 spent per forward in the plan broadcast and
in the collectives (2 per layer, all-reduces in fast numerics and all-gathers summed in rank order
in exact, plus the LM head's gather). Then gloo's own all-reduce of [rows, hidden] float32 between
two ranks (two processes' worth of threads in this one), the floor under each of those.

On paper: a ring all-reduce on NVLink moves 2 (N - 1) / N of the message per GPU each way, so per
step ``2 * layers * (latency + 2 (N-1)/N * rows * hidden * 2 bytes / bandwidth)`` in bfloat16, for
the assumed per-direction bandwidth and per-call latency below (not measured here: no GPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEMO, machine  # noqa: E402

NVLINK_GBPS = 450.0  # H100/H200 NVLink 4, per direction per GPU (900 GB/s both ways), peak
NVLINK_LATENCY_US = 8.0  # one small NCCL all-reduce inside a node: an assumption, of the order NCCL reports
PAPER_SHAPES = {  # name: (hidden, layers, heads, kv heads)
    "demo target": (384, 8, 6, 6),
    "Llama-3.1-8B": (4096, 32, 32, 8),
    "Llama-3.1-70B": (8192, 80, 64, 8),
}


def forward_ms(engine, rows: int, steps: int) -> tuple[float, dict]:
    """Median ms of one forward of ``rows`` rows at a 32-token context, and rank 0's collective seconds per forward."""
    from specdec.core.runner import Feed

    runner = engine.runner
    cache = runner.new_cache()
    runner.forward([Feed(cache, 0, list(range(10, 42)), 1)])
    comm = getattr(runner, "comm", None)
    times = []
    for i in range(steps + 3):
        if i == 3 and comm is not None:
            base = (comm.reductions, comm.reduce_s, comm.plan_s)
        t0 = time.perf_counter()
        runner.forward([Feed(cache, 32, list(range(50, 50 + rows)), rows)])
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    runner.free(cache)
    extra = {}
    if comm is not None:
        extra = {"collectives_per_forward": (comm.reductions - base[0]) / steps,
                 "collective_ms_per_forward": round((comm.reduce_s - base[1]) * 1e3 / steps, 3),
                 "plan_ms_per_forward": round((comm.plan_s - base[2]) * 1e3 / steps, 3)}
    return statistics.median(times), extra


def gloo_allreduce_us(hidden: int, rows: int, reps: int = 200) -> float:
    """Median microseconds of one gloo all-reduce of [rows, hidden] float32 between two ranks (threads here)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    groups = [None, None]

    def make(rank: int) -> None:
        s = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=datetime.timedelta(seconds=30))
        groups[rank] = dist.ProcessGroupGloo(s, rank, 2, datetime.timedelta(seconds=30))

    t = threading.Thread(target=make, args=(1,))
    t.start()
    make(0)
    t.join()
    times: list[float] = []

    def run(rank: int) -> None:
        x = torch.ones(rows, hidden)
        for i in range(reps + 10):
            t0 = time.perf_counter()
            groups[rank].allreduce([x]).wait()
            if rank == 0 and i >= 10:
                times.append((time.perf_counter() - t0) * 1e6)

    t = threading.Thread(target=run, args=(1,))
    t.start()
    run(0)
    t.join()
    return statistics.median(times)


def paper(hidden: int, layers: int, n: int, rows: int, element_bytes: int = 2) -> float:
    """Microseconds of one step's 2 * layers ring all-reduces on NVLink, on the assumptions above."""
    message = rows * hidden * element_bytes
    one = NVLINK_LATENCY_US + 2 * (n - 1) / n * message / (NVLINK_GBPS * 1e9) * 1e6
    return 2 * layers * one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=f"{DEMO / 'target'},/tmp/target-tp-768",
                    help="comma-separated target folders; those missing are skipped (scripts/inflate_target.py makes "
                         "one: --hidden 768 --layers 8 --heads 12 --kv-heads 6 --intermediate 2048)")
    ap.add_argument("--numerics", default="exact,fast")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from specdec.target.engine import TargetConfig, VerifierEngine

    measured = []
    for target in [t for t in args.targets.split(",") if t]:
        if not (Path(target) / "config.json").is_file():
            print(f"skipped {target}: not there")
            continue
        cfg = AutoConfig.from_pretrained(target, local_files_only=True)
        for numerics in args.numerics.split(","):
            for n in (1, 2):
                t0 = time.perf_counter()
                engine = VerifierEngine.from_config(TargetConfig(target, threads=1, numerics=numerics, tensor_parallel=n))
                load_s = time.perf_counter() - t0
                for rows in (1, 5):
                    ms, extra = forward_ms(engine, rows, args.steps)
                    row = {"target": target, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "numerics": numerics,
                           "ranks": n, "rows": rows, "forward_ms": round(ms, 3), "load_s": round(load_s, 1), **extra}
                    measured.append(row)
                    print(json.dumps(row))
                if engine.tensor_parallel is not None:
                    engine.tensor_parallel.stop()
    hiddens = sorted({r["hidden"] for r in measured} | {4096, 8192})
    gloo = [{"hidden": h, "rows": rows, "allreduce_us": round(gloo_allreduce_us(h, rows), 1)} for h in hiddens for rows in (1, 5)]
    for g in gloo:
        print(json.dumps({"gloo": g}))
    model = [{"model": name, "hidden": hidden, "layers": layers, "ranks": n, "rows": rows,
              "allreduce_bytes": rows * hidden * 2, "step_us": round(paper(hidden, layers, n, rows), 1)}
             for name, (hidden, layers, heads, kv) in PAPER_SHAPES.items() for n in (2, 4, 8)
             if heads % n == 0 and kv % n == 0 for rows in (1, 8, 64)]
    print(f"NVLink paper model ({NVLINK_GBPS:g} GB/s per direction, {NVLINK_LATENCY_US:g} us per all-reduce, bf16):")
    for m in model:
        print(f"  {m['model']:>14} N={m['ranks']} rows={m['rows']:>2}: {m['allreduce_bytes']:>8} B per all-reduce, "
              f"{2 * m['layers']} per step: {m['step_us']:.0f} us per step")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "machine": machine(), "command": " ".join(sys.argv), "threads_per_rank": 1, "measured": measured,
            "gloo_allreduce": gloo, "nvlink_model": {"bandwidth_gb_s_per_direction": NVLINK_GBPS,
                                                     "latency_us_per_allreduce": NVLINK_LATENCY_US, "dtype": "bfloat16",
                                                     "rows": model}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
