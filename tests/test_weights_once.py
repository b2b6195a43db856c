"""A decoder that owns its model's weights (``LlamaDecoder(..., own_weights=True)``) leaves the process
holding each weight once, in the layout it runs with, and changes no logit: its own, the model's HF
forward's (which reads back what it lost), or the KV blocks' model fingerprint."""
from __future__ import annotations

import gc
import mmap
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specdec.core import llama_decode
from specdec.core.kv_blocks import model_fingerprint
from specdec.core.llama_decode import LlamaDecoder
from specdec.core.models import _file_mappings, weights_released

VOCAB = 384
IDS = [(i * 37) % VOCAB for i in range(40)]


@pytest.fixture(scope="module", params=["float32", "bfloat16"], ids=["mapped", "copied"])
def folder(request, tmp_path_factory):
    """A checkpoint transformers maps as it is (float32, loaded as float32) or converts into memory of
    its own (bfloat16 on disk, loaded as float32)."""
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=320, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.2)
    out = tmp_path_factory.mktemp(f"llama-{request.param}")
    LlamaForCausalLM(cfg).to(getattr(torch, request.param)).save_pretrained(out)
    return out


def load(folder) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()


def mapped_in(ptr: int, nbytes: int) -> int:
    """Bytes of the pages of [ptr, ptr + nbytes) present in this process (/proc/self/pagemap, bit 63)."""
    page = mmap.PAGESIZE
    first, last = ptr // page, (ptr + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(8 * first)
        entries = pagemap.read(8 * (last - first + 1))
    return page * sum(int.from_bytes(entries[i:i + 8], "little") >> 63 for i in range(0, len(entries), 8))


def resident_bytes(*roots: object) -> int:
    """Bytes of the distinct tensors reachable from ``roots`` (attributes, containers, closures) that
    occupy memory: a tensor mapped from a file counts its pages present in this process, a meta tensor nothing."""
    spans = _file_mappings()
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, (type, types.ModuleType, str, bytes, int, float)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_meta:
                continue
            if obj.is_mkldnn:  # a oneDNN-packed weight: no storage to name, its own memory
                storages[id(obj)] = obj.numel() * obj.element_size()
                continue
            ptr, nbytes = obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes()
            mapped = any(lo <= ptr < hi for lo, hi in spans)
            storages[ptr] = mapped_in(ptr, nbytes) if mapped and nbytes else nbytes
            continue
        if isinstance(obj, types.FunctionType):  # what it closes over, never its module's globals
            stack.extend(cell.cell_contents for cell in obj.__closure__ or ())
            stack.extend(obj.__defaults__ or ())
            continue
        if isinstance(obj, types.MethodType):
            stack.extend((obj.__self__, obj.__func__))
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decoder_logits(dec: LlamaDecoder) -> torch.Tensor:
    cache = dec.new_cache()
    first = dec.forward(cache, IDS[:30], 0)
    return torch.cat([first, dec.forward(cache, IDS[30:34], 30), dec.forward(cache, IDS[34:35], 34)])


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_an_owning_decoder_holds_each_weight_once_and_changes_no_logit(folder, numerics):
    model = load(folder)
    weights = param_bytes(model)
    with torch.inference_mode():
        hf_before = model(input_ids=torch.tensor([IDS])).logits[0]
    fingerprint = model_fingerprint(model, torch.float32)
    before = decoder_logits(LlamaDecoder(model, single_row="packed", multi_row="packed", numerics=numerics))
    gc.collect()
    plain = resident_bytes(model)
    dec = LlamaDecoder(model, single_row="packed", multi_row="packed", numerics=numerics, own_weights=True)
    gc.collect()
    # Before: the model's weights, read (so resident) if mapped. After: the decoder's layouts, plus
    # the embedding the two share (counted once), plus nothing of the model's.
    assert plain >= weights  # (a check of the count: the first decoder read every weight)
    assert resident_bytes(model, dec) <= 1.1 * weights, (resident_bytes(model, dec), weights, plain)
    assert torch.equal(decoder_logits(dec), before)
    assert model_fingerprint(model, torch.float32) == fingerprint  # what the verifier's KV blocks are named by
    assert next(model.parameters()).device.type == "cpu"
    with torch.inference_mode():
        hf_after = model(input_ids=torch.tensor([IDS])).logits[0]  # reads back whatever it lost
    assert torch.equal(hf_after, hf_before)
    assert not weights_released(model)
    again = LlamaDecoder(model, single_row="packed", multi_row="packed", numerics=numerics)  # a second decoder of the model
    assert torch.equal(decoder_logits(again), before)


def test_a_copied_checkpoint_is_released_and_read_back_only_when_its_forward_runs(folder):
    model = load(folder)
    mapped = "float32" in folder.name
    LlamaDecoder(model, single_row="packed", multi_row="packed", own_weights=True)
    q = model.model.layers[0].self_attn.q_proj.weight
    # mapped: the tensor stays (its pages were dropped, the file refills them); copied: it is gone
    assert weights_released(model) != mapped and q.is_meta != mapped
    assert not model.model.embed_tokens.weight.is_meta


def test_one_layout_per_weight_runs_one_kernel_when_measured_kernels_differ(folder, monkeypatch):
    """Timed kernels: one-row calls fastest on the plain weight, more rows on the packed one. By default
    a decoder keeps both layouts (two copies); with one layout per weight it runs one kernel for both,
    the one fastest over both row counts of those that run any rows, and keeps one copy."""
    fake = {1: {"packed": 5.0, "plain": 1.0, "transposed": 4.0, "native": 6.0},
            llama_decode.MEASURE_ROWS: {"packed": 1.0, "transposed": 3.0, "native": 2.0}}

    def timed(self, layouts, rows, names):
        return {name: [fake[rows][name]] * llama_decode.TIMED_REPS for name in names}

    monkeypatch.setattr(LlamaDecoder, "_time_kernels", timed)
    assert LlamaDecoder(load(folder)).kernels == ("plain", "packed")
    model = load(folder)
    dec = LlamaDecoder(model, own_weights=True, layouts_per_weight=1)
    assert dec.kernels == ("packed", "packed")  # 5 + 1 against transposed's 4 + 3
    for f in dec._layouts():
        assert f.weight is None and f.transposed is None and f.packed is not None
    assert resident_bytes(model, dec) <= 1.1 * param_bytes(model)


def test_a_model_without_a_folder_says_its_weights_are_gone():
    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=64)).eval()
    LlamaDecoder(model, own_weights=True)
    with pytest.raises(ValueError, match="load the model again"):
        model(input_ids=torch.tensor([IDS[:4]]))
