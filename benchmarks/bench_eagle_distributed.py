"""The EAGLE head distributed (issue 31): its features over the wire to a draft worker, against the
same head inside the verifier, against the draft model, each through its own ``specdec up`` (one
process per role, loopback gRPC, sessions in Redis).

Two deployments run side by side: A with the head on the draft worker (the verifier sends each
step's features in its outcome), B with ``--in-verifier-drafters eagle,eagle_tree`` (the head in
the verifier's process: no hop, no features on the wire). One stream at a time, greedy, held-out
prompts, alternated rounds; chains of 4 and 7 and trees of 7 nodes (5 and 8 rows verified); per
method: tokens/s (completion tokens over the requests' wall time, median over rounds), mean
accepted drafts per verification, and every output checked equal to the draft model's (greedy is
exact whatever drafts).

    python benchmarks/bench_eagle_distributed.py        # results in benchmarks/results/eagle/
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEMO, held_out_prompts, write_result  # noqa: E402

METHODS = (  # (name, deployment, drafter, k)
    ("model_k4", "A", "model", 4),
    ("eagle_k4_wire", "A", "eagle", 4),
    ("eagle_k4_in_verifier", "B", "eagle", 4),
    ("model_k7", "A", "model", 7),
    ("tree7", "A", "tree", 7),
    ("eagle_tree7_wire", "A", "eagle_tree", 7),
    ("eagle_tree7_in_verifier", "B", "eagle_tree", 7),
)


def start(base: int, redis_url: str, extra: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "specdec", "up", "--topology", "split", "--base-port", str(base), "--redis-url", redis_url,
                                 "--threads", "1", "--http-port", "-1", *extra],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


async def generate(stub, prompt: str, drafter: str, k: int, new_tokens: int):
    from specdec.v1 import common_pb2, generation_pb2 as pb

    policy = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=k, overlap=True)
    return await stub.Generate(pb.GenerateRequest(text=prompt, max_new_tokens=new_tokens, drafter=drafter, speculation=policy),
                               timeout=600)


async def wait_ready(stub, deadline_s: float = 180.0) -> None:
    t0 = time.monotonic()
    while True:
        try:
            await generate(stub, "def f():", "model", 1, 2)
            return
        except Exception:
            if time.monotonic() - t0 > deadline_s:
                raise
            await asyncio.sleep(1.0)


async def run(args) -> list[dict]:
    import grpc

    from specdec.bench_runners import free_base_port
    from specdec.v1 import generation_pb2_grpc

    args.out.mkdir(parents=True, exist_ok=True)
    bases = {"A": free_base_port()}
    procs = {"A": start(bases["A"], args.redis_url, [], args.out / "up-A.log")}
    bases["B"] = free_base_port()
    while bases["B"] <= bases["A"] + 3 and bases["B"] + 2 >= bases["A"]:
        bases["B"] = free_base_port()
    procs["B"] = start(bases["B"], args.redis_url, ["--in-verifier-drafters", "eagle,eagle_tree"], args.out / "up-B.log")
    try:
        channels = {d: grpc.aio.insecure_channel(f"127.0.0.1:{b}") for d, b in bases.items()}
        stubs = {d: generation_pb2_grpc.GenerationStub(c) for d, c in channels.items()}
        await asyncio.gather(*(wait_ready(s) for s in stubs.values()))
        prompts = held_out_prompts(args.prompts)
        stats = {name: {"seconds": [], "tokens": 0, "accepted": 0, "steps": 0, "outputs": []} for name, *_ in METHODS}
        for r in range(args.rounds):
            for name, where, drafter, k in (METHODS if r % 2 == 0 else METHODS[::-1]):
                t0 = time.perf_counter()
                replies = [await generate(stubs[where], p, drafter, k, args.new_tokens) for p in prompts]
                stats[name]["seconds"].append(time.perf_counter() - t0)
                if r == 0:
                    st = stats[name]
                    st["tokens"] = sum(len(x.token_ids) for x in replies)
                    st["accepted"] = sum(x.stats.accepted_tokens for x in replies)
                    st["steps"] = sum(x.stats.verify_steps for x in replies)
                    st["outputs"] = [tuple(x.token_ids) for x in replies]
        for c in channels.values():
            await c.close()
    finally:
        for proc in procs.values():
            stop(proc)
    rows = []
    for name, where, drafter, k in METHODS:
        st = stats[name]
        assert st["outputs"] == stats["model_k4"]["outputs"], f"{name}: greedy output differs from the draft model's"
        rows.append({"method": name, "drafter": drafter, "k": k, "head": {"A": "draft worker", "B": "in verifier"}[where],
                     "mean_accepted": round(st["accepted"] / st["steps"], 3), "tokens_per_step": round(st["tokens"] / st["steps"], 3),
                     "tokens_per_s": round(st["tokens"] / statistics.median(st["seconds"]), 1)})
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["tokens_per_s_vs_model"] = round(row["tokens_per_s"] / base, 3)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--redis-url", default=os.environ.get("SPECDEC_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "eagle")
    args = ap.parse_args(argv)
    rows = asyncio.run(run(args))
    write_result(args.out / "eagle_distributed.json", prompts=args.prompts, new_tokens=args.new_tokens, target=str(DEMO / "target"),
                 rows=rows)
    print("| method | head | mean accepted | tokens/step | tokens/s | vs model |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['head']} | {r['mean_accepted']} | {r['tokens_per_step']} | {r['tokens_per_s']} | {r['tokens_per_s_vs_model']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
