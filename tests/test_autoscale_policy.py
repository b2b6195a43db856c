"""The autoscaling policy as a pure function: measured load in, replicas and a reason out."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specdec.autoscale.policy import (DrafterLoad, PolicyConfig, PolicyState, PoolLimits, RequestLoad, Snapshot,
                                      VerifierLoad, decide)

CONFIG = PolicyConfig(target_limits=PoolLimits(1, 10), draft_limits=PoolLimits(1, 10), target_utilization=0.7,
                      draft_utilization=0.5, queued_steps_per_replica=2, ttft_objective_s=1.0, itl_objective_s=0.05,
                      hysteresis=0.1, scale_up_cooldown_s=60, scale_down_cooldown_s=300)


def snapshot(at: float = 1000.0, target_replicas: int = 2, draft_replicas: int = 2, busy: float = 0.7,
             pods: int | None = None, queued: float = 0, rounds: float = 100.0, tokens_per_round: float = 4.0,
             draft_busy: float = 0.4, cost: float | None = 0.001, requests: RequestLoad | None = None) -> Snapshot:
    """Defaults: a pool at its target utilisation, drafts wanting 100 x 4 x 1 ms = 0.4 draft-s/s."""
    return Snapshot(taken_at=at, window_s=30.0, target_replicas=target_replicas, draft_replicas=draft_replicas,
                    target=VerifierLoad(pods if pods is not None else target_replicas, busy, queued, rounds,
                                        tokens_per_round),
                    draft=DrafterLoad(draft_replicas, draft_busy, cost), requests=requests)


def test_steady_load_at_the_target_utilisation_holds():
    d = decide(snapshot(draft_replicas=1), PolicyState(), CONFIG)
    assert (d.target.desired, d.draft.desired) == (2, 1)
    assert not d.target.changed and not d.draft.changed


def test_scale_up_on_queue_and_the_reason_shows_the_numbers():
    # Verifiers only 0.6 busy (under 0.7), but 9 rounds queued at 2 per replica: 4.5 replicas.
    d = decide(snapshot(busy=0.6, queued=9), PolicyState(), CONFIG)
    assert d.target.desired == 4  # ceil(4.5) = 5, capped at x2 per step
    assert "9 queued rounds / 2 per replica" in d.target.reason
    assert "at most x2" in d.target.reason
    assert "scale up" in d.target.reason


def test_scale_up_on_busy_fraction():
    d = decide(snapshot(target_replicas=4, busy=0.95), PolicyState(), CONFIG)
    assert d.target.desired == 6  # 0.95 x 4 / 0.7 = 5.43
    assert "busy 0.95 on 4 pods" in d.target.reason


def test_waiting_requests_scale_target_in_proportion():
    requests = RequestLoad(running=20, waiting=10, ttft_s=None, itl_s=None)
    d = decide(snapshot(busy=0.5, requests=requests), PolicyState(), CONFIG)
    assert d.target.desired == 3  # 2 x (20 + 10) / 20


def test_latency_over_objective_scales_busy_verifiers_only():
    slow = RequestLoad(running=4, waiting=0, ttft_s=0.2, itl_s=0.08)  # ITL 80 ms against 50 ms: x1.6
    busy = decide(snapshot(busy=0.6, requests=slow), PolicyState(), CONFIG)
    assert busy.target.desired == 4  # 2 x 1.6 = 3.2
    assert "ITL 80 ms over its 50 ms objective" in busy.target.reason
    # Idle verifiers with a slow ITL: the draft or the network is slow; more targets would not help.
    idle = decide(snapshot(busy=0.2, requests=slow), PolicyState(), CONFIG)
    assert idle.target.desired == 2
    assert "not a target capacity problem" in idle.target.reason


def test_scale_up_waits_for_its_cooldown():
    first = decide(snapshot(at=1000, busy=0.95), PolicyState(), CONFIG)
    assert first.target.desired == 3
    # The next window: still hot (the new pod is loading its model), 30 s later: hold.
    again = decide(snapshot(at=1030, target_replicas=3, pods=2, busy=1.0, queued=12), first.state, CONFIG)
    assert again.target.desired == 3
    assert "cooldown" in again.target.reason
    later = decide(snapshot(at=1061, target_replicas=3, busy=1.0, queued=12), again.state, CONFIG)
    assert later.target.desired == 6


def test_scale_down_only_after_a_quiet_period_and_to_its_peak():
    state = PolicyState()
    cfg = replace(CONFIG, draft_limits=PoolLimits(2, 10))  # keep the draft pool out of this
    wanted = []
    # Load falls from 6 busy replicas' worth to 1: it wants 2, then 1 replica.
    for t, busy in ((0, 0.3), (100, 0.2), (200, 0.1), (299, 0.1)):
        d = decide(snapshot(at=t, target_replicas=6, busy=busy), state, cfg)
        state = d.state
        wanted.append(d.target.desired)
        assert "if it stays low" in d.target.reason
    assert wanted == [6, 6, 6, 6]
    d = decide(snapshot(at=300, target_replicas=6, busy=0.1), state, cfg)
    # The most it wanted in the quiet period: 0.3 x 6 / 0.7 = 2.57 -> 3, not the last dip's 1.
    assert d.target.desired == 3
    assert "scale down after 300s" in d.target.reason
    # A new quiet period starts after the change.
    d = decide(snapshot(at=301, target_replicas=3, busy=0.1), d.state, cfg)
    assert d.target.desired == 3


def test_a_break_in_the_quiet_period_restarts_it():
    state = PolicyState()
    for t, busy in ((0, 0.1), (200, 0.7), (250, 0.1), (500, 0.1)):
        state = decide(snapshot(at=t, busy=busy, target_replicas=4), state, CONFIG).state
    d = decide(snapshot(at=549, busy=0.1, target_replicas=4), state, CONFIG)
    assert d.target.desired == 4  # quiet since 250 only
    d = decide(snapshot(at=550, busy=0.1, target_replicas=4), d.state, CONFIG)
    assert d.target.desired == 1


def test_hysteresis_band_holds_both_ways():
    # 8 replicas: wanted 7.31 and 8.69 are inside +-10%; ceil alone would flap between 8 and 9.
    for busy in (0.64, 0.76):
        d = decide(snapshot(target_replicas=8, busy=busy), PolicyState(), CONFIG)
        assert d.target.desired == 8, busy
        assert "within the band" in d.target.reason
    d = decide(snapshot(target_replicas=8, busy=0.8), PolicyState(), CONFIG)
    assert d.target.desired == 10  # 9.14, outside the band


def test_draft_replicas_follow_measured_demand():
    base = dict(rounds=100.0, tokens_per_round=4.0, cost=0.001)  # 0.4 draft-s/s at 0.5 per replica: 0.8
    assert decide(snapshot(draft_replicas=1, **base), PolicyState(), CONFIG).draft.desired == 1
    # Acceptance rises: the adaptive k drafts 8 tokens per round (and rounds/s stays): 1.6 -> 2.
    d = decide(snapshot(draft_replicas=1, **(base | {"tokens_per_round": 8.0})), PolicyState(), CONFIG)
    assert d.draft.desired == 2
    assert "100.0 rounds/s x 8.00 draft tokens/round x 1.000 ms/token = 0.80 draft-s/s" in d.draft.reason
    # A slower draft model (3 ms a token): 100 x 4 x 3 ms = 1.2 draft-s/s -> 2.4 replicas, capped x2 from 1.
    d = decide(snapshot(draft_replicas=1, **(base | {"cost": 0.003})), PolicyState(), CONFIG)
    assert d.draft.desired == 2
    d = decide(snapshot(draft_replicas=2, **(base | {"cost": 0.003})), PolicyState(), CONFIG)
    assert d.draft.desired == 3
    # More traffic: 400 rounds/s x 4 x 1 ms = 1.6 -> 3.2 replicas: 4.
    d = decide(snapshot(draft_replicas=2, **(base | {"rounds": 400.0})), PolicyState(), CONFIG)
    assert d.draft.desired == 4
    # ...but from 3 replicas, 3.2 is inside the band: hold.
    assert not decide(snapshot(draft_replicas=3, **(base | {"rounds": 400.0})), PolicyState(), CONFIG).draft.changed


def test_draft_pool_shrinks_to_min_without_demand_after_the_quiet_period():
    cfg = replace(CONFIG, draft_limits=PoolLimits(1, 10))
    first = decide(snapshot(at=0, draft_replicas=4, tokens_per_round=0.0, cost=None), PolicyState(), cfg)
    assert first.draft.desired == 4
    assert "no draft demand" in first.draft.reason
    d = decide(snapshot(at=300, draft_replicas=4, tokens_per_round=0.0, cost=None), first.state, cfg)
    assert d.draft.desired == 1


def test_min_and_max_clamp():
    cfg = replace(CONFIG, target_limits=PoolLimits(2, 5), draft_limits=PoolLimits(3, 4))
    d = decide(snapshot(target_replicas=4, busy=1.0, queued=100, draft_replicas=4, cost=0.01), PolicyState(), cfg)
    assert (d.target.desired, d.draft.desired) == (5, 4)
    # Already at max: it holds even though more is wanted, and says so.
    d = decide(snapshot(target_replicas=5, busy=1.0, queued=100, draft_replicas=4, cost=0.01), PolicyState(), cfg)
    assert not d.target.changed and not d.draft.changed
    assert "hold at the limit 5" in d.target.reason
    # Idle for long: down to min, not below.
    state = decide(snapshot(at=0, target_replicas=4, busy=0.0, draft_replicas=4, rounds=0), PolicyState(), cfg).state
    d = decide(snapshot(at=301, target_replicas=4, busy=0.0, draft_replicas=4, rounds=0), state, cfg)
    assert (d.target.desired, d.draft.desired) == (2, 3)


def test_outside_the_limits_moves_inside_at_once_even_without_metrics():
    cfg = replace(CONFIG, target_limits=PoolLimits(2, 5))
    empty = Snapshot(taken_at=0, window_s=30, target_replicas=9, draft_replicas=0)
    d = decide(empty, PolicyState(), cfg)
    assert (d.target.desired, d.draft.desired) == (5, 1)
    assert "outside [2, 5]" in d.target.reason


@pytest.mark.parametrize("case", ["no loads", "no pods answered", "first scrape", "stale"])
def test_missing_or_stale_data_holds(case):
    hot = snapshot(at=1000, busy=1.0, queued=50)
    if case == "no loads":
        s, now = Snapshot(taken_at=1000, window_s=30, target_replicas=2, draft_replicas=2), None
    elif case == "no pods answered":
        s, now = replace(hot, target=replace(hot.target, pods=0), draft=replace(hot.draft, pods=0)), None
    elif case == "first scrape":
        s, now = replace(hot, window_s=0.0), None
    else:
        s, now = hot, 1000 + CONFIG.max_snapshot_age_s + 1
    d = decide(s, PolicyState(), CONFIG, now=now)
    assert (d.target.desired, d.draft.desired) == (2, 2)
    assert "hold" in d.target.reason and "hold" in d.draft.reason


def test_a_blind_spell_holds_and_leaves_the_quiet_period_running():
    # Low at 0, then no metrics at 200: hold, and the quiet period is neither reset nor ended...
    state = decide(snapshot(at=0, busy=0.1, target_replicas=4), PolicyState(), CONFIG).state
    blind = Snapshot(taken_at=200, window_s=30, target_replicas=4, draft_replicas=2)
    state = decide(blind, state, CONFIG).state
    # ...and a decision still needs measurements saying "low" at the end of it.
    d = decide(snapshot(at=300, busy=0.1, target_replicas=4), state, CONFIG)
    assert d.target.desired == 1


def test_draft_without_verifier_metrics_holds():
    s = replace(snapshot(draft_replicas=3, cost=0.01), target=None)
    d = decide(s, PolicyState(), CONFIG)
    assert d.draft.desired == 3
    assert "no verifier metrics" in d.draft.reason


def test_draft_cost_unknown_holds():
    d = decide(snapshot(draft_replicas=3, cost=None), PolicyState(), CONFIG)
    assert d.draft.desired == 3
    assert "draft cost unknown" in d.draft.reason


def test_config_is_validated():
    with pytest.raises(ValueError):
        PoolLimits(3, 2)
    with pytest.raises(ValueError):
        PolicyConfig(target_utilization=0)
    with pytest.raises(ValueError):
        PolicyConfig(hysteresis=1.0)


def test_the_policy_module_is_pure():
    """Its docstring promises no I/O: it imports nothing but arithmetic and dataclasses."""
    import ast
    import inspect

    from specdec.autoscale import policy

    tree = ast.parse(inspect.getsource(policy))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "math", "dataclasses"}, imported
