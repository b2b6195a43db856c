"""Fault injection on a replicated session store: a Redis Cluster's shard primary, and a
Sentinel-managed primary, hit with SIGKILL and SIGSTOP mid-generation, repeatedly.

The deployment is benchmarks/fault_inject.py's (separate ``specdec serve`` processes, mutual TLS
on every hop, clients through `specdec.client.ResumingClient`), one process per role, with
``--redis-url`` and ``--kv-redis-url`` pointing at a real Redis Cluster (3 primaries, 3 replicas,
``cluster-node-timeout`` 1000 ms; tests/redis_cluster.py starts it) and then at a Sentinel-managed
primary (2 replicas, 1 Sentinel, ``down-after-milliseconds`` 1000). Each round starts ``--sessions``
sessions (greedy, and seeded sampling under the coupled rule), waits until every one is
mid-generation, then hits the primary that holds the most of them (on the cluster: the primary of
their sessions' slots): SIGKILL, then a supervisor's restart once a replica was promoted (the old
primary rejoins as a replica), or SIGSTOP for ``--stop-s`` then SIGCONT. Every session must end with
exactly the tokens of the undisturbed reference run: ``lost`` counts sessions that failed or did
not finish, ``changed`` those with other tokens. The pause is the longest gap between two messages
of a session whose record lives on the victim (each session, once per round).

Run: python benchmarks/fault_inject_cluster.py [--repeats 5] [--out benchmarks/results/faults_cluster/faults_cluster.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fault_inject as fi  # noqa: E402
from redis_cluster import RedisClusterProcs, SentinelProcs, tools  # noqa: E402

from specdec.bench_common import machine  # noqa: E402

SESSION_PREFIX = "specdec"  # what `specdec serve orchestrator` names its keys


def session_key(session_id: str) -> str:
    return f"{SESSION_PREFIX}:sess:{{{session_id}}}"


class _FaultTarget:
    """What a store's processes (``procs``) have in common as a fault target."""

    procs: RedisClusterProcs | SentinelProcs

    @property
    def url(self) -> str:
        return self.procs.url

    def start(self) -> None:
        self.procs.start()

    def stop(self) -> None:
        self.procs.stop()

    def stop_and_cont(self, port: int, stop_s: float, some_session: str) -> dict:
        self.procs.servers[port].signal(signal.SIGSTOP)
        time.sleep(stop_s)
        self.procs.servers[port].signal(signal.SIGCONT)
        return {}


class ClusterStore(_FaultTarget):
    """The Redis Cluster as a fault target."""

    kind = "cluster"

    def __init__(self, server: str, cli: str) -> None:
        self.procs = RedisClusterProcs(server, cli)

    def victim(self, session_ids: list[str]) -> tuple[int, list[str]]:
        """The primary holding the most of these sessions, and those sessions."""
        home = {sid: self.procs.primary_of(session_key(sid)) for sid in session_ids}
        port = Counter(home.values()).most_common(1)[0][0]
        return port, [sid for sid, p in home.items() if p == port]

    def kill_and_recover(self, port: int, some_session: str) -> dict:
        t0 = time.monotonic()
        self.procs.servers[port].signal(signal.SIGKILL)
        self.procs.servers[port].proc.wait()
        new = self.procs.wait_primary_changes(session_key(some_session), port)
        promoted_s = time.monotonic() - t0
        self.procs.restart(port)  # the supervisor: it rejoins as the new primary's replica
        return {"new_primary": new, "promoted_after_s": round(promoted_s, 3)}

    def settle(self, some_session: str | None = None) -> dict:
        """Healthy again: every node agrees, every primary has a replica in sync."""
        self.procs.wait_ok(120)
        self.procs.wait_replicas_online(120)
        return {"primary_now": self.procs.primary_of(session_key(some_session))} if some_session else {}


class SentinelStore(_FaultTarget):
    """The Sentinel-managed primary as a fault target."""

    kind = "sentinel"

    def __init__(self, server: str) -> None:
        self.procs = SentinelProcs(server)

    def victim(self, session_ids: list[str]) -> tuple[int, list[str]]:
        return self.procs.current_primary(), list(session_ids)

    def kill_and_recover(self, port: int, some_session: str) -> dict:
        t0 = time.monotonic()
        self.procs.servers[port].signal(signal.SIGKILL)
        self.procs.servers[port].proc.wait()
        new = self.procs.wait_promotion(port)
        promoted_s = time.monotonic() - t0
        self.procs.restart_as_replica(port, new)
        return {"new_primary": new, "promoted_after_s": round(promoted_s, 3)}

    def settle(self, some_session: str | None = None) -> dict:
        self.procs.wait_replicas(2, 120)
        return {"primary_now": self.procs.current_primary()}


def make_fault(store, how: str, stop_s: float, info_out: dict):
    async def fault(results: list[fi.SessionResult]) -> dict:
        ids = [r.report.session_id for r in results if r.report.session_id and not r.finished]
        port, on_victim = store.victim(ids)
        info = {"victim_port": port, "sessions_on_victim": len(on_victim), "victim_sessions": on_victim}
        if how == "kill":
            info.update(await asyncio.to_thread(store.kill_and_recover, port, on_victim[0]))
        else:
            info.update(await asyncio.to_thread(store.stop_and_cont, port, stop_s, on_victim[0]))
        info_out.update(info)
        return info

    return fault


async def campaign(store, deployment: fi.Deployment, args, expected: dict, specs: list, label: str) -> list[dict]:
    rounds = []
    turn = 0
    for repeat in range(args.repeats):
        for how in args.signals:
            batch = [specs[(turn * args.sessions + j) % len(specs)] for j in range(args.sessions)]
            turn += 1
            await asyncio.to_thread(store.settle)
            await asyncio.to_thread(deployment.wait_ready)
            info: dict = {}
            t0 = time.monotonic()
            results, _ = await fi.run_round(deployment, batch, args.max_new_tokens, make_fault(store, how, args.stop_s, info))
            on_victim = set(info.get("victim_sessions", ()))
            after = await asyncio.to_thread(store.settle, next(iter(on_victim), None))
            outcome = {
                "store": label, "signal": how, "repeat": repeat,
                **{k: v for k, v in info.items() if k != "victim_sessions"}, **after,
                "failed_over": after.get("primary_now") not in (None, info.get("victim_port")),
                "round_s": round(time.monotonic() - t0, 2), "sessions": len(results),
                "lost": sum(bool(r.error) or not r.finished for r in results),
                "changed": sum(not r.error and r.finished and r.tokens != expected[r.spec] for r in results),
                "pause_s_victim": [round(r.max_gap, 4) for r in results if r.report.session_id in on_victim],
                "max_gap_s_others": [round(r.max_gap, 4) for r in results if r.report.session_id not in on_victim],
                "client_resumes": sum(len(r.report.failovers) for r in results),
                "errors": [r.error for r in results if r.error],
            }
            rounds.append(outcome)
            print(f"{label} {how:4s} #{repeat}: victim :{info.get('victim_port')} ({outcome['sessions_on_victim']} sessions), "
                  f"failed over {outcome['failed_over']}, lost {outcome['lost']}, changed {outcome['changed']}, "
                  f"pause {max(outcome['pause_s_victim'], default=0):.2f}s, resumes {outcome['client_resumes']}", flush=True)
    return rounds


def _pct(xs: list[float], q: float) -> float | None:
    return round(fi.percentile(xs, q), 3) if xs else None  # None, not NaN: the report stays strict JSON


def summarize(rounds: list[dict], baseline_gaps: list[float]) -> dict:
    out = {"baseline_max_gap_s": {"p50": round(fi.percentile(baseline_gaps, 0.5), 4),
                                  "p90": round(fi.percentile(baseline_gaps, 0.9), 4),
                                  "max": round(max(baseline_gaps, default=0.0), 4)}}
    for key in sorted({(r["store"], r["signal"]) for r in rounds}):
        group = [r for r in rounds if (r["store"], r["signal"]) == key]
        pauses = [g for r in group for g in r["pause_s_victim"]]
        promoted = [r["promoted_after_s"] for r in group if "promoted_after_s" in r]
        out["/".join(key)] = {
            "faults": len(group), "sessions": sum(r["sessions"] for r in group),
            "sessions_on_victim": sum(r["sessions_on_victim"] for r in group),
            "failovers": sum(r["failed_over"] for r in group),
            "lost": sum(r["lost"] for r in group), "changed": sum(r["changed"] for r in group),
            "client_resumes": sum(r["client_resumes"] for r in group),
            "pause_s_p50": _pct(pauses, 0.5), "pause_s_p90": _pct(pauses, 0.9), "pause_s_max": _pct(pauses, 1.0),
            "others_max_gap_s_p50": _pct([g for r in group for g in r["max_gap_s_others"]], 0.5),
            "promoted_after_s_p50": _pct(promoted, 0.5),
        }
    out["total"] = {"faults": len(rounds), "sessions": sum(r["sessions"] for r in rounds),
                    "lost": sum(r["lost"] for r in rounds), "changed": sum(r["changed"] for r in rounds)}
    return out


async def main_async(args) -> dict:
    found = tools()
    if found is None:
        raise SystemExit("fault_inject_cluster needs redis-server and redis-cli on PATH")
    workdir = Path(tempfile.mkdtemp(prefix="specdec-faults-cluster-"))
    specs = fi.specs_for(args.prompts)
    report: dict = {"machine": machine(), "config": {k: v for k, v in vars(args).items() if k != "out"},
                    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                             cwd=ROOT).stdout.strip(), "rounds": []}
    expected: dict | None = None
    baseline: list[float] = []
    stores = {"cluster": lambda: ClusterStore(*found), "sentinel": lambda: SentinelStore(found[0])}
    try:
        for label in args.stores:
            store = stores[label]()
            deployment = None
            try:
                store.start()
                deployment = fi.Deployment(workdir / label, args.target, args.draft, replicas=1,
                                           step_timeout_s=args.step_timeout_s, grace_s=args.grace_s,
                                           redis_url=store.url, kv_redis_url=store.url)
                if args.store_retry_s is not None:
                    orch = deployment.processes["orchestrator"][0]
                    orch.argv += ["--store-retry-s", str(args.store_retry_s)]
                t0 = time.monotonic()
                deployment.start()
                print(f"{label}: deployment up in {time.monotonic() - t0:.1f}s over {store.url}", flush=True)
                mine, gaps = await fi.reference(deployment, specs, args.max_new_tokens, args.sessions)
                baseline += gaps
                if expected is None:
                    expected = mine
                report.setdefault("reference_equal_across_stores", True)
                report["reference_equal_across_stores"] &= mine == expected
                report["rounds"] += await campaign(store, deployment, args, expected, specs, label)
            finally:
                if deployment is not None:
                    deployment.stop()
                store.stop()
        report["summary"] = summarize(report["rounds"], baseline)
    finally:
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(fi.DEMO / "target"))
    ap.add_argument("--draft", default=str(fi.DEMO / "draft"))
    ap.add_argument("--stores", nargs="+", default=["cluster", "sentinel"], choices=["cluster", "sentinel"])
    ap.add_argument("--signals", nargs="+", default=["kill", "stop"], choices=["kill", "stop"])
    ap.add_argument("--repeats", type=int, default=5, help="rounds per (store, signal)")
    ap.add_argument("--sessions", type=int, default=4, help="sessions in flight per round")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--stop-s", type=float, default=5.0, help="how long a SIGSTOP freezes the primary")
    ap.add_argument("--store-retry-s", type=float, default=None, help="the orchestrator's --store-retry-s (default: its own, read from the store)")
    ap.add_argument("--step-timeout-s", type=float, default=3.0)
    ap.add_argument("--grace-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    random.seed(args.seed)
    report = asyncio.run(main_async(args))
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    total = report["summary"]["total"]
    return 0 if total["lost"] == 0 and total["changed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
