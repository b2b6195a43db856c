"""Which modules of specdec.core are pure: the algorithms, apart from model runtime and adapters.

A pure module computes on plain values and tensors. It imports no grpc, protobuf or redis, and
nothing of the project outside specdec.core (no drafter or verifier, no orchestrator, no CLI, no
gRPC edge), not inside a function either, and neither does any module it imports
(tests/test_import_cycles.py walks them with ``ast``). The rest of core is model runtime (runners,
KV caches, kernels, model loading) or adapters (Redis, threads, the allocator).

A new algorithm module of core is added here.
"""
from __future__ import annotations

PURE_MODULES: frozenset[str] = frozenset({
    # the rules: which drafts are accepted, what is committed
    "rejection", "coupled", "batch_rules", "tree_rules",
    # sampling, and the counter-based randomness every draw is keyed by
    "sampling", "rng", "noise",
    # speculation control: k per request and under load, torch threads per forward, by measurement
    "speculation", "goodput", "ewfit", "threads",
    # records: the messages between roles, sessions, overlap bookkeeping, token trees, errors
    "steps", "sessions", "overlap", "tree", "features", "errors",
})
