"""The verifier's model work: the target, one KV cache per session, one step over a whole batch.

Synchronous and single-threaded: the scheduler (services/target/scheduler.py) is its only caller
and runs it on the model thread. A step is one forward over a flat ragged batch and one call of the
verification rules over all of it (core/batch_rules.py). No gRPC here.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core.batch_rules import RuleStep, decide_batch
from specdec.core.choose_runner import choose_runner
from specdec.core.errors import InvalidRequest, Overloaded, SessionAlreadyOpen, SpecdecError
from specdec.core.exact_ops import ExactNumericsUnavailable
from specdec.core.features import needs_features, needs_row_tokens, to_chunks
from specdec.core.kv import shared_prefixes
from specdec.core.kv_blocks import BlockLayout, HostCopy, PendingBlock, encode_block, model_fingerprint
from specdec.core.llama_decode import NUMERICS, PACK_ROWS, LlamaDecoder
from specdec.core.models import LoadedModel, load_causal_lm, resolve_dtype
from specdec.core.paged_runner import PagedRunner
from specdec.core.runner import Feed, HFRunner, LeanRunner, ModelRunner
from specdec.core.sampling import SamplingParams
from specdec.core.session_table import FreedMemory, SessionTable
from specdec.core.steps import MAX_PREFILL_TOKENS, DraftProposal, SessionSpec, VerifyOutcome, WorkerInfo, check_room, dense_draft_probs, validate_prompt
from specdec.core.tensor_parallel import TensorParallelError
from specdec.core.tree_rules import TreeOutcome, TreeStep, decide_tree_batch
from specdec.target.tp_ranks import RankConfig, TensorParallelGroup, check_tensor_parallel, start_group

log = logging.getLogger(__name__)
# Opens of one prefill batch whose prompts share at least this many leading tokens compute them once.
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class TargetConfig:
    model_path: str
    max_sessions: int = 256
    idle_timeout_s: float = 300.0
    threads: int | None = None
    # The lean Llama forward with oneDNN-packed weights (specdec.core.llama_decode): verifying k
    # drafts then costs little more than one step. False, or a model it does not support, runs the
    # reference HF forward. Either way the verifier's forward defines the target distribution.
    fast_forward: bool = True
    pack_rows: int = PACK_ROWS
    # Layouts the lean forward keeps of each weight: 1 (each weight held once; single-row calls may run
    # a slower kernel for it) or 2 (the fastest kernel for one row and for more rows: twice the memory).
    weight_layouts: int = 1
    # The target's precision: float32 | bfloat16 (docs/operations.md says which compute runs where).
    dtype: str = "float32"
    # Where the target's weights, KV cache and logits live: cpu | cuda | cuda:N (the CLI resolves auto).
    device: str = "cpu"
    # The model runner (core/runner.py): auto (paged on CUDA, lean on CPU) | lean | paged | hf.
    runner: str = "auto"
    # The paged runner's page pool: this fraction of the device's free memory after the weights
    # (None: pages for the KV budget, max_kv_tokens or max_sessions full contexts).
    kv_memory_fraction: float | None = None
    kv_page_tokens: int = 16  # positions per page of the paged runner's pool
    # The paged runner on CUDA: replay the verify forward from CUDA graphs captured at start-up (fast numerics).
    cuda_graphs: bool = True
    # auto | exact | fast. exact: a row's logits are bitwise the same whatever else shares the forward
    # (its block's other rows, other sessions, thread count; core/exact_ops.py), so speculation never
    # changes greedy output; needs the lean forward. auto: exact where this CPU's kernels hold it
    # (checked at load), else fast, with a warning; fast on the reference forward.
    numerics: str = "auto"
    # KV memory budget in tokens over all sessions (None: max_sessions full contexts). A session
    # reserves prompt + max_new_tokens (at most the context) when it opens, so one admitted never
    # runs out mid-stream; one that does not fit is refused with RESOURCE_EXHAUSTED.
    max_kv_tokens: int | None = None
    # Continuous batching: the verify steps that arrive while a batch runs form the next batch (no
    # waiting when idle, so one session alone pays nothing), up to this many sessions per forward.
    max_batch_sessions: int = 64
    kv_wait_s: float = 30.0  # over the KV budget, a new session waits this long for room before RESOURCE_EXHAUSTED
    # Session KV in Redis (core/redis_kv.py): full blocks of kv_block_tokens written off the verify
    # path, read back when a session opens here that began elsewhere. None: not kept.
    kv_redis_url: str | None = None
    kv_block_tokens: int = 16  # smaller blocks leave less to recompute on resume (docs/decisions/kv-block-size.md)
    kv_prefix: str = "specdec"  # the key prefix, as the session store's
    # Redis memory per session is capped: positions past this are not kept (a resume recomputes them).
    kv_redis_max_tokens: int = 4096
    # Sessions whose steps came back together re-submit a moment apart (their blocks come back from
    # their drafters): the scheduler holds a batch this long at most for the sessions still on their
    # way, so a batch is not split in two halves that alternate. One session alone never waits.
    batch_wait_s: float = 0.003
    # Opens that arrive while a prefill runs are prefilled together, up to this many prompt tokens per forward.
    max_prefill_tokens: int = MAX_PREFILL_TOKENS
    # Ranks of one tensor-parallel verifier (services/target/tp_ranks.py): the lean runner on the CPU,
    # sharded over this many processes on gloo; 1: one process, as ever.
    tensor_parallel: int = 1
    # A tensor-parallel collective waits this long for the other ranks before the group is taken for broken.
    tensor_parallel_timeout_s: float = 30.0


class KVBudgetFull(Overloaded):
    """Over the verifier's KV budget now; ``ever_fits`` says whether it would fit once others close."""

    def __init__(self, message: str, ever_fits: bool) -> None:
        super().__init__(message)
        self.ever_fits = ever_fits


@dataclass
class SessionState:
    """One session at the verifier: its tokens and its KV cache. The only copy of its committed
    tokens in this process (the loop and the scheduler read this list, the step extends it)."""

    committed: list[int]
    cache: object  # the runner's cache (core/runner.py)
    sampling: SamplingParams
    reserved_tokens: int  # of the worker's KV budget, held until the session closes
    # Positions of the cache that hold committed tokens' keys and values. Past them lie the keys of
    # rejected drafts, which the next feed overwrites: rollback is this number going down.
    valid_len: int = 0
    blocks_written: int = 0  # full KV blocks handed to the store so far
    # Its drafter reads the target's features (core/features.py): each prefill and step leaves the
    # newly paired positions' here, for the session's loop to send with its next outcome.
    wants_features: bool = False
    features_out: collections.deque = dataclasses.field(default_factory=collections.deque)
    # Its drafter iterates on the target's guesses: the last step's (row argmax, draft ids, parents).
    wants_row_tokens: bool = False
    rows_out: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None

    def take_for_drafter(self) -> tuple[list, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None]:
        """What the last steps left for the session's drafter (feature chunks, the last step's rows),
        handed over once: the session forgets them (sent or, with the link down, dropped)."""
        chunks, rows = list(self.features_out), self.rows_out
        self.features_out.clear()
        self.rows_out = None
        return chunks, rows

    def feed(self, draft_ids: Sequence[int] = (), parents: tuple[int, ...] = (), prefill: bool = False) -> Feed:
        """The committed tokens the cache lacks (at least the last one, whose logits judge the first
        draft, or give a prefill its next token), then the drafts (a chain, or a tree's nodes with
        their ``parents``); logits for the last k + 1 (and, for a feature drafter, features for the
        rows a prefill computes or for those k + 1)."""
        start = min(self.valid_len, len(self.committed) - 1)
        rows = self.committed[start:] + list(draft_ids)
        features = (len(rows) if prefill else len(draft_ids) + 1) if self.wants_features else 0
        return Feed(self.cache, start, rows, len(draft_ids) + 1, parents, features)


def _decide(logits: torch.Tensor, steps: Sequence[RuleStep | TreeStep]) -> list[tuple[tuple[int, ...], int] | TreeOutcome]:
    """Every step of a batch by its rule: the chains in one `decide_batch` call, the trees in one
    `decide_tree_batch` call, each over its own rows (step i's k_i + 1 rows of ``logits``, in order)."""
    rows = torch.tensor([0, *itertools.accumulate(len(s.tree) + 1 if isinstance(s, TreeStep) else s.k + 1 for s in steps)])
    out: list = [None] * len(steps)
    for kind, decide in ((RuleStep, decide_batch), (TreeStep, decide_tree_batch)):
        members = [i for i, s in enumerate(steps) if isinstance(s, kind)]
        if not members:
            continue
        if len(members) == len(steps):
            part = logits
        else:
            part = logits[torch.cat([torch.arange(int(rows[i]), int(rows[i + 1])) for i in members]).to(logits.device)]
        for i, outcome in zip(members, decide(part, [steps[i] for i in members])):
            out[i] = outcome
    return out


class VerifierEngine:
    """Synchronous; the server runs it on one worker thread, the embedded path calls it directly."""

    def __init__(self, loaded: LoadedModel, config: TargetConfig, own_weights: bool = False) -> None:
        """``own_weights``: the lean forward takes the model's weights over (each held once, in the layout
        it runs with); for a model loaded for this engine alone (`from_config`)."""
        self.loaded = loaded
        self.config = config
        self.sessions: SessionTable[SessionState] = SessionTable(config.max_sessions, config.idle_timeout_s, freed=FreedMemory())
        if config.numerics not in (*NUMERICS, "auto"):
            raise ValueError(f"numerics must be auto or one of {', '.join(NUMERICS)}; got {config.numerics!r}")
        kind = choose_runner(loaded.model, config.runner, config.fast_forward)
        if config.numerics == "exact" and kind == "hf":
            raise ValueError("numerics='exact' needs the lean or the paged runner (fast_forward on, a Llama-family model)")
        self.tensor_parallel: TensorParallelGroup | None = None
        if config.tensor_parallel != 1:  # rank 0 of a group; the lean runner sharded (services/target/tp_ranks.py)
            check_tensor_parallel(config, loaded.model.config)
            if kind != "lean":
                raise TensorParallelError(f"--tensor-parallel {config.tensor_parallel} shards the lean runner only, not "
                                          f"the {kind} runner this model and device get (not built yet)")
            if config.kv_redis_url:
                log.warning("--kv-redis-url is ignored with --tensor-parallel: each rank holds only its heads' keys and "
                            "values, and KV blocks of a sharded cache are not built; a resumed session recomputes its prefix")
            self.tensor_parallel = start_group(loaded.model, RankConfig.of(config), own_weights)
            kind = "tensor-parallel"
        self.decoder = self._decoder(loaded, config, own_weights) if kind == "lean" else None
        self.paged: PagedRunner | None = self._paged(loaded, config, own_weights) if kind == "paged" else None
        # every session's forward goes through the runner, batched
        self.runner: ModelRunner = self.paged or (LeanRunner(self.decoder) if self.decoder is not None else
                                                  self.tensor_parallel.runner if self.tensor_parallel else HFRunner(loaded.model))
        self.numerics = (self.tensor_parallel or self.decoder or self.paged).numerics if kind != "hf" else "fast"
        self.last_prefill_tokens = 0  # positions the last prefill batch computed (the rest came from stored KV blocks)
        # The KV block layout, on the lean and paged runners (blocks are their caches' bytes); none across
        # ranks (each holds its heads' part): a tensor-parallel verifier's sessions resume by recomputing.
        self.layout = None
        if kind in ("lean", "paged"):
            # The paged runner's exact keys are other bits than the lean forward's: blocks of one are foreign to the other.
            shape = (len(self.decoder.layers), self.decoder.n_kv, self.decoder.head_dim, self.decoder.dtype) if self.decoder \
                else (self.paged.layer_count, self.paged.n_kv, self.paged.head_dim, self.paged.dtype)
            numerics = self.numerics if kind == "lean" or self.numerics == "fast" else f"{self.numerics}-paged"
            if self.decoder is not None and self.decoder.half_weights:  # float32 keys of bf16 weights: their own bits
                numerics += "-bf16-weights"
            fingerprint = model_fingerprint(loaded.model, shape[3], numerics)
            self.layout = BlockLayout(*shape, config.kv_block_tokens, fingerprint)

    @staticmethod
    def _paged(loaded: LoadedModel, config: TargetConfig, own_weights: bool) -> PagedRunner:
        """The paged runner, its pool sized by memory fraction (CUDA) or the KV budget. ``auto``
        numerics: exact where checked at load (the CPU; fast if its kernels cannot hold it), fast on
        CUDA, where exact mode runs without CUDA graphs (docs/performance.md, GPU check)."""
        build = functools.partial(PagedRunner, loaded.model, page_tokens=config.kv_page_tokens,
                                  kv_budget_tokens=config.max_kv_tokens, max_sessions=config.max_sessions,
                                  kv_memory_fraction=config.kv_memory_fraction, own_weights=own_weights,
                                  max_batch_sessions=config.max_batch_sessions)
        graphs = None if config.cuda_graphs else False  # None: on CUDA in fast numerics
        if config.numerics != "auto":
            return build(numerics=config.numerics, cuda_graphs=graphs)
        if not config.device.startswith("cpu"):
            return build(numerics="fast", cuda_graphs=graphs)
        try:
            return build(numerics="exact")
        except ExactNumericsUnavailable as exc:
            log.warning("exact numerics unavailable, running fast numerics: %s", exc)
            return build(numerics="fast")

    @staticmethod
    def _decoder(loaded: LoadedModel, config: TargetConfig, own_weights: bool) -> LlamaDecoder:
        """The lean forward in the numerics asked for; ``auto``: exact unless this CPU cannot hold it."""
        build = functools.partial(LlamaDecoder, loaded.model, pack_rows=config.pack_rows, dtype=resolve_dtype(config.dtype),
                                  own_weights=own_weights, layouts_per_weight=config.weight_layouts)
        try:
            return build(numerics="exact" if config.numerics == "auto" else config.numerics)
        except ExactNumericsUnavailable as exc:
            if config.numerics != "auto":
                raise
            log.warning("exact numerics unavailable, running fast numerics (speculation may then change greedy "
                        "output where logits nearly tie): %s", exc)
            return build(numerics="fast")

    @classmethod
    def from_config(cls, config: TargetConfig) -> "VerifierEngine":
        if config.tensor_parallel != 1:  # a degree that cannot serve this model fails before the weights load
            from transformers import AutoConfig

            check_tensor_parallel(config, AutoConfig.from_pretrained(config.model_path, local_files_only=True))
        return cls(load_causal_lm(config.model_path, dtype=config.dtype, threads=config.threads, device=config.device),
                   config, own_weights=True)

    def open(self, spec: SessionSpec, max_new_tokens: int | None = None, stored: Sequence[torch.Tensor] = ()) -> int:
        """Prefill a session; ``max_new_tokens`` sizes its KV reservation (None: the whole context);
        ``stored``: KV blocks of the prompt's first positions, already checked (core/redis_kv.py)."""
        result = self.open_batch([(spec, max_new_tokens, stored)])[0]
        if isinstance(result, SpecdecError):
            raise result
        return result

    def open_batch(self, opens: Sequence[tuple[SessionSpec, int | None, Sequence[torch.Tensor]]]) -> list[int | SpecdecError]:
        """Prefill many sessions in one target forward: (spec, max_new_tokens, stored) each, as `open`.

        A prefill is bound by arithmetic rather than by reading weights, yet one forward over many
        prompts measured much faster than one forward each (benchmarks/bench_prefill.py;
        docs/performance.md, 2.1). A refused open gets its error in its place and the others
        go on. Returns each one's time in ns (the whole batch's: each waited for all of it).
        """
        t0 = time.perf_counter_ns()
        results: list[int | SpecdecError | None] = [None] * len(opens)
        ready = []  # (index, session id, session, prompt ids)
        reserving = 0  # what the batch's earlier opens reserve: they count against the budget too
        context = self.loaded.context_length
        for i, (spec, max_new_tokens, stored) in enumerate(opens):
            try:  # every check before the prefill, not after it
                self.sessions.check_can_add(spec.session_id, adding=len(ready))
                validate_prompt(spec.prompt_ids, self.loaded.vocab_size, context)
                if any(spec.session_id == sid for _, sid, _, _ in ready):
                    raise SessionAlreadyOpen("a session is opened at most once per prefill batch")
                reserve = context if max_new_tokens is None else min(context, len(spec.prompt_ids) + max_new_tokens)
                self._check_kv_budget(reserve, reserving)
            except SpecdecError as exc:
                results[i] = exc
                continue
            reserving += reserve
            session = SessionState(list(spec.prompt_ids), self.runner.new_cache(), spec.sampling, reserve,
                                   wants_features=needs_features(spec.drafter), wants_row_tokens=needs_row_tokens(spec.drafter))
            if stored:
                session.valid_len = len(stored) * self.layout.block_tokens
                self.runner.write_prefix(session.cache, torch.cat(list(stored), dim=3))
                session.blocks_written = len(stored)
            ready.append((i, spec.session_id, session, spec.prompt_ids))
        # Prefill all but the last prompt token's successor: the first Verify feeds only drafts.
        # Prompts that begin alike (one prompt sent many times, a shared system prompt) compute what
        # they share once: the first in one forward, the others copy its keys and values and feed
        # only the rest in a second.
        copies = shared_prefixes([prompt for _, _, _, prompt in ready], MIN_SHARED_PREFIX,
                                 [self.layout is not None and session.valid_len == 0 and not session.wants_features
                                  for _, _, session, _ in ready])  # (a copied prefix computes no features)
        leaders = [session for (_, _, session, _), copy in zip(ready, copies) if copy is None]
        followers = [(session, ready[copy[0]][2], copy[1]) for (_, _, session, _), copy in zip(ready, copies) if copy]
        self.last_prefill_tokens = (sum(len(s.committed) - s.valid_len for s in leaders)
                                    + sum(len(s.committed) - shared for s, _, shared in followers))
        self._prefill(leaders)
        for session, leader, shared in followers:
            self.runner.write_prefix(session.cache, self.runner.read_kv(leader.cache, 0, shared))
            session.valid_len = shared
        self._prefill([session for session, _, _ in followers])
        elapsed = time.perf_counter_ns() - t0  # each open waited for the whole prefill
        for i, session_id, session, _ in ready:
            self.sessions.add(session_id, session)
            results[i] = elapsed
        return results

    def verify(self, session_id: str, proposal: DraftProposal) -> VerifyOutcome:
        """Check ``proposal`` against the session's committed tokens; commit what the rule keeps."""
        result = self.verify_batch([(session_id, proposal)])[0]
        if isinstance(result, SpecdecError):
            raise result
        return result

    def _prefill(self, sessions: Sequence[SessionState]) -> None:
        """Feed each session's prompt past what its cache holds, in one forward (logits of the last row only)."""
        if sessions:
            feeds = [s.feed(prefill=True) for s in sessions]
            self._forward(feeds)
            for s, feed, features in zip(sessions, feeds, self._features(len(feeds))):
                if features is not None:  # the prompt's pairs: every row but the last, whose next token is to come
                    s.features_out.extend(to_chunks(feed.start, features[:-1]))
        for s in sessions:
            s.valid_len = len(s.committed)

    @torch.inference_mode()
    def _forward(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """One forward over the feeds, each cache first cut to where its feed starts (exact rollback)."""
        for feed in feeds:
            self.runner.truncate(feed.cache, feed.start)
        return self.runner.forward(feeds)

    def verify_batch(self, steps: Sequence[tuple[str, DraftProposal]]) -> list[VerifyOutcome | SpecdecError]:
        """One verification step for each (session, proposal): one target forward over the flat
        ragged batch, then the rules once over all of it.

        Proposals are ragged (each session its own k, 0 included). A step that is refused gets its
        error in its place and changes nothing; the others go on. Every session's tokens follow
        from its own logits and its own seed, so what shares a batch never changes an outcome.
        """
        t0 = time.perf_counter_ns()
        results: list[VerifyOutcome | SpecdecError | None] = [None] * len(steps)
        checked = []  # (index, session, rule step: a chain's RuleStep or a tree's TreeStep)
        seen: set[str] = set()
        for i, (session_id, proposal) in enumerate(steps):
            try:  # validate everything before touching the session: a refused step leaves it as it was
                if session_id in seen:
                    raise InvalidRequest("a session verifies at most one step per batch")
                s = self.sessions.get(session_id)
                n = len(s.committed)
                check_room(n, len(proposal.token_ids), self.loaded.context_length)
                draft_probs = dense_draft_probs(proposal, self.loaded.vocab_size)  # [k, vocab] or None
            except SpecdecError as exc:
                results[i] = exc
                continue
            seen.add(session_id)
            checked.append((i, s, self._rule_step(proposal, draft_probs, s.sampling, n)))
        if checked:
            feeds = [s.feed(step.tree.token_ids, step.tree.parents) if isinstance(step, TreeStep) else s.feed(step.draft_ids)
                     for _, s, step in checked]
            logits = torch.cat(self._forward(feeds))  # [sum(k + 1), vocab], in order
            features = self._features(len(feeds))
            self._row_tokens(logits, checked)
            for (i, s, step), outcome, rows in zip(checked, _decide(logits, [step for _, _, step in checked]), features):
                if isinstance(outcome, TreeOutcome):
                    self.runner.keep_path(s.cache, step.position, outcome.path)  # the path's keys where a chain's would be
                    tokens, accepted = outcome.tokens, outcome.accepted
                    kept = [0, *(1 + node for node in outcome.path)]
                else:
                    tokens, accepted = outcome
                    kept = list(range(accepted + 1))
                if rows is not None:  # the last committed token's row and the accepted drafts'
                    s.features_out.extend(to_chunks(step.position - 1, rows[kept]))
                s.valid_len = step.position + accepted  # the accepted drafts' keys are the committed tokens'
                s.committed.extend(tokens)
                results[i] = (tokens, accepted, len(s.committed))
        elapsed = time.perf_counter_ns() - t0  # each step waited for the whole batch
        return [VerifyOutcome(*r, elapsed) if isinstance(r, tuple) else r for r in results]

    @staticmethod
    def _row_tokens(logits: torch.Tensor, checked: list) -> None:
        """For sessions whose drafter iterates on the target's guesses: the argmax of each draft's row
        (after row 0, the last committed token's), with the block it belongs to."""
        first = 0
        for _, s, step in checked:
            tree = step.tree if isinstance(step, TreeStep) else None
            rows = len(tree) + 1 if tree is not None else step.k + 1
            if s.wants_row_tokens:
                ids = tuple(tree.token_ids) if tree is not None else tuple(step.draft_ids)
                parents = tuple(tree.parents) if tree is not None else ()
                s.rows_out = (tuple(logits[first + 1 : first + rows].argmax(-1).tolist()), ids, parents)
            first += rows

    def _features(self, count: int) -> list[torch.Tensor | None]:
        """The last forward's features per feed (None where none were asked or the runner has none)."""
        return self.runner.last_features or [None] * count

    def _rule_step(self, proposal: DraftProposal, draft_probs: torch.Tensor | None, sampling: SamplingParams,
                   n: int) -> RuleStep | TreeStep:
        """A chain's step, or a tree's; a runner that cannot verify trees gets the tree's main chain."""
        if not proposal.parents:
            return RuleStep(proposal.token_ids, draft_probs, sampling, n)
        tree = proposal.tree
        if tree.is_chain:
            return RuleStep(tree.token_ids, None, sampling, n)
        if not self.runner.verifies_trees:
            return RuleStep(tuple(tree.token_ids[j] for j in tree.main_chain), None, sampling, n)
        return TreeStep(tree, sampling, n)

    def due_blocks(self, session_ids: Sequence[str]) -> list[tuple[str, list[tuple[int, bytes | PendingBlock]]]]:
        """The KV blocks of these sessions (those a batch just stepped) that have become full and
        valid since last asked: encoded, or, from device memory, on their way to the host (the
        store's writer encodes them: the model's thread never waits for a copy)."""
        if self.layout is None:
            return []
        b = self.layout.block_tokens
        out = []
        for session_id in dict.fromkeys(session_ids):
            s = self.sessions.peek(session_id)
            if s is None:
                continue
            full = s.valid_len // b
            if full > s.blocks_written:
                lo = s.blocks_written * b
                kv = self.runner.read_kv(s.cache, lo, full * b)
                if kv.device.type == "cpu":  # encoded now, from the cache itself
                    blocks = [(i, encode_block(self.layout, i * b, s.committed, kv[:, :, :, i * b - lo:(i + 1) * b - lo]))
                              for i in range(s.blocks_written, full)]
                else:  # one copy per session, started now; encoded by the store's writer once it has landed
                    host, tokens = HostCopy(kv), tuple(s.committed[:full * b])
                    blocks = [(i, PendingBlock(self.layout, i * b, tokens, host, i * b - lo))
                              for i in range(s.blocks_written, full)]
                s.blocks_written = full
                out.append((session_id, blocks))
        return out

    def early_exit(self, session_id: str, committed: Sequence[int], layers: Sequence[int]):
        """A layer-skip draft over a session's own cache (the lean runner): the logits [vocab] of
        ``committed``'s last row through ``layers`` alone, and ``step(token, position)`` giving the
        next rows'. Only positions past the session's committed ones are written (their keys in those
        layers, which its next verification overwrites). None where the session is gone, or where
        ``committed`` is not a continuation of what it has committed (a block planned before its
        last step: its rows would land on committed positions)."""
        state = self.sessions.peek(session_id)
        if state is None or self.decoder is None:
            return None
        valid = state.valid_len  # positions before it hold committed tokens' keys and values
        if len(committed) <= valid or list(committed[:valid]) != state.committed[:valid]:
            return None
        decoder, cache = self.decoder, state.cache
        logits = decoder.partial_forward(cache, list(committed[valid:]), valid, layers)[-1]
        return logits, lambda token, position: decoder.partial_forward(cache, [token], position, layers)[-1]

    def close(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id)
        if session is None:
            return False
        self.runner.free(session.cache)  # its KV slot is reused now, not when the garbage collector gets to it
        return True

    @property
    def kv_budget_tokens(self) -> int:
        budget = self.config.max_kv_tokens or self.config.max_sessions * self.loaded.context_length
        if self.paged is not None:  # no more than the page pool holds
            return min(budget, self.paged.kv_token_capacity(self.config.max_sessions))
        return budget

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value vectors of every layer for one token, as this engine stores them."""
        cfg = self.loaded.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        element = next(self.loaded.model.parameters()).element_size()
        return 2 * cfg.num_hidden_layers * heads * head_dim * element

    def kv_bytes_held(self) -> int:
        """Bytes of KV cache the sessions hold now (read by the metrics thread: retried if the table moves)."""
        if self.paged is not None:
            return self.paged.kv_bytes()  # device bytes of the pages in use
        for _ in range(3):
            try:
                return self.kv_bytes_per_token * sum(len(s.committed) for s in self.sessions.values())
            except RuntimeError:  # the table changed size while we read it
                continue
        return 0

    def kv_reserved_tokens(self) -> int:
        return sum(s.reserved_tokens for s in self.sessions.values())

    def _check_kv_budget(self, reserve: int, reserving: int = 0) -> None:
        """``reserving``: tokens that opens of the same prefill batch, not yet in the table, reserve."""
        self.sessions.reap_idle()  # an expired session's reservation is free again
        held, budget = self.kv_reserved_tokens() + reserving, self.kv_budget_tokens
        if reserve > budget:
            raise KVBudgetFull(f"this session needs {reserve} KV tokens (prompt + max_new_tokens), more than this verifier's "
                               f"whole budget of {budget}: ask for fewer tokens", ever_fits=False)
        if held + reserve > budget:
            raise KVBudgetFull(f"this verifier's KV budget is {budget} tokens and {held} are reserved by {len(self.sessions)} "
                               f"sessions; this one needs {reserve} (prompt + max_new_tokens): retry later, on another "
                               "replica, or ask for fewer tokens", ever_fits=True)

    def status(self) -> WorkerInfo:
        self.sessions.reap_idle()
        return WorkerInfo(len(self.sessions), self.loaded.path, self.loaded.vocab_size, self.loaded.context_length)
