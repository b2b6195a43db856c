"""`specdec up` backed by a Redis Cluster gives the tokens `specdec up` backed by one server gives (issue 29).

Starts a local 6-node Redis Cluster (tests/redis_cluster.py), then `specdec up` twice on the demo
pair: once with ``--redis-url redis+cluster://...``, once with a single server; sends the same greedy
and seeded requests to each (`specdec generate --server ... --json`) and compares the token ids.

    python benchmarks/up_on_cluster.py                  # results in benchmarks/results/up_on_cluster/
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEMO, held_out_prompts, write_result  # noqa: E402
from redis_cluster import RedisClusterProcs  # noqa: E402
from test_cli import free_port_block  # noqa: E402

# Greedy and coupled outputs do not depend on the speculation (adaptive k here); a seeded rejection
# run's do (its draws follow the drafts), so it runs at a fixed k without drafting ahead.
REQUESTS = [("greedy", ()), ("seeded coupled", ("--temperature", "0.8", "--seed", "7")),
            ("seeded rejection", ("--temperature", "0.8", "--seed", "7", "--rule", "rejection", "-k", "3", "--no-overlap"))]


def outputs(redis_url: str, prompts: list[str], new_tokens: int) -> dict:
    base = free_port_block(4)
    up = subprocess.Popen([sys.executable, "-m", "specdec", "up", "--redis-url", redis_url, "--base-port", str(base),
                           "--http-port", "-1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "SPECDEC_API_KEYS_FILE": ""})
    try:
        deadline = time.time() + 180
        for line in up.stdout:
            if "ready" in line:
                break
            if time.time() > deadline:
                raise RuntimeError("specdec up did not get ready")
        got = {}
        for name, extra in REQUESTS:
            for i, prompt in enumerate(prompts):
                run = subprocess.run([sys.executable, "-m", "specdec", "generate", prompt, "--server", f"127.0.0.1:{base}",
                                      "--max-new-tokens", str(new_tokens), "--json", *extra],
                                     capture_output=True, text=True, timeout=300)
                if run.returncode:
                    raise RuntimeError(run.stderr)
                got[f"{name} {i}"] = json.loads(run.stdout)["token_ids"]
        return got
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--single", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "up_on_cluster")
    args = ap.parse_args(argv)
    os.environ.setdefault("SPECDEC_TARGET_MODEL", str(DEMO / "target"))
    os.environ.setdefault("SPECDEC_DRAFT_MODEL", str(DEMO / "draft"))
    prompts = held_out_prompts(args.prompts)
    cluster = RedisClusterProcs(shutil.which("redis-server"), shutil.which("redis-cli"))
    cluster.start()
    try:
        on_cluster = outputs(cluster.url, prompts, args.new_tokens)
    finally:
        cluster.stop()
    on_single = outputs(args.single, prompts, args.new_tokens)
    same = {key: on_cluster[key] == on_single[key] for key in on_single}
    write_result(args.out / "up_on_cluster.json", prompts=args.prompts, new_tokens=args.new_tokens,
                 requests=len(same), identical=sum(same.values()), per_request=same)
    print(f"{sum(same.values())} of {len(same)} requests identical between specdec up on a Redis Cluster and on one server")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
