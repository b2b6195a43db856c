"""Loading Hugging Face causal LMs from local paths, checking that two share a tokenizer, and handing
a model's weights over to a decoder that holds them in its own layout (`release_weights`)."""
from __future__ import annotations

import bisect
import ctypes
import mmap
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.core.cpu_features import check_dtype_supported
from specdec.core.errors import ModelMismatch, ModelNotFound, UnsupportedModel
from specdec.core.native_kernels import weight_dtypes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what a model may run in on the CPU path


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype from its name in a config or on the command line (``float32`` | ``bfloat16``), or itself."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for inference, with the tokenizer it was trained with."""

    path: str
    model: "torch.nn.Module"
    tokenizer: object  # transformers.PreTrainedTokenizerBase
    vocab_size: int  # rows of the model's output layer (may exceed len(tokenizer))
    context_length: int  # max_position_embeddings: prompt plus generated tokens

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id


def load_causal_lm(path: str | Path, dtype: str | torch.dtype = torch.float32, threads: int | None = None,
                   device: str | torch.device = "cpu") -> LoadedModel:
    """Load ``AutoModelForCausalLM`` and ``AutoTokenizer`` from a local folder; never from a hub.

    ``dtype``: float32 (the default) or bfloat16 (a name or the dtype); on the CPU, bfloat16 only where
    the CPU computes it natively (cpuinfo avx512_bf16 or amx_bf16; elsewhere it is emulated, several
    times slower), else ValueError naming what the CPU has. The weights are loaded in that dtype,
    straight onto ``device`` (cpu, cuda, cuda:N).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # servers log lines, not progress bars

    folder = Path(path)
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    if device.type == "cpu":
        check_dtype_supported(dtype, f"model {folder}", weight_dtypes())  # before minutes of loading
    if not (folder / "config.json").is_file():
        raise ModelNotFound(f"no model at {folder}: expected a folder saved with save_pretrained (config.json, *.safetensors, tokenizer files)")
    if threads:
        torch.set_num_threads(threads)
    try:
        from transformers import AutoConfig

        check_exact_rollback(AutoConfig.from_pretrained(folder, local_files_only=True), folder)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **_placement(device))
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"could not load a causal LM from {folder}: {exc}") from exc
    if device.type != "cpu" and model.device.type == "cpu":  # loaded on the CPU (no accelerate): moved once
        model.to(device)
    model.eval()
    context = int(getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return LoadedModel(str(folder), model, tokenizer, vocab, context)


def _placement(device: torch.device) -> dict:
    """from_pretrained's arguments that put the weights on ``device`` as they load (no copy on the CPU
    first). transformers takes a device_map only with accelerate installed; without it the model loads
    on the CPU and `load_causal_lm` moves it."""
    import importlib.util

    if device.type == "cpu" or importlib.util.find_spec("accelerate") is None:
        return {}
    return {"device_map": str(device)}


def check_exact_rollback(config, folder: str | Path) -> None:
    """Refuse, at load, a model whose cache cannot be cut back to any length exactly.

    Speculation rolls the KV cache back after every rejection. A recurrent layer (Mamba, linear
    attention) keeps no per-token state to cut, so it is refused. Sliding-window attention (Mistral,
    Qwen2's sliding layers) is served: the paged runner (core/paged_runner.py) keeps every position
    of the cache and masks the keys older than the window, so a rollback never needs a dropped entry
    (a rolling buffer, such as HF's sliding cache, would; the verifier never uses one)."""
    # Anything but full or sliding attention is recurrent.
    recurrent = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if recurrent:
        raise UnsupportedModel(f"model {folder} has layer types {recurrent} (config.json layer_types): specdec serves only "
                               "layers whose cache can be cut back to any length (full or sliding-window attention)")


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer differs from the target's: its token ids would mean other strings."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(set(t_vocab.items()) - set(d_vocab.items()))
        only_d = len(set(d_vocab.items()) - set(t_vocab.items()))
        raise ModelMismatch(
            f"draft model {draft.path} has a different tokenizer from target {target.path} "
            f"({len(d_vocab)} vs {len(t_vocab)} tokens; {only_d} draft and {only_t} target entries differ): "
            "a draft model must share the target's tokenizer"
        )
    if target.tokenizer.eos_token_id != draft.tokenizer.eos_token_id:
        raise ModelMismatch(f"draft model {draft.path} has eos id {draft.tokenizer.eos_token_id}, target {target.tokenizer.eos_token_id}")


# ----------------------------------------------------------------------------- weights held once

MADV_DONTNEED = 4  # Linux madvise(2): drop a range's pages from this process (a file mapping refaults them from the page cache)
_RESTORE_HOOK = "_specdec_restore_hook"  # the attribute a released model keeps its forward pre-hook under


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of every file-backed mapping of this process, sorted (Linux; elsewhere none)."""
    if not sys.platform.startswith("linux"):
        return []
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):  # an inode and a path: a file
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
    return sorted(spans)


def _in_file(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    ptr = tensor.data_ptr()
    at = bisect.bisect_right(spans, (ptr, float("inf"))) - 1
    return at >= 0 and spans[at][0] <= ptr < spans[at][1]


class WeightRelease:
    """Stops ``model`` holding the parameters of the modules it is called with, in memory: a decoder
    holds them now, in its own layout (core/llama_decode.py, ``own_weights``).

    A parameter mapped from the checkpoint file keeps its tensor and loses its resident pages; any
    other becomes a meta tensor of its shape and dtype, and the model's own forward, if it ever runs
    (a reference check), first reloads its weights from its folder (`restore_weights`). ``keep``:
    tensors left as they are (the embedding: the decoder shares it, and ``model.device`` reads it)."""

    def __init__(self, model: torch.nn.Module, keep: Iterable[torch.Tensor] = ()) -> None:
        self.model = model
        self.kept = {id(t) for t in keep}
        self.spans = _file_mappings()  # the checkpoint's mapping is made at load and stays: read once
        self.libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
        self.trim = getattr(self.libc, "malloc_trim", None)  # glibc's; musl has none

    def trim_heap(self) -> None:
        """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op elsewhere)."""
        if self.trim is not None:
            self.trim(0)

    def __call__(self, *modules: torch.nn.Module) -> None:
        released = False
        mapped: list[tuple[int, int]] = []
        for module in modules:
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) in self.kept or param.is_meta:
                    continue
                if _in_file(param, self.spans):
                    mapped.append((param.data_ptr(), param.data_ptr() + param.numel() * param.element_size()))
                    continue
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
                released = True
        self._drop_pages(mapped)
        # A fused copy freed once packed stays in the C heap's free lists otherwise: reused by the
        # next layer's, but its pages stay with the process and add to the peak at load.
        self.trim_heap()
        if released and getattr(self.model, _RESTORE_HOOK, None) is None:
            setattr(self.model, _RESTORE_HOOK, self.model.register_forward_pre_hook(lambda m, args: restore_weights(m)))

    def _drop_pages(self, ranges: list[tuple[int, int]]) -> None:
        """Drop the whole pages of byte ranges [start, end) of file mappings from this process's memory.

        transformers maps a safetensors checkpoint whose dtype it keeps instead of copying it: a
        weight costs resident memory once read, and stays resident while mapped. Dropped pages stay
        in the page cache, and a later read of a tensor there faults them back in: the tensors stay
        valid (reading what the file holds: a weight changed in place after loading would lose it). Ranges are merged first (a checkpoint stores a layer's tensors side by side), so only
        the edge pages of a run, which a neighbour may share, stay."""
        if self.libc is None:
            return
        page = mmap.PAGESIZE
        merged: list[list[int]] = []
        for start, end in sorted(ranges):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            first, last = -(-start // page) * page, end // page * page
            if last > first:
                self.libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


def release_weights(model: torch.nn.Module, modules: Iterable[torch.nn.Module], keep: Iterable[torch.Tensor] = ()) -> None:
    """`WeightRelease` of ``modules`` at once."""
    WeightRelease(model, keep)(*modules)


def weights_released(model: torch.nn.Module) -> bool:
    return getattr(model, _RESTORE_HOOK, None) is not None


def restore_weights(model: torch.nn.Module) -> None:
    """Give a model whose weights `release_weights` took them back, from the folder it was loaded from."""
    hook = getattr(model, _RESTORE_HOOK, None)
    if hook is None:
        return
    from transformers import AutoModelForCausalLM

    folder = getattr(model, "name_or_path", "")
    if not folder or not (Path(folder) / "config.json").is_file():
        raise ValueError("this model's weights were handed to a decoder (own_weights) and it has no folder to "
                         "reload them from: load the model again to run its own forward")
    dtype = next(model.parameters()).dtype
    fresh = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    for name, param in model.named_parameters():
        if param.is_meta:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = fresh.get_parameter(name)
    hook.remove()
    setattr(model, _RESTORE_HOOK, None)
