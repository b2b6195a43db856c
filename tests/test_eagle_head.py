"""The EAGLE head (core/eagle_head.py) and its trainer (scripts/train_eagle_head.py) on a tiny random Llama."""
from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.core.eagle_head import (WEIGHTS, EagleHead, HeadCache, TargetMismatch, TargetParts, load_target_parts,
                                     target_fingerprint)
from specdec.core.tree import DraftTree, feed_mask, feed_positions

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


# ----------------------------------------------------------------------------- the target's parts alone
DEMO = ROOT / "models" / "demo"


def full_target(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_parts_match(parts: TargetParts, full: torch.nn.Module) -> None:
    """Same fingerprint, bitwise the same embedding and LM head, tied exactly when the full model's are."""
    assert target_fingerprint(parts) == target_fingerprint(full)
    assert isinstance(parts.get_input_embeddings(), torch.nn.Embedding)
    assert isinstance(parts.get_output_embeddings(), torch.nn.Linear) and parts.get_output_embeddings().bias is None
    assert torch.equal(parts.get_input_embeddings().weight, full.get_input_embeddings().weight)
    assert torch.equal(parts.get_output_embeddings().weight, full.get_output_embeddings().weight)
    tied = full.get_output_embeddings().weight is full.get_input_embeddings().weight
    assert (parts.get_output_embeddings().weight is parts.get_input_embeddings().weight) == tied
    assert not any(p.requires_grad for p in parts.parameters())


def assert_same_head_logits(folder, parts: TargetParts, full: torch.nn.Module) -> None:
    over_parts, over_full = EagleHead.load(folder, parts).eval(), EagleHead.load(folder, full).eval()
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 5, full.config.hidden_size, generator=gen)
    tokens = torch.randint(0, full.config.vocab_size, (2, 5), generator=gen)
    with torch.no_grad():
        assert torch.equal(over_parts.logits(over_parts(feats, tokens)), over_full.logits(over_full(feats, tokens)))


def test_the_demo_targets_parts_stand_in_for_it():
    full, parts = full_target(DEMO / "target"), load_target_parts(str(DEMO / "target"))
    assert parts.config.tie_word_embeddings
    assert_parts_match(parts, full)
    assert_same_head_logits(DEMO / "eagle", parts, full)


def test_the_tiny_targets_parts_stand_in_for_it(target, tiny_pair, tmp_path):
    parts = load_target_parts(tiny_pair[0])
    assert parts.config.tie_word_embeddings
    assert_parts_match(parts, target)
    new_head(target).save(tmp_path)
    assert_same_head_logits(tmp_path, parts, target)
    # Another precision of one checkpoint is the same target, as for the full model.
    half = load_target_parts(tiny_pair[0], dtype=torch.bfloat16)
    assert half.get_input_embeddings().weight.dtype == torch.bfloat16
    assert target_fingerprint(half) == target_fingerprint(target)


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_untied_and_sharded_targets_parts(tmp_path, shard):
    """An untied LM head is its own tensor; a sharded checkpoint is read through its index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.2)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "untied", **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "untied" / "model.safetensors.index.json").exists() == (shard is not None)
    full, parts = full_target(tmp_path / "untied"), load_target_parts(tmp_path / "untied")
    assert not parts.config.tie_word_embeddings
    assert not torch.equal(parts.get_output_embeddings().weight, parts.get_input_embeddings().weight)
    assert_parts_match(parts, full)
    new_head(full).save(tmp_path / "head")
    assert_same_head_logits(tmp_path / "head", parts, full)


# ----------------------------------------------------------------------------- tree attention
TREE = (-1, -1, 0, 0, 1, 2, 4, 6)  # several roots, siblings, and one long path


def test_a_masked_tree_forward_equals_each_paths_causal_forward(target):
    """One forward over a tree's nodes (positions by depth, each node seeing the prefix, its ancestors
    and itself) gives at every node what a causal forward over the prefix and that node's path gives."""
    head = new_head(target).eval()
    hidden, vocab, prefix, n = target.config.hidden_size, target.config.vocab_size, 6, len(TREE)
    gen = torch.Generator().manual_seed(0)
    feats, tokens = torch.randn(2, prefix + n, hidden, generator=gen), torch.randint(0, vocab, (2, prefix + n), generator=gen)
    nodes_f, nodes_t = feats[:, prefix:], tokens[:, prefix:]
    tree = DraftTree(tuple(range(n)), TREE)
    with torch.no_grad():
        cache = HeadCache()
        head(feats[:, :prefix], tokens[:, :prefix], 0, cache)
        positions = torch.tensor(feed_positions(prefix, n, TREE))
        masked = head(nodes_f, nodes_t, prefix, cache, positions=positions, mask=feed_mask(prefix, n, TREE))
        assert cache.length == prefix + n  # the nodes are cached like any rows, for the caller to roll back
        for node in range(n):
            path = tree.path_to(node)
            cache.truncate(prefix)
            along = head(nodes_f[:, path], nodes_t[:, path], prefix, cache)
            torch.testing.assert_close(masked[:, node], along[:, -1], atol=1e-5, rtol=1e-5)
        cache.truncate(prefix)
        causal = head(nodes_f, nodes_t, prefix, cache)
    # A forward that ignored the mask (or the positions) would be this causal one: it differs on the tree.
    assert not torch.allclose(masked, causal, atol=1e-3)


def test_default_positions_and_a_causal_mask_change_nothing(target):
    """Explicit consecutive positions and the causal mask give bitwise what the defaults give."""
    head = new_head(target).eval()
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 7, target.config.hidden_size, generator=gen)
    tokens = torch.randint(0, target.config.vocab_size, (2, 7), generator=gen)
    with torch.no_grad():
        plain, explicit = HeadCache(), HeadCache()
        head(feats[:, :3], tokens[:, :3], 0, plain)
        head(feats[:, :3], tokens[:, :3], 0, explicit)
        want = head(feats[:, 3:], tokens[:, 3:], 3, plain)
        got = head(feats[:, 3:], tokens[:, 3:], 3, explicit, positions=torch.arange(3, 7),
                   mask=feed_mask(3, 4, DraftTree.chain(range(4)).parents))
    assert torch.equal(got, want)
    assert torch.equal(plain.keys, explicit.keys)


def test_a_mask_or_positions_of_the_wrong_shape_are_refused(target):
    head = new_head(target).eval()
    feats, tokens = torch.randn(1, 3, target.config.hidden_size), torch.randint(0, target.config.vocab_size, (1, 3))
    cache = HeadCache()
    head(feats, tokens, 0, cache)
    with torch.no_grad(), pytest.raises(ValueError, match="the mask must be bool"):
        head(feats, tokens, 3, cache, mask=torch.ones(3, 3, dtype=torch.bool))
    assert cache.length == 3  # a refused call does not grow the cache
    with torch.no_grad(), pytest.raises(ValueError, match="positions must be"):
        head(feats, tokens, 3, cache, positions=torch.arange(2))
