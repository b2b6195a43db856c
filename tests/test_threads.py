"""Torch thread counts chosen by measurement (core/threads.py), and one model thread for both
engines in one process (DraftEngine.submit, roles.embedded)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from specdec.core.sampling import SamplingParams
from specdec.core.threads import ThreadChooser
from specdec.draft.drafters import DraftConfig
from specdec.draft.engine import DraftEngine
from specdec.draft.ngram import NgramDrafter


def drive(chooser: ThreadChooser, rows: int, seconds_at, calls: int) -> list[int]:
    """``calls`` calls of ``rows`` rows whose time is ``seconds_at(count)``; the counts used."""
    used = []
    for _ in range(calls):
        count = chooser.choose(rows)
        chooser.observe(rows, count, seconds_at(count))
        used.append(count)
    return used


def test_the_faster_count_is_used_and_the_slower_one_tried_now_and_then():
    chooser = ThreadChooser((1, 2), explore_every=32)
    used = drive(chooser, 1, {1: 0.008, 2: 0.0055}.get, 320)
    settled = used[6:]  # after three calls of each
    assert settled.count(2) / len(settled) > 0.95
    assert 1 in settled  # still measured, so a change would be seen
    assert chooser.best(1) == 2


def test_a_busy_neighbour_turns_two_threads_off_and_a_quiet_one_back_on():
    chooser = ThreadChooser((1, 2), explore_every=16, max_interval=128)
    drive(chooser, 1, {1: 0.008, 2: 0.0055}.get, 100)
    assert chooser.best(1) == 2
    busy = drive(chooser, 1, {1: 0.008, 2: 0.036}.get, 64)  # another process took the second core
    assert busy[1:].count(2) <= 4  # seen on the next call, because the count in use is always measured
    assert chooser.best(1) == 1
    quiet = drive(chooser, 1, {1: 0.008, 2: 0.0055}.get, 600)  # it went away
    assert chooser.best(1) == 2
    assert quiet.index(2) <= 128  # found again within one longest interval
    assert quiet[-200:].count(2) > 190


def test_tries_of_a_count_that_stays_slower_become_rare():
    chooser = ThreadChooser((1, 2), explore_every=32, max_interval=256)
    used = drive(chooser, 1, {1: 0.008, 2: 0.036}.get, 3000)
    assert chooser.best(1) == 1
    assert used[-2000:].count(2) <= 2000 // 256 + 1  # one try per longest interval
    assert 2 in used[-2000:]  # but never none


def test_calls_of_different_sizes_are_compared_only_with_their_own_size():
    chooser = ThreadChooser((1, 2))
    drive(chooser, 1, {1: 0.005, 2: 0.007}.get, 50)  # small calls: one thread wins
    drive(chooser, 64, {1: 0.060, 2: 0.040}.get, 50)  # large ones: two
    assert chooser.best(1) == 1 and chooser.best(2) == 1  # rows 1 and 2-3 are different sizes; 2 untried -> fewest
    assert chooser.best(64) == 2 and chooser.best(100) == 2  # 64..127 share a size


def test_a_size_first_seen_starts_from_the_largest_smaller_size_and_still_measures_the_rest():
    chooser = ThreadChooser((1, 2), explore_every=8)
    drive(chooser, 1, {1: 0.008, 2: 0.0055}.get, 20)
    drive(chooser, 64, {1: 0.060, 2: 0.035}.get, 20)
    # A prefill of many prompts: rare, so its own first calls at one thread would be whole slow forwards.
    prefill = drive(chooser, 2500, {1: 0.9, 2: 0.5}.get, 4)
    assert prefill == [2, 2, 2, 2]
    # Where one thread is the faster at that size, its own times take over once one thread is tried.
    chooser = ThreadChooser((1, 2), explore_every=8)
    drive(chooser, 64, {1: 0.060, 2: 0.035}.get, 20)
    used = drive(chooser, 2500, {1: 0.5, 2: 0.9}.get, 20)
    assert used[:7] == [2] * 7 and used[7] == 1  # tried on the explore_every-th call
    assert used[8:16] == [1] * 8 and used[8:].count(1) >= 11 and chooser.best(2500) == 1


def test_one_noisy_first_call_does_not_decide():
    chooser = ThreadChooser((1, 2), first_samples=3)
    times = iter([0.020, 0.008, 0.008] + [0.0055] * 3 + [0.0055] * 20)  # two threads' first call was cold

    def at(count):
        return next(times) if count in (1, 2) else None

    used = drive(chooser, 1, at, 20)
    assert used[:6] == [1, 1, 1, 2, 2, 2]
    assert chooser.best(1) == 2


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        ThreadChooser(())
    with pytest.raises(ValueError):
        ThreadChooser((0, 1))


@pytest.fixture
def engine():
    engine = DraftEngine({"ngram": NgramDrafter(3, 1)}, DraftConfig())
    yield engine
    engine.shutdown()


def test_submitted_calls_run_on_the_draft_thread_and_return_or_raise(engine):
    assert engine.submit(lambda a, b: (threading.current_thread().name, a + b), 2, 3).result(30) == ("draft", 5)

    def fails():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        engine.submit(fails).result(30)
    assert engine.submit(lambda: "still serving").result(30) == "still serving"  # one failure stops nothing


def test_queued_session_opens_go_ahead_of_submitted_calls(engine):
    """A session starts only when both workers have prefilled it: a drafter's open must not wait
    behind the verifier's stream of batches (in one process they share this thread)."""
    from specdec.core.steps import SessionSpec

    order = []
    gate = threading.Event()
    engine.submit(gate.wait, 30)  # hold the thread so the next two queue up
    opened = engine.open(SessionSpec("a" * 32, (1, 2, 3), SamplingParams(), "ngram"), lambda block: None)
    opened.add_done_callback(lambda _: order.append("open"))
    call = engine.submit(lambda: order.append("call"))
    gate.set()
    call.result(30)
    opened.result(30)
    assert order == ["open", "call"]


def test_after_shutdown_submit_refuses(engine):
    engine.shutdown()
    with pytest.raises(RuntimeError):
        engine.submit(lambda: None)


def test_one_process_runs_the_verifiers_model_work_on_the_draft_thread(tiny_pair):
    from specdec import roles
    from specdec.orchestrator.loop import collect
    from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
    from specdec.target.engine import TargetConfig

    target, draft = tiny_pair
    orch = roles.embedded(TargetConfig(target), DraftConfig(draft, target), OrchestratorConfig())
    engine = orch.verifier.scheduler
    names = []
    verify_batch = engine.engine.verify_batch

    def spy(steps):
        names.append(threading.current_thread().name)
        return verify_batch(steps)

    engine.engine.verify_batch = spy
    asyncio.run(collect(orch.generate(GenerationRequest(prompt_text="def f(x):", max_new_tokens=8))))
    assert names and set(names) == {"draft"}
    assert engine.threads is not None
    assert any(engine.threads.seconds(rows, 1) is not None for rows in (1, 2, 4, 8, 16, 32))  # counts are measured
    fixed = roles.embedded(TargetConfig(target, threads=1), DraftConfig(draft, target, threads=1), OrchestratorConfig())
    assert fixed.verifier.scheduler.threads is None  # a fixed count is left as it is


def test_on_a_shared_model_thread_an_adaptive_request_does_not_draft_ahead():
    """Nothing can draft while the shared thread runs a forward: an adaptive request there runs
    sequential steps only; a fixed policy keeps the overlap it asked for, and so does any request
    whose verifier has a model thread of its own."""
    from concurrent.futures import ThreadPoolExecutor

    from specdec.core.speculation import SpeculationMode, SpeculationPolicy
    from specdec.target.scheduler import VerifierScheduler
    from fake_engine import FakeEngine

    def overlap(shared: bool, policy: SpeculationPolicy) -> bool:
        scheduler = VerifierScheduler(FakeEngine(), executor=ThreadPoolExecutor(1) if shared else None, threaded=False)
        return scheduler.admit(_run(policy)).controller.next_overlap()

    adaptive = SpeculationPolicy(SpeculationMode.ADAPTIVE, 4, 8)
    assert overlap(True, adaptive) is False
    assert overlap(False, adaptive) is True
    assert overlap(True, SpeculationPolicy(SpeculationMode.FIXED, 3)) is True


def _run(policy, session_id: str = "0" * 32):
    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import SessionRun, SessionSpec

    return SessionRun(SessionSpec(session_id, (1, 2, 3), SamplingParams()), "", 64, policy)


def test_on_a_shared_model_thread_in_company_a_fixed_request_does_not_draft_ahead():
    """What the scheduler tells the drafter: a fixed-k request drafts ahead on a model thread it
    shares with the verifier only while its session is the only one open (in company that thread is
    never idle, and drafts ahead delay the others' forwards); with a drafter of its own it always may."""
    from concurrent.futures import ThreadPoolExecutor

    from specdec.core.sampling import SamplingParams
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy
    from specdec.core.steps import SessionSpec
    from specdec.target.scheduler import VerifierScheduler
    from fake_engine import FakeEngine

    def told(shared: bool, sessions: int) -> bool:
        engine = FakeEngine()
        engine.open_batch([(SessionSpec(f"{i:032x}", (1, 2, 3), SamplingParams()), 8, ()) for i in range(sessions)])
        scheduler = VerifierScheduler(engine, executor=ThreadPoolExecutor(1) if shared else None, threaded=False)
        plan = scheduler.admit(_run(SpeculationPolicy(SpeculationMode.FIXED, 3)))
        plan.state = engine.sessions.peek("0" * 32)
        scheduler._decide([plan])
        assert plan.k == 3
        return plan.overlap

    assert told(shared=True, sessions=1) is True
    assert told(shared=True, sessions=2) is False
    assert told(shared=False, sessions=64) is True
