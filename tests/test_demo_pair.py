"""The committed demo pair (models/demo), loaded through the public loading path like any user model."""
from __future__ import annotations

import asyncio
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from specdec.core.models import check_same_tokenizer, load_causal_lm

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
pytestmark = pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not built (scripts/train_demo_pair.py)")


@pytest.fixture(scope="module")
def pair():
    target, draft = load_causal_lm(DEMO / "target"), load_causal_lm(DEMO / "draft")
    check_same_tokenizer(target, draft)
    return target, draft


@pytest.fixture(scope="module")
def held_out_texts() -> list[str]:
    card = json.loads((DEMO / "training.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / rel).read_text(encoding="utf-8") for rel in card["training"]["held_out_list"][:6] if (stdlib / rel).is_file()]


def test_artifacts_are_small_half_precision_safetensors():
    files = [p for p in DEMO.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 40 * 2**20
    for name in ("target", "draft"):
        assert (DEMO / name / "model.safetensors").is_file()
        assert json.loads((DEMO / name / "config.json").read_text())["dtype"] in ("float16", "bfloat16")


def test_tokenizer_round_trips_held_out_code(pair, held_out_texts):
    tok = pair[0].tokenizer
    assert held_out_texts, "the held-out files of the model card are not on this machine"
    for text in held_out_texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == text


def test_greedy_speculation_equals_target_only(pair, held_out_texts):
    from specdec.core.sessions import InMemorySessionStore
    from specdec.core.speculation import SpeculationMode, SpeculationPolicy
    from specdec.draft.drafters import DraftConfig
    from specdec import roles
    from specdec.draft.engine import DraftEngine
    from specdec.draft.model_drafter import ModelDrafter
    from specdec.orchestrator.loop import collect
    from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
    from specdec.target.engine import TargetConfig, VerifierEngine

    from cluster import PATIENT

    target, draft = pair
    verifier = VerifierEngine(target, TargetConfig(target.path))
    drafter = DraftEngine({"model": ModelDrafter(draft, 32)}, DraftConfig(draft.path), draft.context_length)
    # Every step verifies a whole block drafted just in time for it (no pre-drafts, which a verify
    # call may cut short, and no step that gave up on a late block): the acceptance below is then
    # the pair's own, the same on a loaded machine as on an idle one.
    orch = roles.embedded_engines(verifier, drafter, OrchestratorConfig(), InMemorySessionStore(), PATIENT)
    accepted = steps = 0
    for i, text in enumerate(held_out_texts[:3]):
        at = text.find("\ndef ", 200 * i) + 1
        prompt = text[at : at + 120]
        ids = target.tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            ref = target.model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=target.eos_token_id)
        req = GenerationRequest(prompt_text=prompt, max_new_tokens=32, policy=SpeculationPolicy(SpeculationMode.FIXED, 4, overlap=False))
        last, out, _ = asyncio.run(collect(orch.generate(req)))
        assert out == tuple(ref[0, len(ids):].tolist()), prompt
        accepted += last.counters.accepted_tokens
        steps += last.counters.drafts
    # An untrained or mismatched pair commits about 1 token per verification; this pair 1.76 here.
    assert 1 + accepted / steps > 1.5, f"{1 + accepted / steps:.2f} tokens per verification: is the draft trained for this target?"
