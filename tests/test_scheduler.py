"""The verifier's scheduler owns its batch: one forward and one call of the rules per batch, every
k of a batch decided in one place, the sessions' loops doing only their streams' I/O."""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence

from fake_engine import VOCAB, FakeEngine

from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.core.steps import DraftBlock, DraftProposal, SessionRun, SessionSpec, StepOutcome
from specdec.target.engine import TargetConfig, VerifierEngine
from specdec.target.loop import LoopConfig
from specdec.target.scheduler import VerifierScheduler
from specdec.target.worker import LocalVerifier


def test_the_rules_run_once_per_batch_over_every_session_in_it(tiny_pair, monkeypatch):
    import specdec.target.engine as engine_module

    calls: list[int] = []
    decide = engine_module.decide_batch
    monkeypatch.setattr(engine_module, "decide_batch", lambda logits, steps: calls.append(len(steps)) or decide(logits, steps))
    engine = VerifierEngine.from_config(TargetConfig(tiny_pair[0]))
    forwards: list[int] = []
    forward = engine.runner.forward
    engine.runner.forward = lambda feeds: forwards.append(len(feeds)) or forward(feeds)
    scheduler = VerifierScheduler(engine, threaded=False)
    samplings = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, seed=4, rule=VerificationRule.COUPLED),
                 SamplingParams(temperature=0.7, top_k=5, seed=5)]

    async def go():
        sids = [secrets.token_hex(16) for _ in samplings]
        for i, (sid, sampling) in enumerate(zip(sids, samplings)):
            await scheduler.open(SessionSpec(sid, tuple(range(3, 9 + i)), sampling), 16)
        forwards.clear()
        return await asyncio.gather(*(scheduler.verify(sid, DraftProposal(tuple(range(5, 5 + k))))
                                      for sid, k in zip(sids, (0, 1, 3, 5))))

    outcomes = asyncio.run(go())
    assert calls == [4] and forwards == [4]  # one forward and one call of the rules for the four sessions
    assert dict(scheduler.batch_sizes) == {4: 1}
    assert all(1 <= len(o.token_ids) == o.num_accepted + 1 for o in outcomes)


class CountingDrafter:
    """A drafter link that drafts exactly what the fake target will say (counting up), k at a time."""

    def __init__(self, told: list[tuple[str, StepOutcome]], session_id: str) -> None:
        self.told, self.session_id = told, session_id
        self.k = 0
        self.up = True

    async def open(self, spec: SessionSpec) -> None:
        pass

    def send(self, outcome: StepOutcome) -> None:
        self.told.append((self.session_id, outcome))
        self.k = outcome.num_speculative_tokens

    async def next_block(self, committed: Sequence[int], timeout_s: float) -> DraftBlock | None:
        await asyncio.sleep(0)  # a block comes back through the event loop, as from a real drafter
        last = committed[-1]
        return DraftBlock(len(committed), (), DraftProposal(tuple((last + 1 + i) % VOCAB for i in range(self.k))))

    async def close(self) -> None:
        self.up = False


def test_every_k_of_a_batch_is_decided_in_one_place_and_told_to_the_drafters():
    engine = FakeEngine()
    scheduler = VerifierScheduler(engine, threaded=False)
    decisions: list[list[str]] = []
    decide = scheduler._decide
    scheduler._decide = lambda plans: decisions.append([p.run.spec.session_id for p in plans]) or decide(plans)
    told: list[tuple[str, StepOutcome]] = []
    verifier = LocalVerifier(scheduler, lambda run: CountingDrafter(told, run.spec.session_id), LoopConfig(draft_wait_s=5.0))
    ks = {"a" * 32: 1, "b" * 32: 2, "c" * 32: 3}

    async def one(sid: str):
        run = SessionRun(SessionSpec(sid, (7,), SamplingParams()), "in-process", 12, SpeculationPolicy(SpeculationMode.FIXED, ks[sid]))
        return [commit async for commit in verifier.run(run)]

    async def go():
        return await asyncio.gather(*(one(sid) for sid in ks))

    streams = dict(zip(ks, asyncio.run(go())))
    for sid, commits in streams.items():
        tokens = [t for c in commits for t in c.token_ids]
        assert tokens == [(8 + i) % VOCAB for i in range(12)]  # the fake target's own continuation
        assert all(c.num_accepted == c.num_draft_tokens for c in commits)  # every draft of the counting drafter holds
        assert max(c.num_draft_tokens for c in commits) == ks[sid]
    # Each batch of planned steps got exactly one decision over the sessions that go on: the three
    # opens' first ks, then one call per batch.
    batch_decisions = decisions[3:]
    assert len(batch_decisions) == len(engine.batches)
    for batch, decided in zip(engine.batches, batch_decisions):
        assert set(decided) <= {sid for sid, _ in batch}
    # What the drafters were told is what was decided: each request's own k, never past its remaining tokens.
    for sid, outcome in told:
        assert outcome.num_speculative_tokens <= ks[sid]
    assert not scheduler.plans and len(engine.sessions) == 0  # every session retired and closed


def test_a_batch_takes_every_session_that_is_in():
    """Sessions whose steps came back together step together again: with three sessions and
    drafters that answer through the event loop, no batch is split. (A long hold, so that how busy
    the machine is cannot end it early: it ends when every session is in.)"""
    engine = FakeEngine(TargetConfig("fake", batch_wait_s=60.0))
    scheduler = VerifierScheduler(engine, threaded=False)
    told: list[tuple[str, StepOutcome]] = []
    verifier = LocalVerifier(scheduler, lambda run: CountingDrafter(told, run.spec.session_id), LoopConfig(draft_wait_s=5.0))

    async def one(sid: str):
        run = SessionRun(SessionSpec(sid, (7,), SamplingParams()), "in-process", 9, SpeculationPolicy(SpeculationMode.FIXED, 2))
        return [commit async for commit in verifier.run(run)]

    async def go():
        await asyncio.gather(*(one(c * 32) for c in "def"))

    asyncio.run(go())
    assert [len(batch) for batch in engine.batches] == [3, 3, 3]  # 9 tokens each, 3 a step


def test_a_fault_in_the_planning_costs_no_session_its_tokens(monkeypatch, caplog):
    """What a step streams is made before the bookkeeping that steers speed; if that raises, every
    session still gets its tokens and goes on (as plain decoding)."""
    from specdec.core.speculation import SpeculationController

    def broken(self, *args, **kwargs):
        raise ZeroDivisionError("a bug in a controller")

    monkeypatch.setattr(SpeculationController, "observe", broken)
    engine = FakeEngine()
    scheduler = VerifierScheduler(engine, threaded=False)
    told: list[tuple[str, StepOutcome]] = []
    verifier = LocalVerifier(scheduler, lambda run: CountingDrafter(told, run.spec.session_id), LoopConfig(draft_wait_s=5.0))

    async def one(sid: str):
        run = SessionRun(SessionSpec(sid, (7,), SamplingParams()), "in-process", 10, SpeculationPolicy(SpeculationMode.FIXED, 3))
        return [t for commit in [c async for c in verifier.run(run)] for t in commit.token_ids]

    async def go():
        return await asyncio.gather(*(one(c * 32) for c in "abc"))

    for tokens in asyncio.run(go()):
        assert tokens == [(8 + i) % VOCAB for i in range(10)]
    assert "verify batch planning failed" in caplog.text
