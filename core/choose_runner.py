"""Which model runner serves a model: one rule for the verifier and the drafter alike.

- "lean" (core/llama_decode.py): a plain Llama on the CPU, every sequence's keys in a slot slab;
- "paged" (core/paged_runner.py): the Llama family (Qwen2's biases, Mistral's sliding windows) on
  any device, keys in a page pool; on CUDA it replays CUDA graphs;
- "hf": the transformers forward, for any other architecture and as the reference (``fast_forward``
  off). Its sliding-window cache drops what a rollback needs, so a windowed model never runs on it.

How a runner computes (fast or exact numerics, oneDNN, C, Triton or fixed tiles) is its own choice,
made once at load; this picks only the runner.
"""
from __future__ import annotations

import torch

from specdec.core.errors import UnsupportedModel
from specdec.core.llama_decode import supports as lean_supports
from specdec.core.paged_runner import layer_windows
from specdec.core.paged_runner import supports as paged_supports

RUNNERS = ("auto", "lean", "paged", "hf")


def has_sliding_window(model: torch.nn.Module) -> bool:
    return any(w is not None for w in layer_windows(model.config, model.config.num_hidden_layers))


def choose_runner(model: torch.nn.Module, runner: str = "auto", fast_forward: bool = True) -> str:
    """lean | paged | hf for ``model`` on its own device. ``runner``: one of `RUNNERS` (auto: the rule
    in the module's docstring); ``fast_forward`` off: the transformers forward, unless a runner is named."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}")
    if runner == "lean" and not lean_supports(model):
        raise ValueError(f"the lean runner serves plain Llamas, not {type(model).__name__}: use runner auto or paged")
    if runner == "paged" and not paged_supports(model):
        raise ValueError(f"the paged runner does not serve {type(model).__name__}: use runner auto or hf")
    if runner != "auto":
        kind = runner
    elif not fast_forward:
        kind = "hf"
    elif model.device.type != "cpu":
        kind = "paged" if paged_supports(model) else "hf"
    else:
        kind = "lean" if lean_supports(model) else "paged" if paged_supports(model) else "hf"
    if kind == "hf" and has_sliding_window(model):
        raise UnsupportedModel(f"{type(model).__name__} has a sliding window (sliding_window="
                               f"{model.config.sliding_window}): only the paged runner rolls it back exactly; "
                               "use runner auto or paged, with fast_forward on")
    return kind
