"""What ``specdec bench`` compares: its configuration and the methods, by name.

Shared by the run (specdec.bench), the runners (specdec.bench_runners) and the report
(specdec.bench_report); imports none of them.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from specdec.cli_common import eagle_head_path
from specdec.core.speculation import SpeculationMode, SpeculationPolicy

DEFAULT_KS = (1, 2, 3, 4, 5, 6, 7, 8)
MAX_ADAPTIVE_K = 8  # the adaptive upper bound, as `specdec generate` defaults it
BASELINE = "target_only"


@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str
    prompts: tuple[str, ...]
    max_new_tokens: int = 96
    ks: tuple[int, ...] = DEFAULT_KS
    methods: tuple[str, ...] = ()  # substrings or globs; empty: all. target_only always runs.
    distributed: bool = True
    redis_url: str = ""  # sessions of the distributed orchestrator; "": in its memory
    out: Path = Path("bench-results")
    prompt_source: str = ""
    threads: int | None = 1  # torch threads per model; None: in-process methods choose per forward, as `specdec generate` does
    draft_min_confidence: float = 0.0  # the drafter's --draft-min-confidence, in every method
    dtype: str = "float32"  # the target's, in specdec's methods (the transformers baseline stays float32)
    numerics: str = "auto"
    device: str = "cpu"  # the target's (resolved), the transformers baseline's too
    runner: str = "auto"  # the target's model runner (TargetConfig.runner)
    fast_forward: bool = True  # False: runner hf
    kv_memory_fraction: float | None = None  # the paged runner's page pool (TargetConfig.kv_memory_fraction)
    draft_device: str = "cpu"  # the draft's (resolved)
    draft_dtype: str = "float32"

    def target_fields(self) -> dict:
        """The TargetConfig fields every specdec method's target runs with."""
        return {"dtype": self.dtype, "numerics": self.numerics, "device": self.device, "runner": self.runner,
                "fast_forward": self.fast_forward, "kv_memory_fraction": self.kv_memory_fraction}

    def draft_fields(self) -> dict:
        """The DraftConfig fields every specdec method's drafter runs with."""
        return {"draft_device": self.draft_device, "draft_dtype": self.draft_dtype, "min_confidence": self.draft_min_confidence,
                "eagle_head_path": eagle_head_path(None, self.target)}

    @property
    def reference(self) -> str:
        """The method every output must equal: transformers in float32; specdec's own k = 0 in the
        target's dtype otherwise (bf16 logits differ from fp32 ones: docs/guarantees.md)."""
        return BASELINE if self.dtype == "float32" else "specdec_k0"


@dataclass(frozen=True)
class Method:
    name: str
    family: str
    policy: SpeculationPolicy | None = None  # None: target_only
    distributed: bool = False
    drafter: str = "model"  # the request's drafter: model (chains) or tree (token trees of k nodes)


TREE_BUDGETS = (3, 7, 15)


def policy(k: int | None, overlap: bool) -> SpeculationPolicy:
    """Fixed k, or adaptive (k None) starting at 4, up to MAX_ADAPTIVE_K."""
    if k is None:
        return SpeculationPolicy(SpeculationMode.ADAPTIVE, 4, MAX_ADAPTIVE_K, overlap=overlap)
    return SpeculationPolicy(SpeculationMode.FIXED, k, max(k, MAX_ADAPTIVE_K), overlap=overlap)


def all_methods(ks: tuple[int, ...], eagle: bool = False) -> list[Method]:
    """Every method; ``eagle``: with the EAGLE head's rows (the configuration has a head for its target)."""
    methods = [Method(BASELINE, "target only (HF)"), Method("specdec_k0", "specdec k=0", policy(0, False))]
    for where, dist in (("inproc", False), ("dist", True)):
        for mode, overlap in (("seq", False), ("overlap", True)):
            family = f"{'in-process' if where == 'inproc' else 'distributed'}, {'overlap' if overlap else 'sequential'}"
            fixed = (4,) if (where, mode) == ("inproc", "overlap") else ks
            methods += [Method(f"{where}_{mode}_k{k}", family, policy(k, overlap), dist) for k in fixed]
            methods.append(Method(f"{where}_{mode}_adaptive", family, policy(None, overlap), dist))
    # Token trees of k nodes (k + 1 verified rows; benchmarks/bench_trees.py compares them at equal rows).
    methods += [Method(f"inproc_seq_tree{k}", "in-process, sequential, token trees", policy(k, False), drafter="tree")
                for k in TREE_BUDGETS]
    methods.append(Method("dist_overlap_tree7", "distributed, overlap, token trees", policy(7, True), True, "tree"))
    # The drafters that need no model: prompt lookup, Jacobi iterates, lookahead trees.
    methods += [Method("inproc_seq_ngram_k4", "in-process, sequential, model-free", policy(4, False), drafter="ngram"),
                Method("inproc_seq_jacobi_k4", "in-process, sequential, model-free", policy(4, False), drafter="jacobi"),
                Method("inproc_seq_lookahead_tree7", "in-process, sequential, model-free", policy(7, False), drafter="lookahead"),
                Method("inproc_seq_layer_skip_k3", "in-process, sequential, the target's own layers", policy(3, False),
                       drafter="layer_skip")]
    if eagle:  # the head over the target's features, chains and trees, at the rows of the draft model's rows above
        methods += [Method(f"inproc_seq_eagle_k{k}", "in-process, sequential, EAGLE head", policy(k, False), drafter="eagle")
                    for k in (3, 4, 7)]
        methods += [Method(f"inproc_seq_eagle_tree{k}", "in-process, sequential, EAGLE head trees", policy(k, False),
                           drafter="eagle_tree") for k in TREE_BUDGETS]
        methods += [Method("dist_overlap_eagle_k4", "distributed, overlap, EAGLE head", policy(4, True), True, "eagle"),
                    Method("dist_overlap_eagle_tree7", "distributed, overlap, EAGLE head trees", policy(7, True), True, "eagle_tree")]
    return methods


def select(methods: list[Method], patterns: tuple[str, ...], always: tuple[str, ...] = (BASELINE,)) -> list[Method]:
    """Methods whose name contains a pattern or matches it as a glob; the baseline (and the
    reference, where it is not the baseline: ``always``) whatever the patterns."""
    def wanted(name: str) -> bool:
        return not patterns or any(p in name or fnmatch.fnmatchcase(name, p) for p in patterns)

    return [m for m in methods if m.name in always or wanted(m.name)]
