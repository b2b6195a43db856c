"""Token trees against chains at the same number of verified rows, on the demo pair (issue 30).

One process, greedy, held-out prompts: for each budget k (k + 1 rows verified per step: 4, 8, 16)
the chain drafter (``model``, k tokens) and the tree drafter (``tree``, k nodes) each decode every
prompt; reported per drafter and budget: mean accepted tokens per verification, tokens per step
(accepted + 1), and tokens/s of the whole loop (draft and verify, one thread), medians over
alternated rounds. Outputs are checked equal to the chain's (greedy is exact either way).

    python benchmarks/bench_trees.py                    # results in benchmarks/results/trees/
"""
from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEMO, held_out_prompts, write_result  # noqa: E402


def decode(engine, drafter, prompt_ids: list[int], k: int, new_tokens: int) -> tuple[list[int], list[int], float]:
    """(output ids, accepted per step, seconds) for one prompt."""
    from specdec.core.sampling import SamplingParams
    from specdec.core.steps import SessionSpec

    sid = secrets.token_hex(16)
    t0 = time.perf_counter()
    engine.open(SessionSpec(sid, tuple(prompt_ids), SamplingParams()), new_tokens + 32)
    session = drafter.open(prompt_ids, SamplingParams())
    committed, accepted = list(prompt_ids), []
    while len(committed) - len(prompt_ids) < new_tokens:
        proposal = session.propose(committed, k)
        outcome = engine.verify(sid, proposal)
        accepted.append(outcome.num_accepted)
        committed.extend(outcome.token_ids)
    seconds = time.perf_counter() - t0
    engine.close(sid)
    return committed[len(prompt_ids):len(prompt_ids) + new_tokens], accepted, seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--budgets", default="3,7,15", help="k: draft tokens (chain) or nodes (tree) per step")
    ap.add_argument("--rounds", type=int, default=2, help="alternated timing rounds")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "trees")
    args = ap.parse_args(argv)

    from specdec.draft.drafters import DraftConfig, build_drafters
    from specdec.target.engine import TargetConfig, VerifierEngine

    torch.set_num_threads(1)
    engine = VerifierEngine.from_config(TargetConfig(str(DEMO / "target"), max_sessions=4))
    drafters = build_drafters(DraftConfig(draft_model_path=str(DEMO / "draft"), target_model_path=str(DEMO / "target")))
    tok = engine.loaded.tokenizer
    prompts = [tok(p)["input_ids"] for p in held_out_prompts(args.prompts)]
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = []
    for k in budgets:
        stats = {name: {"accepted": [], "seconds": [], "tokens": 0} for name in ("model", "tree")}
        outputs: dict[str, list[list[int]]] = {"model": [], "tree": []}
        for r in range(args.rounds):
            for name in (("model", "tree") if r % 2 == 0 else ("tree", "model")):
                seconds = 0.0
                for i, p in enumerate(prompts):
                    out, accepted, s = decode(engine, drafters[name], p, k, args.new_tokens)
                    seconds += s
                    if r == 0:
                        outputs[name].append(out)
                        stats[name]["accepted"] += accepted
                        stats[name]["tokens"] += len(out)
                stats[name]["seconds"].append(seconds)
        assert outputs["tree"] == outputs["model"], "greedy outputs differ between chain and tree"
        for name, st in stats.items():
            steps = len(st["accepted"])
            rows.append({"drafter": "chain" if name == "model" else "tree", "k": k, "verified_rows": k + 1,
                         "mean_accepted": round(statistics.mean(st["accepted"]), 3),
                         "tokens_per_step": round(st["tokens"] / steps, 3),
                         "tokens_per_s": round(st["tokens"] / statistics.median(st["seconds"]), 1)})
    for k in budgets:
        chain, tree = (next(r for r in rows if r["k"] == k and r["drafter"] == d) for d in ("chain", "tree"))
        tree["accepted_vs_chain"] = round(tree["mean_accepted"] / chain["mean_accepted"], 3)
        tree["tokens_per_s_vs_chain"] = round(tree["tokens_per_s"] / chain["tokens_per_s"], 3)
    write_result(args.out / "trees.json", prompts=args.prompts, new_tokens=args.new_tokens, rows=rows)
    print("| drafter | rows verified | mean accepted | tokens/step | tokens/s | accepted vs chain | tokens/s vs chain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['verified_rows']} | {r['mean_accepted']} | {r['tokens_per_step']} | {r['tokens_per_s']} "
              f"| {r.get('accepted_vs_chain', '')} | {r.get('tokens_per_s_vs_chain', '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
