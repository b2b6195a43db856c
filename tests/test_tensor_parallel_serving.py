"""A tensor-parallel verifier as a user runs it: real processes, two gloo ranks on the demo pair.

`specdec generate --tensor-parallel 2` gives one rank's greedy token ids, and so does `specdec up
--tensor-parallel 2` over gRPC while speculating; a served two-rank verifier
in a pool of two, whose follower rank is killed mid-stream, loses no session and changes no token
(rank 0 exits, the orchestrator resumes the session on the other verifier).
(The engine-level checks: tests/test_tensor_parallel.py.)"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.autoscale.observe import MetricsTargets, Observer
from specdec.ports import free_ports
from specdec.v1 import common_pb2, generation_pb2_grpc, verifier_pb2_grpc
from specdec.v1 import generation_pb2 as pb

TARGET, DRAFT = "models/demo/target", "models/demo/draft"
PROMPT = "def fib(n):"
LONG = 300  # tokens of the stream a rank dies in (the demo target's context is 512)
ENV = {**os.environ, "SPECDEC_TARGET_MODEL": "", "SPECDEC_DRAFT_MODEL": "", "SPECDEC_API_KEYS_FILE": "",
       "OMP_NUM_THREADS": "1"}


def generate_json(*args: str) -> dict:
    """``specdec generate ARGS --json`` in this process (the reference: no interpreter to start)."""
    from specdec import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["generate", *args, "--json"])
    assert code == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def one_rank_greedy() -> list[int]:
    """Target-only greedy decoding of PROMPT by one process, ``--tensor-parallel 1``: LONG token ids."""
    ids = generate_json(PROMPT, "--target", TARGET, "--draft", DRAFT, "--max-new-tokens", str(LONG), "-k", "0",
                        "--threads", "1", "--tensor-parallel", "1")["token_ids"]
    assert len(ids) == LONG
    return [int(t) for t in ids]


def test_generate_at_two_ranks_gives_one_ranks_greedy_token_ids(one_rank_greedy):
    out = subprocess.run([sys.executable, "-m", "specdec", "generate", PROMPT, "--target", TARGET, "--draft", DRAFT,
                          "--max-new-tokens", "24", "-k", "0", "--threads", "1", "--tensor-parallel", "2", "--json"],
                         capture_output=True, text=True, timeout=300, env=ENV, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["stats"]["draft_tokens"] == 0 and result["finish_reason"] == "length"
    # (k = 0 decodes one token a step from the committed prefix: its first 24 tokens are a 24-token run's)
    assert [int(t) for t in result["token_ids"]] == one_rank_greedy[:24]
    # a second rank did run it (its own log line), and stopped when told to
    assert "tensor-parallel rank 1 of 2 stopped by rank 0" in out.stderr, out.stderr


def wait_healthy(address: str, proc: subprocess.Popen, log_path, timeout_s: float = 300) -> None:
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.time() + timeout_s
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert proc.poll() is None, f"{address} exited with {proc.returncode}: {log_path.read_text()}"
            assert time.time() < deadline, f"{address} did not become healthy: {log_path.read_text()}"
            time.sleep(0.3)


def active_sessions(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetWorkerStatus(common_pb2.WorkerStatusRequest(), timeout=30).active_sessions


def stream(stub, on_first_tokens=None) -> tuple[list[int], str, int]:
    """A greedy GenerateStream of PROMPT, LONG tokens (model drafter, k = 3); ``on_first_tokens()`` runs
    once, as soon as the first tokens arrive. (token ids, session id, finish reason)."""
    ids: list[int] = []
    session_id, finish = "", 0
    request = pb.GenerateRequest(text=PROMPT, max_new_tokens=LONG, sampling=common_pb2.SamplingParams(temperature=0),
                                 speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED,
                                                                           num_speculative_tokens=3))
    for chunk in stub.GenerateStream(request, timeout=300):
        session_id = chunk.session_id
        ids.extend(chunk.token_ids)
        finish = chunk.finish_reason or finish
        if on_first_tokens is not None and ids:
            on_first_tokens()
            on_first_tokens = None
    return ids, session_id, finish


@pytest.mark.timeout(600)
def test_a_follower_rank_killed_mid_stream_loses_no_session_and_changes_no_token(one_rank_greedy, redis_url, tmp_path):
    """Two verifiers, each drafting its own sessions (no draft worker): one of two ranks, one plain;
    an orchestrator over both, sessions in Redis. A greedy stream (k = 3) whose session is on the
    two-rank verifier when its follower rank is SIGKILLed, just after the first tokens, gives exactly
    the uninterrupted target-only greedy tokens of one process: rank 0 exits (status 3), the
    orchestrator resumes the session on the plain verifier (one failover), and the stored session
    holds the whole completion. Before the kill the autoscaler's observer, reading the two verifiers'
    /metrics, counts two verifier pods (three processes) with verify rounds going on."""
    base = free_ports(5)  # orchestrator, the two verifiers, their two metrics ports
    orch_address = f"127.0.0.1:{base}"
    # Equal loads go to the address that sorts first: the two-rank verifier's (placement is asserted below anyway).
    tp_address, plain_address = sorted(f"127.0.0.1:{p}" for p in (base + 1, base + 2))
    serve = [sys.executable, "-m", "specdec", "serve"]
    models = ["--target", TARGET, "--draft", DRAFT, "--threads", "1"]
    commands = {
        "tp": [*serve, "target", "--port", tp_address.rsplit(":", 1)[1], *models, "--in-verifier-drafters", "all",
               "--tensor-parallel", "2", "--metrics-port", str(base + 3)],
        "plain": [*serve, "target", "--port", plain_address.rsplit(":", 1)[1], *models, "--in-verifier-drafters", "all",
                  "--metrics-port", str(base + 4)],
        "orchestrator": [*serve, "orchestrator", "--port", str(base), "--target", TARGET, "--verifier-address",
                         f"{tp_address},{plain_address}", "--drafter-address", "", "--redis-url", redis_url],
    }
    logs = {name: tmp_path / f"{name}.log" for name in commands}
    procs: dict[str, subprocess.Popen] = {}
    try:
        def start(name: str) -> None:
            with open(logs[name], "w") as log:
                procs[name] = subprocess.Popen(commands[name], env=ENV, stdout=log, stderr=subprocess.STDOUT)

        start("tp")
        start("plain")
        wait_healthy(tp_address, procs["tp"], logs["tp"])
        wait_healthy(plain_address, procs["plain"], logs["plain"])
        start("orchestrator")  # after the verifiers: its first loads see both (an unreachable one gets no session)
        wait_healthy(orch_address, procs["orchestrator"], logs["orchestrator"])
        rank0 = procs["tp"]
        followers = subprocess.run(["pgrep", "-P", str(rank0.pid)], capture_output=True, text=True, check=False).stdout.split()
        assert len(followers) == 1, followers  # rank 1, rank 0's only child
        follower = int(followers[0])
        with open(f"/proc/{follower}/cmdline") as cmdline:
            assert "specdec.target.tp_ranks" in cmdline.read().split("\0")

        with grpc.insecure_channel(orch_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            # Placement goes by the loads the orchestrator last polled (a poll can race a session's
            # open), so a stream may land on the plain verifier: each one is an uninterrupted run
            # (compared too), and the next is tried until one holds the two-rank verifier.
            held: list[int] = []
            # The autoscaler's view of the target pool (each metrics address one pod): the group is one verifier.
            observer = Observer(MetricsTargets(target=tuple(("127.0.0.1", base + i) for i in (3, 4))))
            observer.observe()
            seen_by_autoscaler = []

            def kill_the_follower_if_its_session_is_here() -> None:
                held.append(active_sessions(tp_address))
                if held[-1]:
                    seen_by_autoscaler.append(observer.observe().target)
                    os.kill(follower, signal.SIGKILL)

            for _ in range(6):
                ids, session_id, finish = stream(stub, kill_the_follower_if_its_session_is_here)
                assert ids == one_rank_greedy and finish == pb.FINISH_REASON_LENGTH
                if held[-1]:
                    break
                time.sleep(1.5)  # past the pool's status TTL: the next placement sees fresh loads
            assert held[-1] == 1, f"no stream of {len(held)} was placed on the two-rank verifier"
            (load,) = seen_by_autoscaler  # three processes, two verifiers; rank 0's page counts its group's rounds
            assert load.pods == 2 and load.verify_rounds_per_s > 0
            observer.close()
            stored = stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=30)
            assert list(stored.output_token_ids) == one_rank_greedy  # the session is whole in the store
        assert rank0.wait(60) == 3  # the group broke: rank 0 exited, as a served verifier does on a lost rank
        assert active_sessions(plain_address) == 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    tp_log, orch_log = logs["tp"].read_text(), logs["orchestrator"].read_text()
    assert "exiting so that this verifier's sessions resume on another" in tp_log, tp_log
    resumed = [line for line in orch_log.splitlines() if "resuming on another replica" in line]
    assert len(resumed) == 1 and tp_address in resumed[0], orch_log  # one failover, away from the two-rank verifier


def test_up_at_two_ranks_serves_one_ranks_greedy_text(one_rank_greedy, redis_url, tmp_path):
    """`specdec up --tensor-parallel 2` (colocated: an orchestrator, and a verifier of two ranks that
    drafts its own sessions): a greedy request over gRPC, speculating, gives one process's target-only
    tokens; the verifier's follower rank runs beside it; `up` stops them all on SIGTERM."""
    base = free_ports(6)
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specdec", "up", "--target", TARGET, "--draft", DRAFT,
                                 "--tensor-parallel", "2", "--threads", "1", "--base-port", str(base),
                                 "--redis-url", redis_url, "--http-port", "-1"],
                                stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_healthy(f"127.0.0.1:{base}", proc, log_path)
        with grpc.insecure_channel(f"127.0.0.1:{base}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            fixed = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=3)
            reply = stub.Generate(pb.GenerateRequest(text=PROMPT, max_new_tokens=48, speculation=fixed,
                                                     sampling=common_pb2.SamplingParams(temperature=0)), timeout=300)
        assert list(reply.token_ids) == one_rank_greedy[:48]
        assert reply.stats.draft_tokens > 0  # it speculated, through the two ranks
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        verifier = [p for p in children if "target" in open(f"/proc/{p}/cmdline").read().split("\0")]
        assert len(children) == 2 and len(verifier) == 1  # colocated: an orchestrator and a verifier
        ranks = subprocess.run(["pgrep", "-P", verifier[0]], capture_output=True, text=True).stdout.split()
        assert any("specdec.target.tp_ranks" in open(f"/proc/{r}/cmdline").read() for r in ranks), "no follower rank"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log_path.read_text()


def test_exact_bfloat16_at_two_ranks_speculates_to_its_own_k0_tokens():
    """Exact numerics at N = 2 with bfloat16 weights: speculative greedy decoding (k = 3) gives the
    very tokens of the same two ranks' k = 0 (a row's bits do not depend on what shares its forward)."""
    def ids(k: int) -> tuple[list[int], int]:
        out = subprocess.run([sys.executable, "-m", "specdec", "generate", PROMPT, "--target", TARGET, "--draft", DRAFT,
                              "--max-new-tokens", "40", "-k", str(k), "--threads", "1", "--tensor-parallel", "2",
                              "--dtype", "bfloat16", "--numerics", "exact", "--json"],
                             capture_output=True, text=True, timeout=300, env=ENV, check=False)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        return [int(t) for t in result["token_ids"]], result["stats"]["draft_tokens"]

    plain, none = ids(0)
    speculated, drafted = ids(3)
    assert none == 0 and drafted > 0 and len(plain) == 40
    assert speculated == plain
