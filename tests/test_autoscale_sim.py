"""The autoscaling policy against simulated load (benchmarks/autoscale_sim.py): the real decide() on
Snapshots built by the real observe functions, every 15 s of a simulated clock, pods taking a start-up
delay. Each property is a check that returns its problems; each is shown to fail on a broken variant
of the policy (a config or a wrapper around decide), so a pass means something."""
from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from specdec.autoscale.policy import PoolLimits, decide, wanted_draft_replicas

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "autoscale_sim.py"
_spec = importlib.util.spec_from_file_location("autoscale_sim", _PATH)
sim = importlib.util.module_from_spec(_spec)
sys.modules["autoscale_sim"] = sim  # dataclasses look their module up by name
_spec.loader.exec_module(sim)

CONFIG = sim.SIM_CONFIG
MINUTE = 60.0


@pytest.fixture(scope="module")
def runs() -> dict[str, sim.Run]:
    return {trace.name: sim.simulate(trace) for trace in sim.traces()}


def trace(name: str, **changes) -> sim.Trace:
    return replace(next(t for t in sim.traces() if t.name == name), **changes)


# ----------------------------------------------------------------------------- the model itself
@pytest.mark.parametrize("workload, k, ratio", [
    (sim.BASE, 4, 0.357),  # alpha 0.8: long blocks pay
    (replace(sim.BASE, alpha=0.5), 2, 0.208),  # fewer accepted: shorter blocks, relatively fewer drafts
    (replace(sim.BASE, draft_cost_s_per_token=0.003), 3, 0.577),  # a dearer draft: shorter blocks, more drafters
])
def test_acceptance_and_draft_cost_set_k_and_the_analytic_ratio(workload, k, ratio):
    ideal = sim.ideal(5.0, workload, sim.Deployment(), CONFIG)
    assert ideal.k == k
    assert ideal.ratio == pytest.approx(ratio, abs=1e-3)
    assert sim.tokens_per_round(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)


def test_snapshots_come_from_the_metrics_as_observe_reads_them(runs):
    run = runs["switch_alpha"]
    first = run.records[0]
    assert first.snapshot.window_s == 15.0 and first.snapshot.target.pods == first.target_ready
    # Settled at alpha 0.8: the verifiers' rounds/s is what the trace asks for, the drafters draft k per round.
    r = next(r for r in run.records if r.t == 30 * MINUTE)
    assert r.snapshot.target.draft_tokens_per_round == pytest.approx(r.ideal.k)
    assert r.snapshot.target.verify_rounds_per_s == pytest.approx(r.ideal.rounds_per_s, rel=0.05)
    assert r.snapshot.draft.draft_cost_s_per_token == pytest.approx(0.0015)
    assert r.snapshot.requests.itl_s is not None and r.snapshot.requests.waiting == pytest.approx(0.0, abs=1e-6)


def test_a_run_is_deterministic():
    short = trace("bursty", duration_s=20 * MINUTE)
    a, b = sim.simulate(short), sim.simulate(short)
    assert [(r.target_spec, r.draft_spec, r.queued, r.itl_s) for r in a.records] == \
        [(r.target_spec, r.draft_spec, r.queued, r.itl_s) for r in b.records]


# ----------------------------------------------------------------------------- limits
def test_never_below_the_minimum_nor_above_the_maximum(runs):
    assert runs["bursty"].series("target_spec").count(CONFIG.target_limits.max_replicas) > 0  # the max is reached
    for run in runs.values():
        assert sim.check_bounds(run, CONFIG.target_limits, CONFIG.draft_limits) == []


def test_the_bounds_check_bites():
    unbounded = replace(CONFIG, target_limits=PoolLimits(0, 100), draft_limits=PoolLimits(0, 100))
    run = sim.simulate(trace("bursty", duration_s=62 * MINUTE), config=unbounded)  # the 14 req/s spike at 56 min
    assert sim.check_bounds(run, CONFIG.target_limits, CONFIG.draft_limits)


# ----------------------------------------------------------------------------- following the load
@pytest.mark.parametrize("name", ["steady", "ramp", "fall", "bursty", "switch_alpha", "switch_draft_cost"])
def test_target_reaches_the_needed_size_within_cooldowns_and_start_up(runs, name):
    assert sim.check_follows_up(runs[name], "target", CONFIG) == []


@pytest.mark.parametrize("name", ["ramp", "fall", "bursty", "switch_alpha", "switch_draft_cost"])
def test_draft_reaches_the_needed_size_within_cooldowns_and_start_up(runs, name):
    assert sim.check_follows_up(runs[name], "draft", CONFIG) == []


def test_the_follow_up_check_bites():
    # One pod per step (+1 each cooldown): 11 -> 17 after the acceptance drop takes 6 cooldowns, not 1.
    one_pod_per_step = replace(CONFIG, max_scale_up_factor=1.0)
    run = sim.simulate(trace("switch_alpha", duration_s=60 * MINUTE), config=one_pod_per_step)
    assert sim.check_follows_up(run, "target", CONFIG)


@pytest.mark.xfail(strict=True, reason="policy weakness: draft demand is measured from the rounds the verifiers "
                                       "serve, so while the target pool is the bottleneck the draft pool looks "
                                       "idle and starts scaling only once the targets have caught up")
def test_draft_demand_is_seen_while_the_targets_are_short(runs):
    # Cold start: 1 target, 1 draft for 3.8 req/s (7 targets, 2.4 drafts needed).
    for r in runs["steady"].records:
        if 30 <= r.t <= 180:
            wanted, _ = wanted_draft_replicas(r.snapshot, CONFIG)
            assert wanted >= 0.5 * r.ideal.draft, \
                f"t={r.t:.0f}s: the policy sees {wanted:.2f}, {r.ideal.draft:.2f} needed"


def test_scale_down_only_after_the_quiet_period(runs):
    downs = 0
    for run in runs.values():
        for pool in ("target", "draft"):
            assert sim.check_scale_down_waits(run, pool, CONFIG) == []
            counts = run.series(pool + "_spec")
            downs += sum(a > b for a, b in zip(counts, counts[1:]))
    assert downs >= 20  # the check had scale-downs to judge


def test_the_scale_down_check_bites():
    impatient = replace(CONFIG, scale_down_cooldown_s=0.0)
    assert sim.check_scale_down_waits(sim.simulate(trace("fall"), config=impatient), "target", CONFIG)


def test_a_falling_load_brings_both_pools_down_within_two_quiet_periods(runs):
    for pool in ("target", "draft"):
        assert sim.check_comes_down(runs["fall"], pool, CONFIG) == []
    assert runs["fall"].records[-1].target_spec < runs["fall"].records[0].target_spec / 3


def test_the_comes_down_check_bites():
    sluggish = replace(CONFIG, scale_down_cooldown_s=30 * MINUTE)
    assert sim.check_comes_down(sim.simulate(trace("fall"), config=sluggish), "target", CONFIG)


@pytest.mark.xfail(strict=True, reason="policy weakness: the queue vote (queued rounds / 2 per replica) and the "
                                       "waiting vote count a backlog as missing replicas, so each spike ends at the "
                                       "max (24 for a need of 14), and the quiet period's peak includes the drain: "
                                       "back down only in a staircase of 5-minute steps")
def test_target_pool_is_back_near_its_need_within_two_quiet_periods_after_a_spike(runs):
    assert sim.check_comes_down(runs["bursty"], "target", CONFIG) == []


# ----------------------------------------------------------------------------- no flapping
def test_no_oscillation_on_a_steady_noisy_load_after_settling(runs):
    run = runs["steady"]
    assert sim.check_no_oscillation(run, after_s=20 * MINUTE) == []
    last = run.records[-1]
    limits = CONFIG.target_limits
    assert sim.needed(last.ideal.target, limits, CONFIG) <= last.target_spec \
        <= sim.at_most(last.ideal.target, limits, CONFIG)


def test_the_oscillation_check_bites():
    twitchy = replace(CONFIG, hysteresis=0.0, scale_up_cooldown_s=0.0, scale_down_cooldown_s=0.0)
    run = sim.simulate(trace("steady", duration_s=45 * MINUTE), config=twitchy)
    assert sim.check_no_oscillation(run, after_s=20 * MINUTE)


# ----------------------------------------------------------------------------- drafts while speculation pays
LIGHT = sim.Trace("light", "0.3 req/s: draft demand well under one replica", 20 * MINUTE, lambda t: 0.3,
                  lambda t: sim.BASE, settled=(), start=(1, 1))
MAY_REACH_ZERO = replace(CONFIG, target_limits=PoolLimits(0, 24), draft_limits=PoolLimits(0, 16))


def test_drafts_never_scaled_to_zero_while_speculation_pays(runs):
    for run in runs.values():
        assert sim.check_drafts_while_speculating(run) == []
    # With a minimum of 0 the policy itself must keep one: 0.3 req/s wants ~0.15 draft replicas.
    light = sim.simulate(LIGHT, config=MAY_REACH_ZERO)
    assert max(r.ideal.draft for r in light.records) < 0.5
    assert sim.check_drafts_while_speculating(light) == []


def _rounding_drafts(snapshot, state, config, now=None):
    """Broken: drafts to the nearest whole replica of demand, so 0.15 becomes 0."""
    decision = decide(snapshot, state, config, now=now)
    wanted, _ = wanted_draft_replicas(snapshot, config)
    if wanted is None:
        return decision
    return replace(decision, draft=replace(decision.draft, desired=config.draft_limits.clamp(round(wanted))))


def test_the_drafts_check_bites():
    light = sim.simulate(LIGHT, config=MAY_REACH_ZERO, decide_fn=_rounding_drafts)
    assert sim.check_drafts_while_speculating(light)


IDLE = sim.Trace("idle", "3 req/s, nothing for 15 min, 3 req/s again", 45 * MINUTE,
                 lambda t: 0.0 if 10 * MINUTE <= t < 25 * MINUTE else 3.0, lambda t: sim.BASE, settled=())


def test_drafts_come_back_after_an_idle_period_with_min_draft_zero():
    config = replace(CONFIG, draft_limits=PoolLimits(0, 16))
    run = sim.simulate(IDLE, config=config)
    assert min(r.draft_spec for r in run.records) == 0  # it did scale to zero while idle (no demand: correct)
    assert sim.check_drafts_while_speculating(run) == []


# Found by this simulator: a pool at zero has no pod to scrape, so the policy held it at 0 forever.
# Now the orchestrators' requests (targets) and the verifiers' rounds (drafts) bring one replica back.
def test_targets_come_back_after_an_idle_period_with_min_target_zero():
    config = replace(CONFIG, target_limits=PoolLimits(0, 24))
    run = sim.simulate(IDLE, config=config)
    assert min(r.target_spec for r in run.records) == 0  # it did scale to zero while idle
    assert sim.check_follows_up(run, "target", config) == []
    assert run.records[-1].target_spec > 0


# ----------------------------------------------------------------------------- the draft:target ratio
@pytest.mark.parametrize("name", ["steady", "ramp", "fall", "switch_alpha", "switch_draft_cost"])
def test_draft_to_target_ratio_tracks_the_analytic_one(runs, name):
    run = runs[name]
    assert sim.check_ratio(run) == []
    judged = [r for start, end in run.trace.settled for r in run.records if start <= r.t <= end]
    assert len(judged) >= 40


def test_the_ratio_moves_with_the_workload(runs):
    for name, before, after in (("switch_alpha", 0.357, 0.208), ("switch_draft_cost", 0.357, 0.577)):
        at = {r.t: r for r in runs[name].records}
        early, late = at[35 * MINUTE], at[85 * MINUTE]
        assert early.ideal.ratio == pytest.approx(before, abs=1e-3)
        assert late.ideal.ratio == pytest.approx(after, abs=1e-3)
        moved = late.draft_spec / late.target_spec - early.draft_spec / early.target_spec
        assert math.copysign(1, moved) == math.copysign(1, after - before)


def _fixed_ratio(snapshot, state, config, now=None):
    """Broken: drafts at the alpha-0.8 ratio of the targets, whatever the workload."""
    decision = decide(snapshot, state, config, now=now)
    drafts = config.draft_limits.clamp(math.ceil(0.357 * decision.target.desired))
    return replace(decision, draft=replace(decision.draft, desired=drafts))


def test_the_ratio_check_bites():
    run = sim.simulate(trace("switch_alpha"), decide_fn=_fixed_ratio)
    problems = sim.check_ratio(run)
    assert problems and all(float(p.split("t=")[1].split("s")[0]) >= 40 * MINUTE for p in problems)  # after the switch


# ----------------------------------------------------------------------------- the benchmark's outputs
def test_summary_and_table(runs, tmp_path):
    rows = [sim.summary(run) for run in runs.values()]
    text = sim.table(rows)
    assert text.count("\n") == len(rows) + 1 and "| steady |" in text
    steady = rows[0]
    assert steady["itl_p50_ms"] < steady["itl_p99_ms"] and steady["target_changes"] >= 3
