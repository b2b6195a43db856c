"""KV blocks in Redis against recomputing: for block sizes B, what writing costs the verify thread,
what reading a session's prefix back costs, and what recomputing that prefix costs instead.

    python benchmarks/bench_kv_blocks.py --redis-url redis://127.0.0.1:6379/0 --json benchmarks/results/kv_blocks/kv_blocks.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import torch

from common import DEMO, machine
from specdec.core.kv_blocks import decode_block, encode_block
from specdec.core.redis_kv import RedisKVStore
from specdec.target.engine import TargetConfig, VerifierEngine


async def write_cost(args, engine: VerifierEngine, steps: int = 200, rounds: int = 3) -> dict:
    """Decoding tokens/s of one session with and without writing its KV blocks, alternated in one run."""
    import secrets

    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import DraftProposal, SessionSpec
    from specdec.target.scheduler import VerifierScheduler

    store = RedisKVStore.from_url(args.redis_url, engine.layout, prefix=f"specdec-bench-{uuid.uuid4().hex[:8]}")
    rates: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(rounds):
        for mode in ("without", "with"):
            verifier = VerifierScheduler(engine, threaded=False, kv_store=store if mode == "with" else None)
            sid = secrets.token_hex(16)
            await verifier.open(SessionSpec(sid, tuple(range(3, 40)), SamplingParams(seed=1), "ngram"), max_new_tokens=steps)
            t0 = time.perf_counter()
            for _ in range(steps):
                await verifier.verify(sid, DraftProposal(()))
            rates[mode].append(steps / (time.perf_counter() - t0))
            await verifier.close(sid)
    await store.flush()
    await store.aclose()
    out = {mode: statistics.median(r) for mode, r in rates.items()}
    out["with_over_without"] = out["with"] / out["without"]
    print(f"decoding with KV blocks written: {out['with']:.1f} tok/s against {out['without']:.1f} without "
          f"({out['with_over_without']:.3f}x)")
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--tokens", type=int, default=448, help="the session's length")
    ap.add_argument("--blocks", default="16,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = VerifierEngine.from_config(TargetConfig(args.target))
    dec = engine.decoder
    tokens = [int(t) for t in torch.randint(3, engine.loaded.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))]
    cache = dec.new_cache()
    dec.forward(cache, tokens, 0, 1)

    def recompute() -> float:
        fresh = dec.new_cache()
        t0 = time.perf_counter()
        dec.forward(fresh, tokens, 0, 1)
        return time.perf_counter() - t0

    recompute_s = statistics.median(recompute() for _ in range(args.repeats))
    results = {"recompute_prefix_ms": 1e3 * recompute_s, "tokens": args.tokens, "blocks": {}}
    print(f"recompute {args.tokens} positions: {1e3 * recompute_s:.1f} ms")
    for b in (int(x) for x in args.blocks.split(",")):
        layout = engine.layout.__class__(**{**engine.layout.__dict__, "block_tokens": b})
        store = RedisKVStore.from_url(args.redis_url, layout, prefix=f"specdec-bench-{uuid.uuid4().hex[:8]}")
        sid = uuid.uuid4().hex
        n = (args.tokens - 1) // b
        t0 = time.perf_counter()
        encoded = [(i, encode_block(layout, i * b, tokens, cache.buf[:, :, :, i * b:(i + 1) * b].clone())) for i in range(n)]
        encode_s = (time.perf_counter() - t0) / max(1, n)
        store.offer(sid, encoded)
        await store.flush()
        loads = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            got = await store.load(sid, tokens)
            loads.append(time.perf_counter() - t0)
        assert len(got) == n and all(torch.equal(g, cache.buf[:, :, :, i * b:(i + 1) * b]) for i, g in enumerate(got))
        tail = args.tokens - n * b
        fresh = dec.new_cache()
        dec.forward(fresh, tokens[: n * b], 0, 1)
        t0 = time.perf_counter()
        dec.forward(fresh, tokens[n * b:], n * b, 1)
        tail_s = time.perf_counter() - t0
        block_bytes = len(encoded[0][1]) if encoded else 0
        r = {"block_bytes": block_bytes, "encode_ms_per_block": 1e3 * encode_s,
             "encode_us_per_token": 1e6 * encode_s / b, "load_ms": 1e3 * statistics.median(loads),
             "tail_tokens": tail, "tail_recompute_ms": 1e3 * tail_s,
             "resume_ms": 1e3 * (statistics.median(loads) + tail_s)}
        results["blocks"][str(b)] = r
        print(f"B={b:>3}: block {block_bytes / 1024:7.0f} KiB, encode {r['encode_ms_per_block']:.2f} ms/block "
              f"({r['encode_us_per_token']:.0f} us/token), load {r['load_ms']:.1f} ms + tail of {tail} in "
              f"{r['tail_recompute_ms']:.1f} ms = resume {r['resume_ms']:.1f} ms (recompute all: {1e3 * recompute_s:.1f})")
        keys = [store.key(sid, i) for i in range(n)]
        if keys:
            await store._redis.delete(*keys)
        await store.aclose()
    results["write_cost"] = await write_cost(args, engine)
    if args.json:
        results["machine"] = machine()
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
