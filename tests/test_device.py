"""Device and dtype everywhere (issue 27, 1), checked without a GPU.

* Every tensor the rules, the noise and the samplers make is made on the logits' device: they run
  under ``with torch.device("meta")``, which sends every tensor made without an explicit device to
  the meta device, while the logits are real CPU tensors; a tensor made without ``device=`` then
  meets a CPU tensor and fails loudly. The outcomes must also equal those made outside the context.
* Decisions leave the device once per verify step, not once per session: the calls that copy a
  tensor to the host (or sync with the device) inside decide_batch are counted.
* The command line resolves --device/--draft-device/--dtype/--draft-dtype/--runner/
  --kv-memory-fraction in one place, with usage errors that say what torch sees.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specdec import cli_common
from specdec.cli_common import UsageError, draft_placement, resolve_device, resolve_dtype_for, target_placement
from specdec.core.batch_rules import RuleStep, decide_batch, decide_one
from specdec.core.sampling import SamplingParams, VerificationRule
from test_batch_rules import random_batch
from test_cli import in_process

VOCAB = 120


# ----------------------------------------------------------------------------- tensors on the logits' device
def sampled(rule: VerificationRule, seed: int, temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature, top_k, top_p, seed, rule)


def mixed_batch(sessions: int, vocab: int = VOCAB, seed: int = 7) -> tuple[torch.Tensor, list[RuleStep]]:
    """Every rule, k from 0 to 4, top-k and top-p filters, draft distributions sent and not: [sum(k+1), vocab]."""
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(),
              sampled(VerificationRule.COUPLED, 11, 0.7, top_k=20),
              sampled(VerificationRule.REJECTION, 12, 1.2, top_p=0.9),
              sampled(VerificationRule.COUPLED, 13, 1.0, top_p=0.5),
              sampled(VerificationRule.REJECTION, 14, 0.5, top_k=5, top_p=0.8)]
    steps, rows = [], []
    for i in range(sessions):
        k = i % 5
        logits = torch.randn(k + 1, vocab, generator=g) * 3
        draft_ids = tuple(int(t) for t in logits[:k].argmax(-1))  # mostly accepted: every path is taken
        if i % 3 == 2 and k:
            draft_ids = (*draft_ids[:-1], (draft_ids[-1] + 1) % vocab)  # a rejection
        probs = None
        if i % 2 and k:
            probs = torch.rand(k, vocab, generator=g)
            probs = probs / probs.sum(-1, keepdim=True)
        steps.append(RuleStep(draft_ids, probs, params[i % len(params)], 40 + 3 * i))
        rows.append(logits)
    return torch.cat(rows), steps


@pytest.mark.parametrize("sessions", [1, 2, 8])
def test_rules_make_every_tensor_on_the_logits_device(sessions):
    logits, steps = mixed_batch(sessions)
    expected = decide_batch(logits, steps)
    with torch.device("meta"):  # any tensor made without device= lands here and cannot meet the CPU logits
        assert decide_batch(logits, steps) == expected
        row = 0
        for step in steps:  # the per-session rules too (decide_batch's path for one step)
            assert decide_one(logits[row : row + step.k + 1], step) == decide_batch(logits[row : row + step.k + 1], [step])[0]
            row += step.k + 1


def test_random_batches_decide_the_same_under_a_meta_default_device():
    r = random.Random(27)
    for _ in range(8):
        logits, steps = random_batch(r, r.randint(2, 12), r.randint(50, 200))
        expected = decide_batch(logits, steps)
        with torch.device("meta"):
            assert decide_batch(logits, steps) == expected


def test_noise_and_uniforms_land_on_the_device_asked_for():
    from specdec.core import rng
    from specdec.core.noise import gumbel_noise

    with torch.device("meta"):
        noise = gumbel_noise(5, range(3), 50, "cpu")
        uniforms = rng.uniforms(5, rng.Stream.ACCEPT, range(3), "cpu")
    assert noise.device.type == uniforms.device.type == "cpu"
    assert torch.equal(noise, gumbel_noise(5, range(3), 50))  # computed on the CPU wherever it goes
    assert gumbel_noise(5, range(3), 50, "meta").device.type == "meta"


def test_rejection_sample_makes_its_tensors_on_the_inputs_device():
    from specdec.core.rejection import rejection_sample

    g = torch.Generator().manual_seed(3)
    target = torch.softmax(torch.randn(2, 4, 30, generator=g), -1)
    drafts = torch.randint(30, (2, 3), generator=g)
    args = dict(draft_token_ids=drafts, draft_probs=None, target_probs=target,
                accept_uniforms=torch.rand(2, 3, generator=g, dtype=torch.float64),
                sample_uniforms=torch.rand(2, 4, generator=g, dtype=torch.float64))
    expected = rejection_sample(**args)
    with torch.device("meta"):
        output, accepted = rejection_sample(**args)
    assert torch.equal(output, expected[0]) and torch.equal(accepted, expected[1])


# ----------------------------------------------------------------------------- the draft's proposals
class _Logits:
    """A stand-in for a session's KV cache: fixed CPU logits per sequence length."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def logits_for(self, seq, num_last):
        g = torch.Generator().manual_seed(len(seq))
        return torch.randn(num_last, self.vocab, generator=g, device="cpu") * 2


@pytest.mark.parametrize("sampling", [SamplingParams(), sampled(VerificationRule.COUPLED, 3, top_k=10),
                                      sampled(VerificationRule.REJECTION, 4, 0.9, top_p=0.8)],
                         ids=["greedy", "coupled", "rejection"])
@pytest.mark.parametrize("min_confidence", [0.0, 0.05])
def test_draft_proposals_make_every_tensor_on_the_logits_device(tiny_pair, sampling, min_confidence):
    from specdec.draft.drafters import DraftConfig
    from specdec.draft.model_drafter import build

    drafter = build(DraftConfig(tiny_pair[1], fast_draft_forward=False, min_confidence=min_confidence))
    session = drafter.open([1, 2, 3], sampling)
    expected = session.propose([1, 2, 3, 4], 4, num_alternatives=2)
    fake = drafter.open([1, 2, 3], sampling)
    fake._kv = _Logits(drafter.vocab_size)
    with_fake = fake.propose([1, 2, 3, 4], 4, num_alternatives=2)
    with torch.device("meta"):
        # Through the model's own forward (the draft's path on a GPU), and the picking alone.
        assert session.propose([1, 2, 3, 4], 4, num_alternatives=2).token_ids == expected.token_ids
        proposal = fake.propose([1, 2, 3, 4], 4, num_alternatives=2)
    assert (proposal.token_ids, proposal.distributions, proposal.alternatives) == \
        (with_fake.token_ids, with_fake.distributions, with_fake.alternatives)


# ----------------------------------------------------------------------------- transfers to the host
# Tensor methods that copy to the host or wait for the device (where the logits are on a GPU).
HOST_CALLS = {"tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "nonzero",
              "masked_select", "unique"}


class HostTransfers(TorchFunctionMode):
    """Counts the calls that bring a tensor's values to the host; indexing by a boolean mask counts too
    (its size is data-dependent: a sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_CALLS:
            self.calls.append(name)
        elif name in ("__getitem__", "__setitem__") and _has_mask(args[1]):
            self.calls.append(f"{name}[mask]")
        return func(*args, **(kwargs or {}))


def _has_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@pytest.mark.parametrize("sessions", [1, 8, 32])
def test_one_transfer_to_the_host_per_verify_step_whatever_the_sessions(sessions):
    logits, steps = mixed_batch(sessions)
    with HostTransfers() as counter:
        decide_batch(logits, steps)
    assert counter.calls == ["tolist"], counter.calls


@pytest.mark.parametrize("rule", ["greedy", "coupled", "rejection"])
def test_each_rule_alone_transfers_once(rule):
    logits, steps = mixed_batch(15)
    mine = [s for s in steps if ("greedy" if s.sampling.greedy else "coupled" if s.sampling.coupled else "rejection") == rule]
    rows, row = [], 0
    for s in steps:
        if s in mine:
            rows.append(logits[row : row + s.k + 1])
        row += s.k + 1
    for batch in (mine[:1], mine):
        with HostTransfers() as counter:
            decide_batch(torch.cat(rows[: len(batch)]), batch)
        assert counter.calls == ["tolist"], (rule, len(batch), counter.calls)


# ----------------------------------------------------------------------------- command line
@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_auto_is_the_cpu_without_cuda_and_float32_there(no_cuda):
    assert resolve_device("auto") == resolve_device(None) == "cpu"
    assert resolve_dtype_for("cpu", "auto") == resolve_dtype_for("cpu", None) == "float32"
    assert target_placement(None, None) == {"device": "cpu", "runner": "auto", "fast_forward": True,
                                            "kv_memory_fraction": None, "dtype": "float32", "numerics": "auto"}
    assert draft_placement(None, None) == {"draft_device": "cpu", "draft_dtype": "float32"}


def test_auto_is_cuda_where_visible_and_bfloat16_there(two_gpus):
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda:1") == "cuda:1"
    assert resolve_dtype_for("cuda", "auto") == resolve_dtype_for("cuda:1", None) == "bfloat16"
    assert resolve_dtype_for("cuda", "float32") == "float32"
    placed = target_placement("auto", None, kv_memory_fraction=0.8)  # auto runs the paged runner on CUDA
    assert placed["device"] == "cuda" and placed["dtype"] == "bfloat16" and placed["kv_memory_fraction"] == 0.8
    with pytest.raises(UsageError, match="--runner lean has none"):
        target_placement("cuda", None, runner="lean", kv_memory_fraction=0.8)
    with pytest.raises(UsageError, match=r"--device cuda:2: torch sees 2 CUDA devices \(cuda:0 \.\. cuda:1\)"):
        resolve_device("cuda:2")


def test_cuda_asked_where_none_is_visible_says_what_torch_sees(no_cuda):
    with pytest.raises(UsageError, match="--draft-device cuda: no CUDA device is available to this torch") as err:
        resolve_device("cuda", "--draft-device")
    assert torch.__version__ in str(err.value) and "0 CUDA devices visible" in str(err.value)
    assert ("CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}") in str(err.value)


def test_bfloat16_on_a_cpu_without_native_bf16_keeps_its_error(monkeypatch):
    from specdec.core import cpu_features

    from specdec.core import native_kernels

    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)
    monkeypatch.setattr(native_kernels, "weight_dtypes", lambda: ())  # (with them, bf16 weights run in C: tests/test_half_weights.py)
    with pytest.raises(UsageError, match="--draft-dtype bfloat16 needs a CPU with native bf16"):
        resolve_dtype_for("cpu", "bfloat16", "--draft-dtype")
    assert resolve_dtype_for("cuda", "bfloat16") == "bfloat16"  # not the CPU's business


def test_runner_flags_are_checked_together(no_cuda):
    assert target_placement("cpu", None, reference_forward=True)["runner"] == "hf"
    assert target_placement("cpu", None, runner="hf")["fast_forward"] is False
    with pytest.raises(UsageError, match="--reference-forward is --runner hf"):
        target_placement("cpu", None, runner="lean", reference_forward=True)
    with pytest.raises(UsageError, match="from a CUDA device's free memory"):
        target_placement("cpu", None, runner="paged", kv_memory_fraction=0.5)  # the CPU's pool follows the budget
    with pytest.raises(UsageError, match="--numerics exact needs specdec's lean forward"):
        target_placement("cpu", None, "exact", runner="hf")


@pytest.mark.parametrize("flags, named", [(("--device", "gpu"), "--device"), (("--draft-device", "cuda:x"), "--draft-device"),
                                          (("--dtype", "float16"), "--dtype"), (("--draft-dtype", "fp8"), "--draft-dtype"),
                                          (("--runner", "vllm"), "--runner"), (("--kv-memory-fraction", "1"), "--kv-memory-fraction")])
def test_bad_values_are_refused_by_argparse(flags, named, capsys):
    code, _, err = in_process("generate", "x", *flags, capsys=capsys)
    assert code == 2 and named in err


def test_cuda_without_one_is_a_usage_error_before_any_load(no_cuda, tiny_pair, capsys):
    target, draft = tiny_pair
    code, _, err = in_process("generate", "x", "--target", target, "--draft", draft, "--device", "cuda", capsys=capsys)
    assert code == 2 and "specdec: --device cuda: no CUDA device is available" in err and "Traceback" not in err
    code, _, err = in_process("bench", "--target", target, "--draft", draft, "--draft-device", "cuda:0",
                              "--skip-distributed", capsys=capsys)
    assert code == 2 and "--draft-device cuda:0: no CUDA device" in err


def test_generate_with_explicit_cpu_flags_gives_the_default_output(tiny_pair, capsys):
    target, draft = tiny_pair
    common = ("generate", "def add(a, b):", "--target", target, "--draft", draft, "--max-new-tokens", "10", "-k", "3", "--json",
              "--threads", "1")
    code, stdout, stderr = in_process(*common, capsys=capsys)
    assert code == 0, stderr
    default = json.loads(stdout)["token_ids"]
    code, stdout, stderr = in_process(*common, "--device", "cpu", "--draft-device", "cpu", "--dtype", "auto",
                                      "--draft-dtype", "auto", "--runner", "auto", capsys=capsys)
    assert code == 0, stderr
    assert json.loads(stdout)["token_ids"] == default


@pytest.mark.parametrize("topology, processes", [("colocated", 2), ("split", 3)])
def test_up_passes_every_process_the_resolved_placement(no_cuda, monkeypatch, tiny_pair, topology, processes):
    from specdec import cli, up

    started = []

    class Exited:  # a process that has already exited: `up` stops at once
        returncode = 0

        def __init__(self, argv, env=None):
            started.append(argv)

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(up.subprocess, "Popen", Exited)
    monkeypatch.setattr(up.signal, "signal", lambda *a: None)
    target, draft = tiny_pair
    assert cli.main(["up", "--target", target, "--draft", draft, "--draft-device", "cpu", "--topology", topology]) == 1
    assert len(started) == processes
    for argv in started:
        flags = dict(zip(argv, argv[1:]))
        assert (flags["--device"], flags["--dtype"], flags["--draft-device"], flags["--draft-dtype"], flags["--runner"]) == \
            ("cpu", "float32", "cpu", "float32", "auto")


def test_serve_draft_takes_device_for_the_drafts_when_draft_device_is_absent(no_cuda, capsys):
    code, _, err = in_process("serve", "draft", "--no-draft-model", "--device", "cuda", "--port", "0", capsys=capsys)
    assert code == 2 and "--device cuda: no CUDA device" in err  # the draft's device, refused by its own flag's name


# ----------------------------------------------------------------------------- loading onto a device
@pytest.fixture
def without_accelerate(monkeypatch):
    """Loads as where accelerate is not installed: on the CPU, then moved (a device_map cannot say meta)."""
    from specdec.core import models

    monkeypatch.setattr(models, "_placement", lambda device: {})


def test_models_load_onto_the_device_asked_for(tiny_pair, monkeypatch, without_accelerate):
    from specdec.core import cpu_features, models
    from specdec.core.models import load_causal_lm

    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)
    monkeypatch.setattr(models, "weight_dtypes", lambda: ())
    # Off the CPU the CPU's bf16 check does not apply; meta stands in for a GPU here.
    loaded = load_causal_lm(tiny_pair[1], "bfloat16", device="meta")
    assert {p.device.type for p in loaded.model.parameters()} == {"meta"}
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="native bf16"):
        load_causal_lm(tiny_pair[1], "bfloat16")


def test_a_draft_off_the_cpu_runs_the_paged_runner(tiny_pair, without_accelerate):
    from specdec.core.paged_runner import PagedRunner
    from specdec.core.runner import HFRunner
    from specdec.draft.drafters import DraftConfig
    from specdec.draft.model_drafter import build

    drafter = build(DraftConfig(tiny_pair[1], draft_device="meta", draft_dtype="bfloat16"))
    assert drafter.decoder is None  # the lean forward is CPU-only
    assert isinstance(drafter.runner, PagedRunner) and drafter.runner.device.type == "meta"
    assert next(drafter.loaded.model.parameters()).dtype == torch.bfloat16
    reference = build(DraftConfig(tiny_pair[1], draft_device="meta", draft_dtype="bfloat16", fast_draft_forward=False))
    assert isinstance(reference.runner, HFRunner)  # --reference-forward: the transformers forward, on the device


def test_the_target_loads_on_its_configured_device(monkeypatch):
    from specdec.target import engine

    seen = {}

    def load(path, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("loaded")

    monkeypatch.setattr(engine, "load_causal_lm", load)
    with pytest.raises(RuntimeError, match="loaded"):
        engine.VerifierEngine.from_config(engine.TargetConfig("m", device="cuda:1", dtype="bfloat16"))
    assert seen["device"] == "cuda:1" and seen["dtype"] == "bfloat16"


def test_cli_common_still_loads_without_torch():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(cli_common.__file__).read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
           for alias in node.names} | {node.module.split(".")[0] for node in tree.body
                                       if isinstance(node, ast.ImportFrom) and node.module}
    assert "torch" not in top
