"""Memory soak: does every worker's resident memory level off under sustained load?

Starts `specdec up --replicas 2` (two orchestrators, two drafters, two verifiers, sessions in
Redis) on its own ports, then sends ``--rounds`` rounds of ``--concurrency`` concurrent requests
through the gRPC client (specdec.client.ResumingClient over both orchestrators). Requests are
mixed: held-out code prompts, 32-64 new tokens, greedy and sampled (coupled and rejection rule),
adaptive and fixed k, the model drafter and n-gram lookup. After each round and a pause for the
sessions to close (``--settle-s``), it reads every process's resident set (VmRSS in /proc/<pid>/status; the
processes are the `up` process's children, named by role and port) and prints a row per round,
then each process's growth over the last ``--last`` rounds (RSS after the final round against
RSS after round R - last); exits 1 unless every process grew less than 2%. Writes <name>.json
(every row, the growth, the setup) and <name>.log (the servers' output) to ``--out``.

    python benchmarks/soak.py --rounds 10 --concurrency 300            # the full soak
    python benchmarks/soak.py --rounds 5 --concurrency 100 --out /tmp/soak
    python benchmarks/soak.py --python /path/to/venv/bin/python         # serve with another install
    python benchmarks/soak.py --env MALLOC_ARENA_MAX=2                  # set for every process

``--python`` is the interpreter that runs `specdec up` (and so every role): test a copy of the
code installed in another virtual environment without touching this one. The client runs here.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


# ----------------------------------------------------------------------------- processes
def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def rss_kib(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB, or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def role_of(pid: int) -> str | None:
    """'target:52053' for a `specdec serve target --port 52053` process, else None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    argv = [a.decode() for a in argv]
    if "serve" not in argv or "--port" not in argv:
        return None
    at = argv.index("--port")  # `up` puts the role just before its port
    role, port = argv[at - 1], argv[at + 1]
    return f"{role}:{port}"


def workers(up_pid: int) -> dict[str, int]:
    """name -> pid of every serving process under `specdec up`."""
    found = {}
    for pid in children(up_pid):
        name = role_of(pid)
        if name:
            found[name] = pid
    return dict(sorted(found.items()))


# ----------------------------------------------------------------------------- requests
def make_requests(n: int, prompts: list[str], rng: random.Random, min_new: int, max_new: int) -> list:
    """``n`` mixed requests: greedy and sampled, both rules, adaptive and fixed k, model and n-gram
    drafter, lengths drawn from [min_new, max_new]."""
    from specdec.v1 import common_pb2, generation_pb2 as pb

    requests = []
    for _ in range(n):
        sampling = common_pb2.SamplingParams()  # unset temperature: greedy
        if rng.random() < 0.5:
            sampling = common_pb2.SamplingParams(
                temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 50]), seed=rng.randrange(1 << 31),
                rule=rng.choice([common_pb2.VERIFICATION_RULE_COUPLED, common_pb2.VERIFICATION_RULE_REJECTION]))
        speculation = common_pb2.SpeculationPolicy()  # server default: adaptive
        if rng.random() < 0.3:
            speculation = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED,
                                                       num_speculative_tokens=rng.randint(1, 6))
        requests.append(pb.GenerateRequest(text=rng.choice(prompts), max_new_tokens=rng.randint(min_new, max_new),
                                           sampling=sampling, speculation=speculation,
                                           drafter="ngram" if rng.random() < 0.15 else "model"))
    return requests


async def run_round(client, requests: list, timeout_s: float) -> dict:
    """Every request at once; tokens received, errors and failovers."""
    from specdec.client import StreamReport

    tokens = errors = failovers = 0
    first_error = ""

    async def one(request) -> None:
        nonlocal tokens, errors, failovers, first_error
        report = StreamReport()
        try:
            async for msg in client.stream(request, report, timeout_s=timeout_s):
                tokens += len(msg.token_ids)
        except Exception as exc:  # counted and reported: a soak goes on past a failed request
            errors += 1
            first_error = first_error or f"{type(exc).__name__}: {exc}"[:300]
        failovers += len(report.failovers)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "errors": errors, "failovers": failovers,
            "first_error": first_error}


# ----------------------------------------------------------------------------- the soak
def wait_ready(up: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while True:
        line = up.stdout.readline()
        if not line:
            raise RuntimeError(f"specdec up exited ({up.poll()}) before it was ready")
        sys.stdout.write("  | " + line)
        if "specdec up: ready" in line:
            return
        if time.time() > deadline:
            raise RuntimeError("specdec up did not come up in time")


def drain_output(up: subprocess.Popen, log_path: Path) -> None:
    """Copy the up process's output to a log file in a thread (a full pipe would block it)."""
    import threading

    def copy() -> None:
        with log_path.open("a") as f:
            for line in up.stdout:
                f.write(line)
                f.flush()

    threading.Thread(target=copy, daemon=True).start()


async def soak(args, up_pid: int, after_round=None) -> dict:
    """``after_round(round, {name: pid})``: called after each round's RSS is read (investigation hooks)."""
    from specdec.bench_common import held_out_prompts
    from specdec.client import ResumingClient

    host = "127.0.0.1"
    orchestrators = [f"{host}:{args.base_port + 3 * i}" for i in range(args.replicas)]
    prompts = held_out_prompts(64, Path(args.target).resolve().parent)
    rng = random.Random(args.seed)
    procs = workers(up_pid)
    print("workers: " + ", ".join(f"{n} (pid {p})" for n, p in procs.items()), flush=True)
    rows = [{"round": 0, "sessions": 0, "rss_kib": {n: rss_kib(p) for n, p in procs.items()}}]
    print_header(procs)
    print_row(rows[0], procs)
    sessions = 0
    async with ResumingClient(orchestrators, retry_for_s=120) as client:
        if args.warmup:
            await run_round(client, make_requests(args.warmup, prompts, rng, args.min_new_tokens, args.max_new_tokens),
                            args.request_timeout_s)
            sessions += args.warmup
            await asyncio.sleep(args.settle_s)
            rows[0] = {"round": 0, "sessions": sessions, "rss_kib": {n: rss_kib(p) for n, p in procs.items()}}
            print_row(rows[0], procs)
        if after_round is not None:
            after_round(0, dict(procs))
        for r in range(1, args.rounds + 1):
            result = await run_round(client, make_requests(args.concurrency, prompts, rng, args.min_new_tokens,
                                                           args.max_new_tokens), args.request_timeout_s)
            sessions += args.concurrency
            await asyncio.sleep(args.settle_s)  # sessions close on the workers after the last token
            now = workers(up_pid)
            restarted = sorted(n for n in procs if now.get(n) != procs[n])
            row = {"round": r, "sessions": sessions, **result, "restarted": restarted,
                   "rss_kib": {n: rss_kib(now.get(n, p)) for n, p in procs.items()}}
            rows.append(row)
            print_row(row, procs)
            procs.update(now)
            if after_round is not None:
                after_round(r, dict(procs))
    return {"rounds": rows, "workers": procs}


def growth(rows: list[dict], last: int) -> dict[str, dict]:
    """Per process: RSS after round R - last and after round R, and the relative growth."""
    if len(rows) <= last:
        return {}
    before, after = rows[-1 - last], rows[-1]
    out = {}
    for name, kib in after["rss_kib"].items():
        start = before["rss_kib"].get(name)
        if kib and start:
            out[name] = {"from_round": before["round"], "from_kib": start, "to_kib": kib, "growth": (kib - start) / start}
    return out


def print_header(procs: dict[str, int]) -> None:
    cols = "".join(f"{n:>20}" for n in procs)
    print(f"{'round':>5} {'sessions':>8} {'s':>6} {'tok':>6} {'err':>4} {cols}   (RSS MiB)", flush=True)


def print_row(row: dict, procs: dict[str, int]) -> None:
    cols = "".join(f"{(row['rss_kib'].get(n) or 0) / 1024:>20.1f}" for n in procs)
    print(f"{row['round']:>5} {row['sessions']:>8} {row.get('seconds', 0):>6.0f} {row.get('tokens', 0):>6} "
          f"{row.get('errors', 0):>4} {cols}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs `specdec up` (default: this one)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=300, help="requests sent at once per round")
    ap.add_argument("--min-new-tokens", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=20, help="requests before round 1 (loads every path once)")
    ap.add_argument("--last", type=int, default=5, help="growth is measured over this many final rounds")
    ap.add_argument("--settle-s", type=float, default=3.0, help="pause after a round before reading RSS")
    ap.add_argument("--request-timeout-s", type=float, default=1800.0)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--base-port", type=int, default=52051, help="orchestrator 0's port; `up` takes base .. base + 3 x replicas")
    ap.add_argument("--redis-url", default=os.environ.get("SPECDEC_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in the environment of `specdec up` and its processes (repeatable)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak"))
    ap.add_argument("--name", default="soak", help="the result is <out>/<name>.json, the servers' output <out>/<name>.log")
    args = ap.parse_args()

    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in args.env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"{args.name}.log"
    log_path.write_text("")
    up = subprocess.Popen([args.python, "-m", "specdec", "up", "--replicas", str(args.replicas), "--base-port", str(args.base_port),
                           "--http-port", "-1", "--redis-url", args.redis_url, "--target", args.target, "--draft", args.draft],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_ready(up, 600)
        drain_output(up, log_path)
        time.sleep(2.0)  # every replica, not only orchestrator 0, serving
        result = asyncio.run(soak(args, up.pid))
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
    grown = growth(result["rounds"], args.last)
    print(f"\ngrowth over the last {args.last} rounds (RSS after round {result['rounds'][-1]['round']} "
          f"against after round {result['rounds'][-1]['round'] - args.last}):")
    for name, g in grown.items():
        print(f"  {name:>20}: {g['from_kib'] / 1024:8.1f} -> {g['to_kib'] / 1024:8.1f} MiB  {g['growth'] * 100:+6.2f}%")
    ok = bool(grown) and all(g["growth"] < 0.02 for g in grown.values())
    print("flat (every process < 2%)" if ok else "NOT flat: some process grew 2% or more")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip():
        commit += "-dirty"  # measured with changes not yet committed
    result.update(growth=grown, flat=ok, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
                  commit=commit or None, env=args.env,
                  setup={k: getattr(args, k) for k in ("rounds", "concurrency", "min_new_tokens", "max_new_tokens", "warmup",
                                                       "last", "replicas", "seed", "python")})
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / args.name}.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
