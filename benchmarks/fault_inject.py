"""Fault injection with real processes: kill -9, SIGTERM and SIGSTOP of every role mid-generation.

A deployment of separate ``specdec serve`` processes (2 drafters, 2 verifiers, 2 orchestrators,
mutual TLS on every hop) over private redis-servers: the session store with its append-only file
fsynced on every write, and one without persistence for the KV blocks (a cache). Faults hit the
three roles and the session store. Each round starts a few sessions through
`specdec.client.ResumingClient` (greedy, and seeded sampling under the coupled rule, which makes
the output a function of the seed alone), waits until they are mid-generation, then hits one
process of one role: SIGKILL (restarted at once), SIGTERM (it drains, exits, is restarted) or
SIGSTOP (frozen for ``--stop-s``, then SIGCONT). Every session must complete with exactly the
tokens an uninterrupted run gives. The pause a fault adds is the longest gap between two messages
of a session in flight, against the same figure in the rounds without a fault.

Run: python benchmarks/fault_inject.py [--repeats 3] [--out benchmarks/results/faults/faults.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from redis_server import free_port, ping  # noqa: E402

from specdec.client import ResumingClient, StreamReport  # noqa: E402
from specdec.rpc.certs import make_dev_certs  # noqa: E402
from specdec.rpc.tls import TlsFiles, client_tls, internal_channel  # noqa: E402
from specdec.v1 import common_pb2, drafter_pb2_grpc, generation_pb2 as pb, verifier_pb2_grpc  # noqa: E402

DEMO = ROOT / "models" / "demo"
ROLES = ("draft", "target", "orchestrator")
FAULT_ROLES = (*ROLES, "redis")
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


@dataclass
class Process:
    role: str
    index: int
    port: int
    health_port: int
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, env: dict[str, str]) -> None:
        self.starts += 1
        log = open(self.log_path, "ab")
        log.write(f"\n===== start {self.starts} at {time.time():.3f}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


class RedisProcess(Process):
    """The session store, with every write fsynced to its append-only file before it is acknowledged:
    a crash loses nothing a client has been sent."""

    def healthy(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and ping("127.0.0.1", self.port)


class Deployment:
    """2 drafters, 2 verifiers, 2 orchestrators and a redis-server, all separate processes."""

    def __init__(self, workdir: Path, target: str, draft: str, replicas: int = 2, kv_blocks: bool = True,
                 step_timeout_s: float = 3.0, grace_s: float = 2.0, threads: int = 1,
                 redis_url: str | None = None, kv_redis_url: str | None = None) -> None:
        """``redis_url``, ``kv_redis_url``: a session store and a KV-block Redis run by someone else
        (any form core/redis_connect.py accepts: benchmarks/fault_inject_cluster.py passes a Redis
        Cluster or a Sentinel); without them, private redis-servers are started."""
        self.workdir = workdir
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.certs = make_dev_certs(str(workdir / "tls"), ["127.0.0.1"], days=1)
        self.tls = TlsFiles(str(self.certs["tls.crt"]), str(self.certs["tls.key"]), str(self.certs["ca.crt"]))
        redis_server = shutil.which("redis-server")
        if redis_server is None:
            raise SystemExit("fault_inject needs redis-server on PATH")
        redis_port = free_port()
        self.redis_url = redis_url or f"redis://127.0.0.1:{redis_port}/0"
        (workdir / "redis").mkdir(exist_ok=True)
        self.redis = RedisProcess("redis", 0, redis_port, 0,
                                  [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "yes", "--appendfsync", "always", "--dir", str(workdir / "redis")],
                                  workdir / "logs" / "redis.log")
        # KV blocks are a cache (a resume recomputes what is missing): they go to a Redis of their own
        # that keeps nothing on disk, as a deployment would run them, so the session store's
        # append-only file holds only records and a restart replays it quickly.
        kv_port = free_port()
        self.kv_redis_url = kv_redis_url or f"redis://127.0.0.1:{kv_port}/0"
        self.kv_redis = RedisProcess("kv-redis", 0, kv_port, 0,
                                     [redis_server, "--port", str(kv_port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir / "redis")], workdir / "logs" / "kv-redis.log")
        # One torch thread per process and OpenMP threads that sleep when idle: spinning workers make
        # their neighbours on a small machine many times slower (docs/performance.md, "How to read these figures").
        self.env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
        common = [sys.executable, "-m", "specdec", "serve", "--target", target, "--draft", draft, "--threads", str(threads),
                  "--tls-cert", str(self.certs["tls.crt"]), "--tls-key", str(self.certs["tls.key"]),
                  "--tls-ca", str(self.certs["ca.crt"]), "--grace-s", str(grace_s)]
        self.processes: dict[str, list[Process]] = {"kv-redis": [] if kv_redis_url else [self.kv_redis],
                                                    "redis": [] if redis_url else [self.redis],
                                                    **{role: [] for role in ROLES}}
        ports = {role: [free_port() for _ in range(replicas)] for role in ROLES}
        for role in ROLES:
            for i, port in enumerate(ports[role]):
                argv = common + [role, "--port", str(port), "--health-port", str(free_port())]
                if role == "target" and kv_blocks:
                    argv += ["--kv-redis-url", self.kv_redis_url]
                if role == "orchestrator":
                    argv += ["--redis-url", self.redis_url, "--step-timeout-s", str(step_timeout_s),
                             "--verifier-address", ",".join(f"127.0.0.1:{p}" for p in ports["target"]),
                             "--drafter-address", ",".join(f"127.0.0.1:{p}" for p in ports["draft"])]
                self.processes[role].append(Process(role, i, port, int(argv[argv.index("--health-port") + 1]), argv,
                                                    workdir / "logs" / f"{role}{i}.log"))

    @property
    def all(self) -> list[Process]:
        return [p for role in ("kv-redis", *FAULT_ROLES) for p in self.processes[role]]

    @property
    def orchestrators(self) -> list[str]:
        return [p.address for p in self.processes["orchestrator"]]

    def start(self, ready_timeout_s: float = 300.0) -> None:
        for p in self.all:  # Redis, then workers: orchestrators ask them for the model at start-up
            p.start(self.env)
            if p.role in ("kv-redis", "redis", "target"):
                self.wait_ready([p], ready_timeout_s)
        self.wait_ready(self.all, ready_timeout_s)

    def wait_ready(self, processes: list[Process] | None = None, timeout_s: float = 300.0) -> float:
        processes = processes or self.all
        t0 = time.monotonic()
        while not all(p.healthy() for p in processes):
            dead = [p.name for p in processes if p.proc is not None and p.proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited; see {self.workdir / 'logs'}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"not ready after {timeout_s}s: {[p.name for p in processes if not p.healthy()]}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def stop(self) -> None:
        for p in self.all:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
                p.proc.kill()
        for p in self.all:
            if p.proc is not None:
                p.proc.wait()

    async def worker_sessions(self, p: Process) -> int:
        stub_cls = drafter_pb2_grpc.DrafterStub if p.role == "draft" else verifier_pb2_grpc.VerifierStub
        async with internal_channel(p.address, self.tls) as channel:
            try:
                status = await stub_cls(channel).GetWorkerStatus(common_pb2.WorkerStatusRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                return -1
        return status.active_sessions


# ----------------------------------------------------------------------------- sessions


@dataclass(frozen=True)
class SessionSpec:
    prompt: str
    seed: int
    temperature: float  # 0: greedy

    def request(self, max_new_tokens: int) -> pb.GenerateRequest:
        sampling = common_pb2.SamplingParams(temperature=self.temperature, seed=self.seed,
                                             rule=common_pb2.VERIFICATION_RULE_COUPLED)
        return pb.GenerateRequest(text=self.prompt, max_new_tokens=max_new_tokens, sampling=sampling, drafter="model")


@dataclass
class SessionResult:
    spec: SessionSpec
    tokens: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive messages
    report: StreamReport = field(default_factory=StreamReport)
    error: str = ""
    finished: bool = False

    @property
    def max_gap(self) -> float:
        return max(self.gaps, default=0.0)


async def run_session(client: ResumingClient, result: SessionResult, max_new_tokens: int, timeout_s: float) -> None:
    last = None
    try:
        async for msg in client.stream(result.spec.request(max_new_tokens), result.report, timeout_s=timeout_s):
            now = time.monotonic()
            if last is not None:
                result.gaps.append(now - last)
            last = now
            result.tokens.extend(msg.token_ids)
            result.finished = bool(msg.finish_reason)
    except grpc.aio.AioRpcError as err:
        result.error = f"{err.code().name}: {err.details()}"
    except Exception as exc:  # noqa: BLE001 - a harness reports every way a session can end
        result.error = repr(exc)


def clients_for(deployment: Deployment, n: int) -> list[ResumingClient]:
    """One client per session, each starting on a different orchestrator (they spread like a load balancer would)."""
    addresses = deployment.orchestrators
    credentials = client_tls(str(deployment.certs["ca.crt"]))
    return [ResumingClient(addresses[i % len(addresses):] + addresses[: i % len(addresses)], credentials, retry_for_s=90)
            for i in range(n)]


async def run_round(deployment: Deployment, specs: list[SessionSpec], max_new_tokens: int, fault=None,
                    mid_tokens: int = 24, timeout_s: float = 180.0) -> tuple[list[SessionResult], dict]:
    """Run ``specs`` at once; once every one has ``mid_tokens`` tokens, await ``fault(results)`` (it
    returns a dict of what it did)."""
    clients = clients_for(deployment, len(specs))
    results = [SessionResult(spec) for spec in specs]
    tasks = [asyncio.ensure_future(run_session(c, r, max_new_tokens, timeout_s)) for c, r in zip(clients, results)]
    info: dict = {}
    if fault is not None:
        while not all(t.done() or len(r.tokens) >= mid_tokens for t, r in zip(tasks, results)):
            await asyncio.sleep(0.01)
        info = await fault(results)
    await asyncio.gather(*tasks)
    for c in clients:
        await c.aclose()
    return results, info


# ----------------------------------------------------------------------------- faults


def make_fault(deployment: Deployment, role: str, how: str, stop_s: float, rng: random.Random):
    """A fault on the busiest process of ``role`` (for orchestrators: the one most streams are on)."""

    async def victim(results: list[SessionResult]) -> Process:
        processes = deployment.processes[role]
        if role == "orchestrator":
            load = [sum(r.report.address == p.address for r in results) for p in processes]
        elif role == "redis":
            load = [len(results)]
        else:
            load = [await deployment.worker_sessions(p) for p in processes]
        busiest = max(load)
        return rng.choice([p for p, n in zip(processes, load) if n == busiest])

    async def fault(results: list[SessionResult]) -> dict:
        p = await victim(results)
        if role == "orchestrator":
            sessions_on_it = sum(r.report.address == p.address for r in results)
        elif role == "redis":
            sessions_on_it = len(results)  # every session commits there
        else:
            sessions_on_it = await deployment.worker_sessions(p)
        t0 = time.monotonic()
        p.proc.send_signal(SIGNALS[how])
        info = {"victim": p.name, "sessions_on_victim": sessions_on_it}
        if how == "stop":
            await asyncio.sleep(stop_s)
            p.proc.send_signal(signal.SIGCONT)
        else:
            await asyncio.to_thread(p.proc.wait)
            info["exited_after_s"] = round(time.monotonic() - t0, 3)
            p.start(deployment.env)  # back to two replicas, while the sessions go on
        return info

    return fault


# ----------------------------------------------------------------------------- the run


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def specs_for(n: int) -> list[SessionSpec]:
    from common import held_out_prompts

    prompts = held_out_prompts(n)
    return [SessionSpec(prompt, 1000 + i, 0.0 if i % 2 == 0 else 0.8) for i, prompt in enumerate(prompts)]


async def reference(deployment: Deployment, specs: list[SessionSpec], max_new_tokens: int, sessions: int) -> tuple[dict, list[float]]:
    """Each spec's tokens from a run with no fault (in rounds as the faults see them), and the gaps seen."""
    expected: dict[SessionSpec, list[int]] = {}
    gaps: list[float] = []
    for i in range(0, len(specs), sessions):
        results, _ = await run_round(deployment, specs[i : i + sessions], max_new_tokens)
        for r in results:
            if r.error or not r.finished:
                raise RuntimeError(f"the fault-free reference run failed: {r.error}")
            expected[r.spec] = r.tokens
            gaps.append(r.max_gap)
    return expected, gaps


async def campaign(deployment: Deployment, args, kinds: list[tuple[str, str]], expected: dict, specs: list[SessionSpec],
                   rng: random.Random, label: str) -> list[dict]:
    rounds = []
    turn = 0
    for repeat in range(args.repeats):
        for role, how in kinds:
            batch = [specs[(turn * args.sessions + j) % len(specs)] for j in range(args.sessions)]
            turn += 1
            ready_s = await asyncio.to_thread(deployment.wait_ready)
            t0 = time.monotonic()
            results, info = await run_round(deployment, batch, args.max_new_tokens,
                                             make_fault(deployment, role, how, args.stop_s, rng))
            outcome = {
                "campaign": label, "role": role, "signal": how, "repeat": repeat, **info,
                "waited_for_ready_s": round(ready_s, 2), "round_s": round(time.monotonic() - t0, 2),
                "sessions": len(results),
                "lost": sum(bool(r.error) or not r.finished for r in results),
                "changed": sum(not r.error and r.finished and r.tokens != expected[r.spec] for r in results),
                "max_gap_s": [round(r.max_gap, 4) for r in results],
                "client_failovers": [[{"code": f.code, "at": f.received, "pause_s": round(f.pause_s, 4), "attempts": f.attempts}
                                      for f in r.report.failovers] for r in results],
                "errors": [r.error for r in results if r.error],
            }
            rounds.append(outcome)
            print(f"{label} {role:12s} {how:4s} #{repeat}: victim {info.get('victim')} "
                  f"({info.get('sessions_on_victim')} sessions), lost {outcome['lost']}, changed {outcome['changed']}, "
                  f"max gap {max(outcome['max_gap_s']):.3f}s", flush=True)
    return rounds


def summarize(rounds: list[dict], baseline_gaps: list[float]) -> dict:
    """Per role and signal: faults, sessions, lost, changed, and the pause (the longest gap of a
    session that was on the victim, or of every session for a role all of them use) p50/p99."""
    out = {"baseline_max_gap_s": {"p50": round(percentile(baseline_gaps, 0.5), 4),
                                  "p99": round(percentile(baseline_gaps, 0.99), 4)}}
    threshold = percentile(baseline_gaps, 0.99)
    for key in sorted({(r["campaign"], r["role"], r["signal"]) for r in rounds}):
        group = [r for r in rounds if (r["campaign"], r["role"], r["signal"]) == key]
        gaps = [g for r in group for g in r["max_gap_s"]]
        hit = [g for g in gaps if g > threshold]  # sessions the fault reached (their longest gap is past any quiet one)
        out["/".join(key)] = {
            "faults": len(group), "sessions": sum(r["sessions"] for r in group),
            "lost": sum(r["lost"] for r in group), "changed": sum(r["changed"] for r in group),
            "sessions_paused": len(hit),
            "pause_s_p50": round(percentile(hit, 0.5), 4) if hit else 0.0,
            "pause_s_p99": round(percentile(hit, 0.99), 4) if hit else 0.0,
            "max_gap_s_p50_all": round(percentile(gaps, 0.5), 4),
        }
    totals = {"faults": len(rounds), "sessions": sum(r["sessions"] for r in rounds),
              "lost": sum(r["lost"] for r in rounds), "changed": sum(r["changed"] for r in rounds)}
    out["total"] = totals
    return out


async def main_async(args) -> dict:
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="specdec-faults-"))
    specs = specs_for(args.prompts)
    report: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "rounds": []}
    kinds = [(role, how) for role in args.roles for how in args.signals]
    deployment = Deployment(workdir, args.target, args.draft, step_timeout_s=args.step_timeout_s, grace_s=args.grace_s)
    try:
        t0 = time.monotonic()
        deployment.start()
        print(f"deployment up in {time.monotonic() - t0:.1f}s (logs in {workdir / 'logs'})", flush=True)
        expected, baseline = await reference(deployment, specs, args.max_new_tokens, args.sessions)
        report["rounds"] += await campaign(deployment, args, kinds, expected, specs, rng, "kv")
        if args.compare_recompute:
            # The same verifier faults with no KV blocks kept: a resumed session recomputes its prefix.
            deployment.stop()
            plain = Deployment(workdir / "recompute", args.target, args.draft, kv_blocks=False,
                               step_timeout_s=args.step_timeout_s, grace_s=args.grace_s)
            plain.start()
            deployment = plain
            report["rounds"] += await campaign(deployment, args, [("target", "kill")], expected, specs, rng, "recompute")
        report["summary"] = summarize(report["rounds"], baseline)
    finally:
        deployment.stop()
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--repeats", type=int, default=3, help="rounds per (role, signal)")
    ap.add_argument("--sessions", type=int, default=4, help="sessions in flight per round")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--stop-s", type=float, default=5.0, help="how long a SIGSTOP freezes its process")
    ap.add_argument("--step-timeout-s", type=float, default=3.0)
    ap.add_argument("--grace-s", type=float, default=2.0)
    ap.add_argument("--roles", nargs="+", default=list(FAULT_ROLES), choices=FAULT_ROLES)
    ap.add_argument("--signals", nargs="+", default=list(SIGNALS), choices=list(SIGNALS))
    ap.add_argument("--compare-recompute", action="store_true", help="also run verifier kills without KV blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    report = asyncio.run(main_async(args))
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["summary"]["total"]["lost"] == 0 and report["summary"]["total"]["changed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
