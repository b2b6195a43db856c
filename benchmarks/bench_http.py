"""The HTTP API against the gRPC API on one running deployment: tokens/s and time to first token at
1 and 16 concurrent streams.

Starts `specdec up` (its default topology, sessions in Redis) with the demo pair, then, per round, for
each concurrency level, streams the same greedy requests once over gRPC (`GenerateStream`) and once
over HTTP (`POST /v1/completions`, `stream: true`, read as server-sent events with httpx), the two
alternated and their order swapped each round (a machine's speed drifts by more than the
difference measured). Reports per API and level the median over rounds of aggregate tokens/s and of
the median TTFT, and the HTTP/gRPC ratios. The client runs in this process, one event loop.

    python benchmarks/bench_http.py --rounds 3 --out benchmarks/results/http
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEMO, held_out_prompts, machine, median  # noqa: E402


async def grpc_stream(stub, prompt: str, max_new: int) -> tuple[float, int]:
    from specdec.v1 import common_pb2, generation_pb2 as pb

    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async for msg in stub.GenerateStream(pb.GenerateRequest(text=prompt, max_new_tokens=max_new,
                                                            sampling=common_pb2.SamplingParams(temperature=0)), timeout=600):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - t0
        tokens += len(msg.token_ids)
    return ttft, tokens


async def http_stream(client, url: str, prompt: str, max_new: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    body = {"prompt": prompt, "max_tokens": max_new, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                ids = json.loads(line[6:])["choices"]
                n = len(ids[0]["token_ids"]) if ids else 0
                if ttft is None and n:
                    ttft = time.perf_counter() - t0
                tokens += n
    return ttft, tokens


async def level(run_one, prompts: list[str], concurrency: int, per_client: int) -> dict:
    ttfts: list[float] = []
    total = 0

    async def client(i: int) -> None:
        nonlocal total
        for j in range(per_client):
            ttft, tokens = await run_one(prompts[(i * per_client + j) % len(prompts)])
            ttfts.append(ttft)
            total += tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"tokens": total, "seconds": wall, "tokens_per_s": total / wall, "ttft_median_s": median(ttfts)}


async def measure(args, grpc_address: str, http_url: str) -> dict:
    import grpc
    import httpx

    from specdec.v1 import generation_pb2_grpc

    prompts = held_out_prompts(args.prompts)
    channel = grpc.aio.insecure_channel(grpc_address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64))
    apis = {"grpc": lambda p: grpc_stream(stub, p, args.max_new_tokens),
            "http": lambda p: http_stream(client, http_url, p, args.max_new_tokens)}
    await level(apis["grpc"], prompts, 2, 1)  # warm both paths up
    await level(apis["http"], prompts, 2, 1)
    runs = {f"{api}@{c}": [] for api in apis for c in args.concurrency}
    for r in range(args.rounds):
        order = list(apis) if r % 2 == 0 else list(apis)[::-1]
        for c in args.concurrency:
            for api in order:
                result = await level(apis[api], prompts, c, args.requests_per_client)
                runs[f"{api}@{c}"].append(result)
                print(f"round {r} {api}@{c}: {result['tokens_per_s']:.1f} tok/s, TTFT {result['ttft_median_s'] * 1e3:.0f} ms",
                      flush=True)
    await client.aclose()
    await channel.close()
    summary = {}
    for c in args.concurrency:
        g = {k: median([x[k] for x in runs[f"grpc@{c}"]]) for k in ("tokens_per_s", "ttft_median_s")}
        h = {k: median([x[k] for x in runs[f"http@{c}"]]) for k in ("tokens_per_s", "ttft_median_s")}
        summary[str(c)] = {"grpc": g, "http": h, "http_over_grpc_tokens_per_s": h["tokens_per_s"] / g["tokens_per_s"],
                           "http_over_grpc_ttft": h["ttft_median_s"] / g["ttft_median_s"]}
    return {"summary": summary, "runs": runs}


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base-port", type=int, default=51051)
    ap.add_argument("--redis-url", default=os.environ.get("SPECDEC_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "http"))
    args = ap.parse_args()
    up = subprocess.Popen([sys.executable, "-m", "specdec", "up", "--target", args.target, "--draft", args.draft,
                           "--base-port", str(args.base_port), "--redis-url", args.redis_url],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        http_url = None
        deadline = time.time() + 300
        while http_url is None:
            line = up.stdout.readline()
            if not line or time.time() > deadline:
                raise RuntimeError("specdec up did not come up")
            if "OpenAI-compatible HTTP API on " in line:
                http_url = line.split(" on ", 1)[1].strip().removesuffix("/v1")
        time.sleep(1.0)
        result = asyncio.run(measure(args, f"127.0.0.1:{args.base_port}", http_url))
    finally:
        up.terminate()
        up.wait(timeout=30)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result.update(machine=machine(), commit=commit, date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv),
                  setup={"max_new_tokens": args.max_new_tokens, "prompts": args.prompts, "rounds": args.rounds,
                         "requests_per_client": args.requests_per_client, "greedy": True, "speculation": "server default (adaptive)"})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http.json").write_text(json.dumps(result, indent=2))
    for c, s in result["summary"].items():
        print(f"{c} streams: gRPC {s['grpc']['tokens_per_s']:.1f} tok/s TTFT {s['grpc']['ttft_median_s'] * 1e3:.0f} ms; "
              f"HTTP {s['http']['tokens_per_s']:.1f} tok/s TTFT {s['http']['ttft_median_s'] * 1e3:.0f} ms; "
              f"ratio tok/s {s['http_over_grpc_tokens_per_s']:.3f}, TTFT {s['http_over_grpc_ttft']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
