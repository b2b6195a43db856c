"""The autoscaler's policy (`specdec.autoscale.policy.decide`) against a simulated specdec deployment.

    python benchmarks/autoscale_sim.py [--out deploy/docs] [--no-plots]

A deterministic fluid model on a simulated clock (no sleeping): a target pool and a draft pool of
pods, each pod taking a start-up delay before it is ready and scraped; requests arriving at a rate
that follows a trace. Every ``interval_s`` the pods' metrics are built as ``Scrape``s and turned
into a `Snapshot` by the real `observe` functions (`PoolWindow`, `verifier_load`, `drafter_load`,
`request_load`), the real `decide()` runs on it, and its desired replicas are applied as
`run.Autoscaler.step` applies them. Prints a table, writes ``autoscale_<trace>.png`` and
``autoscale_sim.json`` to ``--out``.

The model, per second of simulated time (deploy/README.md, "The policy against simulated load", says it in words):
  - tokens per round = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al., https://arxiv.org/abs/2211.17192);
    a round costs the target ``verify_s(k)`` busy seconds and the drafters k x draft cost;
  - the adaptive k is the k in 0..8 with the most tokens per second of round time;
  - N requests in the system, of which min(N, sessions per verifier x ready verifiers) run and the
    rest wait; each running session asks for one round per round time (draft + verify + network,
    plus the M/D/1 wait at each pool's utilisation); rounds served = min(asked, target capacity,
    draft capacity); sessions beyond what the target pool serves queue at the verifiers;
  - ITL = round time / tokens per round (the histogram's mean in `specdec.metrics`).
With no draft pod ready the orchestrator is taken to decode without drafts (k = 0).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from specdec import metrics as m
from specdec.autoscale.observe import Observation, PoolWindow, Scrape, drafter_load, request_load, verifier_load
from specdec.autoscale.policy import Decision, PolicyConfig, PolicyState, PoolLimits, Snapshot, decide

ROOT = Path(__file__).resolve().parents[1]
DecideFn = Callable[..., Decision]  # decide(snapshot, state, config, now=...)

# The configuration simulated: the policy's defaults, with room above the deploy README's 8 pods so
# that the ratio between the pools is not lost in rounding.
SIM_CONFIG = PolicyConfig(target_limits=PoolLimits(1, 24), draft_limits=PoolLimits(1, 16))


# ----------------------------------------------------------------------------- the deployment
@dataclass(frozen=True)
class Workload:
    """What the requests are like: acceptance rate and the draft model's cost."""

    alpha: float  # probability a draft token is accepted
    draft_cost_s_per_token: float  # drafter busy seconds per drafted token


@dataclass(frozen=True)
class Deployment:
    """The modelled system; seconds are busy seconds of one pod."""

    tokens_per_request: int = 256
    verify_base_s: float = 0.012  # one verification round without drafts (a target decode step)
    verify_per_draft_token: float = 0.1  # each draft token verified adds this fraction of the base
    network_s: float = 0.002  # per round, both hops
    sessions_per_verifier: int = 32  # beyond this, requests wait
    target_startup_s: tuple[float, float] = (60.0, 120.0)  # uniform, per pod: model load until ready
    draft_startup_s: tuple[float, float] = (45.0, 90.0)
    interval_s: float = 15.0  # one decision, one measurement window
    step_s: float = 1.0  # the fluid model's time step
    latency_quantile: float = 0.9
    max_k: int = 8

    def verify_s(self, k: int) -> float:
        return self.verify_base_s * (1 + self.verify_per_draft_token * k)

    def adaptive_k(self, workload: Workload) -> int:
        """The k an adaptive controller settles on: most tokens per second of one session's round."""
        return _adaptive_k(self, workload)

    def round_s(self, workload: Workload, k: int) -> float:
        return k * workload.draft_cost_s_per_token + self.verify_s(k) + self.network_s


@functools.lru_cache(maxsize=64)
def _adaptive_k(deployment: Deployment, workload: Workload) -> int:
    return max(range(deployment.max_k + 1),
               key=lambda k: tokens_per_round(workload.alpha, k) / deployment.round_s(workload, k))


def tokens_per_round(alpha: float, k: int) -> float:
    """Expected tokens one verification round commits: accepted draft tokens plus the one the target adds."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(frozen=True)
class Ideal:
    """What the trace's parameters ask for: replicas (real numbers) at the configured utilisations."""

    k: int
    rounds_per_s: float
    target: float
    draft: float

    @property
    def ratio(self) -> float:
        return self.draft / self.target if self.target > 0 else 0.0


def ideal(rate: float, workload: Workload, deployment: Deployment, config: PolicyConfig) -> Ideal:
    k = deployment.adaptive_k(workload)
    rounds = rate * deployment.tokens_per_request / tokens_per_round(workload.alpha, k)
    return Ideal(k, rounds, rounds * deployment.verify_s(k) / config.target_utilization,
                 rounds * k * workload.draft_cost_s_per_token / config.draft_utilization)


def serve(running: float, round_s: float, verify_s: float, draft_s: float, targets: int,
          drafts: int) -> tuple[float, float, float]:
    """Rounds served per second, the round time at that rate, and the rounds the sessions ask for.

    Each running session asks for one round per round time, and the round time grows with each pool's
    utilisation (its M/D/1 wait), which grows with the rounds served: the rate is the root of
    g(s) = s x round_time(s) - running (convex and increasing: Newton from above converges), capped
    by the pools' capacities.
    """
    if not targets or running <= 0:
        return 0.0, round_s, running / round_s
    pools = [(verify_s, targets)] + ([(draft_s, drafts)] if draft_s > 0 else [])

    def round_time(s: float) -> tuple[float, float]:
        """The round time at rate s, and its derivative in s."""
        time, slope = round_s, 0.0
        for cost, n in pools:
            rho = min(s * cost / n, 0.95)
            time += cost * rho / (2 * (1 - rho))
            if rho < 0.95:
                slope += cost * cost / n / (2 * (1 - rho) ** 2)
        return time, slope

    capacity = min(targets / verify_s, drafts / draft_s if draft_s > 0 else math.inf)
    hi = min(running / round_s, capacity)
    time, slope = round_time(hi)
    if running / time >= hi:  # the pools are the limit
        return hi, time, running / time
    knee = min([hi] + [0.95 * (1 - 1e-9) * n / cost for cost, n in pools])  # past it a wait is capped: a kink
    time, slope = round_time(knee)
    if knee * time < running:  # the root lies past the kink (a pool over 95% busy): bisect
        lo = knee
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mid * round_time(mid)[0] < running else (lo, mid)
        return lo, round_time(lo)[0], lo
    s = knee
    for _ in range(50):  # g is smooth and convex below the kink: Newton from above only falls to the root
        step = (s * time - running) / (time + s * slope)
        s -= step
        time, slope = round_time(s)
        if abs(step) < 1e-9 * s:
            break
    return s, time, s


def mdl_wait(rho: float) -> float:
    """M/D/1 mean wait, in service times (utilisation capped: the fluid model handles overload)."""
    rho = min(max(rho, 0.0), 0.95)
    return rho / (2 * (1 - rho))


# ----------------------------------------------------------------------------- traces
@dataclass(frozen=True)
class Trace:
    name: str
    title: str
    duration_s: float
    rate: Callable[[float], float]  # requests per second, before noise
    workload: Callable[[float], Workload]
    settled: tuple[tuple[float, float], ...]  # windows where the load has been flat long enough to judge the ratio
    start: tuple[int, int] | None = None  # (target, draft) ready at t = 0; None: what the first load needs
    noise: float = 0.1  # the rate is multiplied by a uniform draw in [1 - noise, 1 + noise] every noise_s
    noise_s: float = 30.0


BASE = Workload(alpha=0.8, draft_cost_s_per_token=0.0015)


def _ramp(t: float, t0: float, t1: float, a: float, b: float) -> float:
    return a if t <= t0 else b if t >= t1 else a + (b - a) * (t - t0) / (t1 - t0)


def traces() -> list[Trace]:
    minute = 60.0
    flat = lambda _t: BASE  # noqa: E731
    return [
        Trace("steady", "steady 3.8 req/s from a cold start (1 target, 1 draft)", 90 * minute, lambda t: 3.8, flat,
              settled=((30 * minute, 90 * minute),), start=(1, 1)),
        Trace("ramp", "ramp 1 -> 8 req/s over 40 min", 90 * minute, lambda t: _ramp(t, 20 * minute, 60 * minute, 1, 8),
              flat, settled=((75 * minute, 90 * minute),)),
        Trace("fall", "fall 8 -> 1 req/s over 30 min", 90 * minute, lambda t: _ramp(t, 20 * minute, 50 * minute, 8, 1),
              flat, settled=((75 * minute, 90 * minute),)),
        Trace("bursty", "2 req/s with 4-min spikes to 7 and one to 14 (over the max)", 100 * minute,
              lambda t: (14.0 if 56 * minute <= t < 60 * minute else 7.0) if t % (20 * minute) >= 16 * minute else 2.0,
              flat, settled=()),
        Trace("switch_alpha", "5.5 req/s; acceptance 0.8 -> 0.5 at 40 min", 90 * minute, lambda t: 5.5,
              lambda t: BASE if t < 40 * minute else replace(BASE, alpha=0.5),
              settled=((25 * minute, 40 * minute), (70 * minute, 90 * minute))),
        Trace("switch_draft_cost", "5.5 req/s; draft cost doubles (1.5 -> 3 ms/token) at 40 min", 90 * minute,
              lambda t: 5.5, lambda t: BASE if t < 40 * minute else replace(BASE, draft_cost_s_per_token=0.003),
              settled=((25 * minute, 40 * minute), (70 * minute, 90 * minute))),
    ]


# ----------------------------------------------------------------------------- pods and their metrics
@dataclass
class Pod:
    address: str
    ready_at: float
    offsets: dict[str, float] | None = None  # the pool's per-pod totals when it became ready (None: starting)


class Pool:
    """The pods of one Deployment. Ready pods share the work evenly, so each pod's counter is the
    pool's running per-pod share minus the share at the moment it became ready."""

    def __init__(self, role: str, startup_s: tuple[float, float], seed: str) -> None:
        self.role, self.startup_s, self.rng = role, startup_s, random.Random(seed)
        self.pods: list[Pod] = []
        self.share: dict[str, float] = {}  # per ready pod, cumulative
        self.gauges: dict[str, float] = {}  # whole pool, split evenly at scrape time
        self.made = 0
        self.ready = 0  # pods ready now

    @property
    def spec(self) -> int:
        return len(self.pods)

    def scale_to(self, n: int, now: float, ready_now: bool = False) -> None:
        """Kubernetes' order: new pods start; removal takes pods not ready first, then the newest."""
        while len(self.pods) < n:
            self.made += 1
            pod = Pod(f"{self.role}-{self.made}:9400", now if ready_now else now + self.rng.uniform(*self.startup_s))
            self.pods.append(pod)
        while len(self.pods) > n:
            starting = [p for p in self.pods if p.offsets is None]
            self.pods.remove(starting[-1] if starting else self.pods[-1])
        self.ready = sum(p.offsets is not None for p in self.pods)
        self.promote(now)

    def promote(self, now: float) -> None:
        if self.ready == len(self.pods):
            return
        for pod in self.pods:
            if pod.offsets is None and pod.ready_at <= now:
                pod.offsets = dict(self.share)
                self.ready += 1

    def add(self, name: str, per_pod: float) -> None:
        self.share[name] = self.share.get(name, 0.0) + per_pod

    def scrape(self, now: float) -> dict[str, Scrape]:
        """Every ready pod's metrics, as `observe.parse_scrape` would give them."""
        ready = [p for p in self.pods if p.offsets is not None]
        out = {}
        for pod in ready:
            samples = {name: {(): total - pod.offsets.get(name, 0.0)} for name, total in self.share.items()}
            samples.update({name: {(): value / len(ready)} for name, value in self.gauges.items()})
            out[pod.address] = Scrape(pod.address, now, samples, frozenset(self.share))
        return out


class Orchestrator:
    """One orchestrator pod: request gauges and the TTFT and ITL histograms."""

    def __init__(self) -> None:
        self.running = self.waiting = 0.0
        self.hist = {m.TIME_TO_FIRST_TOKEN: [m.TTFT_BUCKETS_S, [0.0] * (len(m.TTFT_BUCKETS_S) + 1), 0.0, 0.0],
                     m.INTER_TOKEN_LATENCY: [m.ITL_BUCKETS_S, [0.0] * (len(m.ITL_BUCKETS_S) + 1), 0.0, 0.0]}

    def observe(self, name: str, value: float, count: float) -> None:
        bounds, buckets, _, _ = h = self.hist[name]
        for i, bound in enumerate((*bounds, math.inf)):
            if value <= bound:
                buckets[i] += count
        h[2] += count
        h[3] += count * value

    def scrape(self, now: float) -> dict[str, Scrape]:
        samples: dict = {m.NUM_REQUESTS_RUNNING: {(): self.running}, m.NUM_REQUESTS_WAITING: {(): self.waiting}}
        for name, (bounds, buckets, count, total) in self.hist.items():
            les = [str(b) for b in bounds] + ["+Inf"]
            samples[name + "_bucket"] = {(("le", le),): c for le, c in zip(les, buckets)}
            samples[name + "_count"], samples[name + "_sum"] = {(): count}, {(): total}
        monotone = frozenset(n + s for n in self.hist for s in ("_bucket", "_count", "_sum"))
        return {"orchestrator-1:9400": Scrape("orchestrator-1:9400", now, samples, monotone)}


# ----------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class Record:
    """One decision: the window before it and what the policy did."""

    t: float
    rate: float  # requests/s over the window (noise included)
    alpha: float
    draft_cost_s: float
    ideal: Ideal
    target_spec: int  # replicas asked for after the decision
    target_ready: int  # pods serving during the window's last step
    draft_spec: int
    draft_ready: int
    queued: float  # verification rounds queued at the verifiers, at the window's end
    waiting: float  # requests waiting for admission, at the window's end
    itl_s: float  # mean inter-token latency over the window (token-weighted)
    target_busy: float
    draft_busy: float
    target_reason: str
    draft_reason: str
    snapshot: Snapshot = field(repr=False)  # what decide() was given


@dataclass
class Run:
    trace: Trace
    config: PolicyConfig
    deployment: Deployment
    records: list[Record] = field(default_factory=list)
    token_latencies: list[tuple[float, float]] = field(default_factory=list)  # (itl_s, tokens), per step

    def series(self, name: str) -> list:
        return [getattr(r, name) for r in self.records]


def simulate(trace: Trace, config: PolicyConfig = SIM_CONFIG, deployment: Deployment = Deployment(),
             decide_fn: DecideFn = decide) -> Run:
    """Run one trace: a decision every interval, the fluid model every step in between."""
    d = deployment
    run = Run(trace, config, d)
    noise_rng = random.Random(f"noise/{trace.name}")
    noise = [1 + noise_rng.uniform(-trace.noise, trace.noise) for _ in range(int(trace.duration_s / trace.noise_s) + 2)]
    target = Pool("target", d.target_startup_s, f"target/{trace.name}")
    draft = Pool("draft", d.draft_startup_s, f"draft/{trace.name}")
    orch = Orchestrator()
    first = ideal(trace.rate(0.0), trace.workload(0.0), d, config)
    n_target, n_draft = trace.start or (config.target_limits.clamp(math.ceil(first.target)),
                                        config.draft_limits.clamp(math.ceil(first.draft)))
    target.scale_to(n_target, 0.0, ready_now=True)
    draft.scale_to(n_draft, 0.0, ready_now=True)
    sessions = first.rounds_per_s * d.round_s(trace.workload(0.0), first.k)  # Little's law at t = 0
    last = {"target": target.scrape(0.0), "draft": draft.scrape(0.0), "orch": orch.scrape(0.0)}
    last_at, state = 0.0, PolicyState()
    t, steps_per_window = 0.0, round(d.interval_s / d.step_s)
    while t < trace.duration_s - 1e-9:
        rate_sum = tokens_sum = itl_tokens = 0.0
        for _ in range(steps_per_window):
            target.promote(t)
            draft.promote(t)
            rate = trace.rate(t) * noise[int(t / trace.noise_s)]
            workload = trace.workload(t)
            k = d.adaptive_k(workload) if draft.ready else 0
            per_round, verify_s = tokens_per_round(workload.alpha, k), d.verify_s(k)
            draft_s = k * workload.draft_cost_s_per_token
            running = min(sessions, target.ready * d.sessions_per_verifier)
            served, cycle, asked = serve(running, d.round_s(workload, k), verify_s, draft_s, target.ready, draft.ready)
            tokens = served * per_round * d.step_s
            rho_target = served * verify_s / target.ready if target.ready else 0.0
            rho_draft = served * draft_s / draft.ready if draft.ready else 0.0
            # Sessions the target pool cannot take wait at the verifiers; those the drafters cannot, at the drafters.
            target_bound = target.ready / verify_s <= (draft.ready / draft_s if draft_s > 0 else math.inf)
            behind = running - served * cycle if served < asked and target_bound else 0.0
            queued = served * mdl_wait(rho_target) * verify_s + max(0.0, behind)
            itl = (running / served if served > 0 else cycle) / per_round
            ttft = cycle + (sessions - running) / max(rate, 1e-9)
            sessions = max(0.0, sessions + rate * d.step_s - tokens / d.tokens_per_request)
            if target.ready:
                target.add(m.VERIFY_ROUNDS, served * d.step_s / target.ready)
                target.add(m.VERIFIER_BUSY_SECONDS, rho_target * d.step_s)
            if draft.ready:
                draft.add(m.DRAFTER_DRAFT_TOKENS, served * k * d.step_s / draft.ready)
                draft.add(m.DRAFTER_BUSY_SECONDS, rho_draft * d.step_s)
            target.gauges[m.VERIFIER_QUEUED_STEPS] = queued
            orch.running = min(sessions, target.ready * d.sessions_per_verifier)
            orch.waiting = sessions - orch.running
            orch.observe(m.INTER_TOKEN_LATENCY, itl, tokens)
            orch.observe(m.TIME_TO_FIRST_TOKEN, ttft, rate * d.step_s)
            run.token_latencies.append((itl, tokens))
            rate_sum += rate
            tokens_sum += tokens
            itl_tokens += itl * tokens
            t += d.step_s
        # observe → decide → scale, as run.Autoscaler.step does it
        now = {"target": target.scrape(t), "draft": draft.scrape(t), "orch": orch.scrape(t)}
        windows = {pool: PoolWindow(last[pool], now[pool]) for pool in now}
        observation = Observation(t, t - last_at, verifier_load(windows["target"], windows["draft"]),
                                  drafter_load(windows["draft"]), request_load(windows["orch"], d.latency_quantile))
        last, last_at = now, t
        snapshot: Snapshot = observation.snapshot(target.spec, draft.spec)
        decision = decide_fn(snapshot, state, config, now=t)
        state = decision.state
        ready_target, ready_draft = target.ready, draft.ready
        target.scale_to(decision.target.desired, t)
        draft.scale_to(decision.draft.desired, t)
        mean_rate = rate_sum / steps_per_window
        run.records.append(Record(
            t, mean_rate, workload.alpha, workload.draft_cost_s_per_token, ideal(mean_rate, workload, d, config),
            target.spec, ready_target, draft.spec, ready_draft, queued, orch.waiting,
            itl_tokens / tokens_sum if tokens_sum else itl, rho_target, rho_draft,
            decision.target.reason, decision.draft.reason, snapshot))
    return run


# ----------------------------------------------------------------------------- properties (each: a list of problems)
def needed(ideal_replicas: float, limits: PoolLimits, config: PolicyConfig) -> int:
    """The fewest replicas the policy may settle on for this load: the band lets it hold ±hysteresis."""
    return limits.clamp(math.ceil(ideal_replicas / (1 + config.hysteresis) - 1e-9))


def at_most(ideal_replicas: float, limits: PoolLimits, config: PolicyConfig) -> int:
    """The most replicas it may hold for this load."""
    return limits.clamp(math.ceil(ideal_replicas / (1 - config.hysteresis) - 1e-9))


def _pool(run: Run, pool: str):
    limits = run.config.target_limits if pool == "target" else run.config.draft_limits
    ideals = [r.ideal.target if pool == "target" else r.ideal.draft for r in run.records]
    return run.series(pool + "_spec"), run.series(pool + "_ready"), ideals, limits


def check_bounds(run: Run, target_limits: PoolLimits, draft_limits: PoolLimits) -> list[str]:
    problems = []
    for r in run.records:
        for pool, n, limits in (("target", r.target_spec, target_limits), ("draft", r.draft_spec, draft_limits)):
            if not limits.min_replicas <= n <= limits.max_replicas:
                problems.append(f"t={r.t:.0f}s: {pool} {n} outside [{limits.min_replicas}, {limits.max_replicas}]")
    return problems


def direction_changes(counts: list[int]) -> int:
    """How often the pool turned: a scale-up after a scale-down or the other way round."""
    moves = [b - a for a, b in zip(counts, counts[1:]) if b != a]
    return sum((x > 0) != (y > 0) for x, y in zip(moves, moves[1:]))


def check_no_oscillation(run: Run, after_s: float) -> list[str]:
    problems = []
    for pool in ("target", "draft"):
        counts = [r.target_spec if pool == "target" else r.draft_spec for r in run.records if r.t >= after_s]
        turns = direction_changes(counts)
        if turns:
            problems.append(f"{pool}: {turns} direction changes after {after_s:.0f}s ({counts})")
    return problems


def scale_up_bound_s(current: int, need: int, promised: PolicyConfig, startup_max_s: float, interval_s: float) -> float:
    """How long the promised policy may take from `current` to `need`: per step of at most
    x max_scale_up_factor a scale-up cooldown (the first measurement window may catch only part of a
    rise), then the last pods' start-up, and four intervals to see and act."""
    steps = 0
    while current < need:
        current = max(math.ceil(current * promised.max_scale_up_factor), current + 1)
        steps += 1
    return steps * promised.scale_up_cooldown_s + startup_max_s + 4 * interval_s


def check_follows_up(run: Run, pool: str, promised: PolicyConfig) -> list[str]:
    """At every decision, the pods ready a bound later cover the load (the least needed over that span)."""
    spec, ready, ideals, limits = _pool(run, pool)
    d = run.deployment
    startup = (d.target_startup_s if pool == "target" else d.draft_startup_s)[1]
    need = [needed(x, limits, promised) for x in ideals]
    problems = []
    for i, r in enumerate(run.records):
        later = r.t + scale_up_bound_s(ready[i], need[i], promised, startup, d.interval_s)
        j = next((j for j in range(i, len(run.records)) if run.records[j].t >= later), None)
        if j is None:
            break
        floor = min(need[i:j + 1])
        if ready[j] < floor:
            problems.append(f"{pool}: needed {floor} from t={r.t:.0f}s, {ready[j]} ready at t={run.records[j].t:.0f}s")
    return problems


def check_scale_down_waits(run: Run, pool: str, promised: PolicyConfig) -> list[str]:
    """Every scale-down comes a quiet period after the pool's previous change, and the load asked
    for fewer pods than the pool had through that period."""
    spec, _, ideals, _ = _pool(run, pool)
    interval, cooldown = run.deployment.interval_s, promised.scale_down_cooldown_s
    problems, last_change = [], None
    for i in range(1, len(spec)):
        t = run.records[i].t
        if spec[i] < spec[i - 1]:
            if last_change is not None and t - last_change < cooldown:
                problems.append(f"{pool}: down {spec[i - 1]} -> {spec[i]} at t={t:.0f}s, {t - last_change:.0f}s "
                                f"after the previous change")
            quiet = [x for r, x in zip(run.records, ideals) if t - cooldown + 2 * interval <= r.t <= t]
            if any(x >= spec[i - 1] for x in quiet):
                problems.append(f"{pool}: down from {spec[i - 1]} at t={t:.0f}s, but the load asked for "
                                f"{max(quiet):.2f} within the quiet period")
        if spec[i] != spec[i - 1]:
            last_change = t
    return problems


def check_comes_down(run: Run, pool: str, promised: PolicyConfig) -> list[str]:
    """A pool above what its load needs is back within two quiet periods (a scale-down goes to the
    most wanted during the quiet period, so a falling load comes down as a staircase)."""
    spec, _, ideals, limits = _pool(run, pool)
    span = 2 * promised.scale_down_cooldown_s + 4 * run.deployment.interval_s
    problems = []
    for i, r in enumerate(run.records):
        j = next((j for j in range(i, len(spec)) if run.records[j].t >= r.t + span), None)
        if j is None:
            break
        ceiling = max(at_most(x, limits, promised) for x in ideals[i:j + 1])
        if spec[j] > ceiling:
            problems.append(f"{pool}: at most {ceiling} needed from t={r.t:.0f}s, still {spec[j]} at "
                            f"t={run.records[j].t:.0f}s")
    return problems


def check_drafts_while_speculating(run: Run) -> list[str]:
    """Speculation pays (the adaptive k > 0) and there is load: at least one draft pod asked for."""
    return [f"t={r.t:.0f}s: 0 drafts while {r.ideal.draft:.2f} draft replicas of demand (k={r.ideal.k})"
            for r in run.records if r.ideal.k > 0 and r.rate > 0 and r.draft_spec < 1]


def check_ratio(run: Run, slack: float = 0.15) -> list[str]:
    """In the trace's settled windows: drafts within one replica (or `slack`) of analytic ratio x targets."""
    problems = []
    for start, end in run.trace.settled:
        for r in run.records:
            if start <= r.t <= end:
                want = r.ideal.ratio * r.target_spec
                if abs(r.draft_spec - want) > max(1.0, slack * want):
                    problems.append(f"t={r.t:.0f}s: {r.draft_spec} drafts for {r.target_spec} targets, the analytic "
                                    f"ratio {r.ideal.ratio:.3f} asks for {want:.2f}")
    return problems


def check_all(run: Run, promised: PolicyConfig = SIM_CONFIG) -> dict[str, list[str]]:
    out = {"bounds": check_bounds(run, promised.target_limits, promised.draft_limits),
           "drafts while speculating": check_drafts_while_speculating(run),
           "ratio": check_ratio(run)}
    for pool in ("target", "draft"):
        out[f"{pool} follows up"] = check_follows_up(run, pool, promised)
        out[f"{pool} scale-down waits"] = check_scale_down_waits(run, pool, promised)
        out[f"{pool} comes down"] = check_comes_down(run, pool, promised)
    if run.trace.name == "steady":
        out["no oscillation"] = check_no_oscillation(run, after_s=20 * 60)
    return out


# ----------------------------------------------------------------------------- figures
def _quantile(pairs: list[tuple[float, float]], q: float) -> float:
    """Weighted quantile of (value, weight) pairs."""
    pairs = sorted(p for p in pairs if p[1] > 0)
    total, acc = sum(w for _, w in pairs), 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= q * total:
            return value
    return pairs[-1][0] if pairs else float("nan")


def _worst_deficit_s(run: Run, pool: str) -> float:
    """The longest stretch with fewer pods ready than the load needs."""
    _, ready, ideals, limits = _pool(run, pool)
    worst = length = 0.0
    for n, x in zip(ready, ideals):
        length = length + run.deployment.interval_s if n < needed(x, limits, run.config) else 0.0
        worst = max(worst, length)
    return worst


def summary(run: Run) -> dict:
    rs = run.records
    changes = {pool: sum(a != b for a, b in zip(run.series(pool + "_spec"), run.series(pool + "_spec")[1:]))
               for pool in ("target", "draft")}
    used = {pool: sum(run.series(pool + "_ready")) for pool in ("target", "draft")}
    wanted = {"target": sum(r.ideal.target for r in rs), "draft": sum(r.ideal.draft for r in rs)}
    return {
        "trace": run.trace.name, "title": run.trace.title,
        "max_queued_rounds": round(max(r.queued for r in rs), 1),
        "max_waiting_requests": round(max(r.waiting for r in rs), 1),
        "itl_p50_ms": round(1e3 * _quantile(run.token_latencies, 0.5), 2),
        "itl_p99_ms": round(1e3 * _quantile(run.token_latencies, 0.99), 2),
        "target_changes": changes["target"], "draft_changes": changes["draft"],
        "target_turns": direction_changes(run.series("target_spec")),
        "draft_turns": direction_changes(run.series("draft_spec")),
        "worst_target_deficit_s": _worst_deficit_s(run, "target"),
        "worst_draft_deficit_s": _worst_deficit_s(run, "draft"),
        "target_pod_hours_over_ideal": round(used["target"] / wanted["target"], 2),
        "draft_pod_hours_over_ideal": round(used["draft"] / wanted["draft"], 2),
        "problems": {name: len(found) for name, found in check_all(run).items()},
    }


TABLE = [("trace", "trace", "{}"), ("max queue", "max_queued_rounds", "{:.0f}"), ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
         ("ITL p99 ms", "itl_p99_ms", "{:.1f}"), ("target changes", "target_changes", "{}"),
         ("draft changes", "draft_changes", "{}"), ("worst target deficit s", "worst_target_deficit_s", "{:.0f}"),
         ("worst draft deficit s", "worst_draft_deficit_s", "{:.0f}"),
         ("target pod-h / ideal", "target_pod_hours_over_ideal", "{:.2f}"),
         ("draft pod-h / ideal", "draft_pod_hours_over_ideal", "{:.2f}")]


def table(rows: list[dict]) -> str:
    """A Markdown table of the summaries."""
    head = "| " + " | ".join(h for h, _, _ in TABLE) + " |"
    rule = "|" + "|".join("---" for _ in TABLE) + "|"
    body = ["| " + " | ".join(fmt.format(row[key]) for _, key, fmt in TABLE) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def plot(run: Run, path: Path) -> None:
    """Load, then each pool (asked for, ready, analytic ideal), then queue and ITL, over time."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [r.t / 60 for r in run.records]
    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True, gridspec_kw={"height_ratios": [1, 1.4, 1.4, 1]})
    ax = axes[0]
    ax.plot(minutes, run.series("rate"), color="black", lw=1, label="requests/s")
    ax.set_ylabel("requests/s")
    ax.set_ylim(0, max(run.series("rate")) * 1.15)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{run.trace.name}: {run.trace.title}", fontsize=11)
    alpha_ax = ax.twinx()
    alpha_ax.plot(minutes, run.series("alpha"), color="tab:purple", lw=1, ls="--", label="acceptance")
    alpha_ax.plot(minutes, [c * 100 for c in run.series("draft_cost_s")], color="tab:brown", lw=1, ls=":",
                  label="draft cost (1.0 = 10 ms/token)")
    alpha_ax.set_ylim(0, 1)
    alpha_ax.set_ylabel("acceptance, draft cost")
    alpha_ax.legend(loc="upper right", fontsize=8)
    pools = ((axes[1], "target", run.config.target_limits), (axes[2], "draft", run.config.draft_limits))
    for ax, pool, limits in pools:
        ideals = [r.ideal.target if pool == "target" else r.ideal.draft for r in run.records]
        ax.plot(minutes, ideals, color="tab:gray", lw=1, label="analytic ideal (real)")
        ax.step(minutes, run.series(pool + "_spec"), where="post", color="tab:blue", lw=1.5, label="asked for (spec)")
        ax.step(minutes, run.series(pool + "_ready"), where="post", color="tab:orange", lw=1, ls="--", label="ready")
        ax.axhline(limits.max_replicas, color="tab:red", lw=0.8, ls=":", label="max")
        ax.set_ylabel(f"{pool} replicas")
        ax.set_ylim(0, max(max(ideals), max(run.series(pool + "_spec"))) * 1.15 + 1)
        ax.legend(loc="upper left", fontsize=8, ncol=4)
    ax = axes[3]
    ax.plot(minutes, run.series("queued"), color="tab:red", lw=1, label="queued rounds")
    ax.set_ylabel("queued rounds")
    ax.set_yscale("symlog", linthresh=10)
    itl_ax = ax.twinx()
    itl_ax.plot(minutes, [1e3 * x for x in run.series("itl_s")], color="tab:green", lw=1, label="ITL (ms)")
    itl_ax.set_ylabel("ITL ms")
    itl_ms = [1e3 * x for x in run.series("itl_s")]
    if max(itl_ms) > 4 * min(itl_ms):  # spikes: a log scale keeps the rest readable
        itl_ax.set_yscale("log")
        itl_ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        itl_ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        itl_ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(loc="upper left", fontsize=8)
    itl_ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "deploy" / "docs")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [simulate(trace) for trace in traces()]
    rows = [summary(run) for run in runs]
    print(table(rows))
    for row in rows:
        bad = {name: n for name, n in row["problems"].items() if n}
        print(f"{row['trace']}: " + (f"properties broken: {bad}" if bad else "every property holds"))
    if not args.no_plots:
        for run in runs:
            plot(run, args.out / f"autoscale_{run.trace.name}.png")
    report = {"config": repr(SIM_CONFIG), "deployment": repr(Deployment()), "traces": rows}
    (args.out / "autoscale_sim.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}/autoscale_sim.json" + ("" if args.no_plots else " and autoscale_<trace>.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
