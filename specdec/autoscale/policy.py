"""How many target and draft replicas the measured load asks for. Pure: no I/O, no clock, no globals.

``decide(snapshot, state, config)`` turns one window of measurements into a `Decision` (replicas
per pool, with a reason that shows the numbers) and the state the next call needs.

Target pool: the most replicas any of these asks for (each in replica units, a real number):
  - busy: Σ busy fraction over the pods answering / target utilisation (the capacity in use);
  - queue: verification rounds waiting for a target forward / the rounds one replica may queue;
  - waiting requests: replicas × (running + waiting) / running (admission is the bottleneck);
  - latency: replicas × observed / objective, when TTFT or ITL is over its objective and the
    verifiers are busy (a slow drafter or network also makes latency, and more targets do not fix
    that). Latency under the objective never scales down on its own: it has a floor.
Draft pool: the draft-seconds needed per second, measured as
  verify rounds/s × tokens drafted per round × draft cost (busy seconds per drafted token),
over the draft-seconds one replica gives per second at the target utilisation. Acceptance enters
through tokens per round (the adaptive k grows with acceptance), the draft model's speed through
the cost, so the draft:target ratio follows what is measured rather than a fixed ratio.

Then, per pool: a band of ±hysteresis around the current count holds (no flapping on noise);
limits [min, max] clamp; scale-up waits ``scale_up_cooldown_s`` after the previous scale-up (new
pods take time to load their models and show up in the metrics); scale-down happens only after the
pool has wanted fewer replicas for ``scale_down_cooldown_s`` without a break, and then only to the
most it wanted during that quiet period. Without measurements (no pod answered, a stale snapshot)
a pool holds; only the configured limits are enforced then, since they need no measurement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

TARGET, DRAFT = "target", "draft"


# ----------------------------------------------------------------------------- measurements
@dataclass(frozen=True)
class VerifierLoad:
    """The target pool over one window, from the verifiers' metrics."""

    pods: int  # pods whose metrics were read at both ends of the window
    busy_fraction: float  # mean over those pods of busy seconds / window seconds, in [0, 1]
    queued_steps: float  # verification rounds waiting for a target forward, all pods, at the window's end
    verify_rounds_per_s: float  # all pods together
    draft_tokens_per_round: float | None  # tokens the drafters drafted per verification round (None: no rounds)


@dataclass(frozen=True)
class DrafterLoad:
    """The draft pool over one window, from the drafters' metrics."""

    pods: int
    busy_fraction: float
    draft_cost_s_per_token: float | None  # drafter busy seconds / tokens drafted (None: nothing drafted)


@dataclass(frozen=True)
class RequestLoad:
    """Requests as the orchestrators saw them over the window."""

    running: float
    waiting: float
    ttft_s: float | None  # time to first token over the window (the observer's quantile); None: no first tokens
    itl_s: float | None  # inter-token latency, likewise


@dataclass(frozen=True)
class Snapshot:
    """What the loop knows at one moment: replicas from Kubernetes, loads from the metrics (None: none)."""

    taken_at: float  # the loop's clock (seconds) at the end of the window
    window_s: float  # how long the window was
    target_replicas: int  # each Deployment's spec.replicas now
    draft_replicas: int
    target: VerifierLoad | None = None
    draft: DrafterLoad | None = None
    requests: RequestLoad | None = None


# ----------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class PoolLimits:
    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True)
class PolicyConfig:
    target_limits: PoolLimits = PoolLimits()
    draft_limits: PoolLimits = PoolLimits()
    target_utilization: float = 0.7  # busy fraction a verifier should run at: headroom for bursts
    draft_utilization: float = 0.7
    queued_steps_per_replica: float = 2.0  # more queued rounds than this per verifier: it is behind
    ttft_objective_s: float | None = None  # None: no objective
    itl_objective_s: float | None = None
    hysteresis: float = 0.1  # wanted within ±10% of the current count: hold
    scale_up_cooldown_s: float = 120.0  # at least a pod's start-up (model load) time
    scale_down_cooldown_s: float = 300.0  # the quiet period before any scale-down
    max_scale_up_factor: float = 2.0  # one scale-up at most doubles a pool (at least +1)
    max_snapshot_age_s: float = 120.0  # older measurements are not acted on

    def __post_init__(self) -> None:
        for name in ("target_utilization", "draft_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("ttft_objective_s", "itl_objective_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if not self.queued_steps_per_replica > 0:
            raise ValueError(f"queued_steps_per_replica must be > 0, got {self.queued_steps_per_replica}")
        if not self.max_scale_up_factor >= 1:
            raise ValueError(f"max_scale_up_factor must be >= 1, got {self.max_scale_up_factor}")
        if min(self.scale_up_cooldown_s, self.scale_down_cooldown_s, self.max_snapshot_age_s) < 0:
            raise ValueError("cooldowns and max_snapshot_age_s must be >= 0")


# ----------------------------------------------------------------------------- state and decisions
@dataclass(frozen=True)
class PoolState:
    last_scale_up_at: float | None = None
    below_since: float | None = None  # since when the pool has wanted fewer replicas than it has, without a break
    below_peak: int = 0  # the most replicas it wanted since then: a scale-down goes to this, not to the last dip


@dataclass(frozen=True)
class PolicyState:
    target: PoolState = PoolState()
    draft: PoolState = PoolState()


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    current: int
    desired: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.desired != self.current


@dataclass(frozen=True)
class Decision:
    target: PoolDecision
    draft: PoolDecision
    state: PolicyState = field(repr=False)  # pass to the next decide() once the decision is carried out

    @property
    def reason(self) -> str:
        return f"{self.target.reason}\n{self.draft.reason}"


# ----------------------------------------------------------------------------- the policy
def decide(snapshot: Snapshot, state: PolicyState, config: PolicyConfig, now: float | None = None) -> Decision:
    """One decision per pool from one snapshot. ``now`` (default: the snapshot's time) dates it."""
    now = snapshot.taken_at if now is None else now
    stale = _stale(snapshot, config, now)
    if stale:
        target_wanted, target_why = None, stale
        draft_wanted, draft_why = None, stale
    else:
        target_wanted, target_why = wanted_target_replicas(snapshot, config)
        draft_wanted, draft_why = wanted_draft_replicas(snapshot, config)
    target, target_state = _settle(TARGET, snapshot.target_replicas, target_wanted, target_why, config.target_limits,
                                   state.target, config, now)
    draft, draft_state = _settle(DRAFT, snapshot.draft_replicas, draft_wanted, draft_why, config.draft_limits,
                                 state.draft, config, now)
    return Decision(target, draft, PolicyState(target_state, draft_state))


def _stale(snapshot: Snapshot, config: PolicyConfig, now: float) -> str | None:
    age = now - snapshot.taken_at
    if age > config.max_snapshot_age_s:
        return f"metrics are {age:.0f}s old (over {config.max_snapshot_age_s:.0f}s)"
    if not snapshot.window_s > 0:
        return "no measurement window yet (one scrape so far)"
    return None


def wanted_target_replicas(snapshot: Snapshot, config: PolicyConfig) -> tuple[float | None, str]:
    """Target replicas the load asks for (None: no data), and why, with the numbers."""
    load = snapshot.target
    requests = snapshot.requests
    if snapshot.target_replicas == 0 and requests is not None and requests.running + requests.waiting > 0:
        # A pool scaled to zero reports nothing: the orchestrators' requests are what says it is needed.
        return 1.0, f"no verifier running, {requests.running + requests.waiting:.0f} requests at the orchestrators"
    if load is None or load.pods == 0:
        return None, "no verifier metrics"
    current = snapshot.target_replicas
    votes = [(load.busy_fraction * load.pods / config.target_utilization,
              f"busy {load.busy_fraction:.2f} on {load.pods} pods / utilisation {config.target_utilization:.2f}")]
    if load.queued_steps > 0:
        votes.append((load.queued_steps / config.queued_steps_per_replica,
                      f"{load.queued_steps:.0f} queued rounds / {config.queued_steps_per_replica:g} per replica"))
    notes = []
    if requests is not None and requests.waiting > 0:
        if requests.running > 0:
            votes.append((current * (requests.running + requests.waiting) / requests.running,
                          f"{requests.waiting:.0f} requests waiting beside {requests.running:.0f} running"))
        else:
            votes.append((current + 1.0, f"{requests.waiting:.0f} requests waiting, none running"))
    if requests is not None:
        over = _latency_over_objective(requests, config)
        if over is not None:
            ratio, what = over
            if load.busy_fraction >= 0.5 * config.target_utilization:
                votes.append((current * ratio, what))
            else:
                notes.append(f"{what}, but verifiers are {load.busy_fraction:.2f} busy: not a target capacity problem")
    wanted, why = max(votes, key=lambda vote: vote[0])
    others = [f"{w:.2f} ({reason})" for w, reason in votes if reason != why]
    text = f"wants {wanted:.2f} ({why})"
    if others:
        text += "; also " + ", ".join(others)
    if notes:
        text += "; " + "; ".join(notes)
    return wanted, text


def _latency_over_objective(requests: RequestLoad, config: PolicyConfig) -> tuple[float, str] | None:
    """The worst observed/objective ratio above 1, with words; None when every objective is met."""
    worst = None
    for name, observed, objective in (("TTFT", requests.ttft_s, config.ttft_objective_s),
                                      ("ITL", requests.itl_s, config.itl_objective_s)):
        if observed is None or objective is None or observed <= objective:
            continue
        ratio = observed / objective
        if worst is None or ratio > worst[0]:
            worst = (ratio, f"{name} {observed * 1e3:.0f} ms over its {objective * 1e3:.0f} ms objective (x{ratio:.2f})")
    return worst


def wanted_draft_replicas(snapshot: Snapshot, config: PolicyConfig) -> tuple[float | None, str]:
    """Draft replicas the measured draft demand asks for (None: no data), and why."""
    target, draft = snapshot.target, snapshot.draft
    if target is None or target.pods == 0:
        return None, "no verifier metrics (draft demand is counted in verification rounds)"
    if snapshot.draft_replicas == 0 and target.verify_rounds_per_s > 0:
        # No drafter to measure a cost on: one replica, then its measurements size the pool.
        return 1.0, f"no drafter running while verifiers run {target.verify_rounds_per_s:.1f} rounds/s"
    if draft is None or draft.pods == 0:
        return None, "no drafter metrics"
    rounds, per_round = target.verify_rounds_per_s, target.draft_tokens_per_round or 0.0
    if rounds <= 0 or per_round <= 0:
        return 0.0, f"no draft demand ({rounds:.2f} rounds/s, {per_round:.2f} draft tokens per round)"
    cost = draft.draft_cost_s_per_token
    if cost is None:
        return None, "draft cost unknown (rounds want drafts, but no drafter drafted in the window)"
    demand = rounds * per_round * cost  # draft-seconds needed per second
    wanted = demand / config.draft_utilization
    return wanted, (f"wants {wanted:.2f} ({rounds:.1f} rounds/s x {per_round:.2f} draft tokens/round x "
                    f"{cost * 1e3:.3f} ms/token = {demand:.2f} draft-s/s / utilisation {config.draft_utilization:.2f})")


def _settle(pool: str, current: int, wanted: float | None, why: str, limits: PoolLimits, state: PoolState,
            config: PolicyConfig, now: float) -> tuple[PoolDecision, PoolState]:
    """From the replicas the load asks for to what to do now: limits, band, cooldowns."""
    def decision(desired: int, action: str) -> PoolDecision:
        return PoolDecision(pool, current, desired, f"{pool}: {current} -> {desired}: {action}; {why}")

    bounded = limits.clamp(current)
    if bounded != current:  # the configured limits hold with or without measurements
        return decision(bounded, f"outside [{limits.min_replicas}, {limits.max_replicas}]"), _changed(state, now, bounded > current)
    if wanted is None:
        return decision(current, "hold"), state
    lo, hi = current * (1 - config.hysteresis), current * (1 + config.hysteresis)
    if current > 0 and lo <= wanted <= hi:
        return decision(current, f"hold, within the band [{lo:.2f}, {hi:.2f}]"), replace(state, below_since=None, below_peak=0)
    unbounded = math.ceil(wanted - 1e-9)  # ceil: enough capacity; the epsilon absorbs float noise
    recommended = limits.clamp(unbounded)
    if recommended == current:
        action = "hold" if unbounded == current else f"hold at the limit {current}"
        return decision(current, action), replace(state, below_since=None, below_peak=0)
    if recommended > current:
        step_cap = max(math.ceil(current * config.max_scale_up_factor), current + 1)
        desired = min(recommended, step_cap)
        if state.last_scale_up_at is not None and now - state.last_scale_up_at < config.scale_up_cooldown_s:
            left = config.scale_up_cooldown_s - (now - state.last_scale_up_at)
            return decision(current, f"hold, scale up to {desired} after the cooldown ({left:.0f}s left)"), \
                replace(state, below_since=None, below_peak=0)
        capped = f" (at most x{config.max_scale_up_factor:g} per step)" if desired < recommended else ""
        return decision(desired, f"scale up{capped}"), _changed(state, now, True)
    # Fewer wanted: only after a quiet period, and only to the most wanted during it.
    since = state.below_since if state.below_since is not None else now
    peak = max(state.below_peak, recommended) if state.below_since is not None else recommended
    quiet = now - since
    if quiet < config.scale_down_cooldown_s:
        left = config.scale_down_cooldown_s - quiet
        return decision(current, f"hold, scale down to {peak} if it stays low {left:.0f}s more"), \
            replace(state, below_since=since, below_peak=peak)
    return decision(peak, f"scale down after {quiet:.0f}s below {current}"), _changed(state, now, False)


def _changed(state: PoolState, now: float, up: bool) -> PoolState:
    """The state after the pool was resized: the quiet period starts again."""
    return PoolState(last_scale_up_at=now if up else state.last_scale_up_at, below_since=None, below_peak=0)
