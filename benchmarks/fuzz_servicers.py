"""Fuzz every RPC of the three services over real gRPC (TLS on every hop) with hypothesis.

Random protobuf messages of every request type (field values drawn across their whole wire range:
NaN and infinite floats, negative and huge ids, long and odd strings, unknown enum values), random
Speculate streams, and random bytes that may not parse at all. The property: no reply is UNKNOWN
or INTERNAL (an INTERNAL is a bug the last-resort interceptor caught), every reply comes within a
bound, and no worker session is left open when the calls are over.

    python benchmarks/fuzz_servicers.py --minutes 3          # the demo pair
    python benchmarks/fuzz_servicers.py --minutes 3 --json benchmarks/results/fuzz/fuzz_results.json   # docs/performance.md, 6
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import secrets
import tempfile
import threading
import time

import grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from common import DEMO
from specdec import roles
from specdec.core.sessions import InMemorySessionStore
from specdec.draft.drafters import DraftConfig
from specdec.orchestrator.request import OrchestratorConfig
from specdec.rpc.certs import make_dev_certs
from specdec.rpc.server import ServerConfig
from specdec.rpc.tls import TlsFiles
from specdec.target.engine import TargetConfig
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, generation_pb2 as pb, generation_pb2_grpc
from specdec.v1 import verifier_pb2, verifier_pb2_grpc

REPLY_BOUND_S = 30.0  # generous: valid requests run real (short) generations
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
small_uint = st.one_of(st.integers(0, 12), uint32)  # mostly valid, sometimes anything
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
token_ids = st.lists(st.one_of(st.integers(0, 400), int32), max_size=80)
names = st.one_of(st.sampled_from(["", "model", "ngram"]), st.text(max_size=80))
session_ids = st.one_of(st.just(None), st.text(max_size=40), st.just("Z" * 32))  # None: a fresh valid id


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=draw(st.one_of(st.just(0.0), floats)), top_k=draw(small_uint),
                                    top_p=draw(st.one_of(st.just(1.0), floats)), rule=draw(st.integers(0, 5)))
    if draw(st.booleans()):
        msg.seed = draw(st.integers(0, 2**64 - 1))
    return msg


@st.composite
def policy(draw) -> common_pb2.SpeculationPolicy:
    msg = common_pb2.SpeculationPolicy(mode=draw(st.integers(0, 4)), max_speculative_tokens=draw(small_uint))
    if draw(st.booleans()):
        msg.num_speculative_tokens = draw(small_uint)
    if draw(st.booleans()):
        msg.overlap = draw(st.booleans())
    return msg


@st.composite
def generate_request(draw) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(max_new_tokens=draw(st.one_of(st.integers(0, 12), uint32)), sampling=draw(sampling()),
                             stop=draw(st.lists(st.text(max_size=70), max_size=10)), drafter=draw(names),
                             speculation=draw(policy()))
    prompt = draw(st.sampled_from(["text", "ids", "none"]))
    if prompt == "text":
        msg.text = draw(st.text(max_size=400))
    elif prompt == "ids":
        msg.token_ids.SetInParent()
        msg.token_ids.ids.extend(draw(token_ids))
    return msg


@st.composite
def open_session(draw) -> common_pb2.OpenSessionRequest:
    sid = draw(session_ids)
    return common_pb2.OpenSessionRequest(session_id=secrets.token_hex(16) if sid is None else sid,
                                         prompt_token_ids=draw(token_ids), sampling=draw(sampling()), drafter=draw(names))


@st.composite
def session_request(draw, drafter_address: str) -> verifier_pb2.SessionRequest:
    return verifier_pb2.SessionRequest(session=draw(open_session()), max_new_tokens=draw(st.one_of(st.integers(0, 12), uint32)),
                                       drafter_address=draw(st.one_of(st.just(drafter_address), st.just(""),
                                                                      st.just("127.0.0.1:1"), st.text(max_size=30))),
                                       speculation=draw(policy()), stop_token_ids=draw(token_ids))


@st.composite
def speculate_stream(draw) -> list[drafter_pb2.SpeculateRequest]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()) or not out:
            out.append(drafter_pb2.SpeculateRequest(open=draw(open_session())))
        else:
            out.append(drafter_pb2.SpeculateRequest(outcome=drafter_pb2.StepOutcome(
                committed_len=draw(small_uint), token_ids=draw(token_ids), num_speculative_tokens=draw(small_uint),
                overlap=draw(st.booleans()))))
    return out


class Servers:
    """The three roles in a background event loop, TLS on every hop, as `specdec serve` runs them."""

    def __init__(self, target: str, draft: str, tls: TlsFiles) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tls = tls
        worker = ServerConfig(tls=tls, require_client_cert=True)
        self.draft_server, self.draft = self._run(roles.start_draft(DraftConfig(draft, target, threads=1), worker))
        self.target_server, self.target = self._run(roles.start_target(TargetConfig(target, threads=1), worker))
        upstreams = roles.Upstreams(self.draft_server.address, self.target_server.address, target, tls=tls)
        self.orch_server, self.orch = self._run(roles.start_orchestrator(
            OrchestratorConfig(max_new_tokens_limit=64), upstreams, InMemorySessionStore(), ServerConfig(tls=tls)))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def sessions(self) -> tuple[int, int]:
        return self.draft.status().active_sessions, self._run(self.target.status()).active_sessions

    def stop(self) -> None:
        for s in (self.orch_server, self.target_server, self.draft_server):
            self._run(s.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="specdec-fuzz-")
    paths = make_dev_certs(tmp.name)
    tls = TlsFiles(str(paths["tls.crt"]), str(paths["tls.key"]), str(paths["ca.crt"]))
    servers = Servers(args.target, args.draft, tls)
    mutual = tls.channel_credentials()
    client = grpc.secure_channel(servers.orch_server.address, grpc.ssl_channel_credentials(paths["ca.crt"].read_bytes()))
    to_target = grpc.secure_channel(servers.target_server.address, mutual)
    to_draft = grpc.secure_channel(servers.draft_server.address, mutual)
    generation, verifier, drafter = (generation_pb2_grpc.GenerationStub(client), verifier_pb2_grpc.VerifierStub(to_target),
                                     drafter_pb2_grpc.DrafterStub(to_draft))
    raw_methods = [(client, "/specdec.v1.Generation/Generate", False), (client, "/specdec.v1.Generation/GenerateStream", True),
                   (client, "/specdec.v1.Generation/GetSession", False), (to_target, "/specdec.v1.Verifier/Generate", True),
                   (to_target, "/specdec.v1.Verifier/GetWorkerStatus", False),
                   (to_draft, "/specdec.v1.Drafter/GetWorkerStatus", False)]

    codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    slowest = [0.0]

    def record(kind: str, fn) -> None:
        started = time.monotonic()
        try:
            fn()
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
            if code in BAD:
                failures.append(f"{kind}: {code.name}: {err.details()}")
        took = time.monotonic() - started
        slowest[0] = max(slowest[0], took)
        if took > REPLY_BOUND_S:
            failures.append(f"{kind}: reply took {took:.1f}s")
        codes[kind][code.name] += 1

    def drain(call) -> None:
        for _ in call:
            pass

    def streamed(messages):
        yield from messages

    fuzz_settings = settings(max_examples=50, deadline=None, database=None,
                             suppress_health_check=list(HealthCheck), derandomize=False)

    @fuzz_settings
    @given(request=generate_request(), stream=st.booleans())
    def fuzz_generate(request, stream):
        record("Generation.GenerateStream" if stream else "Generation.Generate",
               lambda: drain(generation.GenerateStream(request, timeout=REPLY_BOUND_S)) if stream
               else generation.Generate(request, timeout=REPLY_BOUND_S))

    @fuzz_settings
    @given(session_id=st.text(max_size=300))
    def fuzz_get_session(session_id):
        record("Generation.GetSession", lambda: generation.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=10))

    @fuzz_settings
    @given(request=session_request(servers.draft_server.address))
    def fuzz_verifier(request):
        record("Verifier.Generate", lambda: drain(verifier.Generate(request, timeout=REPLY_BOUND_S)))

    @fuzz_settings
    @given(messages=speculate_stream())
    def fuzz_speculate(messages):
        # A stream that stays open waits for more outcomes: a short deadline ends it (DEADLINE_EXCEEDED is fine).
        record("Drafter.Speculate", lambda: drain(drafter.Speculate(streamed(messages), timeout=2)))

    @fuzz_settings
    @given(method=st.sampled_from(raw_methods), payload=st.binary(max_size=300))
    def fuzz_bytes(method, payload):
        channel, name, streams_out = method
        call = (channel.unary_stream if streams_out else channel.unary_unary)(name)
        record(f"bytes {name.rsplit('/', 2)[1].split('.')[-1]}.{name.rsplit('/', 1)[1]}",
               lambda: drain(call(payload, timeout=REPLY_BOUND_S)) if streams_out else call(payload, timeout=REPLY_BOUND_S))

    deadline = time.monotonic() + args.minutes * 60
    rounds = 0
    while time.monotonic() < deadline:
        for fuzz in (fuzz_generate, fuzz_get_session, fuzz_verifier, fuzz_speculate, fuzz_bytes):
            fuzz()
            if time.monotonic() >= deadline:
                break
        rounds += 1
        print(f"round {rounds}: {sum(sum(c.values()) for c in codes.values())} calls, {len(failures)} failures, "
              f"slowest reply {slowest[0]:.2f}s", flush=True)

    time.sleep(1.0)  # sessions wind down just after their streams end
    left_open = servers.sessions()
    total = sum(sum(c.values()) for c in codes.values())
    summary = {"minutes": args.minutes, "calls": total, "failures": failures[:20], "num_failures": len(failures),
               "slowest_reply_s": round(slowest[0], 3), "sessions_left_open": left_open,
               "codes": {kind: dict(c) for kind, c in sorted(codes.items())}}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    servers.stop()
    if failures or left_open != (0, 0):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
