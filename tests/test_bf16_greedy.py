"""Lossless greedy decoding with the target in bfloat16 (issue 26): with ``numerics="exact"`` the
speculative output is token-identical to specdec's own target-only (k = 0) decoding in bfloat16, on
the demo pair, for every drafter and k, in one process and over gRPC.

Why bfloat16 needs its own test: with 8 significant bits, the top two logits of some positions lie
within rounding of each other, so a row computed in another shape (one token at k = 0, row j of a
k + 1 block, beside other sessions, on another thread count) may pick another greedy token in fast
mode. Exact numerics (core/exact_ops.py) keeps each row's bits whatever shares its forward. The
reference is therefore specdec's own k = 0 output in bfloat16 (computed once per module, every
prompt in one batch, and held to requests decoded alone), not ``transformers`` (another summation
order). Prompts are cut from the demo pair's held-out code, often mid-line, where the target is
least sure: where a near tie would show.
"""
from __future__ import annotations

import asyncio
import json
import sysconfig
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

from specdec import roles
from specdec.client import ResumingClient
from specdec.core.cpu_features import describe_cpu
from specdec.core.llama_decode import bfloat16_supported
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.draft.drafters import REGISTRY, DraftConfig
from specdec.orchestrator.loop import collect
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.target.engine import TargetConfig
from specdec.v1 import common_pb2, generation_pb2 as pb

from cluster import PATIENT, start_cluster
from redis_server import delete_prefix

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
pytestmark = [
    pytest.mark.skipif(not bfloat16_supported(), reason=f"a bfloat16 target needs a CPU with native bf16 (avx512_bf16 or amx_bf16) or specdec's kernels; "
                                                 f"this one has neither ({describe_cpu()})"),
    pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not built (scripts/train_demo_pair.py)"),
]

NUM_PROMPTS = 24
MAX_NEW = 32
KS = (1, 3, 5, None)  # None: adaptive
# Every drafter a request can choose (the demo head serves eagle), but layer_skip: opt-in, the
# target loaded again on the drafter (tests/test_layer_skip.py).
DRAFTERS = tuple(name for name in REGISTRY if name != "layer_skip")
HEAD = str(DEMO / "eagle")
NUM_GRPC_REQUESTS = 16
NUM_ALONE = 4  # reference prompts also decoded one request at a time
BF16_EXACT = dict(dtype="bfloat16", numerics="exact")


def code_prompts(n: int) -> list[str]:
    """``n`` distinct cuts of the demo pair's held-out standard-library files: each starts at the
    beginning of a line near a ``def`` and ends after 60 to 200 characters, usually mid-line."""
    card = json.loads((DEMO / "training.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / rel).read_text(encoding="utf-8") for rel in card["training"]["held_out_list"] if (stdlib / rel).is_file()]
    assert len(texts) >= 4, "the held-out files of the demo pair's model card are not on this machine"
    out = []
    for i in range(n):
        text = texts[i % len(texts)]
        start = (i * 7919) % max(1, len(text) - 400)  # spread over the file
        at = text.find("def ", start, len(text) - 200)
        at = text.rfind("\n", 0, at if at >= 0 else start) + 1
        out.append(text[at : at + 60 + (i * 37) % 141])
    assert len(set(out)) == n, "two prompts are the same cut"
    return out


def policy(k: int | None) -> SpeculationPolicy:
    return SpeculationPolicy(SpeculationMode.ADAPTIVE) if k is None else SpeculationPolicy(SpeculationMode.FIXED, k)


def request(prompt: str, k: int | None, drafter: str) -> GenerationRequest:
    return GenerationRequest(prompt_text=prompt, max_new_tokens=MAX_NEW, drafter=drafter, policy=policy(k))


def grpc_request(prompt: str, k: int | None, drafter: str) -> pb.GenerateRequest:
    if k is None:
        spec = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_ADAPTIVE)
    else:
        spec = common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED, num_speculative_tokens=k)
    return pb.GenerateRequest(text=prompt, max_new_tokens=MAX_NEW, drafter=drafter, speculation=spec)


def first_difference(got: tuple[int, ...], want: tuple[int, ...]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def embedded(target_config: TargetConfig):
    """All roles in this process, as ``specdec generate`` runs them; every step waits for its block."""
    draft = str(DEMO / "draft")
    return roles.embedded(target_config, DraftConfig(draft, target_config.model_path, eagle_head_path=HEAD),
                          OrchestratorConfig(max_new_tokens_limit=256, max_concurrent_requests=len(KS) * NUM_PROMPTS),
                          loop_config=PATIENT)


async def k0_outputs(orch, prompts: list[str], one_at_a_time: bool) -> list[tuple[int, ...]]:
    if one_at_a_time:
        replies = [await collect(orch.generate(request(p, 0, "model"))) for p in prompts]
    else:
        replies = await asyncio.gather(*(collect(orch.generate(request(p, 0, "model"))) for p in prompts))
    assert all(last.counters.draft_tokens == 0 for last, _, _ in replies), "k = 0 drafted"
    return [ids for _, ids, _ in replies]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return code_prompts(NUM_PROMPTS)


@pytest_asyncio.fixture(scope="module")
async def bf16_orchestrator():
    orch = embedded(TargetConfig(str(DEMO / "target"), **BF16_EXACT))
    yield orch
    await orch.aclose()


@pytest_asyncio.fixture(scope="module")
async def reference(bf16_orchestrator, prompts) -> list[tuple[int, ...]]:
    """Target-only greedy in bfloat16: specdec's own k = 0, every prompt at once."""
    outputs = await k0_outputs(bf16_orchestrator, prompts, one_at_a_time=False)
    assert all(len(ids) == MAX_NEW for ids in outputs), "a reference ended early: fewer positions compared"
    return outputs


@pytest_asyncio.fixture(scope="module")
async def float32_k0(prompts) -> list[tuple[int, ...]]:
    """The same k = 0 decoding with the target in float32 (exact numerics, so these bits are fixed too)."""
    orch = embedded(TargetConfig(str(DEMO / "target"), dtype="float32", numerics="exact"))
    try:
        return await k0_outputs(orch, prompts, one_at_a_time=False)
    finally:
        await orch.aclose()


@pytest_asyncio.fixture(scope="module")
async def bf16_cluster(redis_url):
    """Drafter, verifier (bfloat16, exact numerics) and orchestrator gRPC servers on loopback, sessions in Redis."""
    target, draft = str(DEMO / "target"), str(DEMO / "draft")
    c = await start_cluster(target, draft, redis_url, prefix=f"specdec-test-{uuid.uuid4().hex[:8]}",
                            config=OrchestratorConfig(max_new_tokens_limit=256),
                            target_dtype=BF16_EXACT["dtype"], target_numerics=BF16_EXACT["numerics"], eagle_head=HEAD)
    yield c
    await c.stop()
    delete_prefix(redis_url, c.store._prefix)


async def test_bfloat16_is_in_effect_k0_output_differs_from_float32(reference, float32_k0):
    """Without this the tests below could pass by running the target in float32: the bf16 reference
    is not the float32 one (the demo weights rounded to bf16 move some near ties)."""
    differ = [i for i, (b, f) in enumerate(zip(reference, float32_k0)) if b != f]
    assert differ, f"bfloat16 and float32 k = 0 agree on all {len(reference)} prompts: is the target really in bfloat16?"


async def test_reference_is_k0_decoding_alone(bf16_orchestrator, reference, prompts):
    """The batched reference is what a request decoded alone at k = 0 gets (``specdec generate -k 0``)."""
    alone = await k0_outputs(bf16_orchestrator, prompts[:NUM_ALONE], one_at_a_time=True)
    for i, ids in enumerate(alone):
        assert ids == reference[i], f"prompt {i} {prompts[i]!r}: first difference at position {first_difference(ids, reference[i])}"


@pytest.mark.parametrize("drafter", DRAFTERS)
async def test_speculative_greedy_equals_k0_in_bfloat16_in_one_process(bf16_orchestrator, reference, prompts, drafter):
    """Every prompt x k in {1, 3, 5, adaptive}, all at once through one embedded orchestrator, so
    sessions of different k and lengths share the verifier's forwards."""
    grid = [(i, k) for k in KS for i in range(len(prompts))]
    replies = await asyncio.gather(*(collect(bf16_orchestrator.generate(request(prompts[i], k, drafter))) for i, k in grid))
    wrong = [f"prompt {i} {prompts[i]!r}, k={k}: first difference at position {first_difference(ids, reference[i])}"
             for (i, k), (_, ids, _) in zip(grid, replies) if ids != reference[i]]
    assert not wrong, f"drafter {drafter}: {len(wrong)} of {len(grid)} outputs differ from k = 0 in bfloat16:\n" + "\n".join(wrong)
    for k in KS:
        drafted = sum(last.counters.draft_tokens for (_, kk), (last, _, _) in zip(grid, replies) if kk == k)
        assert drafted > 0, f"drafter {drafter}, k={k} never proposed anything: this would not test speculation"


async def test_sixteen_concurrent_requests_over_grpc_equal_k0_in_bfloat16(bf16_cluster, reference, float32_k0, prompts):
    """16 requests at once over real gRPC (the verifier in its own server, in bfloat16): each k and
    drafter once unary and once streamed through specdec.client. The prompts where bfloat16 and float32
    differ go first, so a verifier that ignored its dtype would fail here too."""
    order = sorted(range(len(prompts)), key=lambda i: reference[i] == float32_k0[i])[:NUM_GRPC_REQUESTS]
    assert any(reference[i] != float32_k0[i] for i in order)
    combos = [(k, d) for d in DRAFTERS for k in KS]
    plan = [(i, *combos[n % len(combos)]) for n, i in enumerate(order)]  # 16 = every combination twice

    async def unary(req: pb.GenerateRequest):
        reply = await bf16_cluster.stub.Generate(req)
        return tuple(reply.token_ids), reply.stats.draft_tokens

    async def streamed(client: ResumingClient, req: pb.GenerateRequest):
        ids, drafted = [], 0
        async for msg in client.stream(req):
            ids.extend(msg.token_ids)
            drafted = msg.stats.draft_tokens if msg.finish_reason else drafted
        return tuple(ids), drafted

    async with ResumingClient([bf16_cluster.address]) as client:
        requests = [grpc_request(prompts[i], k, d) for i, k, d in plan]
        results = await asyncio.gather(*(unary(r) if n < len(combos) else streamed(client, r) for n, r in enumerate(requests)))
    wrong = [f"prompt {i} {prompts[i]!r}, drafter {d}, k={k}: first difference at position {first_difference(ids, reference[i])}"
             for (i, k, d), (ids, _) in zip(plan, results) if ids != reference[i]]
    assert not wrong, f"{len(wrong)} of {len(plan)} outputs differ from k = 0 in bfloat16:\n" + "\n".join(wrong)
    assert sum(drafted for _, drafted in results) > 0, "nothing was drafted: this would not test speculation"
