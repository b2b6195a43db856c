"""The lean Llama forward over N ranks (core/tensor_parallel.py has the math and the plan codec).

Every rank runs the same `LlamaDecoder` code on its shard of the weights (its heads, its MLP units,
its part of the vocabulary) and its heads' keys and values: o_proj and down_proj are wrapped to
sum their partial outputs over the ranks (`Collectives.reduce`), the LM head to gather its part of
the logits. Rank 0 runs `TensorParallelRunner`, a `ModelRunner` like any other for the engine
above it: each forward first sends the step's plan (caches made and freed, tree paths kept, the
feeds), then computes its shard; every other rank runs `follow`, which applies the same plan to its
own caches and joins the same collectives in the same order.

Collectives run on a gloo process group of its own (not torch.distributed's global default) with a
timeout: a rank that dies or hangs makes the next collective fail within it, on every rank, and the
group is then broken for good (`TensorParallelError`); rank 0 also pings the others while idle, so
a rank lost between requests is found within the timeout too.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from specdec.core.llama_decode import LlamaDecoder
from specdec.core.runner import Feed, LeanRunner
from specdec.core.tensor_parallel import (
    HEADER,
    OP_FORWARD,
    OP_PING,
    OP_STOP,
    Dims,
    StepPlan,
    FeedPlan,
    TensorParallelError,
    check_degree,
    decode_plan,
    encode_plan,
    gather_vocab,
    header,
    read_header,
    shard_llama,
    sum_in_rank_order,
)

log = logging.getLogger(__name__)


def dims_of(config) -> Dims:
    """The shapes a HF Llama config shards by."""
    heads = config.num_attention_heads
    return Dims(heads, getattr(config, "num_key_value_heads", None) or heads,
                getattr(config, "head_dim", None) or config.hidden_size // heads, config.intermediate_size, config.vocab_size)


def shard_model(model: torch.nn.Module, rank: int, n: int) -> torch.nn.Module:
    """A LlamaForCausalLM holding rank ``rank``'s shard of ``model``'s weights (its config with h/n
    heads, kv/n KV heads, intermediate/n units, the LM head's vocab part untied); embedding and
    norms shared with ``model``, not copied."""
    from transformers import LlamaForCausalLM

    dims = dims_of(model.config)
    check_degree(n, dims)
    cfg = copy.deepcopy(model.config)
    cfg.num_attention_heads, cfg.num_key_value_heads = dims.heads // n, dims.kv_heads // n
    cfg.intermediate_size, cfg.head_dim, cfg.tie_word_embeddings = dims.intermediate // n, dims.head_dim, False
    with torch.device("meta"):
        shard = LlamaForCausalLM(cfg)
    params = dict(model.named_parameters(remove_duplicate=False))  # (a tied LM head by its own name too)
    with torch.no_grad():
        for name, tensor in shard_llama(params, dims, rank, n).items():
            owner, _, leaf = name.rpartition(".")
            shard.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    return shard


class Collectives:
    """One rank's end of a tensor-parallel group: the reductions of the forward, and the plans.

    ``exact``: sums gathered and added in rank order (the same bits for a row whatever shares the
    batch) instead of the backend's all-reduce. Every call waits at most the group's timeout; a
    failure breaks the group (every later call raises the same error) and is reported once to
    ``on_fault``."""

    def __init__(self, group, rank: int, size: int, exact: bool, timeout_s: float,
                 on_fault: Callable[[TensorParallelError], None] | None = None) -> None:
        self.group, self.rank, self.size, self.exact, self.timeout_s = group, rank, size, exact, timeout_s
        self.on_fault = on_fault
        self.lock = threading.Lock()  # rank 0: one plan and its forward at a time (the model thread, the heartbeat)
        self.broken: TensorParallelError | None = None
        self.last_op = time.monotonic()
        self.reductions = 0  # collectives of forwards run, and their seconds on this rank (benchmarks read them)
        self.reduce_s = 0.0
        self.plan_s = 0.0  # seconds sending (rank 0) or receiving plans

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: a peer's connection closed, or the timeout passed
            self._fail(f"{what} failed: {exc}")

    def _fail(self, message: str) -> None:
        err = TensorParallelError(f"tensor-parallel rank {self.rank} of {self.size}: {message} (a rank died, or "
                                  f"hung past the {self.timeout_s:g} s timeout); this group cannot serve any more")
        first = self.broken is None
        self.broken = err
        if first and self.on_fault is not None:
            self.on_fault(err)
        raise err

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (the same shape on each), in rank order."""
        self._check()
        t0 = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [t]), "an all-gather")
        self.reductions += 1
        self.reduce_s += time.perf_counter() - t0
        return parts

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each rank's ``t``: gathered and added in rank order (exact), or all-reduced."""
        if self.exact:
            return sum_in_rank_order(self.gather(t))
        self._check()
        t0 = time.perf_counter()
        t = t.contiguous()
        self._wait(self.group.allreduce([t]), "an all-reduce")
        self.reductions += 1
        self.reduce_s += time.perf_counter() - t0
        return t

    # -- plans: rank 0 sends, the others receive
    def send(self, op: int, plan: StepPlan | None = None) -> None:
        self._check()
        t0 = time.perf_counter()
        payload = encode_plan(plan) if plan is not None else None
        self._wait(self.group.broadcast(header(op, 0 if payload is None else payload.numel()), 0), "sending a plan")
        if payload is not None and payload.numel():
            self._wait(self.group.broadcast(payload, 0), "sending a plan")
        if op == OP_PING:  # every rank answers: a hung one is found while idle too
            self._wait(self.group.allreduce([torch.zeros(1)]), "a heartbeat")
        self.last_op = time.monotonic()
        self.plan_s += time.perf_counter() - t0

    def receive(self) -> tuple[int, StepPlan | None]:
        self._check()
        head = torch.zeros(HEADER, dtype=torch.int64)
        self._wait(self.group.broadcast(head, 0), "waiting for rank 0's plan")
        op, length = read_header(head)
        plan = None
        if op == OP_FORWARD:
            payload = torch.zeros(length, dtype=torch.int64)
            if length:
                self._wait(self.group.broadcast(payload, 0), "receiving a plan")
            plan = decode_plan(payload)
        elif op == OP_PING:
            self._wait(self.group.allreduce([torch.zeros(1)]), "a heartbeat")
        return op, plan


class _Reduced:
    """A row-parallel linear: this rank's partial product, summed over the ranks."""

    __slots__ = ("linear", "comm", "shape")

    def __init__(self, linear, comm: Collectives) -> None:
        self.linear, self.comm, self.shape = linear, comm, getattr(linear, "shape", None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.reduce(self.linear(x))


class _Gathered:
    """The vocabulary-parallel LM head: this rank's logits, gathered beside the others' (padding cut)."""

    __slots__ = ("linear", "comm", "vocab", "shape")

    def __init__(self, linear, comm: Collectives, vocab: int) -> None:
        self.linear, self.comm, self.vocab, self.shape = linear, comm, vocab, getattr(linear, "shape", None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gather_vocab(self.comm.gather(self.linear(x)), self.vocab)


def join(decoder: LlamaDecoder, comm: Collectives, vocab: int) -> LlamaDecoder:
    """``decoder`` (a shard's) made one rank of the group: o_proj and down_proj reduced, the LM head
    gathered, the one-C-call layer (which would skip the reductions) off."""
    decoder.layers = [(ln1, qkv, _Reduced(o, comm), ln2, gate_up, _Reduced(down, comm))
                      for ln1, qkv, o, ln2, gate_up, down in decoder.layers]
    decoder.lm_head = _Gathered(decoder.lm_head, comm, vocab)
    decoder.fused_macs = decoder.native_stack = None
    return decoder


@dataclasses.dataclass(eq=False)
class ShardCache:
    """Rank 0's handle of a sequence's caches: its id on every rank, and rank 0's own cache."""

    id: int
    cache: object
    release: Callable[[], None] = lambda: None


class TensorParallelRunner:
    """Rank 0's model runner: the lean runner on its shard, each forward preceded by the step's plan.

    Caches made, freed (or dropped with their session) and tree paths kept are queued and go with the
    next forward's plan, so a step is one plan. Nothing of the KV cache leaves the ranks: `read_kv`
    and `write_prefix` (Redis KV blocks) are not built for a sharded cache."""

    verifies_trees = True

    def __init__(self, decoder: LlamaDecoder, comm: Collectives, heartbeat_s: float | None = None) -> None:
        self.decoder = decoder
        self.local = LeanRunner(decoder)
        self.comm = comm
        self.last_features = None
        self._ids = itertools.count()
        self._new: list[int] = []
        self._keep: list[tuple[int, int, tuple[int, ...]]] = []
        self._freed: collections.deque[int] = collections.deque()  # (appended by finalizers, on any thread)
        self._stopped = threading.Event()
        self._beat = None
        if heartbeat_s:
            self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), name="tp-heartbeat", daemon=True)
            self._beat.start()

    def new_cache(self) -> ShardCache:
        cid = next(self._ids)
        handle = ShardCache(cid, self.local.new_cache())
        handle.release = weakref.finalize(handle, self._freed.append, cid)  # freed on every rank, also when dropped
        self._new.append(cid)
        return handle

    def truncate(self, cache: ShardCache, length: int) -> None:
        pass  # as the lean runner's: the next feed's start is where every rank's cache is cut

    def free(self, cache: ShardCache) -> None:
        self.local.free(cache.cache)
        cache.release()

    def keep_path(self, cache: ShardCache, first: int, path: Sequence[int]) -> None:
        self.local.keep_path(cache.cache, first, path)
        self._keep.append((cache.id, first, tuple(path)))

    def read_kv(self, cache: ShardCache, lo: int, hi: int) -> torch.Tensor:
        raise TensorParallelError("a tensor-parallel verifier does not export KV blocks (each rank holds its heads' part)")

    def write_prefix(self, cache: ShardCache, kv: torch.Tensor) -> None:
        raise TensorParallelError("a tensor-parallel verifier does not adopt stored KV blocks (each rank holds its heads' part)")

    def forward(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        freed = []
        while self._freed:
            freed.append(self._freed.popleft())
        plan = StepPlan(tuple(self._new), tuple(self._keep), tuple(freed),
                        tuple(FeedPlan(f.cache.id, f.start, tuple(f.token_ids), f.num_last, tuple(f.parents), f.num_features)
                              for f in feeds))
        self._new.clear()
        self._keep.clear()
        with self.comm.lock:
            self.comm.send(OP_FORWARD, plan)
            out = self.local.forward([dataclasses.replace(f, cache=f.cache.cache) for f in feeds])
        self.last_features = self.local.last_features
        return out

    def _heartbeat(self, interval_s: float) -> None:
        """While idle, ping the ranks every ``interval_s``: they wait for plans no longer than the timeout."""
        while not self._stopped.wait(interval_s):
            if time.monotonic() - self.comm.last_op < interval_s or not self.comm.lock.acquire(blocking=False):
                continue
            try:
                self.comm.send(OP_PING)
            except TensorParallelError:
                return  # (reported by the collectives)
            finally:
                self.comm.lock.release()

    def stop(self) -> None:
        """Tell the other ranks to exit (best effort: a broken group has nobody to tell)."""
        self._stopped.set()
        if self.comm.broken is None:
            with self.comm.lock:
                try:
                    self.comm.send(OP_STOP)
                except TensorParallelError:
                    pass


def follow(decoder: LlamaDecoder, comm: Collectives) -> None:
    """A rank other than 0: apply rank 0's plans to this rank's caches and run their forwards, until told to stop."""
    local = LeanRunner(decoder)
    caches: dict[int, object] = {}
    while True:
        op, plan = comm.receive()
        if op == OP_STOP:
            return
        if plan is None:
            continue
        for cid in plan.new:
            caches[cid] = local.new_cache()
        for cid, first, path in plan.keep:
            local.keep_path(caches[cid], first, path)
        for cid in plan.free:
            local.free(caches.pop(cid))
        if plan.feeds:
            local.forward([Feed(caches[f.cache], f.start, f.token_ids, f.num_last, f.parents, f.num_features)
                           for f in plan.feeds])
