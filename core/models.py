"""Loading Hugging Face causal LMs from local paths, and checking that two share a tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.core.cpu_features import check_dtype_supported
from specdec.core.errors import ModelMismatch, ModelNotFound, UnsupportedModel

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


def load_causal_lm(path: str | Path, dtype: str | torch.dtype = torch.float32, threads: int | None = None) -> LoadedModel:
    """Load ``AutoModelForCausalLM`` and ``AutoTokenizer`` from a local folder; never from a hub.

    ``dtype``: float32 (the default) or bfloat16 (a name or the dtype); bfloat16 only where the CPU
    computes it natively (cpuinfo avx512_bf16 or amx_bf16; elsewhere it is emulated, several times
    slower), else ValueError naming what the CPU has. The weights are loaded in that dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # servers log lines, not progress bars

    folder = Path(path)
    dtype = resolve_dtype(dtype)
    check_dtype_supported(dtype, f"model {folder}")  # before minutes of loading
    if not (folder / "config.json").is_file():
        raise ModelNotFound(f"no model at {folder}: expected a folder saved with save_pretrained (config.json, *.safetensors, tokenizer files)")
    if threads:
        torch.set_num_threads(threads)
    try:
        from transformers import AutoConfig

        check_exact_rollback(AutoConfig.from_pretrained(folder, local_files_only=True), folder)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"could not load a causal LM from {folder}: {exc}") from exc
    model.eval()
    context = int(getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return LoadedModel(str(folder), model, tokenizer, vocab, context)


def check_exact_rollback(config, folder: str | Path) -> None:
    """Refuse, at load, a model whose cache cannot be cut back to any length exactly.

    Speculation rolls the KV cache back after every rejection. A sliding-window layer that has
    filled its window has already dropped the entries a rollback would need (HF's cache then refuses
    to crop), and a recurrent layer (Mamba, linear attention) keeps no per-token state to cut.
    A window as long as the context never slides, so it is fine."""
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False and (not context or window < context):
        raise UnsupportedModel(
            f"model {folder} sets sliding_window={window} (config.json) below its context of {context} tokens: specdec "
            "cannot roll a sliding-window cache back exactly once the window fills. Serve a model without a sliding window "
            "(or, if it was trained with full attention, set sliding_window to null)")
    # Sliding layers are covered by the window check above; anything else but full attention is recurrent.
    recurrent = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if recurrent:
        raise UnsupportedModel(f"model {folder} has layer types {recurrent} (config.json layer_types): specdec serves only "
                               "layers whose cache can be cut back to any length (full attention)")


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
