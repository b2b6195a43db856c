"""The EAGLE head (core/eagle_head.py) and its trainer (scripts/train_eagle_head.py) on a tiny random Llama."""
from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.core.eagle_head import WEIGHTS, EagleHead, HeadCache, TargetMismatch, target_fingerprint

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_eagle_head", ROOT / "scripts" / "train_eagle_head.py")
trainer = importlib.util.module_from_spec(_spec)
sys.modules["train_eagle_head"] = trainer
_spec.loader.exec_module(trainer)


@pytest.fixture(scope="module")
def target(tiny_pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


def new_head(target, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)  # the caller seeds: the module never touches the global generator
    return EagleHead.from_target(target)


def windows(target, n: int = 4, length: int = 24, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The tiny target's features over random token windows, as the trainer caches them."""
    tokens = torch.randint(0, target.config.vocab_size, (n, length), generator=torch.Generator().manual_seed(seed))
    feats = trainer.target_features(target, tokens)
    return feats.to(torch.float16).numpy(), tokens.to(torch.int32).numpy()


def test_shapes_and_what_the_head_owns(target):
    head = new_head(target)
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    feats, tokens = torch.randn(2, 7, hidden), torch.randint(0, vocab, (2, 7))
    predicted = head(feats, tokens)
    assert predicted.shape == (2, 7, hidden)
    assert head.logits(predicted).shape == (2, 7, vocab)
    token, feature, logits = head.draft(feats[:, 0], tokens[:, 0], 0, HeadCache())
    assert token.shape == (2,) and feature.shape == (2, hidden) and logits.shape == (2, vocab)
    # The embedding and LM head are the target's: not the head's parameters, not in its file.
    assert all(name.startswith(("fc.", "layer.")) for name in head.state_dict())
    assert sum(p.numel() for p in head.parameters()) == 2 * hidden * hidden + hidden + sum(
        p.numel() for p in target.model.layers[0].parameters())


def test_drafting_with_the_cache_equals_one_full_forward(target):
    """Prefill then one position at a time (and a multi-position step after a cache) give what one
    causal forward over all positions gives."""
    head = new_head(target).eval()
    feats, tokens = torch.randn(2, 9, target.config.hidden_size), torch.randint(0, target.config.vocab_size, (2, 9))
    with torch.no_grad():
        full = head(feats, tokens)
        cache = HeadCache()
        steps = [head(feats[:, :5], tokens[:, :5], 0, cache)]
        for t in range(5, 9):
            _, feature, _ = head.draft(feats[:, t], tokens[:, t], t, cache)
            steps.append(feature[:, None])
        chunked = HeadCache()
        head(feats[:, :3], tokens[:, :3], 0, chunked)
        rest = head(feats[:, 3:], tokens[:, 3:], 3, chunked)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest, full[:, 3:], atol=1e-5, rtol=1e-5)
    cache.truncate(6)  # rolling back rejected drafts
    assert cache.length == 6
    with pytest.raises(ValueError, match="holds 6 positions"):
        head.draft(feats[:, 8], tokens[:, 8], 8, cache)


def train_a_little(target, feats, tokens, steps: int, seed: int) -> tuple[EagleHead, list[float]]:
    args = Namespace(batch=2, seed=seed, lr=3e-3, warmup=2, token_loss="kl", feature_weight=1.0, token_weight=0.1,
                     feature_noise=0.2)
    head = new_head(target, seed)
    opt = trainer.make_optimizer(head, args.lr)
    losses = []
    trainer.train_steps(head, opt, feats, tokens, 0, steps, steps, args,
                        on_step=lambda step, parts, ntok: losses.append(parts["loss"]))
    return head, losses


def test_a_tiny_training_run_lowers_the_loss_and_is_reproducible(target):
    torch.set_num_threads(1)  # one thread: the same reduction order on every run
    feats, tokens = windows(target)
    with torch.no_grad():
        before = trainer.head_losses(new_head(target, 7), torch.from_numpy(feats).float(), torch.from_numpy(tokens).long())
    head, losses = train_a_little(target, feats, tokens, steps=12, seed=7)
    with torch.no_grad():
        after = trainer.head_losses(head, torch.from_numpy(feats).float(), torch.from_numpy(tokens).long())
    assert after["loss"] < 0.8 * before["loss"], (before["loss"], after["loss"])
    again, losses_again = train_a_little(target, feats, tokens, steps=12, seed=7)
    assert losses == losses_again
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_resuming_continues_the_same_run(target):
    """Steps 0..5 then 5..10 with the optimizer carried over equal steps 0..10 in one go: the batch
    and the noise of a step are functions of the step alone."""
    torch.set_num_threads(1)
    feats, tokens = windows(target, seed=1)
    args = Namespace(batch=2, seed=3, lr=3e-3, warmup=2, token_loss="ce", feature_weight=1.0, token_weight=0.1,
                     feature_noise=0.2)
    one = new_head(target, 3)
    opt = trainer.make_optimizer(one, args.lr)
    trainer.train_steps(one, opt, feats, tokens, 0, 10, 10, args)
    two = new_head(target, 3)
    opt2 = trainer.make_optimizer(two, args.lr)
    trainer.train_steps(two, opt2, feats, tokens, 0, 5, 10, args)
    three = new_head(target, 99)  # a restart: state restored from the checkpoint's dicts
    three.load_state_dict(two.state_dict())
    opt3 = trainer.make_optimizer(three, args.lr)
    opt3.load_state_dict(opt2.state_dict())
    trainer.train_steps(three, opt3, feats, tokens, 5, 10, 10, args)
    for (name, a), (_, b) in zip(one.state_dict().items(), three.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_save_then_load_gives_identical_outputs(target, tmp_path, dtype):
    head = new_head(target, 1).eval()
    head.load_state_dict({k: v.to(dtype).float() for k, v in head.state_dict().items()})  # what the file can hold
    head.save(tmp_path, dtype=dtype)
    loaded = EagleHead.load(tmp_path, target).eval()
    assert loaded.config == head.config
    feats, tokens = torch.randn(2, 6, target.config.hidden_size), torch.randint(0, target.config.vocab_size, (2, 6))
    with torch.no_grad():
        assert torch.equal(loaded.logits(loaded(feats, tokens)), head.logits(head(feats, tokens)))
    assert (tmp_path / WEIGHTS).stat().st_size < (4 if dtype == torch.float32 else 2) * 1.05 * sum(
        p.numel() for p in head.parameters())


def test_the_loader_refuses_a_head_of_another_target(target, tiny_pair, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_models import build_model

    new_head(target).save(tmp_path / "head")
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    other = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / "other", tok, hidden=64, layers=2, seed=5))
    assert target_fingerprint(other) != target_fingerprint(target)
    with pytest.raises(TargetMismatch, match="trained on target"):
        EagleHead.load(tmp_path / "head", other)
    # One checkpoint loaded in another precision is the same target.
    half = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.bfloat16)
    assert target_fingerprint(half) == target_fingerprint(target)
    EagleHead.load(tmp_path / "head", half)


@pytest.mark.parametrize("drafts, truth, expected", [
    # rows: all right; first wrong (a later match after a miss does not count); right twice then wrong
    ([[1, 2, 3], [9, 2, 3], [1, 2, 9]], [[1, 2, 3], [1, 2, 3], [1, 2, 3]],
     {1: 2 / 3, 2: 4 / 3, 3: 5 / 3}),
])
def test_accepted_lengths(drafts, truth, expected):
    got = trainer.accepted_lengths(torch.tensor(drafts), torch.tensor(truth), 3)
    assert got == pytest.approx(expected)
