"""A tensor-parallel verifier on the CPU: two gloo ranks (core/tensor_parallel.py, core/tp_runner.py,
services/target/tp_ranks.py).

The sharding math reproduces the full layers; the plan codec round-trips and refuses what it did not
write; greedy output at N = 2 equals N = 1 on the demo target; in exact numerics a row's logits at
N = 2 are bitwise the same alone and beside other sessions; a degree that does not divide the heads
fails before any weight loads; a rank that hangs breaks the group within its timeout, on rank 0."""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn.functional as F

from specdec.core.runner import Feed
from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftProposal, SessionSpec
from specdec.core.tensor_parallel import (
    Dims,
    FeedPlan,
    StepPlan,
    TensorParallelError,
    check_degree,
    column_shard,
    decode_plan,
    encode_plan,
    gather_vocab,
    row_shard,
    sum_in_rank_order,
    vocab_shard,
)

TARGET = "models/demo/target"
TIMEOUT_S = 3.0  # the group's collective timeout here (short: the hang test waits it out)


def test_column_then_row_split_reproduces_the_full_layer():
    g = torch.Generator().manual_seed(0)
    hidden, heads, d, inter, n = 16, 4, 4, 24, 2
    x = torch.randn(3, hidden, generator=g)
    w_qkv = torch.randn(heads * d, hidden, generator=g)
    w_o = torch.randn(hidden, heads * d, generator=g)
    w_gate, w_up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    w_down = torch.randn(hidden, inter, generator=g)
    # column-parallel by heads: the shards' outputs are the full output's head blocks, side by side
    assert torch.equal(torch.cat([column_shard(w_qkv, r, n, d) for r in range(n)]), w_qkv)
    # row-parallel o_proj over its heads' columns: the partial products sum to the full product
    heads_out = x @ w_qkv.T  # (stand-in for attention's output [3, h * d])
    full_o = heads_out @ w_o.T
    parts = [heads_out[:, r * heads * d // n:(r + 1) * heads * d // n] @ row_shard(w_o, r, n, d).T for r in range(n)]
    assert torch.allclose(sum_in_rank_order(parts), full_o, atol=1e-5)
    # the MLP: gate/up by units, down by the same units' columns
    full_mlp = (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T
    mlp_parts = [(F.silu(x @ column_shard(w_gate, r, n).T) * (x @ column_shard(w_up, r, n).T)) @ row_shard(w_down, r, n).T
                 for r in range(n)]
    assert torch.allclose(sum_in_rank_order(mlp_parts), full_mlp, atol=1e-5)
    # the LM head by vocabulary rows, a vocabulary that does not divide (padded, then cut)
    w_head = torch.randn(7, hidden, generator=g)
    logits = gather_vocab([x @ vocab_shard(w_head, r, n).T for r in range(n)], 7)
    assert logits.shape == (3, 7) and torch.allclose(logits, x @ w_head.T, atol=1e-5)


def test_plan_codec_round_trip_and_refusals():
    plan = StepPlan(new=(3, 4), keep=((1, 10, (0, 2, 3)),), free=(0,),
                    feeds=(FeedPlan(3, 0, (5, 6, 7), 1), FeedPlan(1, 13, (9, 8, 7, 6), 4, (-1, 0, 0), 4)))
    encoded = encode_plan(plan)
    assert encoded.dtype == torch.int64
    assert decode_plan(encoded) == plan
    assert decode_plan(encode_plan(StepPlan())) == StepPlan()
    with pytest.raises(ValueError):
        decode_plan(encoded[:-1])  # a list that runs past the end
    with pytest.raises(ValueError):
        decode_plan(torch.cat([encoded, torch.tensor([0])]))  # values left over


def test_a_degree_that_does_not_divide_the_heads_is_refused(capsys):
    with pytest.raises(TensorParallelError, match="does not divide"):
        check_degree(4, Dims(heads=6, kv_heads=6, head_dim=64, intermediate=1024, vocab=6144))
    check_degree(2, Dims(heads=6, kv_heads=6, head_dim=64, intermediate=1024, vocab=6144))
    from specdec.cli import main

    assert main(["generate", "hello", "--tensor-parallel", "4", "--target", TARGET]) == 2  # before any weight loads
    assert "does not divide this model's attention heads (6), KV heads (6)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engines():
    from specdec.target.engine import TargetConfig, VerifierEngine

    one = VerifierEngine.from_config(TargetConfig(TARGET, threads=1, numerics="exact"))
    two = VerifierEngine.from_config(TargetConfig(TARGET, threads=1, numerics="exact", tensor_parallel=2,
                                                  tensor_parallel_timeout_s=TIMEOUT_S))
    yield one, two
    two.tensor_parallel.stop()


def _greedy(engine, prompt: tuple[int, ...], n: int) -> list[int]:
    """Target-only greedy decoding through the engine's own steps (k = 0), then one step of 3 drafts."""
    engine.open(SessionSpec("a" * 32, prompt, SamplingParams()))
    for _ in range(n):
        engine.verify("a" * 32, DraftProposal(()))
    committed = engine.sessions.get("a" * 32).committed
    engine.close("a" * 32)
    return list(committed[len(prompt):])


def test_greedy_output_at_two_ranks_equals_one(engines):
    one, two = engines
    assert two.numerics == "exact" and two.layout is None  # (no KV blocks across ranks)
    for text in ("def fib(n):", "The capital of France is"):
        prompt = tuple(one.loaded.tokenizer(text)["input_ids"])
        expected = _greedy(one, prompt, 24)
        assert _greedy(two, prompt, 24) == expected
        # speculation: target-only greedy's own tokens as drafts are all accepted, and a wrong one is cut
        two.open(SessionSpec("d" * 32, prompt, SamplingParams()))
        out = two.verify("d" * 32, DraftProposal(tuple(expected[:3])))
        assert (list(out.token_ids), out.num_accepted) == (expected[:4], 3)
        out = two.verify("d" * 32, DraftProposal((expected[4], (expected[5] + 1) % 6144)))
        assert (list(out.token_ids), out.num_accepted) == (expected[4:6], 1)
        two.close("d" * 32)


def test_exact_rows_at_two_ranks_are_the_same_bits_whatever_shares_the_batch(engines):
    _, two = engines
    runner = two.runner
    prompt, others = [5, 17, 300, 42, 7, 99], ([11, 12, 13, 14], [400, 401, 402, 403, 404, 405, 406, 407, 408])
    alone = runner.new_cache()
    runner.forward([Feed(alone, 0, prompt, 1)])
    lone = runner.forward([Feed(alone, len(prompt), [8, 9, 10], 3)])[0]  # [3, vocab]
    beside = [runner.new_cache() for _ in range(3)]
    runner.forward([Feed(c, 0, p, 1) for c, p in zip(beside, (others[0], prompt, others[1]))])
    together = runner.forward([Feed(beside[0], 4, [1, 2], 2), Feed(beside[1], len(prompt), [8, 9, 10], 3),
                               Feed(beside[2], 9, [3], 1)])[1]
    assert torch.equal(lone, together)
    for c in (alone, *beside):
        runner.free(c)


def test_a_rank_that_hangs_breaks_the_group_within_its_timeout(engines):
    _, two = engines
    faults = []
    comm = two.runner.comm
    comm.on_fault = faults.append
    follower = two.tensor_parallel.processes[0]
    os.kill(follower.pid, signal.SIGSTOP)  # alive, answering nothing
    try:
        cache = two.runner.new_cache()
        with pytest.raises(TensorParallelError, match="rank died, or hung"):  # (not a hang: the collective's timeout)
            two.runner.forward([Feed(cache, 0, [1, 2, 3], 1)])
        assert len(faults) == 1 and comm.broken is faults[0]
        with pytest.raises(TensorParallelError):  # broken for good
            two.runner.forward([Feed(cache, 0, [1, 2, 3], 1)])
    finally:
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait(10)
