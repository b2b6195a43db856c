"""Layer-skip self-speculation (drafter ``layer_skip``): the target drafts for itself with a subset of
its own layers and its own LM head (LayerSkip's early exit, Elhoushi et al. 2024; SWIFT's skipped
layers, Xia et al. 2024). No draft model: the draft worker loads the target's weights and runs the
chosen layers on the lean forward, with its own KV cache and the model drafter's exact rollback.

The layers are chosen by measurement when the drafter is built (``layer_skip="auto"``): the full
target greedily continues a fixed code prompt; every candidate subset (each early exit, and each
single skipped layer between the first and the last) is scored by how often its greedy token equals
the full target's on that continuation (teacher-forced: the acceptance alpha a greedy chain of its
drafts would see) and by its measured one-row step time against the full target's (c), and the
subset with the best bound max over k of E(alpha, k) / (k c + 1) drafts. ``layer_skip="0,1,3"``
names the layers instead. Drafts are the model drafter's (greedy, coupled or sampled with their
exact distribution), so every rule verifies them exactly.

Inside the verifier (`serve target --in-verifier-drafters layer_skip`, lean runner) the drafter is
`SharedLayerSkipDrafter`: no second copy of anything. It runs the first L layers of the verifier's
own decoder (an early exit, L chosen by the same measurement on that decoder) over the session's
own KV cache there: the committed tokens' keys and values of those layers are the target's own, and
its draft rows write theirs past the committed positions (`LlamaDecoder.partial_forward`), where
the next verification overwrites every layer. It never moves the session's valid length, so
rolling back is free: the committed positions are never written (`tests/test_layer_skip.py`).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import torch

from specdec.core.models import load_causal_lm
from specdec.core.runner import HFRunner, crop_to
from specdec.core.sampling import SamplingParams
from specdec.core.speculation import expected_tokens
from specdec.core.steps import DraftProposal
from specdec.draft.base import DraftConfig
from specdec.draft.model_drafter import ModelDrafter, ModelDraftSession, draft_chain, resolve_draft_dtype

CALIBRATION_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and run.\"\"\"\n"
CALIBRATION_TOKENS = 96  # the full target's greedy continuation the subsets are scored on
MAX_K = 8


def use_layers(model: torch.nn.Module, layers: Sequence[int], all_layers: Sequence[torch.nn.Module]) -> None:
    """Make ``model`` run only ``layers`` of ``all_layers`` (the same modules: no weights copied)."""
    model.model.layers = torch.nn.ModuleList([all_layers[i] for i in layers])
    model.config.num_hidden_layers = len(layers)
    for place, layer in enumerate(model.model.layers):  # a layer's index into the cache is its place in the subset
        layer.self_attn.layer_idx = place
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in layers]


def candidates(n: int) -> list[list[int]]:
    """Each early exit (after 1 .. n - 1 layers) and each single skipped layer other than the first and last."""
    exits = [list(range(stop)) for stop in range(1, n)]
    skips = [[i for i in range(n) if i != skipped] for skipped in range(1, n - 1)]
    return exits + skips


def speedup_bound(alpha: float, cost: float) -> float:
    """max over k of E(alpha, k) / (k c + 1): verification priced as one step (an upper bound)."""
    return max(expected_tokens(alpha, k) / (k * cost + 1.0) for k in range(MAX_K + 1))


@torch.inference_mode()
def choose_layers(model: torch.nn.Module, tokenizer, all_layers: Sequence[torch.nn.Module]) -> tuple[list[int], dict]:
    """The subset with the best measured bound, and every candidate's figures."""
    n = len(all_layers)
    ids = torch.tensor([tokenizer(CALIBRATION_PROMPT)["input_ids"]])
    full = model.generate(ids, max_new_tokens=CALIBRATION_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    want = model(full).logits[0, ids.shape[1] - 1 : -1].argmax(-1)  # the full target's tokens, teacher-forced
    full_time = _step_time(model, full)
    scores = {}
    for layers in candidates(n):
        use_layers(model, layers, all_layers)
        got = model(full).logits[0, ids.shape[1] - 1 : -1].argmax(-1)
        alpha = float((got == want).float().mean())
        cost = _step_time(model, full) / full_time
        scores[",".join(map(str, layers))] = {"alpha": round(alpha, 3), "cost": round(cost, 3),
                                              "bound": round(speedup_bound(alpha, cost), 3)}
    use_layers(model, range(n), all_layers)
    best = max(scores, key=lambda name: scores[name]["bound"])
    return [int(i) for i in best.split(",")], scores


def _step_time(model: torch.nn.Module, ids: torch.Tensor, reps: int = 15) -> float:
    """Median seconds of one new token after ``ids`` (the cost of a draft step, with its cache)."""
    runner = HFRunner(model)  # (its name for the forward's cache argument, which transformers renamed)
    cache = runner.new_cache()
    model(ids[:, :-1], use_cache=True, **{runner.cache_arg: cache})
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(ids[:, -1:], use_cache=True, **{runner.cache_arg: cache})
        times.append(time.perf_counter() - t0)
        crop_to(cache, ids.shape[1] - 1)
    return statistics.median(times)


class LayerSkipDrafter:
    name = "layer_skip"

    def __init__(self, drafter: ModelDrafter, layers: list[int], scores: dict | None = None) -> None:
        self._drafter = drafter
        self.layers, self.scores = layers, scores or {}
        self.vocab_size = drafter.vocab_size
        self.loaded = drafter.loaded
        self.runner = drafter.runner

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> ModelDraftSession:
        return self._drafter.open(prompt_ids, sampling)

    def open_many(self, opens: Sequence[tuple[Sequence[int], SamplingParams]]) -> list[ModelDraftSession]:
        return self._drafter.open_many(opens)


def build(config: DraftConfig) -> LayerSkipDrafter | None:
    """The registry's factory: None unless ``layer_skip`` is set ("auto" or layer indices) and the target is known."""
    if not config.layer_skip or not config.target_model_path:
        return None
    loaded = load_causal_lm(config.target_model_path, threads=config.threads)
    model = loaded.model
    all_layers = list(model.model.layers)
    if config.layer_skip == "auto":
        layers, scores = choose_layers(model, loaded.tokenizer, all_layers)
    else:
        layers, scores = sorted({int(i) for i in config.layer_skip.split(",")}), None
        if not layers or layers[0] < 0 or layers[-1] >= len(all_layers):
            raise ValueError(f"layer_skip names layers in [0, {len(all_layers)}), got {config.layer_skip!r}")
    use_layers(model, layers, all_layers)
    drafter = ModelDrafter(loaded, config.proposal_top_k, fast=config.fast_draft_forward, dtype=resolve_draft_dtype(config.draft_dtype),
                           min_confidence=config.min_confidence, max_sessions=config.max_sessions)
    return LayerSkipDrafter(drafter, layers, scores)


class SharedLayerSkipSession:
    def __init__(self, verifier, session_id: str, layers: list[int], sampling: SamplingParams, top_k: int) -> None:
        self._verifier, self._session_id, self._layers = verifier, session_id, layers
        self._sampling, self._top_k = sampling, top_k

    def propose(self, committed: Sequence[int], num_speculative_tokens: int, num_alternatives: int = 0,
                interrupt=None) -> DraftProposal:
        t0 = time.perf_counter_ns()
        if num_speculative_tokens <= 0:
            return DraftProposal(())
        # (the verifier's engine runs it over the session's own cache; this runs on the model thread, in turn)
        opened = self._verifier.early_exit(self._session_id, committed, self._layers)
        if opened is None:  # the session is gone, or has moved past what this block was planned after
            return DraftProposal((), None, time.perf_counter_ns() - t0)
        logits, step = opened
        proposal = draft_chain(logits, len(committed), num_speculative_tokens, self._sampling, self._top_k, num_alternatives,
                               step, interrupt)
        return dataclasses.replace(proposal, draft_time_ns=time.perf_counter_ns() - t0)


class SharedLayerSkipDrafter:
    """``layer_skip`` inside the verifier: its decoder's first layers over its sessions' own caches."""

    name = "layer_skip"

    def __init__(self, verifier, layers: list[int], proposal_top_k: int, scores: dict | None = None) -> None:
        self._verifier, self.layers, self.scores = verifier, layers, scores or {}
        self.vocab_size = verifier.loaded.vocab_size
        self._top_k = proposal_top_k

    def open_for(self, spec) -> SharedLayerSkipSession:
        return SharedLayerSkipSession(self._verifier, spec.session_id, self.layers, spec.sampling, self._top_k)

    def open(self, prompt_ids: Sequence[int], sampling: SamplingParams):
        raise TypeError("the in-verifier layer_skip drafter opens per session (open_for): it drafts over the verifier's own cache")


@torch.inference_mode()
def choose_exit(decoder, tokenizer) -> tuple[list[int], dict]:
    """The early exit (the first L layers) with the best measured bound, on ``decoder`` itself: the
    full forward's greedy continuation of the calibration prompt, each exit's teacher-forced
    agreement with it, each exit's one-row step time against the full forward's."""
    ids = list(tokenizer(CALIBRATION_PROMPT)["input_ids"])
    cache = decoder.private_cache()
    logits = decoder.forward(cache, ids, 0, 1)[-1]
    seq = list(ids)
    for _ in range(CALIBRATION_TOKENS):
        seq.append(int(logits.argmax()))
        logits = decoder.forward(cache, seq[-1:], len(seq) - 1, 1)[-1]
    want = torch.tensor(seq[len(ids):])
    full_time = _decoder_step_time(lambda c, t, p: decoder.forward(c, t, p, 1), decoder, seq)
    scores = {}
    for stop in range(1, len(decoder.layers)):
        layers = list(range(stop))
        got = decoder.partial_forward(decoder.private_cache(), seq, 0, layers)[len(ids) - 1 : -1].argmax(-1)
        alpha = float((got == want).float().mean())
        cost = _decoder_step_time(lambda c, t, p: decoder.partial_forward(c, t, p, layers), decoder, seq) / full_time
        scores[",".join(map(str, layers))] = {"alpha": round(alpha, 3), "cost": round(cost, 3),
                                              "bound": round(speedup_bound(alpha, cost), 3)}
    best = max(scores, key=lambda name: scores[name]["bound"])
    return [int(i) for i in best.split(",")], scores


def _decoder_step_time(step, decoder, seq: list[int], reps: int = 15) -> float:
    """Median seconds of one new row after ``seq`` on ``decoder``'s forward ``step(cache, tokens, position)``."""
    cache = decoder.private_cache()
    decoder.forward(cache, seq[:-1], 0, 1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step(cache, seq[-1:], len(seq) - 1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shared_in_verifier(verifier, config: DraftConfig) -> SharedLayerSkipDrafter:
    """The in-verifier drafter over ``verifier`` (a VerifierEngine on the lean runner)."""
    decoder = verifier.decoder
    if decoder is None:
        raise ValueError("layer_skip inside the verifier needs the lean runner (a plain Llama on the CPU); "
                         "run it on a draft worker instead (serve draft --layer-skip auto)")
    if config.layer_skip in ("", "auto"):
        layers, scores = choose_exit(decoder, verifier.loaded.tokenizer)
    else:
        layers, scores = sorted({int(i) for i in config.layer_skip.split(",")}), None
        if not layers or layers[0] < 0 or layers[-1] >= len(decoder.layers):
            raise ValueError(f"layer_skip names layers in [0, {len(decoder.layers)}), got {config.layer_skip!r}")
    return SharedLayerSkipDrafter(verifier, layers, config.proposal_top_k, scores)
