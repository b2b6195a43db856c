"""Where a step goes under load in `specdec up` (issue 42, item 1): per process and thread, CPU time
and time spent waiting for a core, per generated token, in each topology; optionally what the
verifier's threads run (py-spy samples: prefill, verify, drafting, gRPC, event loop).

    python benchmarks/bench_up_breakdown.py --streams 16,64 --topologies colocated,split
    python benchmarks/bench_up_breakdown.py --streams 64 --profile     # + py-spy (pip install py-spy)
    python benchmarks/bench_up_breakdown.py --topologies colocated --pythons /tmp/venv-before/bin/python,python --rounds 3
                                                                       # two checkouts, alternated

With --pythons, each interpreter (its own install of specdec: a venv with an editable install of
another checkout) runs `specdec up` in turn, --rounds times, from a directory outside this checkout
so each imports only its own; the report adds, per topology and level, the median over rounds of
each side's tokens/s, TTFT p50 and CPU per token, and each side's tokens/s over the first side's.

For each topology: start `specdec up --topology T` (demo pair, sessions in Redis), warm it with two
levels of 16 streams (adaptive k learns its load regimes per load level; a server runs for hours,
a benchmark level for seconds), then per level drive N greedy streams (openai_load.py) and read,
before and after, every thread's /proc/<pid>/task/<tid>/schedstat: nanoseconds on a CPU and
nanoseconds runnable but waiting for one. Reports, per process (orchestrator, target, draft) and
per thread name (the model thread, the event loop, gRPC's pollers, ...), both per generated token,
and the share of the machine's cores the server used. The load generator runs in this process and
is not counted (it is the same for every server compared). With --profile, py-spy samples the
verifier process during the level and the samples are split by what they run.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEMO, held_out_prompts, machine, median, write_result  # noqa: E402
from openai_load import run_level, served_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# What a verifier sample runs, by the first of these frames found in its stack (most specific first).
PHASES = (("prefill", "VerifierEngine.open_batch"), ("verify", "VerifierEngine.verify_batch"),
          ("draft", "DraftEngine"), ("draft", "propose_together"), ("gRPC / event loop", "BaseEventLoop"),
          ("gRPC poller", "_poll_wrapper"))


def thread_times(pid: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(process pid, thread name) -> (ns on a CPU, ns waiting for one), summed over same-named threads."""
    out: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            run_ns, wait_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        name = re.sub(r"[-_]?\d+$", "", name) or name  # asyncio_0, asyncio_1 -> asyncio
        out[str(pid), name][0] += run_ns
        out[str(pid), name][1] += wait_ns
    return {k: (v[0], v[1]) for k, v in out.items()}


def role_of(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    for role in ("orchestrator", "target", "draft"):
        if role in argv:
            return role
    return "other"


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def snapshot(pids: list[int]) -> dict:
    times = {}
    for pid in pids:
        times.update(thread_times(pid))
    return times


def phases_of(raw: Path) -> dict[str, float]:
    """Share of py-spy's samples by phase (PHASES), the rest 'other'."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        phase = next((name for name, frame in PHASES if frame in stack), "other")
        counts[phase] += int(n)
    total = sum(counts.values()) or 1
    return {k: round(v / total, 3) for k, v in counts.most_common()}


async def drive(url: str, streams: int, max_tokens: int, prompts: list[str], requests_per_stream: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=4 * streams + 8)) as client:
        model = await served_model(client, url)
        return await run_level(client, url, model, prompts, streams, max_tokens, requests_per_stream)


def run_topology(args, topology: str, prompts: list[str], python: str = sys.executable) -> dict:
    log = Path(tempfile.mkstemp(prefix=f"up-{topology}-", suffix=".log")[1])
    argv = [python, "-m", "specdec", "up", "--topology", topology, "--base-port", str(args.base_port),
            "--redis-url", args.redis_url, "--target", str(args.target), "--draft", str(args.draft)]
    # (outside this checkout: `python -m` puts the working directory first on the path)
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
    try:
        url = None
        deadline = time.time() + 180
        while url is None and time.time() < deadline:
            assert proc.poll() is None, log.read_text()
            for line in log.read_text(errors="replace").splitlines():
                if "OpenAI-compatible HTTP API on " in line:
                    url = line.split(" on ", 1)[1].strip().removesuffix("/v1")
            time.sleep(0.5)
        assert url is not None, f"specdec up not ready: {log.read_text()[-2000:]}"
        for _ in range(2):
            asyncio.run(drive(url, 16, args.max_tokens, prompts, 1))
        pids = children(proc.pid)
        roles = {str(pid): role_of(pid) for pid in pids}
        levels = {}
        for streams in args.streams:
            spy = None
            if args.profile:
                target = next(int(p) for p, r in roles.items() if r == "target")
                raw = Path(tempfile.mkstemp(suffix=".txt")[1])
                spy = subprocess.Popen(["py-spy", "record", "-p", str(target), "-d", str(args.profile_s), "-r", "200",
                                        "-f", "raw", "-o", str(raw), "--threads", "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            before, t0 = snapshot(pids), time.perf_counter()
            result = asyncio.run(drive(url, streams, args.max_tokens, prompts, args.requests_per_stream))
            after, wall = snapshot(pids), time.perf_counter() - t0
            tokens = max(1, result["tokens"])
            threads = {}
            for key, (run_ns, wait_ns) in after.items():
                b_run, b_wait = before.get(key, (0, 0))
                run_us, wait_us = (run_ns - b_run) / 1e3 / tokens, (wait_ns - b_wait) / 1e3 / tokens
                if run_us + wait_us >= 1:
                    threads[f"{roles[key[0]]}/{key[1]}"] = {"cpu_us_per_token": round(run_us, 1),
                                                           "wait_us_per_token": round(wait_us, 1)}
            by_role: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"cpu_us_per_token": 0.0, "wait_us_per_token": 0.0})
            for name, t in threads.items():
                for field in t:
                    by_role[name.split("/")[0]][field] += t[field]
            cpu_s = sum(t["cpu_us_per_token"] for t in threads.values()) * tokens / 1e6
            level = {"tokens_per_s": round(result["tokens_per_s"], 1), "ttft_p50_ms": round(1000 * result["ttft_p50_s"], 1),
                     "cores_used": round(cpu_s / wall, 2), "by_process": dict(by_role),
                     "threads": dict(sorted(threads.items(), key=lambda kv: -kv[1]["cpu_us_per_token"]))}
            if spy is not None:
                spy.wait()
                level["verifier_samples"] = phases_of(raw)
            levels[streams] = level
            print(f"{python} {topology} @ {streams}: {json.dumps(level)}", flush=True)
        return levels
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def compare(runs: dict[str, list[dict]], streams: list[int]) -> dict:
    """Per level, each side's medians over rounds, and its tokens/s over the first side's."""
    out = {}
    for level in streams:
        row = {}
        for py, rounds in runs.items():
            got = [r[level] for r in rounds]
            cpu = {role: median([g["by_process"].get(role, {}).get("cpu_us_per_token", 0.0) for g in got])
                   for role in sorted({role for g in got for role in g["by_process"]})}
            row[py] = {"tokens_per_s": median([g["tokens_per_s"] for g in got]), "ttft_p50_ms": median([g["ttft_p50_ms"] for g in got]),
                       "cpu_us_per_token": cpu, "rounds": [g["tokens_per_s"] for g in got]}
        first = next(iter(row.values()))["tokens_per_s"]
        for v in row.values():
            v["speed"] = v["tokens_per_s"] / first if first else float("nan")
        out[level] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--topologies", default="colocated,split")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--base-port", type=int, default=51251)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--profile", action="store_true", help="py-spy samples of the verifier process per level")
    ap.add_argument("--profile-s", type=int, default=6)
    ap.add_argument("--pythons", default="", help="interpreters whose specdec installs are compared, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="with --pythons: rounds, the sides alternated")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "up_breakdown"))
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    if args.profile and shutil.which("py-spy") is None:
        ap.error("--profile needs py-spy (pip install py-spy)")
    prompts = held_out_prompts(64)
    report = {"streams": args.streams, "max_tokens": args.max_tokens, "cores": len(os.sched_getaffinity(0))}
    topologies = args.topologies.split(",")
    if not args.pythons:
        report["topologies"] = {t: run_topology(args, t, prompts) for t in topologies}
    else:
        pythons = args.pythons.split(",")
        runs = {t: {py: [] for py in pythons} for t in topologies}
        for r in range(args.rounds):
            for t in topologies:
                for py in pythons if r % 2 == 0 else pythons[::-1]:  # alternated, the order turned each round
                    runs[t][py].append(run_topology(args, t, prompts, py))
        report["runs"] = runs
        report["sides"] = {t: compare(runs[t], args.streams) for t in topologies}
        for t, levels in report["sides"].items():
            for streams, row in levels.items():
                print(f"{t} @ {streams}: " + "; ".join(f"{py}: {v['tokens_per_s']:.0f} tok/s ({v['speed']:.2f}x), TTFT p50 "
                                                       f"{v['ttft_p50_ms']:.0f} ms" for py, v in row.items()))
    write_result(Path(args.out) / "up_breakdown.json", **report)
    print(f"wrote {args.out}/up_breakdown.json; machine: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
