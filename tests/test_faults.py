"""Faults with real processes (benchmarks/fault_inject.py, a smaller campaign): separate `specdec
serve` processes, 2 of each role, mutual TLS, a private redis-server with an fsynced append-only
file. A verifier and an orchestrator killed with SIGKILL, an orchestrator frozen with SIGSTOP and
Redis killed, each mid-generation: every session completes with exactly the tokens of a run
without faults (greedy and coupled-seeded), and the client saw at most a pause."""
from __future__ import annotations

import asyncio
import importlib.util
import random
import shutil
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_inject.py"
_spec = importlib.util.spec_from_file_location("fault_inject", _PATH)
faults = importlib.util.module_from_spec(_spec)
sys.modules["fault_inject"] = faults  # dataclasses look their module up by name
_spec.loader.exec_module(faults)

TOKENS = 96
FAULTS = [("target", "kill"), ("orchestrator", "kill"), ("orchestrator", "stop"), ("redis", "kill")]

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server to run a private Redis")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    demo = faults.DEMO
    d = faults.Deployment(tmp_path_factory.mktemp("faults"), str(demo / "target"), str(demo / "draft"), step_timeout_s=3.0)
    try:
        d.start()
        yield d
    finally:
        d.stop()


def test_every_session_survives_real_process_faults_unchanged(deployment):
    async def campaign():
        specs = faults.specs_for(4)
        expected, baseline = await faults.reference(deployment, specs, TOKENS, 2)
        rounds = []
        for i, (role, how) in enumerate(FAULTS):
            await asyncio.to_thread(deployment.wait_ready)
            batch = [specs[(2 * i) % 4], specs[(2 * i + 1) % 4]]  # one greedy, one seeded at T = 0.8
            results, info = await faults.run_round(deployment, batch, TOKENS,
                                                   faults.make_fault(deployment, role, how, 6.0, random.Random(i)))
            rounds.append((role, how, info, results))
        return expected, rounds

    expected, rounds = asyncio.run(campaign())
    for role, how, info, results in rounds:
        for r in results:
            assert not r.error and r.finished, f"{role}/{how}: a session was lost ({r.error})"
            assert r.tokens == expected[r.spec], f"{role}/{how}: a session's output changed"
            assert r.max_gap < 20, f"{role}/{how}: a {r.max_gap:.1f}s pause"
        assert info["sessions_on_victim"] >= 1, f"{role}/{how}: the fault hit no session"
    frozen = [r for role, how, _, results in rounds if how == "stop" for r in results if r.report.failovers]
    assert frozen and all(f.pause_s < 5.5 for r in frozen for f in r.report.failovers)  # noticed before SIGCONT
