"""Speculation length under load (core/goodput.py): the marginal rule and the batch cost model."""
from __future__ import annotations

import pytest

from specdec.core.goodput import BatchCostModel, load_cap


@pytest.mark.parametrize("alpha, cost_ms, goodput, max_k, want", [
    (0.7, 1.0, 100.0, 8, 6),   # alone: 0.7^6 = 0.118 > 0.1 = 1 ms x 100 tok/s; 0.7^7 = 0.082 is not
    (0.7, 1.0, 450.0, 8, 2),   # 16 sessions: the price of a draft token is 0.45 tokens; 0.7^2 = 0.49 still pays
    (0.7, 2.5, 450.0, 8, 0),   # ... at 2.5 ms a token costs more than any draft can win: plain decoding
    (0.9, 1.0, 100.0, 8, 8),   # capped by the request's own maximum
    (0.0, 1.0, 100.0, 8, 0),   # nothing is ever accepted
    (1.0, 5.0, 1000.0, 8, 8),  # everything is accepted: always worth it
    (0.7, 0.0, 100.0, 8, 8),   # free drafts
])
def test_a_draft_token_must_win_more_than_it_costs_the_batch(alpha, cost_ms, goodput, max_k, want):
    assert load_cap(alpha, cost_ms / 1e3, goodput, max_k) == want


def test_the_cap_falls_as_load_grows_and_comes_back_when_it_falls():
    caps = [load_cap(0.75, 1.5e-3, g, 8) for g in (80, 160, 320, 640, 320, 80)]
    assert caps[0] > caps[1] > caps[2] > caps[3] == 0
    assert caps[4] == caps[2] and caps[5] == caps[0]


def test_the_cost_of_a_row_is_fitted_from_batches_of_different_sizes():
    model = BatchCostModel(rate=0.2)
    for rows in (1, 3, 16, 48, 5, 30) * 10:
        model.observe(rows, 0.010 + 0.0005 * rows, committed_tokens=rows)  # 10 ms + 0.5 ms a row
    assert model.per_row_s == pytest.approx(0.0005, rel=1e-6)
    assert model.goodput_tokens_per_s > 0


def test_without_varied_batches_the_slope_falls_back_to_a_share_of_the_step():
    model = BatchCostModel(prior_per_row_fraction=0.04)
    for _ in range(20):
        model.observe(3, 0.012, committed_tokens=2)
    assert model.per_row_s == pytest.approx(0.04 * 0.012)
    assert model.goodput_tokens_per_s == pytest.approx(2 / 0.012)


def test_what_drafts_cost_whole_cycles_is_fitted_apart_from_the_batch_size():
    # Cycles of 16 or 20 sessions; a draft token costs 1.5 ms of cycle (a row is 0.3 ms): the drafter
    # slowing the forward it shares cores with, and the batch waiting for blocks.
    model = BatchCostModel()
    assert model.draft_token_cost_s is None
    pattern = [(16, 0), (16, 0), (20, 0), (16, 2), (20, 0), (16, 0), (20, 3), (16, 0)] * 8
    for sessions, drafts in pattern:
        cycle = 0.004 + 0.0003 * sessions + 0.0015 * drafts
        model.observe(sessions + drafts, cycle - 0.002, committed_tokens=sessions, since_last_s=cycle, drafts=drafts)
    assert model.draft_token_cost_s == pytest.approx(0.0015, rel=1e-3)


def test_the_draft_cost_stays_unknown_while_drafts_move_with_the_batch_size():
    model = BatchCostModel()
    for sessions in (4, 8, 12, 16) * 10:  # every session always drafts 2: drafts = 2 x sessions
        cycle = 0.004 + 0.001 * sessions
        model.observe(3 * sessions, cycle - 0.002, committed_tokens=sessions, since_last_s=cycle, drafts=2 * sessions)
    assert model.draft_token_cost_s is None


# ----------------------------------------------------------------------------- what the loop feeds the cost model
def test_a_prefill_between_two_batches_is_not_a_decode_cycle(tiny_pair):
    import asyncio
    import secrets

    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import DraftProposal, SessionSpec
    from specdec.target.engine import TargetConfig, VerifierEngine
    from specdec.target.scheduler import VerifierScheduler

    engine = VerifierScheduler(VerifierEngine.from_config(TargetConfig(tiny_pair[0])), threaded=False)
    gaps = []
    observe = engine.batch_costs.observe
    engine.batch_costs.observe = lambda *args, **kw: (gaps.append(args[3]), observe(*args, **kw))

    async def go():
        first, second = secrets.token_hex(16), secrets.token_hex(16)
        await engine.open(SessionSpec(first, (5, 6, 7), SamplingParams()), 16)
        await engine.verify(first, DraftProposal(()))
        await engine.verify(first, DraftProposal(()))  # a decode cycle
        await engine.open(SessionSpec(second, (5, 6, 7, 8), SamplingParams()), 16)
        await engine.verify(first, DraftProposal(()))  # the gap before it held a prefill

    asyncio.run(go())
    assert gaps[0] is None and gaps[1] is not None and gaps[2] is None


def _plan(policy):
    from specdec.core.sampling import SamplingParams
    from specdec.core.speculation import SpeculationController
    from specdec.core.steps import SessionRun, SessionSpec
    from specdec.target.scheduler import SessionPlan

    return SessionPlan(SessionRun(SessionSpec("s", (1, 2, 3), SamplingParams()), "", 64, policy), SpeculationController(policy))


def test_alone_the_load_cap_leaves_k_to_the_request():
    from specdec.core.goodput import LoadRegimes
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy
    from specdec.target.scheduler import VerifierScheduler, _BatchPrice

    # A fitted draft-token cost that makes any draft look dear to a batch (price 2 tokens).
    price = _BatchPrice(per_row_s=0.001, draft_per_token_s=0.001, fitted_draft_token_s=0.01, goodput_tokens_per_s=200.0)
    plan = _plan(SpeculationPolicy(SpeculationMode.ADAPTIVE, 4, 8))
    # Alone: its own k, its step-time model already weighed what a draft costs it.
    assert VerifierScheduler._next_k(plan, 1, LoadRegimes.CAPPED, price) == 4
    assert VerifierScheduler._next_k(plan, 8, LoadRegimes.CAPPED, price) == 0  # in company, a draft token must pay for the whole batch


def test_a_fault_in_the_batch_bookkeeping_costs_no_session_its_step(tiny_pair):
    """The cost models steer speed only: if one raises, every step of the batch still gets its
    outcome and later batches still run."""
    import asyncio
    import secrets

    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import DraftProposal, SessionSpec
    from specdec.target.engine import TargetConfig, VerifierEngine
    from specdec.target.scheduler import VerifierScheduler

    engine = VerifierScheduler(VerifierEngine.from_config(TargetConfig(tiny_pair[0])), threaded=False)
    faults = []

    def broken(*args, **kw):
        faults.append(args)
        raise ZeroDivisionError("a bug in the bookkeeping")

    engine.load_regimes.observe = broken

    async def go():
        sid = secrets.token_hex(16)
        await engine.open(SessionSpec(sid, (5, 6, 7), SamplingParams()), 16)
        return [await asyncio.wait_for(engine.verify(sid, DraftProposal(())), 10) for _ in range(3)]

    outcomes = asyncio.run(go())
    assert [len(o.token_ids) for o in outcomes] == [1, 1, 1] and len(faults) == 3


# ----------------------------------------------------------------------------- which way under load, measured
def _epochs(regimes, rates: dict, n: int, sessions: int = 4, start: float = 0.0) -> tuple[list, float]:
    """Run n epochs of 10 batches; each batch commits what the way running then would commit in its time."""
    ways, now = [], start
    step = regimes.epoch_s / 10 * (1 + 1e-6)  # ten batches end an epoch
    for _ in range(n):
        way = regimes.current
        ways.append(way)
        for _ in range(10):
            now += step
            regimes.observe(sessions, round(rates[way] * step), now)
    return ways, now


def test_under_load_each_way_is_tried_then_the_best_runs_and_the_others_are_tried_ever_less_often():
    from specdec.core.goodput import LoadRegimes

    regimes = LoadRegimes(epoch_s=0.5, explore_every=4, max_explore_every=16)
    regimes.adaptive_sessions = 4
    regimes.observe(4, 0, 0.0)  # the first batch starts the first epoch
    ways, _ = _epochs(regimes, {LoadRegimes.CAPPED: 500.0, 2: 650.0}, 80)
    assert ways[:2] == [LoadRegimes.CAPPED, 2]  # each way once first
    assert regimes.goodput(4, 2) == pytest.approx(650.0, rel=0.02)
    tries = [i for i, w in enumerate(ways) if w == LoadRegimes.CAPPED and i > 0]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps and all(g == 16 for g in gaps[1:]) and gaps[0] == 8  # tried after 4, 8, then 16 epochs (the most)
    assert ways.count(2) / len(ways) > 0.9


def test_a_close_contest_keeps_being_looked_at():
    """Ways within the margin of each other (noise could have picked either): the other way is tried
    every few epochs for good, not ever less often."""
    from specdec.core.goodput import LoadRegimes

    regimes = LoadRegimes(epoch_s=0.5, explore_every=4, max_explore_every=32, margin=0.1)
    regimes.adaptive_sessions = 4
    regimes.observe(4, 0, 0.0)
    ways, _ = _epochs(regimes, {LoadRegimes.CAPPED: 1000.0, 2: 1050.0}, 60)
    tries = [i for i, w in enumerate(ways) if w == LoadRegimes.CAPPED and i > 0]
    assert [b - a for a, b in zip(tries, tries[1:])] == [4] * (len(tries) - 1) and len(tries) > 10


def test_a_fixed_k_that_lost_under_less_load_is_not_tried_early_under_more():
    """Speculation pays less as the batch grows: k = 2, worse than capped at 4 sessions, waits the
    longest interval before its first try at 16; one that won at 4 is tried at 16 at once."""
    from specdec.core.goodput import LoadRegimes

    def at_16_after(rate_4: float) -> list:
        regimes = LoadRegimes(epoch_s=0.5, explore_every=4, max_explore_every=16)
        regimes.adaptive_sessions = 4
        regimes.observe(4, 0, 0.0)
        _, now = _epochs(regimes, {LoadRegimes.CAPPED: 500.0, 2: rate_4}, 6, sessions=4)
        regimes.observe(16, 0, now + 0.01)  # the load grows: a new level
        ways, _ = _epochs(regimes, {LoadRegimes.CAPPED: 1400.0, 2: 1000.0}, 20, sessions=16, start=now + 0.01)
        return ways

    lost = at_16_after(400.0)
    assert lost[:16] == [LoadRegimes.CAPPED] * 16 and lost[16] == 2  # first tried after 16 epochs
    assert at_16_after(480.0)[:16] == [LoadRegimes.CAPPED] * 16  # worse by less than the margin: the same
    won = at_16_after(600.0)
    assert won[:2] == [LoadRegimes.CAPPED, 2]


def test_the_way_that_starts_to_win_takes_over():
    from specdec.core.goodput import LoadRegimes

    regimes = LoadRegimes(epoch_s=0.5, explore_every=2, max_explore_every=4)
    regimes.adaptive_sessions = 1
    regimes.observe(16, 0, 0.0)
    ways, now = _epochs(regimes, {LoadRegimes.CAPPED: 1400.0, 2: 1000.0}, 20, sessions=16)
    assert ways[-8:].count(LoadRegimes.CAPPED) >= 6  # the better way, but for a try of the other now and then
    ways, _ = _epochs(regimes, {LoadRegimes.CAPPED: 1000.0, 2: 1400.0}, 20, sessions=16, start=now)  # the load changed in kind
    assert ways[-8:].count(2) >= 6


def test_epochs_count_per_load_level_and_only_with_adaptive_requests_open():
    from specdec.core.goodput import LoadRegimes

    regimes = LoadRegimes(epoch_s=0.5)
    regimes.observe(4, 0, 0.0)
    _, now = _epochs(regimes, {LoadRegimes.CAPPED: 500.0, 2: 650.0}, 3)
    assert regimes.goodput(4, LoadRegimes.CAPPED) is None  # no adaptive request was open: nothing it steers
    regimes.adaptive_sessions = 2
    _, now = _epochs(regimes, {LoadRegimes.CAPPED: 500.0, 2: 650.0}, 3, start=now)
    assert regimes.goodput(5, 2) == pytest.approx(650.0, rel=0.02)  # 3-5 sessions are one level
    assert regimes.goodput(16, 2) is None and regimes.current == 2
    regimes.observe(16, 100, now + 0.1)  # another level: its own ways, capped first
    assert regimes.current == LoadRegimes.CAPPED
    assert [LoadRegimes.level(n) for n in (4, 15, 16, 22, 64)] == [2, 4, 4, 4, 6]


def test_one_way_alone_is_never_left():
    from specdec.core.goodput import LoadRegimes

    regimes = LoadRegimes(epoch_s=0.5, ways=(LoadRegimes.CAPPED,))
    regimes.adaptive_sessions = 1
    regimes.observe(8, 0, 0.0)
    ways, _ = _epochs(regimes, {LoadRegimes.CAPPED: 900.0}, 12, sessions=8)
    assert set(ways) == {LoadRegimes.CAPPED}


def test_in_company_an_adaptive_request_takes_the_way_measured_best():
    from specdec.core.goodput import LoadRegimes
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy
    from specdec.target.scheduler import VerifierScheduler, _BatchPrice

    # Costs that cap any draft to 0 (price 2 tokens).
    price = _BatchPrice(per_row_s=0.001, draft_per_token_s=0.001, fitted_draft_token_s=0.01, goodput_tokens_per_s=200.0)

    def k(max_k: int, regime) -> int:
        return VerifierScheduler._next_k(_plan(SpeculationPolicy(SpeculationMode.ADAPTIVE, 1, max_k)), 4, regime, price)

    assert k(8, LoadRegimes.CAPPED) == 0
    assert k(8, 2) == 2 and k(1, 2) == 1  # never past the request's own maximum
